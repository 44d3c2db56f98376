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


async def test_frames_held_before_the_reservation_do_not_count_as_a_rate(tiny_model):
    """A predicted send's frames that came before the reservation are imported at once when it is
    admitted: they are bytes received, not bytes received since the rate's mark. The first report
    after them measures from the replay with all three counted in (the mark was the first frame's
    bytes, so the other two read as if they had arrived in the next interval: a rate up to
    twice the line's, and a stalled transfer's remaining time too short)."""
    _, inst = await start_instance(tiny_model, "md0")
    c = await _Links(inst).open()
    pb = inst.engine.pool.page_bytes
    try:
        for i in range(3):  # held: no reservation yet
            await c.send_p(Kv("r0", i, 1, None, pb).wire(), bytes(pb))
        await c.gw.call(Reserve("r0", PROMPT, SP, first_page=0).wire())
        ctx = inst.reqs["r0"]
        assert ctx.extra["kv_total"] == 3 * pb and ctx.extra["kv_mark"][1] == 3 * pb
        inst.kv_progress_interval_s = 0.0
        await c.send_p(Kv("r0", 3, 1, None, pb).wire(), bytes(pb))
        h = await asyncio.wait_for(c.got.get(), 30)
        assert (h["t"], h["bytes"]) == ("kv_progress", 4 * pb)
    finally:
        await c.close()
        await inst.stop()
