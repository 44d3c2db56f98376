"""The one-way messages a Peer read before its connection ended from the remote side are handed
to their handlers, in order and within ``drain_timeout_s``, before the close is reported
(``on_close``, ``wait_closed``); a local close or a protocol error drops them (pdd.transfer.peer,
module doc "Close").

No socket: the Peer reads an in-memory ``asyncio.StreamReader`` the test feeds whole frames and
the EOF, and writes to a writer that records the bytes; handlers wait on events the test sets.
``wait_for(..., GUARD_S)`` only bounds a test that would otherwise hang."""

from __future__ import annotations

import asyncio

import pytest

from pdd.transfer import wire
from pdd.transfer.peer import Peer

GUARD_S = 30


class _Transport:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


class _Writer:
    """Records what is written; ``fail``: ``drain()`` raises as on a reset connection."""

    def __init__(self, fail: bool = False):
        self.transport = _Transport()
        self.data = bytearray()
        self.closed = False
        self.fail = fail

    def write(self, b):
        self.data += bytes(b)

    async def drain(self):
        if self.fail:
            raise ConnectionResetError("reset by peer")

    def close(self):
        self.closed = True

    async def wait_closed(self):
        pass

    def get_extra_info(self, name, default=None):
        return default


def _peer(**kw) -> tuple[Peer, asyncio.StreamReader, _Writer]:
    reader = asyncio.StreamReader()
    writer = _Writer(fail=kw.pop("fail", False))
    return Peer(reader, writer, name="remote", **kw), reader, writer


def _feed(reader: asyncio.StreamReader, n: int, eof: bool = True) -> None:
    """The remote side's ``n`` one-way frames ``m`` (``i`` = 0..n-1, payload ``b"p<i>"``), then its EOF."""
    for i in range(n):
        reader.feed_data(wire.frame_bytes({"t": "m", "i": i}, b"p%d" % i))
    if eof:
        reader.feed_eof()


async def _read_to_the_end(peer: Peer) -> None:
    """Until the reader task has read everything fed, the EOF included (it then ends)."""
    await asyncio.wait_for(asyncio.shield(peer._reader_task), GUARD_S)


async def test_oneway_messages_read_before_eof_are_handled_in_order_before_on_close():
    peer, reader, writer = _peer()
    release, first = asyncio.Event(), asyncio.Event()
    events: list = []

    async def slow(p, h, payload):
        first.set()
        await release.wait()
        events.append((h["i"], bytes(payload)))

    peer.on("m", slow)
    peer.on_close(lambda p: events.append("on_close"))
    peer.start()
    # a call of ours is pending when the remote side ends the connection
    call = asyncio.ensure_future(peer.call({"t": "q"}, timeout=None))
    await asyncio.wait_for(_until(lambda: peer._pending and writer.data), GUARD_S)  # sent, awaiting its reply
    _feed(reader, 5, eof=False)
    await asyncio.wait_for(first.wait(), GUARD_S)
    await asyncio.wait_for(_until(lambda: len(peer._q) == 4), GUARD_S)  # 0 in its handler, 1-4 queued
    reader.feed_eof()
    await _read_to_the_end(peer)  # the EOF read, 1-4 still queued
    # the pending call fails at once (no reply can come), the drain notwithstanding
    with pytest.raises(ConnectionError, match="lost"):
        await asyncio.wait_for(call, GUARD_S)
    assert events == [] and peer.closed and peer.draining
    waiter = asyncio.ensure_future(peer.wait_closed())
    await asyncio.sleep(0)
    assert not waiter.done()
    release.set()
    await asyncio.wait_for(waiter, GUARD_S)
    assert events == [(0, b"p0"), (1, b"p1"), (2, b"p2"), (3, b"p3"), (4, b"p4"), "on_close"]
    assert (peer.oneway_dropped, peer.draining, peer.closed) == (0, False, True)
    # a callback added after the report runs at once, as before
    late = []
    peer.on_close(late.append)
    assert late == [peer]


async def test_a_handler_calling_or_sending_during_the_drain_fails_at_once():
    # the bound is an hour: only the fast failure can let the drain end
    peer, reader, writer = _peer(drain_timeout_s=3600)
    release = asyncio.Event()
    outcome: list = []
    closed = asyncio.Event()

    async def handler(p, h, payload):
        if h["i"] == 0:
            await release.wait()
            return
        for what, op in (("call", lambda: p.call({"t": "q", "i": h["i"]}, timeout=None)),
                         ("send", lambda: p.send({"t": "r", "i": h["i"]}))):
            try:
                await op()
                outcome.append((h["i"], what, "sent"))
            except ConnectionError as e:
                outcome.append((h["i"], what, "ConnectionError", "is closed" in str(e)))

    peer.on("m", handler)
    peer.on_close(lambda p: closed.set())
    peer.start()
    _feed(reader, 3)
    await _read_to_the_end(peer)
    release.set()
    await asyncio.wait_for(closed.wait(), GUARD_S)
    assert outcome == [(1, "call", "ConnectionError", True), (1, "send", "ConnectionError", True),
                       (2, "call", "ConnectionError", True), (2, "send", "ConnectionError", True)]
    assert bytes(writer.data) == b""  # nothing was written to the dead socket
    assert peer.oneway_dropped == 0


async def test_a_hanging_handler_does_not_keep_the_close_from_being_reported():
    peer, reader, writer = _peer(drain_timeout_s=0.05)
    release, never = asyncio.Event(), asyncio.Event()
    handled: list = []
    cancelled = asyncio.Event()
    reported = asyncio.Event()

    async def handler(p, h, payload):
        if h["i"] == 0:
            await release.wait()
        elif h["i"] == 1:
            try:
                await never.wait()  # hangs for good
            except asyncio.CancelledError:
                cancelled.set()
                raise
        handled.append(h["i"])

    peer.on("m", handler)
    peer.on_close(lambda p: reported.set())
    peer.start()
    _feed(reader, 4)
    await _read_to_the_end(peer)
    release.set()
    await asyncio.wait_for(reported.wait(), GUARD_S)  # the 0.05 s bound ended the drain
    assert cancelled.is_set() and handled == [0]
    assert (peer.oneway_dropped, peer.draining) == (2, False)  # 2 and 3 were never handled
    await asyncio.wait_for(peer.wait_closed(), GUARD_S)


async def test_a_failed_write_drains_too():
    """A send that finds the socket reset ends the connection from the remote side as well:
    the messages read before are still handled."""
    peer, reader, writer = _peer(fail=True)
    release = asyncio.Event()
    events: list = []

    async def handler(p, h, payload):
        if h["i"] == 0:
            await release.wait()
            try:
                await p.send({"t": "ack"})
            except ConnectionError:
                events.append("send failed")
        events.append(h["i"])

    peer.on("m", handler)
    peer.on_close(lambda p: events.append("on_close"))
    peer.start()
    _feed(reader, 3, eof=False)  # no EOF: the reset is found by the write
    await asyncio.wait_for(_until(lambda: len(peer._q) == 2), GUARD_S)  # 0 in its handler
    release.set()
    await asyncio.wait_for(peer.wait_closed(), GUARD_S)
    assert events == ["send failed", 0, 1, 2, "on_close"]


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0)


def _stuck_handler(peer: Peer) -> tuple[list, asyncio.Event]:
    """Install on ``peer`` a handler of ``m`` that never returns (its message is never handled):
    ``(handled, started)``, the ids handled (stays empty) and an event set when one is in it."""
    handled: list = []
    started, never = asyncio.Event(), asyncio.Event()

    async def handler(p, h, payload):
        started.set()
        await never.wait()
        handled.append(h["i"])

    peer.on("m", handler)
    return handled, started


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_a_local_close_during_the_drain_drops_the_rest_at_once(how):
    peer, reader, writer = _peer(drain_timeout_s=3600)
    handled, _ = _stuck_handler(peer)
    reported: list = []
    peer.on_close(reported.append)
    peer.start()
    _feed(reader, 3)
    await _read_to_the_end(peer)
    assert peer.draining and reported == []
    if how == "close":
        await asyncio.wait_for(peer.close(), GUARD_S)
    else:
        peer.abort()
    assert reported == [peer] and handled == [] and peer.oneway_dropped == 2
    assert not peer.draining


async def test_a_local_close_drops_the_queue_as_before():
    peer, reader, writer = _peer()
    handled, started = _stuck_handler(peer)
    reported: list = []
    peer.on_close(reported.append)
    peer.start()
    _feed(reader, 3, eof=False)
    await asyncio.wait_for(_until(lambda: len(peer._q) == 2), GUARD_S)
    await asyncio.wait_for(started.wait(), GUARD_S)
    await asyncio.wait_for(peer.close(), GUARD_S)
    assert reported == [peer] and handled == [] and peer.oneway_dropped == 2 and not peer.draining


async def test_a_protocol_error_drops_the_queue_and_reports_at_once():
    """Frames after a malformed one are not to be trusted: nothing queued is handled."""
    peer, reader, writer = _peer(drain_timeout_s=3600)
    handled, started = _stuck_handler(peer)
    reported = asyncio.Event()
    peer.on_close(lambda p: reported.set())
    peer.start()
    _feed(reader, 3, eof=False)
    await asyncio.wait_for(started.wait(), GUARD_S)  # 0 in its handler, 1 and 2 queued
    reader.feed_data(b"\x00" * wire.PREFIX_BYTES)  # bad magic: WireError
    await asyncio.wait_for(reported.wait(), GUARD_S)
    assert handled == [] and peer.oneway_dropped == 2 and not peer.draining and peer.closed


async def test_nothing_queued_reports_the_remote_close_at_once():
    """No message waiting: on_close runs within the reader's own end, as before."""
    peer, reader, writer = _peer()
    reported: list = []
    peer.on_close(reported.append)
    peer.start()
    reader.feed_eof()
    await _read_to_the_end(peer)
    assert reported == [peer] and not peer.draining and peer._drain_task is None


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), "2"])
def test_a_bad_drain_bound_is_refused(bad):
    with pytest.raises(ValueError, match="drain_timeout_s must be a finite number of seconds >= 0"):
        Peer(None, None, drain_timeout_s=bad)
