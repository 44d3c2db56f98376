"""Elastic topology: the membership state machine of one instance, as the gateway applies it
(``pdd.gateway.membership``). Pure: no sockets, no clock.

States of an instance (a slot of the config's layout, ``pdd.topology.layout``):

- ``standby``: a slot of the config that is not serving (``ClusterConfig.standby``, or never
  added); routing does not know it.
- ``active``: routed to.
- ``draining``: no new request is routed to it; its in-flight requests finish where they are.
- ``removed``: the gateway dropped its connection; routing, liveness and ``/health`` forget it.

Operations and their outcomes (``decide``; ``busy`` = the gateway's in-flight requests there plus
transfers and handoffs still pending on it; ``others_active`` = other active instances of the
same role):

| op     | from                 | to       | refused with                                            |
|--------|----------------------|----------|---------------------------------------------------------|
| add    | standby, removed     | active   | 409 when active or draining (a duplicate)               |
| drain  | active               | draining | 409 when it is the role's last active one (unless force)|
| drain  | draining             | draining | (idempotent)                                            |
| remove | active, draining     | removed  | 409 while busy > 0, or the role's last active (unless   |
|        |                      |          | force: its requests are then recovered as after a loss) |

A standby or removed instance cannot be drained or removed (409).
"""

from __future__ import annotations

from dataclasses import dataclass

STANDBY, ACTIVE, DRAINING, REMOVED = "standby", "active", "draining", "removed"
STATES = (STANDBY, ACTIVE, DRAINING, REMOVED)
OPS = ("add", "drain", "remove")


@dataclass(frozen=True)
class Decision:
    ok: bool
    new_state: str  # the state after the operation (the old one when refused)
    status: int = 200  # HTTP status of the answer (409 when refused)
    message: str = ""


def decide(op: str, name: str, role: str, state: str, *, busy: int = 0, others_active: int = 1,
           force: bool = False) -> Decision:
    """The outcome of ``op`` on instance ``name`` (of ``role``) in ``state``.

    Raises ValueError for an unknown ``op`` or ``state``."""
    if op not in OPS:
        raise ValueError(f"unknown membership operation {op!r}; expected one of {OPS}")
    if state not in STATES:
        raise ValueError(f"unknown membership state {state!r}; expected one of {STATES}")

    def refuse(msg: str) -> Decision:
        return Decision(False, state, 409, msg)

    if op == "add":
        if state in (ACTIVE, DRAINING):
            return refuse(f"instance {name} is already a member ({state})")
        return Decision(True, ACTIVE)
    if state in (STANDBY, REMOVED):
        return refuse(f"instance {name} is {state}: not a member")
    if op == "drain":
        if state == DRAINING:
            return Decision(True, DRAINING, message=f"instance {name} is already draining")
        if others_active < 1 and not force:
            return refuse(f"instance {name} is the last active {role} instance: add another first (or force)")
        return Decision(True, DRAINING)
    # remove
    if busy > 0 and not force:
        return refuse(f"instance {name} still has {busy} in-flight request(s) or transfer(s): drain it and wait "
                      f"until in_flight is 0 (or force)")
    if state == ACTIVE and others_active < 1 and not force:
        return refuse(f"instance {name} is the last active {role} instance: add another first (or force)")
    return Decision(True, REMOVED)
