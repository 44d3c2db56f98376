"""A relay decoder re-roled to main-decode duty, removed, then added again as the relay decoder
its slot is: its process (left running by the removal) still ran its main_decode role object
while the gateway routed it relay requests, which failed ``LookupError: no handler for message
type 'expect'``. The add now asks the instance its role (``stats``) and switches it back to its
slot's role (``set_role``, as a re-role) before it is active; one that cannot be switched back
is not added. The removal's answer says the role it served in."""

from __future__ import annotations

import asyncio

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.membership import Membership, MembershipError
from pdd.gateway.orchestrator import Orchestrator
from pdd.policy.membership import ACTIVE, REMOVED
from pdd.topology import layout
from tests.gateway.test_membership import RolePeer


class Process:
    """An instance's process: its role object's role outlives the gateway's connections."""

    def __init__(self, role: str):
        self.role = role


class ProcPeer(RolePeer):
    """A connection to ``proc``: ``stats`` says its role now, ``set_role`` switches it (or, with
    ``refuse``, fails as an instance would); ``on_set_role`` is called as the switch is asked."""

    def __init__(self, proc: Process, refuse: str | None = None, on_set_role=None):
        super().__init__(held=0)
        self.proc, self.refuse, self.on_set_role = proc, refuse, on_set_role

    async def call(self, h, payload=b"", timeout=None):
        if h.get("t") == "stats":
            self.sent.append(dict(h))
            return {"role": self.proc.role, "pages_total": 64, "pages_free": 64, "running": 0}, b""
        if h.get("t") == "set_role":
            if self.on_set_role is not None:
                self.on_set_role()
            if self.refuse:
                self.sent.append(dict(h))
                raise RuntimeError(self.refuse)
            self.proc.role = h["role"]
        return await super().call(h, payload, timeout)


def _setup(refuse: str | None = None):
    cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": 18000, "rerole": ["rld1"], "standby": ["md2"],
                                        "instances": {"prefill": 1, "relay_decode": 2, "main_decode": 3}})
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    procs = {s.name: Process(s.role) for s in o.layout.engines}
    o.peers = {s.name: ProcPeer(procs[s.name]) for s in o.layout.engines}
    at_switch = []  # (state, routable) of rld1 as the add asks it to switch
    joined = []

    async def connect(name, retries):
        peer = ProcPeer(procs[name], refuse,
                        lambda: at_switch.append((ms.members[name].state, ms.routable(name))))
        joined.append(peer)
        return peer

    o._connect = connect
    return o, ms, procs, at_switch, joined


def test_a_rerolled_instance_removed_and_added_again_serves_in_its_slots_role():
    o, ms, procs, at_switch, joined = _setup()

    async def run():
        await ms.rerole("rld1", "main_decode")
        gone = await ms.remove("rld1")
        back = await ms.add("relay_decode", "rld1")
        return gone, back

    gone, back = asyncio.run(run())
    assert (gone["role"], gone["slot_role"], gone["state"]) == ("main_decode", "relay_decode", REMOVED)
    assert ms.events[-2]["op"] == "remove" and ms.events[-2]["role"] == "main_decode"
    assert procs["rld1"].role == "relay_decode"  # the process runs its slot's role object again
    assert [h["t"] for h in joined[0].sent] == ["stats", "set_role"]
    assert joined[0].of("set_role") == [{"t": "set_role", "role": "relay_decode"}]
    assert at_switch == [(REMOVED, False)]  # switched before it is active: no request meets the old role
    assert (back["name"], back["role"], back["state"], back["source"], back["role_from"]) == \
        ("rld1", "relay_decode", ACTIVE, "joined", "main_decode")
    assert back["prefix_cache"] == {"fate": "flushed on the role switch back to the slot's role", "pages_dropped": 0,
                                    "tokens_dropped": 0}
    ev = ms.events[-1]
    assert (ev["op"], ev["role"], ev["role_from"], ev["to"]) == ("add", "relay_decode", "main_decode", ACTIVE)
    assert [s.name for s in o.layout.by_role("relay_decode")] == ["rld0", "rld1"]
    assert [s.name for s in o.layout.by_role("main_decode")] == ["md0", "md1"]


def test_an_instance_in_its_slots_role_joins_without_a_switch():
    o, ms, procs, at_switch, joined = _setup()

    async def run():
        await ms.remove("rld1")
        return await ms.add("relay_decode", "rld1")

    back = asyncio.run(run())
    assert [h["t"] for h in joined[0].sent] == ["stats"]
    assert (back["role"], back["state"]) == ("relay_decode", ACTIVE) and "role_from" not in back


def test_a_rerolled_instance_that_cannot_switch_back_is_not_added():
    o, ms, procs, at_switch, joined = _setup(refuse="rld1 still holds 1 request(s): drain it first")

    async def run():
        await ms.rerole("rld1", "main_decode")  # the gateway's own connection: switches
        await ms.remove("rld1")
        with pytest.raises(MembershipError) as ei:
            await ms.add("relay_decode", "rld1")
        return ei.value

    err = asyncio.run(run())
    assert (err.status, err.code, err.param) == (503, "rerole_failed", "name")
    assert err.message == ("instance rld1 runs as 'main_decode' and did not switch back to its slot's role "
                           "relay_decode: RuntimeError: rld1 still holds 1 request(s): drain it first; it is "
                           "not added")
    assert ms.members["rld1"].state == REMOVED and "rld1" not in o.peers
    assert joined[0].closed is True
    assert [s.name for s in o.layout.by_role("relay_decode")] == ["rld0"]
