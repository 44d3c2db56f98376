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
|        |                      |          | force: its requests are then recovered as after a loss);|
|        |                      |          | both: code "conflict", the message names both           |

A standby or removed instance cannot be drained or removed (409).

Re-role (``decide_rerole``): a relay decoder listed in the config's ``rerole`` takes main-decode
duty in its datacenter (A: P->MD over the fast path, no WAN) and back. The gateway drains it
first (``active -> draining``: no new request of its current role), switches its role once
nothing is in flight there, and it is ``active`` again in the new role. Refused with

- 403 when the config does not list the instance (``rerole``), or it is not in datacenter A;
- 400 when the target role is not ``relay_decode`` / ``main_decode``;
- 409 when it is not a member (standby, removed; also to the role it has), is being drained for
  another reason, or is
  the last active instance of its current role (unless force: a pdd topology serves without an
  RLD, P->MD, but an operator should say so);
- ``changed=False`` (200, nothing to do) when it already has that role.
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
    code: str = ""  # a refusal's error code: "in_flight" (remove while busy, not the last), else "conflict"


def decide(op: str, name: str, role: str, state: str, *, busy: int = 0, others_active: int = 1,
           force: bool = False) -> Decision:
    """The outcome of ``op`` on instance ``name`` (of ``role``) in ``state``.

    Raises ValueError for an unknown ``op`` or ``state``."""
    if op not in OPS:
        raise ValueError(f"unknown membership operation {op!r}; expected one of {OPS}")
    if state not in STATES:
        raise ValueError(f"unknown membership state {state!r}; expected one of {STATES}")

    def refuse(msg: str, code: str = "conflict") -> Decision:
        return Decision(False, state, 409, msg, code)

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
    last = state == ACTIVE and others_active < 1 and not force
    if busy > 0 and not force:
        if last:  # both are true: the conflict's code (waiting alone would not do), both reasons said
            return refuse(f"instance {name} is the last active {role} instance and still has {busy} in-flight "
                          f"request(s) or transfer(s): add another first, then drain it and wait until in_flight "
                          f"is 0 (or force)")
        return refuse(f"instance {name} still has {busy} in-flight request(s) or transfer(s): drain it and wait "
                      f"until in_flight is 0 (or force)", "in_flight")
    if last:
        return refuse(f"instance {name} is the last active {role} instance: add another first (or force)")
    return Decision(True, REMOVED)


REROLE_ROLES = ("relay_decode", "main_decode")


@dataclass(frozen=True)
class RoleDecision:
    ok: bool
    changed: bool  # False: refused, or it already has that role
    status: int = 200
    message: str = ""


def decide_rerole(name: str, role: str, to: str, state: str, dc: str, *, allowed: bool, others_active: int,
                  force: bool = False) -> RoleDecision:
    """Whether instance ``name`` (now ``role`` in ``state``, datacenter ``dc``) may take role
    ``to``. ``allowed``: the config lists it in ``rerole``; ``others_active``: other active
    instances of its current role. Raises ValueError for an unknown ``state``."""
    if state not in STATES:
        raise ValueError(f"unknown membership state {state!r}; expected one of {STATES}")
    if to not in REROLE_ROLES:
        return RoleDecision(False, False, 400, f"role {to!r} cannot be taken at run time; expected one of "
                                               f"{', '.join(REROLE_ROLES)}")
    if not allowed and role == "relay_decode":
        return RoleDecision(False, False, 403, f"instance {name} may not change role: only the relay decoders "
                                               f"the config's rerole lists may (add it: rerole: [{name}])")
    if not allowed or role not in REROLE_ROLES:
        return RoleDecision(False, False, 403, f"instance {name} is a {role} instance: only relay decoders "
                                               f"the config's rerole lists may change role")
    if dc != "A":
        return RoleDecision(False, False, 403, f"instance {name} is in datacenter {dc}: only an instance in A "
                                               f"changes role (an RLD's duty is the fast path next to P)")
    if state in (STANDBY, REMOVED):  # no member: refused whatever the role asked (its slot's too)
        return RoleDecision(False, False, 409, f"instance {name} is {state}: only an active member changes role")
    if to == role:
        return RoleDecision(True, False, 200, f"instance {name} is already {to}")
    if state != ACTIVE:
        return RoleDecision(False, False, 409, f"instance {name} is {state}: only an active member changes role")
    if others_active < 1 and not force:
        return RoleDecision(False, False, 409, f"instance {name} is the last active {role} instance: add another "
                                               f"first (or force)")
    return RoleDecision(True, True)
