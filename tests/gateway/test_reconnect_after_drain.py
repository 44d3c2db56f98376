"""A reconnect to an instance whose old connection is still draining (closed by the instance;
the one-way messages read before, e.g. its last tokens, still being handled) waits for that
close to be reported: ``_peer_closed`` declares the old connection's requests lost first. A new
connection put in place before would have made it skip them as "an old connection, already
replaced" (pdd.transfer.peer, module doc "Close")."""

from __future__ import annotations

import asyncio

from pdd.transfer import wire
from pdd.transfer.peer import Peer
from tests.gateway.fake_peer import FakePeer, SocketWriter, fake_orchestrator

GUARD_S = 30


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0)


async def test_a_reconnect_waits_for_the_old_connections_close_to_be_reported():
    o = fake_orchestrator()
    name = o.layout.engines[0].name
    reader = asyncio.StreamReader()
    old = Peer(reader, SocketWriter(), name=name, drain_timeout_s=3600)
    release, started = asyncio.Event(), asyncio.Event()

    async def last_tokens(p, h, payload):  # the instance's last message, handled slowly
        started.set()
        await release.wait()

    old.on("m", last_tokens)
    old.on_close(lambda p, n=name: o._peer_closed(n, p))  # as Orchestrator._connect does
    o.peers[name] = old
    old.start()
    reader.feed_data(wire.frame_bytes({"t": "m"}))
    await asyncio.wait_for(started.wait(), GUARD_S)
    reader.feed_eof()  # the instance died
    await asyncio.wait_for(_until(lambda: old.draining), GUARD_S)

    new = FakePeer()
    connects: list = []

    async def connect(n, retries):
        connects.append(n)
        return new

    o._connect = connect
    task = asyncio.ensure_future(o._reconnect(name))
    for _ in range(20):  # turns of the loop, no clock: the reconnect does not connect yet
        await asyncio.sleep(0)
    assert connects == [] and o.peers[name] is old and not task.done()
    release.set()  # the drain ends, the close is reported
    await asyncio.wait_for(task, GUARD_S)
    assert connects == [name] and o.peers[name] is new
    assert o.totals.get("instances_lost") == 1  # the old connection's loss was declared
