import asyncio
import contextlib

import pytest

from pdd.transfer.kv import (
    KVReceiver,
    KVSender,
    pick_fifo,
    pick_round_robin,
    pick_shortest_remaining,
)
from pdd.transfer.client import connect
from pdd.transfer.server import Server

PB = 1000  # bytes per page


def pages_of(rid_byte: int, n: int) -> bytes:
    # page i of request r: distinctive bytes
    return b"".join(bytes([rid_byte, i % 256]) * (PB // 2) for i in range(n))


def reader_for(blob: bytes):
    def read(i, n):
        return memoryview(blob)[i * PB : (i + n) * PB]

    return read


class Sink:
    def __init__(self):
        self.events = []
        self.data = {}
        self.done = {}
        self.cancelled = set()
        self.finished = asyncio.Event()
        self.expect = 0
        self.n_cancel = 0

    def on_pages(self, rid, first, n, layers, payload):
        self.events.append(("kv", rid, first, n, layers))
        buf = self.data.setdefault(rid, {})
        for k in range(n):
            buf[first + k] = bytes(payload[k * PB : (k + 1) * PB])

    async def on_done(self, rid, h):
        self.events.append(("done", rid))
        self.done[rid] = h
        self._check()

    def on_cancel(self, rid):
        self.events.append(("cancel", rid))
        self.cancelled.add(rid)
        self.n_cancel += 1
        self._check()

    def _check(self):
        if len(self.done) + self.n_cancel >= self.expect:
            self.finished.set()


async def pair(sink, **kw):
    recv = KVReceiver(sink.on_pages, sink.on_done, sink.on_cancel)
    server = Server("127.0.0.1", 0, recv.handlers())
    await server.start()
    peer = await connect("127.0.0.1", server.port)
    return recv, server, peer


@contextlib.asynccontextmanager
async def linked(expect: int = 0):
    """A ``Sink`` that counts ``expect`` finished transfers as done, a ``KVReceiver`` serving it and a
    peer connected to that receiver; the peer and the server are closed on the way out."""
    sink = Sink()
    sink.expect = expect
    recv, server, peer = await pair(sink)
    try:
        yield sink, recv, server, peer
    finally:
        await peer.close()
        await server.close()


async def test_stream_intact_with_done_fields_and_layers():
    async with linked(1) as (sink, recv, server, peer):
        blob = pages_of(7, 20)
        snd = KVSender(peer, chunk_pages=3, crc=True)
        t = snd.submit("r1", 5, reader_for(blob), 15, PB, layers=(0, 4), done_fields={"first_token": 42})
        res = await asyncio.wait_for(t, 5)
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert not res.cancelled and res.bytes_sent == 15 * PB == t.bytes_sent and res.pages_sent == 15
        assert sorted(sink.data["r1"]) == list(range(5, 20))
        for i in range(5, 20):
            assert sink.data["r1"][i] == blob[i * PB : (i + 1) * PB]
        kvs = [e for e in sink.events if e[0] == "kv"]
        assert [e[2] for e in kvs] == [5, 8, 11, 14, 17] and [e[3] for e in kvs] == [3, 3, 3, 3, 3]
        assert all(e[4] == (0, 4) for e in kvs)
        assert sink.events[-1] == ("done", "r1")
        d = sink.done["r1"]
        assert d["first_token"] == 42 and d["n_pages"] == 15 and d["bytes"] == 15 * PB and d["first_page"] == 5
        assert recv.bytes_received["r1"] == 15 * PB and recv.pages_received["r1"] == 15


async def test_async_page_reader_and_zero_pages():
    async with linked(2) as (sink, recv, server, peer):
        blob = pages_of(1, 4)

        async def aread(i, n):
            await asyncio.sleep(0)
            return blob[i * PB : (i + n) * PB]

        snd = KVSender(peer)
        t1 = snd.submit("a", 0, aread, 4, PB)
        t0 = snd.submit("z", 0, aread, 0, PB, done_fields={"first_token": 1})
        r1, r0 = await asyncio.gather(t1.done, t0.done)
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert r1.bytes_sent == 4 * PB and r0.bytes_sent == 0
        assert sink.done["z"]["n_pages"] == 0 and "z" not in sink.data
        assert b"".join(sink.data["a"][i] for i in range(4)) == blob


async def _order_run(order):
    async with linked(3) as (sink, recv, server, peer):
        snd = KVSender(peer, order=order, chunk_pages=2)
        blobs = {"A": pages_of(1, 8), "B": pages_of(2, 4), "C": pages_of(3, 2)}
        ts = [snd.submit(r, 0, reader_for(b), len(b) // PB, PB) for r, b in blobs.items()]
        await asyncio.wait_for(asyncio.gather(*[t.done for t in ts]), 5)
        await asyncio.wait_for(sink.finished.wait(), 5)
        for r, b in blobs.items():
            assert b"".join(sink.data[r][i] for i in range(len(b) // PB)) == b
        return [e[1] for e in sink.events if e[0] == "kv"], [e[1] for e in sink.events if e[0] == "done"]


async def test_order_fifo():
    kv, done = await _order_run("fifo")
    assert kv == ["A"] * 4 + ["B"] * 2 + ["C"]
    assert done == ["A", "B", "C"]


async def test_order_round_robin_interleaves():
    kv, done = await _order_run(pick_round_robin)
    assert kv == ["A", "B", "C", "A", "B", "A", "A"]
    assert done == ["C", "B", "A"]


async def test_order_shortest_remaining():
    kv, done = await _order_run("srf")
    assert kv == ["C"] + ["B"] * 2 + ["A"] * 4
    assert done == ["C", "B", "A"]


def test_pick_functions_pure():
    class T:
        def __init__(self, seq, rem, tick):
            self.seq, self.remaining_bytes, self.last_sent_tick = seq, rem, tick

    a, b, c = T(0, 50, 5), T(1, 10, -1), T(2, 10, 3)
    assert pick_fifo([c, b, a]) is a
    assert pick_shortest_remaining([a, b, c]) is b
    assert pick_round_robin([a, b, c]) is b


async def test_cancel_midway_exact_accounting():
    # The cancel lands at a controlled point: the page reader for the third chunk (pages 8..11)
    # holds until the test has cancelled, so exactly two chunks (8 pages) went out, whatever the load.
    async with linked(2) as (sink, recv, server, peer):
        blob = pages_of(9, 400)
        plain = reader_for(blob)
        at_third_chunk = asyncio.Event()
        release = asyncio.Event()
        reads = []

        async def gated(i, n):
            reads.append((i, n))
            if i == 8:
                at_third_chunk.set()
                await release.wait()
            return plain(i, n)

        snd = KVSender(peer, chunk_pages=4)
        t = snd.submit("big", 0, gated, 400, PB)
        await asyncio.wait_for(at_third_chunk.wait(), 5)
        assert t.bytes_sent == 8 * PB and t.pages_sent == 8
        assert t.cancel() is True
        assert t.cancel() is False
        release.set()
        res = await asyncio.wait_for(t, 5)
        assert res.cancelled and t.cancelled
        assert res.bytes_sent == t.bytes_sent == 8 * PB and res.pages_sent == 8
        assert reads == [(0, 4), (4, 4), (8, 4)]  # the chunk read when the cancel came is not sent
        # the sender goes on with other transfers afterwards
        t2 = snd.submit("after", 0, reader_for(blob), 8, PB)
        await asyncio.wait_for(t2, 5)
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert "big" in sink.cancelled and "big" not in sink.done
        assert recv.bytes_received["big"] == res.bytes_sent
        assert sink.events.index(("cancel", "big")) > max(i for i, e in enumerate(sink.events) if e[:2] == ("kv", "big"))
        assert recv.bytes_received["after"] == 8 * PB


async def test_cancel_before_start_and_by_rid():
    async with linked(3) as (sink, recv, server, peer):
        blob = pages_of(4, 50)
        snd = KVSender(peer, chunk_pages=1)
        t1 = snd.submit("x", 0, reader_for(blob), 50, PB)
        t2 = snd.submit("y", 0, reader_for(blob), 50, PB)
        t3 = snd.submit("y", 0, reader_for(blob), 10, PB, layers=(2, 4))
        assert snd.cancel("y") == 2
        r1, r2, r3 = await asyncio.wait_for(asyncio.gather(t1.done, t2.done, t3.done), 5)
        assert not r1.cancelled and r2.cancelled and r3.cancelled
        assert r2.bytes_sent == 0 and r3.bytes_sent == 0
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert "y" not in recv.bytes_received and sink.cancelled == {"y"}
        assert t1.cancel() is False


async def test_page_reader_error_and_bad_size():
    async with linked(3) as (sink, recv, server, peer):
        blob = pages_of(4, 10)

        def broken(i, n):
            if i >= 4:
                raise KeyError("page gone")
            return blob[i * PB : (i + n) * PB]

        snd = KVSender(peer, chunk_pages=2)
        tb = snd.submit("broken", 0, broken, 10, PB)
        ts = snd.submit("short", 0, lambda i, n: b"x" * 10, 2, PB)
        tok = snd.submit("ok", 0, reader_for(blob), 10, PB)
        with pytest.raises(KeyError):
            await asyncio.wait_for(tb.done, 5)
        with pytest.raises(ValueError, match="returned 10 bytes"):
            await asyncio.wait_for(ts.done, 5)
        assert (await asyncio.wait_for(tok, 5)).bytes_sent == 10 * PB
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert sink.cancelled == {"broken", "short"}
        assert recv.bytes_received["broken"] == 4 * PB


async def test_connection_loss_fails_transfers():
    sink = Sink()
    recv, server, peer = await pair(sink)
    try:
        blob = pages_of(4, 1000)
        snd = KVSender(peer, chunk_pages=1, rate_gbps=0.01)
        t = snd.submit("r", 0, reader_for(blob), 1000, PB)
        await asyncio.sleep(0.02)
        await server.close()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(t.done, 3)
        with pytest.raises(ConnectionError):
            snd.submit("r2", 0, reader_for(blob), 1, PB)
    finally:
        await peer.close()


async def test_pacing_rate_lower_bound():
    async with linked(1) as (sink, recv, server, peer):
        n = 200
        blob = pages_of(5, n)  # 200 kB
        loop = asyncio.get_running_loop()
        from pdd.transfer.pacing import Pacer

        # 20 Mbit/s = 2.5 MB/s, bucket of one chunk: 200 kB take >= 76 ms
        snd2 = KVSender(peer, rate_gbps=Pacer(0.02, burst_bytes=10 * PB), chunk_pages=10)
        t0 = loop.time()
        res = await asyncio.wait_for(snd2.submit("p2", 0, reader_for(blob), n, PB), 5)
        el2 = loop.time() - t0
        expect = (n - 10) * PB * 8 / 0.02e9
        assert el2 >= expect * 0.95, (el2, expect)
        assert el2 < expect * 5 + 1.0


async def test_bidirectional_kv_on_one_peer():
    """P streams to MD while MD calls P on the same connection (shared persistent link)."""
    async with linked(1) as (sink, recv, server, peer):
        server.on("status", lambda p, h, pl: {"t": "st", "ok": True})
        blob = pages_of(6, 64)
        snd = KVSender(peer, chunk_pages=4)
        t = snd.submit("r", 0, reader_for(blob), 64, PB)
        replies = await asyncio.gather(*[peer.call({"t": "status"}) for _ in range(10)])
        assert all(r[0]["ok"] for r in replies)
        await asyncio.wait_for(t, 5)
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert recv.bytes_received["r"] == 64 * PB


async def test_policy_module_pick_adapter():
    from pdd.transfer.kv import pick_from_index

    try:
        from pdd.policy import wan_order
    except Exception:  # policy package not importable in this checkout
        pytest.skip("pdd.policy.wan_order unavailable")
    kv, done = await _order_run(pick_from_index(lambda ts: wan_order.pick_next(ts, "srf")))
    assert kv == ["C"] + ["B"] * 2 + ["A"] * 4


async def test_max_frame_bytes_caps_frames_at_whole_pages():
    async with linked(2) as (sink, recv, server, peer):
        snd = KVSender(peer, chunk_pages=16, max_frame_bytes=2500)  # 2 pages of 1,000 bytes
        a = snd.submit("a", 0, reader_for(pages_of(1, 7)), 7, PB)
        big = bytes(range(200)) * 60  # 3 pages of 4,000 bytes, each above the cap: 1 per frame
        b = snd.submit("b", 0, lambda i, n: big[i * 4000:(i + n) * 4000], 3, 4000)
        await asyncio.wait_for(asyncio.gather(a.done, b.done), 5)
        await asyncio.wait_for(sink.finished.wait(), 5)
        frames = [(e[1], e[3]) for e in sink.events if e[0] == "kv"]
        assert [n for r, n in frames if r == "a"] == [2, 2, 2, 1]
        assert [n for r, n in frames if r == "b"] == [1, 1, 1]
        with pytest.raises(ValueError):
            KVSender(peer, max_frame_bytes=0)



async def test_partial_last_page_sends_only_its_filled_bytes():
    """A transfer whose last page is partial (``last_page_bytes``): the frame that ends with it
    carries ``(n - 1) * PB + last_page_bytes`` and says so in its header; the other frames are
    whole; ``bytes_sent`` / ``total_bytes`` / ``kv_done`` count exactly what crossed."""
    async with linked(1) as (sink, recv, server, peer):
        raw = []
        orig = recv._on_kv

        async def spy(p, h, payload):
            raw.append((dict(h), len(payload)))
            await orig(p, h, payload)

        server.handlers["kv"] = spy
        blob = pages_of(3, 7)
        last = 300

        def read(i, n):
            end = (i + n) * PB - (PB - last if i + n == 7 else 0)
            return memoryview(blob)[i * PB : end]

        snd = KVSender(peer, chunk_pages=3)
        t = snd.submit("r1", 2, read, 5, PB, last_page_bytes=last)
        assert t.total_bytes == 4 * PB + last and t.remaining_bytes == t.total_bytes
        res = await asyncio.wait_for(t, 5)
        await asyncio.wait_for(sink.finished.wait(), 5)
        assert res.bytes_sent == 4 * PB + last == recv.bytes_received["r1"] and res.pages_sent == 5
        assert [(h["first_page"], h["n_pages"], h.get("last_page_bytes"), n) for h, n in raw] == [
            (2, 3, None, 3 * PB), (5, 2, last, PB + last)]
        assert sink.done["r1"]["bytes"] == 4 * PB + last and sink.done["r1"]["last_page_bytes"] == last
        assert t.remaining_bytes == 0


async def test_partial_last_page_reader_of_whole_pages_fails_the_transfer():
    async with linked() as (sink, recv, server, peer):
        blob = pages_of(3, 2)
        snd = KVSender(peer, chunk_pages=4)
        t = snd.submit("r1", 0, reader_for(blob), 2, PB, last_page_bytes=10)  # reader ignores the tail
        with pytest.raises(ValueError, match="returned 2000 bytes, expected 1010"):
            await asyncio.wait_for(t, 5)
        with pytest.raises(ValueError, match="last_page_bytes"):
            snd.submit("r2", 0, reader_for(blob), 2, PB, last_page_bytes=PB + 1)


def test_kv_frame_bytes_and_prompt_kv_bytes():
    from pdd.transfer.kv import kv_frame_bytes, prompt_kv_bytes, prompt_last_slots

    assert kv_frame_bytes({"n_pages": 3, "page_bytes": 100}) == 300
    assert kv_frame_bytes({"n_pages": 3, "page_bytes": 100, "last_page_bytes": 25}) == 225
    for bad in ({"n_pages": 0, "page_bytes": 100, "last_page_bytes": 25}, {"n_pages": 1, "page_bytes": 100,
                "last_page_bytes": 0}, {"n_pages": 1, "page_bytes": 100, "last_page_bytes": 101},
                {"n_pages": True, "page_bytes": 100}, {"n_pages": -1, "page_bytes": 100}, {"page_bytes": 100},
                {"n_pages": 1, "page_bytes": 100, "last_page_bytes": 2.5}):
        assert kv_frame_bytes(bad) is None, bad
    # 200 prompt tokens, pages of 16 (2048 bytes a slot): from page 12 on, the last page's 8 tokens
    assert prompt_kv_bytes(200, 12, 16, 16 * 2048) == 8 * 2048
    assert prompt_kv_bytes(200, 0, 16, 16 * 2048) == 200 * 2048
    assert prompt_kv_bytes(192, 12, 16, 16 * 2048) == 0 and prompt_kv_bytes(192, 13, 16, 16 * 2048) == 0
    assert prompt_kv_bytes(200, 12, 16, 16 * 2048, whole_pages=True) == 16 * 2048  # the ablation: whole pages
    assert prompt_kv_bytes(200, 0, 16, 16 * 2048, whole_pages=True) == 13 * 16 * 2048
    assert prompt_kv_bytes(192, 12, 16, 16 * 2048, whole_pages=True) == 0
    assert prompt_last_slots(200, 16) == 8 and prompt_last_slots(192, 16) is None
    with pytest.raises(ValueError):
        prompt_kv_bytes(10, 0, 16, 1000)
