"""The drain (``pdd.gateway.shutdown``) on the real orchestrator over fake instances: what a
finished request left behind counts as pending, and at the shutdown timeout a relayed
request's KV still awaited on MD is dropped there (with the gateway gone, MD's ``kv_ready``
would be answered by nobody and its reservation held); WAN probes stop when the drain begins."""

from __future__ import annotations

import asyncio

from pdd.gateway.shutdown import Drain
from tests.gateway.fake_peer import fake_orchestrator


async def test_kv_still_awaited_at_the_timeout_is_dropped_on_its_md():
    o = fake_orchestrator()
    o.awaiting_kv["r7"] = ("p0", "md0")
    o.awaiting_kv_deadline["r7"] = 1e18
    drain = Drain(0)
    assert drain.pending(o) == ["kv_awaited 1"]
    rep = await drain.run(o)
    assert (rep["ended"], rep["left"]) == (0, [])
    assert (o.awaiting_kv, o.awaiting_kv_deadline) == ({}, {})
    assert o.peers["md0"].of("drop") == [{"t": "drop", "rid": "r7"}]
    assert all(o.peers[n].sent == [] for n in o.peers if n != "md0")


async def test_the_drain_stops_the_wan_probes():
    o = fake_orchestrator()
    o._probes = asyncio.get_running_loop().create_task(asyncio.Event().wait())
    rep = await Drain(0).run(o)
    await asyncio.gather(o._probes, return_exceptions=True)
    assert o._probes.cancelled() and rep["left"] == []


async def test_the_drain_line_says_when_nothing_is_in_flight(caplog):
    """It read "waiting up to 30 s (shutdown_timeout_s) for nothing" (found by a new user)."""
    import logging

    caplog.set_level(logging.INFO, logger="pdd.gateway.shutdown")
    await Drain(30).run(fake_orchestrator())
    assert caplog.records[0].getMessage() == ("shutting down: new requests are refused (503 shutting_down); "
                                              "nothing in flight, nothing to wait for")
    caplog.clear()
    o = fake_orchestrator()
    o.awaiting_kv["r7"] = ("p0", "md0")
    o.awaiting_kv_deadline["r7"] = 1e18
    await Drain(0).run(o)
    assert caplog.records[0].getMessage() == ("shutting down: new requests are refused (503 shutting_down); "
                                              "waiting up to 0 s (shutdown_timeout_s) for kv_awaited 1")
