"""The cut-off reads an in-flight transfer's own progress (MD's ``kv_progress``): a line that
slowed while a big transfer crawls over it shows at once, not only when a transfer ends and its
receive rate enters the goodput estimate. Fake connections, no processes; the report's age is
the only clock read, and the outcomes hold for any age under a second."""

from __future__ import annotations

import time

from pdd.transfer.messages import KvProgress, WanSample
from tests.faults.test_recovery_rules import orch, relayed, stream_to  # noqa: F401 (orch: a fixture)

TOTAL = 4_000_000  # bytes of KV the transfer plans: 0.64 s at the estimate's 0.05 Gbit/s


async def _fast_estimate(o) -> None:
    """Nine finished transfers read 0.05 Gbit/s: the goodput estimate the cut-off read."""
    for _ in range(9):
        await o.on_wan_sample(o.peers["md0"], WanSample(0.05).wire(), b"")


def _crawling(o, rid: str):
    """A relayed request 0.4 s into its 4 MB transfer (0.24 s left at 0.05 Gbit/s: under the
    0.5 s ``cutoff_min_remaining_s``, so the estimate alone lets it through)."""
    st = relayed(o, rid=rid, trid=rid)
    st.wan.expected = TOTAL
    st.events["prefilled"] = time.perf_counter() - 0.4
    return st


async def _ended_and_settled(o, st) -> None:
    stream_to(st, 16)
    st.finished = True
    o.reqs.pop(st.trid)
    await o._settle_relayed(st)


async def test_a_transfer_that_crawls_after_the_line_slowed_is_cut_off(orch):
    """MD reported 0.5 MB in, lately at 0.4 Mbit/s: 70 s left (less the report's age), so RLD's
    finish cuts it off (P ``cancel``, MD ``drop``). Before, the remaining time came from the
    estimate of finished transfers only (0.24 s) and the transfer was let through to crawl on."""
    await _fast_estimate(orch)
    st = _crawling(orch, "r1")
    assert orch._cutoff_remaining_wan_s(st) < 0.5  # the stale estimate alone: let through
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r1", 500_000, 0.0004).wire(), b"")
    assert 69.0 < orch._cutoff_remaining_wan_s(st) <= 70.0
    await _ended_and_settled(orch, st)
    assert st.wan.cut_off and orch.totals["cut_offs"] == 1
    assert [h["rid"] for h in orch.peers["p0"].of("cancel")] == ["r1"]
    assert [h["rid"] for h in orch.peers["md0"].of("drop")] == ["r1"]


async def test_a_transfer_moving_at_the_line_s_rate_is_let_through(orch):
    """The same transfer reported 3.9 MB in at 0.05 Gbit/s (16 ms left): not cut off; a report
    from another MD, or of another attempt, is not taken."""
    await _fast_estimate(orch)
    st = _crawling(orch, "r2")
    await orch.on_kv_progress(orch.peers["md1"], KvProgress("r2", 0, 0.0004).wire(), b"")  # not its MD
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r2.1", 0, 0.0004).wire(), b"")  # no such attempt
    assert st.wan.progress is None
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r2", 3_900_000, 0.05).wire(), b"")
    assert orch._cutoff_remaining_wan_s(st) <= 0.016
    await _ended_and_settled(orch, st)
    assert not st.wan.cut_off and orch.totals["cut_offs"] == 0
    assert orch.peers["p0"].of("cancel") == []


async def test_a_transfer_whose_reports_stopped_is_cut_off(orch):
    """MD reported 1 MB of 40 MB in at 0.05 Gbit/s (6.24 s left), then nothing for 10 s: no frame
    arrived (MD reports on each frame past its 0.5 s interval), the line stalled. The remaining
    time stays 5.74 s (one interval credited), so RLD's finish cuts the transfer off; with the
    whole age subtracted it read 0 s and the stalled transfer was let through."""
    await _fast_estimate(orch)
    st = _crawling(orch, "r3")
    st.wan.expected = 40_000_000
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r3", 1_000_000, 0.05).wire(), b"")
    at, done, gbps = st.wan.progress
    st.wan.progress = (at - 10.0, done, gbps)  # the report came 10 s ago
    assert 5.7 < orch._cutoff_remaining_wan_s(st) <= 5.74 + 1e-9
    await _ended_and_settled(orch, st)
    assert st.wan.cut_off and orch.totals["cut_offs"] == 1
    assert [h["rid"] for h in orch.peers["p0"].of("cancel")] == ["r3"]


async def test_a_transfer_let_through_at_the_end_is_cut_off_when_a_report_shows_it_crawling(orch):
    """RLD finished before MD's first report: the estimate of finished transfers read 0.24 s left
    and the transfer was let through (awaited). MD's first report then shows 0.5 MB in at 0.4 Mbit/s
    (70 s left): the cut-off is checked again and cuts it off (P ``cancel``, MD ``drop``, no
    longer awaited). Before, the request had left the table and the report was ignored: a new
    user's 571 kB at 1e-4 Gbit/s crawled on for 46 s after RLD finished. A report of a transfer
    still moving at the line's rate leaves it be."""
    await _fast_estimate(orch)
    st, moving = _crawling(orch, "r4"), _crawling(orch, "r5")
    for s in (st, moving):
        await _ended_and_settled(orch, s)
    assert not st.wan.cut_off and {"r4", "r5"} <= set(orch.awaiting_kv)
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r5", 3_900_000, 0.05).wire(), b"")
    await orch.on_kv_progress(orch.peers["md1"], KvProgress("r4", 0, 0.0004).wire(), b"")  # not its MD
    assert orch.totals["cut_offs"] == 0 and {"r4", "r5"} <= set(orch.awaiting_kv)
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r4", 500_000, 0.0004).wire(), b"")
    assert st.wan.cut_off and not moving.wan.cut_off and orch.totals["cut_offs"] == 1
    assert [h["rid"] for h in orch.peers["p0"].of("cancel")] == ["r4"]
    assert [h["rid"] for h in orch.peers["md0"].of("drop")] == ["r4"]
    assert "r4" not in orch.awaiting_kv and "r4" not in orch.awaiting_kv_deadline and "r5" in orch.awaiting_kv
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r4", 600_000, 0.0004).wire(), b"")  # once only
    assert orch.totals["cut_offs"] == 1 and len(orch.peers["md0"].of("drop")) == 1


async def test_a_late_cut_off_moves_the_request_from_rld_finished_first_to_cut_offs(orch):
    """RLD finished before any handoff and the transfer was let through: the settling counted the
    request in ``rld_finished_first`` (MD keeps the prompt's KV). A report then shows it crawling
    and it is cut off: MD drops the KV, so the request leaves ``rld_finished_first`` (a request RLD
    finished first is in one of the two counts, never both: docs/BENCH.md)."""
    await _fast_estimate(orch)
    st, moving = _crawling(orch, "r6"), _crawling(orch, "r7")
    for s in (st, moving):
        await _ended_and_settled(orch, s)
    assert orch.totals["rld_finished_first"] == 2 and st.handoff.rld_finished_first
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r6", 500_000, 0.0004).wire(), b"")
    assert st.wan.cut_off and orch.totals["cut_offs"] == 1
    assert orch.totals["rld_finished_first"] == 1 and not st.handoff.rld_finished_first
    assert moving.handoff.rld_finished_first


async def test_a_transfer_a_quarter_received_is_let_through_however_slow(orch):
    """``policy.cutoff_max_sent_fraction`` (0.25): MD reported 1 MB of the 4 MB in at 0.4 Mbit/s
    (60 s left): a cut-off would throw away the quarter sent and the next turn would send all 4 MB
    again, so RLD's finish lets it through, and so does each later report (2 MB in, 40 s left);
    0.9 MB in (under a quarter, 62 s left) is cut off. With the fraction at 1 the remaining time
    alone decides: the 1 MB transfer is cut off."""
    await _fast_estimate(orch)
    a, late, under = _crawling(orch, "r8"), _crawling(orch, "r9"), _crawling(orch, "r10")
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r8", 1_000_000, 0.0004).wire(), b"")
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r10", 900_000, 0.0004).wire(), b"")
    assert 59.0 < orch._cutoff_remaining_wan_s(a) <= 60.0
    for s in (a, late, under):
        await _ended_and_settled(orch, s)
    assert not a.wan.cut_off and under.wan.cut_off and orch.totals["cut_offs"] == 1
    assert not late.wan.cut_off and {"r8", "r9"} <= set(orch.awaiting_kv)
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r9", 2_000_000, 0.0004).wire(), b"")
    await orch.on_kv_progress(orch.peers["md0"], KvProgress("r8", 2_000_000, 0.0004).wire(), b"")
    assert not late.wan.cut_off and not a.wan.cut_off and orch.totals["cut_offs"] == 1
    assert [h["rid"] for h in orch.peers["p0"].of("cancel")] == ["r10"]
    orch.cfg.policy.cutoff_max_sent_fraction = 1.0
    assert orch._cut_off_due(a)
