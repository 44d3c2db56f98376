"""A KV stream striped over several connections (``KVSender(peers=...)``, ``KVReorder``;
``link.wan_connections``, docs/LINK.md "Parallel connections").

The receiver must see exactly one connection's sequence: every frame once, in the order the
sender numbered them, the closing ``kv_done`` / ``kv_cancel`` after the last, and the same pages
and bytes as one connection. Tests wait on the receiver's events, never on time.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.transfer.kv import KVReceiver, KVReorder, KVSender
from pdd.transfer.client import connect
from pdd.transfer.server import Server
from tests.transfer.kv_sink import EventSink

PAGE = 100  # bytes per page


def page(i: int) -> bytes:
    return bytes([i % 256]) * PAGE


class FakePeer:
    def __init__(self):
        self.cbs = []

    def on_close(self, cb):
        self.cbs.append(cb)

    def close(self):
        for cb in self.cbs:
            cb(self)


def kv(rid, seq, first, tseq=0):
    return {"t": "kv", "rid": rid, "first_page": first, "n_pages": 1, "layers": None, "page_bytes": PAGE,
            "stripe": [tseq, seq]}


def test_reorder_hands_frames_on_in_sequence_and_the_close_last():
    got = []

    async def on(peer, h, payload):
        got.append((h["t"], h.get("stripe"), bytes(payload)))

    r = KVReorder()
    hs = r.wrap({"kv": on, "kv_done": on, "kv_cancel": on})
    a, b = FakePeer(), FakePeer()

    async def run():
        # kv_done first (3 frames), then frames 2, 0, 1 over two connections
        await hs["kv_done"](a, {"t": "kv_done", "rid": "r", "stripe": [7, 3]}, b"")
        await hs["kv"](b, kv("r", 2, 2, 7), page(2))
        assert got == [] and r.open_transfers == 1
        await hs["kv"](a, kv("r", 0, 0, 7), page(0))
        assert [g[1] for g in got] == [[7, 0]]
        await hs["kv"](b, kv("r", 1, 1, 7), page(1))
        # an unstriped frame passes straight through
        await hs["kv"](a, {"t": "kv", "rid": "s", "first_page": 0, "n_pages": 1}, page(9))

    asyncio.run(run())
    assert got == [("kv", [7, 0], page(0)), ("kv", [7, 1], page(1)), ("kv", [7, 2], page(2)),
                   ("kv_done", [7, 3], b""), ("kv", None, page(9))]
    assert r.reordered_frames == 1 and r.dropped_frames == 0 and r.open_transfers == 0


def test_reorder_keys_transfers_apart_drops_duplicates_and_forgets_a_stripe_whose_connection_closed():
    got = []

    def on(peer, h, payload):
        got.append((h["rid"], h["t"], h["stripe"][1]))

    r = KVReorder()
    hs = r.wrap({"kv": on, "kv_cancel": on})
    a, b = FakePeer(), FakePeer()

    async def run():
        await hs["kv"](a, kv("r", 0, 0, 1), page(0))
        await hs["kv"](a, kv("r", 0, 0, 2), page(0))  # the same rid's second transfer (a fill)
        await hs["kv"](a, kv("r", 0, 0, 1), page(0))  # a duplicate
        await hs["kv"](b, kv("q", 1, 1), page(1))  # ahead of q's frame 0, on b
        await hs["kv_cancel"](a, {"t": "kv_cancel", "rid": "r", "bytes": PAGE, "pages": 1, "stripe": [1, 1]}, b"")
        b.close()  # q's frame 0 is lost with b: q is forgotten, its held frame dropped
        await hs["kv"](a, kv("q", 0, 0), page(0))  # a late frame of the forgotten q

    asyncio.run(run())
    assert got == [("r", "kv", 0), ("r", "kv", 0), ("r", "kv_cancel", 1)]
    assert r.dropped_frames == 3 and r.open_transfers == 1  # r's second transfer is still open


class Sink(EventSink):
    def __init__(self):
        super().__init__()
        self.frames = []  # (first_page, n, payload)

    def on_pages(self, rid, first, n, layers, payload):
        assert self.done is None and not self.cancelled, "a frame after the transfer's close"
        self.frames.append((first, n, bytes(payload)))
        self.changed.set()


async def _pair(n_conns: int):
    sink = Sink()
    recv = KVReceiver(sink.on_pages, sink.on_done, sink.on_cancel)
    reorder = KVReorder()
    server = Server("127.0.0.1", 0, reorder.wrap(recv.handlers()))
    await server.start()
    peers = [await connect("127.0.0.1", server.port) for _ in range(n_conns)]
    return sink, reorder, server, peers


async def _close(sender, peers, server) -> None:
    await sender.close()
    for p in peers:
        await p.close()
    await server.close()


def reader(gate: asyncio.Event | None = None, after: int = 0):
    calls = []

    async def read(i, n):
        calls.append(i)
        if gate is not None and len(calls) > after:
            await gate.wait()
        await asyncio.sleep(0)  # every connection's loop gets its turn: frames go over all of them
        return b"".join(page(p) for p in range(i, i + n))

    return read


@pytest.mark.parametrize("n_conns", [1, 4])
def test_a_striped_transfer_delivers_the_same_pages_and_bytes_as_one_connection(n_conns):
    N, CHUNK = 37, 2

    async def run():
        sink, reorder, server, peers = await _pair(n_conns)
        s = KVSender(peers[0], peers=peers[1:], chunk_pages=CHUNK)
        t = s.submit("r", 3, reader(), N, PAGE, done_fields={"first_token": 5})
        res = await t
        await sink.until(lambda: sink.done is not None)
        await _close(s, peers, server)
        return sink, reorder, s, res

    sink, reorder, s, res = asyncio.run(run())
    assert [f[0] for f in sink.frames] == list(range(3, 3 + N, CHUNK))  # in page order
    assert b"".join(f[2] for f in sink.frames) == b"".join(page(p) for p in range(3, 3 + N))
    assert res.bytes_sent == N * PAGE and res.pages_sent == N and not res.cancelled
    assert sink.done["bytes"] == N * PAGE and sink.done["first_token"] == 5
    assert sum(s.bytes_by_connection) == N * PAGE
    assert sum(b > 0 for b in s.bytes_by_connection) == n_conns  # every connection carried frames
    assert ("stripe" in sink.done) == (n_conns > 1)  # one connection: the wire is unchanged
    assert reorder.open_transfers == 0 and reorder.dropped_frames == 0


def test_a_striped_transfer_cancelled_mid_way_closes_after_the_frames_it_sent():
    async def run():
        sink, reorder, server, peers = await _pair(3)
        gate = asyncio.Event()
        s = KVSender(peers[0], peers=peers[1:], chunk_pages=1)
        t = s.submit("r", 0, reader(gate, after=5), 20, PAGE)
        await sink.until(lambda: len(sink.frames) >= 5)
        assert t.cancel()
        gate.set()
        res = await t
        await sink.until(lambda: sink.cancelled)
        await _close(s, peers, server)
        return sink, reorder, res

    sink, reorder, res = asyncio.run(run())
    assert res.cancelled and 5 <= res.pages_sent < 20
    # the receiver got exactly what the sender counted, each page once, before the kv_cancel
    assert [f[0] for f in sink.frames] == list(range(res.pages_sent))
    assert sum(len(f[2]) for f in sink.frames) == res.bytes_sent == res.pages_sent * PAGE
    assert reorder.open_transfers == 0


def test_one_of_the_connections_dying_fails_the_striped_transfer_once_and_closes_the_others():
    async def run():
        sink, reorder, server, peers = await _pair(3)
        gate = asyncio.Event()
        s = KVSender(peers[0], peers=peers[1:], chunk_pages=1)
        t = s.submit("r", 0, reader(gate, after=4), 20, PAGE)
        settled = []
        t.done.add_done_callback(lambda f: settled.append(f.exception()))
        await sink.until(lambda: len(sink.frames) >= 4)
        peers[1].abort()
        gate.set()
        with pytest.raises(ConnectionError):
            await t
        assert s.connection_closed and all(p.closed for p in peers)
        with pytest.raises(ConnectionError):
            s.submit("q", 0, reader(), 1, PAGE)  # the caller reconnects (roles.prefill.sender_for)
        # the receiver forgets the stripe once its connections are gone
        for _ in range(200):
            if reorder.open_transfers == 0:
                break
            await asyncio.sleep(0.01)
        await s.close()
        await server.close()
        return sink, reorder, settled

    sink, reorder, settled = asyncio.run(run())
    assert len(settled) == 1 and isinstance(settled[0], ConnectionError)  # resolved once
    assert sink.done is None and not sink.cancelled  # never completed at the receiver
    assert reorder.open_transfers == 0
    assert [f[0] for f in sink.frames] == list(range(len(sink.frames)))  # what got through, in order


def test_backlog_bytes_is_what_is_queued_and_not_yet_written():
    async def run():
        sink, reorder, server, peers = await _pair(2)
        s = KVSender(peers[0], peers=peers[1:], chunk_pages=2)
        t1 = s.submit("a", 0, reader(), 10, PAGE)
        t2 = s.submit("b", 0, lambda i, n: bytes(n * PAGE - (PAGE - 40 if i + n == 5 else 0)), 5, PAGE,
                      last_page_bytes=40)
        t3 = s.submit("c", 0, reader(), 3, PAGE)
        t3.cancel()
        queued = s.backlog_bytes  # nothing written yet; a cancelled transfer is not queued
        await t1
        await t2
        await t3
        after = s.backlog_bytes
        await _close(s, peers, server)
        return queued, after

    queued, after = asyncio.run(run())
    assert queued == 10 * PAGE + 4 * PAGE + 40 and after == 0
