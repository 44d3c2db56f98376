"""A re-roled relay decoder, or the gateway, restarted: the role the process runs and the role the
gateway records must agree before the instance is routed to again.

- rld0 re-roled to main_decode, then its process killed: its supervisor restarts it as
  relay_decode (its launch role) and the gateway's reconnect swapped the new connection in as
  an MD, so every request routed there failed ``LookupError: no handler for message type
  'reserve'`` while ``/health`` said ok. The reconnect now asks the instance its role and
  applies the recorded one (``set_role``, as a re-role) before the connection is used; one that
  cannot be switched is left out (down, ``role_error`` in ``/pdd/instances``), WARNING logged.
- rld0 re-roled, then the gateway killed: the restarted gateway records the slot's role
  (relay_decode) while the process still ran main_decode, so relayed requests failed ``no
  handler for message type 'expect'``. The gateway's start now switches each ``rerole`` slot's
  process to the role it records."""

from __future__ import annotations

import asyncio
import logging

from pdd.config import ClusterConfig
from pdd.gateway.membership import Membership
from pdd.gateway.orchestrator import Orchestrator
from pdd.policy.membership import ACTIVE
from pdd.topology import layout
from tests.gateway.test_readd_rerolled import Process, ProcPeer


def _setup(refuse: str | None = None):
    cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": 18000, "rerole": ["rld0"], "standby": ["md1"],
                                        "instances": {"prefill": 1, "relay_decode": 2, "main_decode": 2}})
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    procs = {s.name: Process(s.role) for s in lay.engines}
    o.peers = {s.name: ProcPeer(procs[s.name]) for s in o.layout.engines}
    joined: dict[str, list] = {}
    refusing = {"on": refuse}

    async def connect(name, retries):
        peer = ProcPeer(procs[name], refusing["on"])
        joined.setdefault(name, []).append(peer)
        return peer

    o._connect = connect
    return o, ms, procs, joined, refusing


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("pdd.")]


def test_a_rerolled_instance_restarted_in_its_launch_role_is_switched_back_before_it_is_routed(caplog):
    caplog.set_level(logging.INFO)
    o, ms, procs, joined, _ = _setup()

    async def run():
        await ms.rerole("rld0", "main_decode")
        procs["rld0"] = Process("relay_decode")  # kill -9; its supervisor restarts it as launched
        o.peers["rld0"].closed = True
        await o._reconnect("rld0")

    asyncio.run(run())
    new = joined["rld0"][0]
    assert o.peers["rld0"] is new and not new.closed
    assert [h["t"] for h in new.sent] == ["stats", "set_role"]
    assert new.of("set_role") == [{"t": "set_role", "role": "main_decode"}]
    assert procs["rld0"].role == "main_decode"
    assert [s.name for s in o.layout.by_role("main_decode")] == ["rld0", "md0"]
    ev = ms.events[-1]
    assert (ev["op"], ev["instance"], ev["role"], ev["role_from"], ev["after"], ev["to"]) == \
        ("role_restored", "rld0", "main_decode", "relay_decode", "reconnect", ACTIVE)
    assert ms.changes["role_restored"] == 1
    assert _warnings(caplog) == [
        "membership: instance rld0 ran as relay_decode, not as main_decode (the role the gateway records for it), "
        "found at reconnect (a restarted instance runs its launch role; a restarted gateway records the slot's "
        "role): switched it to main_decode before routing to it"]
    v = ms.view("rld0")
    assert (v["role"], v["state"], v["connected"], "role_error" in v) == ("main_decode", ACTIVE, True, False)


def test_a_restarted_instance_in_the_recorded_role_reconnects_without_a_switch(caplog):
    caplog.set_level(logging.INFO)
    o, ms, procs, joined, _ = _setup()

    async def run():
        o.peers["rld0"].closed = True
        await o._reconnect("rld0")

    asyncio.run(run())
    assert [h["t"] for h in joined["rld0"][0].sent] == ["stats"]
    assert o.peers["rld0"] is joined["rld0"][0] and "role_restored" not in ms.changes
    assert _warnings(caplog) == []


def test_a_restarted_instance_that_cannot_be_switched_is_not_routed_and_says_why(caplog):
    caplog.set_level(logging.INFO)
    o, ms, procs, joined, refusing = _setup()

    async def run():
        await ms.rerole("rld0", "main_decode")
        procs["rld0"] = Process("relay_decode")
        old = o.peers["rld0"]
        old.closed = True
        refusing["on"] = "rld0 still holds 1 request(s): drain it first"
        await o._reconnect("rld0")
        await o._reconnect("rld0")  # the watcher tries again: the same reason is not logged twice
        assert o.peers["rld0"] is old
        health = o.health()
        view = ms.view("rld0")
        refusing["on"] = None
        await o._reconnect("rld0")  # it can switch now: it serves in its recorded role
        return health, view

    health, view = asyncio.run(run())
    why = ("instance rld0 runs as relay_decode, not as main_decode (the role the gateway records for it), found at "
           "reconnect, and did not switch: RuntimeError: rld0 still holds 1 request(s): drain it first; no request "
           "is routed to it; tried again at each reconnect (every 1 s)")
    assert [p.closed for p in joined["rld0"]] == [True, True, False]
    assert (view["role"], view["connected"], view["role_error"]) == ("main_decode", False, why)
    assert (health["status"], health["down"]) == ("degraded", ["rld0"])
    assert _warnings(caplog)[:1] == [f"membership: {why}"] and len(_warnings(caplog)) == 2
    assert o.peers["rld0"] is joined["rld0"][2] and procs["rld0"].role == "main_decode"
    assert "role_error" not in ms.view("rld0")
    assert [r.getMessage() for r in caplog.records if "runs the role the gateway records" in r.getMessage()] == \
        ["membership: instance rld0 runs the role the gateway records for it again"]


def test_a_restarted_gateway_switches_a_rerolled_process_back_to_its_slots_role(caplog):
    caplog.set_level(logging.INFO)
    o, ms, procs, joined, _ = _setup()
    procs["rld0"].role = "main_decode"  # re-roled by the gateway before this one

    async def run():
        await o.start(retries=0)
        try:
            return o.peers["rld0"].closed, o.health()
        finally:
            await o.close()

    closed, health = asyncio.run(run())
    new = joined["rld0"][0]
    assert new.of("set_role") == [{"t": "set_role", "role": "relay_decode"}]
    assert procs["rld0"].role == "relay_decode" and o.peers["rld0"] is new and closed is False
    assert health["status"] == "ok"
    assert [h["t"] for h in joined["rld1"][0].sent] == []  # not a rerole slot: not asked
    ev = ms.events[-1]
    assert (ev["op"], ev["role"], ev["role_from"], ev["after"]) == ("role_restored", "relay_decode", "main_decode",
                                                                    "gateway start")
    assert _warnings(caplog) == [
        "membership: instance rld0 ran as main_decode, not as relay_decode (the role the gateway records for it), "
        "found at gateway start (a restarted instance runs its launch role; a restarted gateway records the slot's "
        "role): switched it to relay_decode before routing to it"]


def test_a_restarted_gateway_leaves_out_a_process_it_cannot_switch_back(caplog):
    caplog.set_level(logging.INFO)
    o, ms, procs, joined, _ = _setup(refuse="rld0 still holds 2 request(s): drain it first")
    procs["rld0"].role = "main_decode"

    async def run():
        await o.start(retries=0)
        try:
            return o.health(), ms.view("rld0")
        finally:
            await o.close()

    health, view = asyncio.run(run())
    assert o.peers["rld0"] is joined["rld0"][0] and joined["rld0"][0].closed
    assert (health["status"], health["down"]) == ("degraded", ["rld0"])
    assert view["role_error"] == (
        "instance rld0 runs as main_decode, not as relay_decode (the role the gateway records for it), found at "
        "gateway start, and did not switch: RuntimeError: rld0 still holds 2 request(s): drain it first; no request "
        "is routed to it; tried again at each reconnect (every 1 s)")


def test_a_restarted_gateway_warns_of_a_standby_slot_whose_port_is_taken(caplog, monkeypatch):
    """md1 added at run time (standby in the config), then the gateway restarted: it is no member
    now, which the start says rather than routing nothing there silently."""
    import pdd.topology

    caplog.set_level(logging.INFO)
    o, ms, procs, joined, _ = _setup()
    md1_port = int(ms.members["md1"].address.rsplit(":", 1)[1])
    monkeypatch.setattr(pdd.topology, "port_taken", lambda host, port: port == md1_port)

    async def run():
        await o.start(retries=0)
        await o.close()

    asyncio.run(run())
    assert "md1" not in joined
    assert _warnings(caplog) == [
        f"membership: standby slot md1 (main_decode): something listens at its address 127.0.0.1:{md1_port} (an "
        f"instance added at run time before the gateway started, still running?); it is no member until added "
        f"again (POST /pdd/instances)"]
