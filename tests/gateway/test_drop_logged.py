"""An instance dropping its idle connection to the gateway (it closed it, e.g. its heartbeat
declared the gateway dead behind a slow line) is one WARNING line in the gateway's log, naming the
instance and why, once per drop: not again for each failed reconnect, and not for a close of the
gateway's own (its shutdown, a removal). ``/health`` lists it down until a reconnect succeeds.
Before, the gateway logged nothing: ``/health`` said "degraded" and no log line said why. A real
:class:`Peer` whose socket the test feeds; no process, no clock."""

from __future__ import annotations

import asyncio
import logging

from pdd.transfer.peer import Peer
from tests.gateway.fake_peer import FakePeer, SocketWriter, fake_orchestrator

GUARD_S = 30
LOGGER = "pdd.gateway.orchestrator"


def _connection(o, name: str) -> tuple[Peer, asyncio.StreamReader]:
    """A started connection to ``name`` whose incoming bytes the test controls, its close
    reported to ``o`` as ``Orchestrator._connect`` registers it (not put in ``o.peers``)."""
    reader = asyncio.StreamReader()
    peer = Peer(reader, SocketWriter(), name=name)
    peer.on_close(lambda p, n=name: o._peer_closed(n, p))
    peer.start()
    return peer, reader


def _lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


async def test_an_idle_connection_dropped_by_md_is_one_warning_per_drop(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    o = fake_orchestrator()
    assert o.health()["status"] == "ok"
    peer, reader = _connection(o, "md0")
    o.peers["md0"] = peer
    reader.feed_eof()  # md0 closed the connection: nothing was in flight on it
    await asyncio.wait_for(peer.wait_close_reported(), GUARD_S)
    drop = (logging.WARNING, "lost the connection to instance md0 (connection closed by peer); it is down in "
                             "/health until a reconnect succeeds (tried every 1 s)")
    assert _lines(caplog) == [drop]
    assert o.health() == {"status": "degraded", "mode": "pdd", "down": ["md0"], "missing": ["main_decode"]}

    refused = 0

    async def refuse(name, retries):
        nonlocal refused
        refused += 1
        raise ConnectionRefusedError(f"connect to {name} refused")

    o._connect = refuse
    for _ in range(3):  # the watcher's tries while md0 is down
        await o._reconnect("md0")
    assert refused == 3 and _lines(caplog) == [drop]  # no line per failed try
    assert o.health()["down"] == ["md0"]

    new, new_reader = _connection(o, "md0")  # md0 answers again

    async def accept(name, retries):
        return new

    o._connect = accept
    await o._reconnect("md0")
    assert o.peers["md0"] is new and o.health() == {"status": "ok", "mode": "pdd", "down": [], "missing": []}
    assert _lines(caplog) == [drop, (logging.INFO, "reconnected to md0")]

    new_reader.feed_eof()  # dropped again: a second drop, a second line
    await asyncio.wait_for(new.wait_close_reported(), GUARD_S)
    assert _lines(caplog) == [drop, (logging.INFO, "reconnected to md0"), drop]


async def test_a_close_of_the_gateways_own_is_not_logged_as_a_drop(caplog):
    """The gateway's shutdown closes every connection (``Orchestrator.close``): no warning."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    o = fake_orchestrator()
    peer, _reader = _connection(o, "rld0")
    o.peers["rld0"] = peer
    await o.close()
    assert peer.closed and peer.closed_locally and peer.close_reason == "connection closed locally"
    assert _lines(caplog) == []


async def test_a_forced_removal_declaring_the_instance_lost_is_not_logged_as_a_drop(caplog):
    """``Membership.remove(force)`` declares a still-open connection's requests lost
    (``_peer_closed`` with the live peer): the instance dropped nothing."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    o = fake_orchestrator()
    o.peers["md0"] = live = FakePeer()
    o._peer_closed("md0", live)
    assert _lines(caplog) == [] and o.totals["instances_lost"] == 1
