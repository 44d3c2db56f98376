"""MD reports a KV transfer's progress to the gateway while it arrives (``kv_progress``: bytes
so far, the rate since its previous report), at most once per ``kv_progress_interval_s``; the
gateway's cut-off reads the remaining time from it. MD in process on the tiny model, P and the
gateway played by plain connections; ordered by one-way markers, not by a clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdd.roles.base import EngineInstance
from pdd.transfer.messages import Kv, Reserve
from tests.roles.md_tiny import PROMPT, start_instance
from tests.roles.test_kv_frame_refusal import SP, _Links


def test_a_report_needs_an_interval_and_bytes_since_the_last():
    ctx = SimpleNamespace(rid="r", extra={"kv_mark": (10.0, 1000), "kv_total": 1000})
    rep = EngineInstance.kv_progress
    assert rep(None, ctx, 0.5, now=10.4) is None  # under the interval
    assert rep(None, ctx, 0.5, now=11.0) is None  # no byte since the first frame
    ctx.extra["kv_total"] = 126_000
    m = rep(None, ctx, 0.5, now=11.0)
    assert (m.rid, m.bytes, m.gbps) == ("r", 126_000, 125_000 * 8 / 1.0 / 1e9)
    assert ctx.extra["kv_mark"] == (11.0, 126_000)  # the next interval starts here
    ctx.extra["kv_total"] = 176_000
    assert rep(None, ctx, 0.5, now=11.25) is None
    m = rep(None, ctx, 0.5, now=11.5)
    assert (m.bytes, m.gbps) == (176_000, 50_000 * 8 / 0.5 / 1e9)
    ctx.extra["kv_complete"] = True
    ctx.extra["kv_total"] = 200_000
    assert rep(None, ctx, 0.5, now=20.0) is None  # complete: kv_ready says the rest
    assert rep(None, SimpleNamespace(rid="x", extra={}), 0.5, now=20.0) is None  # no frame yet


async def test_md_reports_progress_after_frames_past_the_first(tiny_model):
    _, inst = await start_instance(tiny_model, "md0")
    c = await _Links(inst).open()
    pb = inst.engine.pool.page_bytes
    try:
        await c.gw.call(Reserve("r0", PROMPT, SP).wire())
        inst.kv_progress_interval_s = 0.0  # every frame may report
        await c.send_p(Kv("r0", 0, 1, None, pb).wire(), bytes(pb))  # the first: the rate starts here
        await c.send_p(Kv("r0", 1, 1, None, pb).wire(), bytes(pb))
        h = await asyncio.wait_for(c.got.get(), 30)
        assert (h["t"], h["rid"], h["bytes"]) == ("kv_progress", "r0", 2 * pb) and h["gbps"] > 0
        inst.kv_progress_interval_s = 3600.0
        await c.send_p(Kv("r0", 2, 1, None, pb).wire(), bytes(pb))  # within the interval: no report
        assert c.got.empty()
    finally:
        await c.close()
        await inst.stop()
