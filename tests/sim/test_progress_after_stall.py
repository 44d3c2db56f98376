"""MD's simulated progress reports after a stall (``ClusterSim.md_reports``) come when the live
MD sends them (``roles.base.EngineInstance.kv_progress``, ``policy.wan_estimate.progress_report``):
with the first frame ``KV_PROGRESS_INTERVAL_S`` or more after the previous report, so after a
stall with the frame that ends it, and the next one an interval after that, not at the next
point of a grid from the first frame. The cut-off's watch of a let-through transfer reads each
report when it reaches the gateway.

One tracked 3 GB send on an 8 Gbit/s line (1 GB/s; 10 ms one way, MD's reports 10 ms more to the
gateway): 0.6 GB computed when it starts, the rest released 1.5 s in (a layer-wise stream whose
prefill paused), so the line sends from 0 to 0.6 s, stalls, and sends again from 1.5 s to 3.9 s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdd.sim.cluster import ClusterSim, SimConfig

LAG = 0.02  # the line's one-way delay and MD's to the gateway


def _stalled_send():
    sim = ClusterSim(SimConfig(mode="pdd", wan_gbps=8.0, wan_rtt_ms=20.0, warmup_frac=0.0))
    line = sim.wan
    assert (line.rate, line.owd + sim.md_owd) == (1e9, LAG)
    f = line.send("r", 3e9, lambda: None, held=2.4e9, track=True)
    sim.after(1.5, lambda: line.release(f, 0.0))
    req = SimpleNamespace(wan_flow=f, fill_flow=None, cut_off=False, md_kv_complete=False, progress_seen=None)
    return sim, line, f, req


def _rounded(reps):
    return [(round(t, 9), round(b), round(g, 9)) for t, b, g in reps]


def test_the_report_after_a_stall_comes_with_the_frame_that_ends_it():
    """Reports 0.5 s after the first frame (0.5 GB at 8 Gbit/s), then at 1.5 s, the stall's end
    (0.1 GB more in 1 s: 0.8 Gbit/s), then every 0.5 s from there until the send ends at 3.9 s.
    On the grid from the first frame it had been 1.0 s (a report during the stall, at 1.6
    Gbit/s) and 2.0 s (0.5 GB in 1 s: 4 Gbit/s)."""
    sim, line, f, req = _stalled_send()
    sim.env.run()
    assert f.t_end == pytest.approx(3.9, abs=1e-9)
    assert _rounded(sim.md_reports(req)) == [
        (0.52, 500_000_000, 8.0), (1.52, 600_000_000, 0.8), (2.02, 1_100_000_000, 8.0),
        (2.52, 1_600_000_000, 8.0), (3.02, 2_100_000_000, 8.0), (3.52, 2_600_000_000, 8.0)]
    assert (line.next_sent_s(f, 0.3), line.next_sent_s(f, 0.7), line.next_sent_s(f, 3.95)) == (0.3, 1.5, None)


def test_the_reports_reach_the_gateway_one_by_one():
    """Asked during the run, MD's last report at the gateway is the one that reached it by then:
    none during the stall after 0.52 s, the stall's end's from 1.52 s."""
    sim, _line, _f, req = _stalled_send()
    seen = {}
    for t in (0.51, 0.53, 1.0, 1.4, 1.51, 1.53, 2.03):
        sim.after(t, lambda t=t: seen.setdefault(t, sim.md_progress(req)))
    sim.env.run()
    last = {t: None if p is None else round(p[0], 9) for t, p in seen.items()}
    assert last == {0.51: None, 0.53: 0.52, 1.0: 0.52, 1.4: 0.52, 1.51: 0.52, 1.53: 1.52, 2.03: 2.02}


def test_the_cutoff_watch_reads_the_report_that_ends_a_stall_when_it_arrives(monkeypatch):
    """A transfer let through at 0.6 s (during the stall) is looked at when each report can reach
    the gateway: 1.02 s (due, but the line is stalled: 0.52 s's is the last, not read by a
    recheck before), 1.52 s (the stall's end's, which the
    line's restart at 1.5 s announces), then every 0.5 s, and once more at 4.02 s, after the send
    ended (no report comes: the watch ends)."""
    sim, _line, _f, req = _stalled_send()
    checks = []

    def recheck(self, r):
        p = self.md_progress(r)
        new = p is not None and p[0] != r.progress_seen
        if new:
            r.progress_seen = p[0]
        checks.append((round(self.env.now, 9), round(p[0], 9) if new else None))
        self._watch_cutoff(r)

    monkeypatch.setattr(ClusterSim, "_recheck_cutoff", recheck)
    sim.after(0.6, lambda: sim._watch_cutoff(req))
    sim.env.run()
    assert checks == [(1.02, 0.52), (1.52, 1.52), (2.02, 2.02), (2.52, 2.52), (3.02, 3.02), (3.52, 3.52),
                      (4.02, None)]
