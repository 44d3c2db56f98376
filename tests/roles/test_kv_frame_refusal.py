"""A decode instance refuses a ``kv`` frame it cannot take, and fails that request cleanly
(docs/LINK.md, "What a receiver refuses"): MD / RLD in process on the tiny model, P and the
gateway played by plain connections. Before, ``import_frame`` sliced the page table with the
frame's numbers as given: a frame naming pages below the request's prefix-cache hit overwrote the
radix cache's shared pages (every later request on that prefix read them), a negative
``first_page`` wrote into another of the request's pages, and a frame refused for its size or
dtype was logged with a traceback and dropped while the request waited on, so the ``kv_done``
after it started decoding over pages that never arrived. A second ``kv_done`` emitted the first
token again and raised in the engine. Ordered by one-way markers (one connection's one-way
messages are handled in order, each to its end) and by the gateway's messages, not by a clock."""

from __future__ import annotations

import asyncio
import numpy as np
import pytest

from pdd.transfer.client import connect
from pdd.transfer.messages import Expect, Kv, KvDone, Reserve
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, start_instance

SP = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()


def _pages(n: int, pb: int) -> bytes:
    """``n`` pages of KV bytes: finite float32 values (random bytes hold NaNs, never equal)."""
    return np.arange(n * pb // 4, dtype=np.float32).tobytes()


class _Links:
    """The gateway's connection (its messages queued) and P's, to one instance."""

    def __init__(self, inst):
        self.inst, self.got = inst, asyncio.Queue()
        self.marked = asyncio.Event()
        inst.server.on("test_mark", lambda p, h, b: self.marked.set())

    async def open(self):
        port = self.inst.server.port
        self.gw = await connect("127.0.0.1", port, {"*": lambda p, h, b: self.got.put_nowait(h)},
                                role="gateway", instance="gateway")
        self.p = await connect("127.0.0.1", port, {"*": lambda p, h, b: None}, role="prefill", instance="p0")
        return self

    async def send_p(self, header, payload=b""):
        """Send one frame from P and return once the instance handled it."""
        self.marked.clear()
        await self.p.send(header, payload)
        await self.p.send({"t": "test_mark"})
        await self.marked.wait()

    async def next_msg(self):
        h = await asyncio.wait_for(self.got.get(), 30)
        return [(m["t"], m.get("rid"), m.get("pos")) for m in h.get("msgs", [h])] if h["t"] == "toks" else \
            [(h["t"], h.get("rid"), h.get("error"))]

    async def close(self):
        await self.gw.close()
        await self.p.close()


async def test_a_frame_into_the_prefix_cache_pages_is_refused_and_the_cache_kept(tiny_model, caplog):
    _, inst = await start_instance(tiny_model, "md0")
    c = await _Links(inst).open()
    pool = inst.engine.pool
    pb = pool.page_bytes
    try:
        await c.gw.call(Reserve("r0", PROMPT, SP).wire())
        await c.send_p(Kv("r0", 0, 5, None, pb).wire(), _pages(5, pb))
        # P's first token ends it: its 4 whole prompt pages enter MD's prefix cache
        await c.send_p(KvDone("r0", 0, 5, None, pb, None, 5 * pb, first_token=5, fin="length").wire())
        assert await c.next_msg() == [("tok", "r0", 0)]
        rep, _ = await c.gw.call(Reserve("r1", PROMPT, SP).wire())
        assert (rep["md_cached_pages"], rep["n_pages"]) == (4, 5)
        shared = list(inst.reqs["r1"].seq.page_table[:4])
        before = pool.buffer[shared].clone()
        await c.send_p(Kv("r1", 0, 1, None, pb).wire(), bytes(pb))  # page 0: the cache's
        assert await c.next_msg() == [("req_error", "r1", "md0: refused a KV frame: kv frame of 'r1': pages "
                                       "[0, 1) are not within its uncached prompt pages [4, 5)")]
        assert bool((pool.buffer[shared] == before).all())
        assert "r1" not in inst.reqs and inst.counters["kv_refused"] == 1
        assert (pool.num_used, await inst.worker.call(lambda e: (e.flush_cache(), e.pool.num_free)[1])) == (4, 64)
        assert "Traceback" not in caplog.text and "refused a 'kv' frame of r1" in caplog.text
    finally:
        await c.close()
        await inst.stop()


@pytest.mark.parametrize("frame, why", [
    (lambda pb: (Kv("r0", -2, 1, None, pb).wire(), bytes(pb)),
     "kv frame of 'r0': pages [-2, -1) are not within its uncached prompt pages [0, 5)"),
    (lambda pb: (Kv("r0", 0, 1, None, pb + 4).wire(), bytes(pb + 4)),
     "kv frame of 'r0': page_bytes 2052 is not a page of 4 tokens in float32 (2048 bytes)"),
    (lambda pb: (Kv("r0", 0, 1, [0], pb).wire(), bytes(pb)),
     "kv frame of 'r0': layers [0] is not a range [l0, l1]"),
    (lambda pb: (Kv("r0", 0, 1, None, pb, dtype="int8").wire(), bytes(pb)),
     "kv frame of 'r0': dtype 'int8' is not one of ['bfloat16', 'float16', 'float32']"),
    (lambda pb: ({"t": "kv", "rid": "r0", "first_page": "0"}, b""),
     "message 'kv': field 'first_page' must be int, got str '0'"),
], ids=["negative_first_page", "page_bytes", "layers", "dtype", "malformed"])
async def test_a_bad_frame_fails_its_request_before_kv_done_can_start_it(tiny_model, caplog, frame, why):
    _, inst = await start_instance(tiny_model, "md0")
    c = await _Links(inst).open()
    pb = inst.engine.pool.page_bytes
    try:
        await c.gw.call(Reserve("r0", PROMPT, SP).wire())
        await c.send_p(*frame(pb))
        assert await c.next_msg() == [("req_error", "r0", f"md0: refused a KV frame: {why}")]
        await c.send_p(Kv("r0", 0, 5, None, pb).wire(), bytes(5 * pb))  # the rest of the stream: dropped
        await c.send_p(KvDone("r0", 0, 5, None, pb, None, 5 * pb, first_token=5, fin=None).wire())
        assert inst.reqs == {} and inst.counters["kv_refused"] == 1
        assert inst.engine.pool.num_free == 64 and c.got.empty()  # nothing decoded, every page free once
        assert "Traceback" not in caplog.text
    finally:
        await c.close()
        await inst.stop()


@pytest.mark.parametrize("name", ["md0", "rld0"])
async def test_a_second_kv_done_is_dropped(tiny_model, caplog, name):
    _, inst = await start_instance(tiny_model, name)
    c = await _Links(inst).open()
    pb = inst.engine.pool.page_bytes
    sp = SamplingParams(max_tokens=230, ignore_eos=True).to_dict()  # RLD decodes on past the test
    admit = Reserve("r0", PROMPT, sp) if name == "md0" else Expect("r0", PROMPT, sp)
    try:
        await c.gw.call(admit.wire())
        await c.send_p(Kv("r0", 0, 5, None, pb).wire(), bytes(5 * pb))
        done = KvDone("r0", 0, 5, None, pb, None, 5 * pb, first_token=5, fin=None, relay=True).wire()
        await c.send_p(done)
        await c.send_p(done)
        assert inst.counters["kv_refused"] == 1 and "r0" in inst.reqs
        await c.send_p(Kv("r0", 4, 1, None, pb).wire(), bytes(pb))  # a frame after it: refused, request failed
        assert "r0" not in inst.reqs
        # MD's prefix cache keeps the 4 whole prompt pages its kv_done inserted; nothing else is held
        assert inst.engine.pool.num_used == (4 if name == "md0" else 0)
        assert await inst.worker.call(lambda e: (e.flush_cache(), e.pool.num_free)[1]) == 64
        msgs = []
        while not msgs or msgs[-1][0] != "req_error":
            msgs += await c.next_msg()
        started = [("kv_ready", "r0", None)] if name == "md0" else [("tok", "r0", 0)]
        assert [m for m in msgs if m in started] == started  # once: the second kv_done started nothing
        assert msgs[-1] == ("req_error", "r0", f"{name}: refused a KV frame: kv frame of 'r0' after its kv_done "
                                               "(the prompt's KV is complete)")
        assert "Traceback" not in caplog.text and "dropped a second kv_done of r0" in caplog.text
    finally:
        await c.close()
        await inst.stop()


async def test_a_bad_frame_held_before_its_reservation_refuses_the_reservation(tiny_model, caplog):
    _, inst = await start_instance(tiny_model, "md0")
    c = await _Links(inst).open()
    pb = inst.engine.pool.page_bytes
    try:
        await c.send_p(Kv("r0", -1, 1, None, pb).wire(), _pages(1, pb))  # a predicted send's frame, held
        with pytest.raises(Exception) as err:
            await c.gw.call(Reserve("r0", PROMPT, SP, first_page=0).wire())
        assert str(err.value).endswith("md0: refused a KV frame of r0: kv frame of 'r0': pages [-1, 0) are not "
                                       "within its uncached prompt pages [0, 5)")
        assert inst.reqs == {} and inst.counters["kv_refused"] == 1 and inst.engine.pool.num_free == 64
        assert "Traceback" not in caplog.text
    finally:
        await c.close()
        await inst.stop()
