"""The simulated cut-off reads MD's progress reports of the transfer in flight, as the gateway's
(``gateway.wan_booking._cut_off_due``): ``policy.wan_estimate.inflight_remaining_s`` of MD's last
``kv_progress`` that has reached the gateway, each ``KV_PROGRESS_INTERVAL_S`` from the first
frame, and a transfer let through when RLD finished is checked again on each later report.

One relayed request: 8,192 prompt tokens (1 GiB of KV) on a 10 Gbit/s line (0.859 s), its first
byte on the line when P's prefill ends; cross traffic slows the line while it crosses. The
estimate of finished transfers (none yet: the configured 10 Gbit/s) lets it through each time."""

from __future__ import annotations

import pytest

import pdd.policy.cutoff as pol_cutoff
from pdd.policy.wan_estimate import KV_PROGRESS_INTERVAL_S as IVL
from pdd.policy.wan_estimate import inflight_remaining_s
from pdd.sim.cluster import ClusterSim, SimConfig
from tests.sim.sim_checks import PRE_RUNTIME_DEFAULTS

PROMPT = 8192
TOTAL = PROMPT * 131072  # payload bytes of the missing KV (llama-3.1-8b)
RATE = 10e9 / 8  # bytes/s of the 10 Gbit/s line
# the timings below are derived on one processor-shared connection with nothing committed to
# the sockets (a cut-off stops a flow at once): PRE_RUNTIME_DEFAULTS
CFG = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=10.0, warmup_frac=0.0, **PRE_RUNTIME_DEFAULTS)


def rec(out: int) -> list[dict]:
    return [{"timestamp": 0, "input_length": PROMPT, "output_length": out, "hash_ids": list(range(PROMPT // 512))}]


def first_byte_s(out: int) -> float:
    """When the request's first KV byte leaves P (its prefill's end), from a run on a quiet line."""
    r = ClusterSim(CFG.replace(cutoff=False)).run(rec(out)).reqs[0]
    assert r.wan_flow.t_served == r.t_prefill_done
    return r.wan_flow.t_served


def spy(monkeypatch, sim_box):
    seen = []
    real = pol_cutoff.should_cut_off

    def f(*a, **k):
        seen.append((sim_box[0].env.now, a))
        return real(*a, **k)

    monkeypatch.setattr(pol_cutoff, "should_cut_off", f)
    return seen


def run(cfg, recs, monkeypatch):
    box = []
    seen = spy(monkeypatch, box)
    sim = ClusterSim(cfg)
    box.append(sim)
    return sim.run(recs), seen


def test_a_transfer_the_line_slowed_is_cut_off_when_rld_finishes(monkeypatch):
    """80 output tokens: RLD finishes 0.56 s after P's prefill, when the estimate leaves 0.30 s
    (let through, as before); the line fell to 1 Gbit/s 0.1 s into the transfer, and MD's first
    report (0.5 s in: 175 MB at 2.8 Gbit/s) says 2.5 s: cut off, the rest cancelled."""
    t0 = first_byte_s(80)
    tx = t0 + 0.1
    cfg = CFG.replace(wan_cross_traffic=((tx, 9.0),))
    sim, seen = run(cfg, rec(80), monkeypatch)
    r = sim.reqs[0]
    (now, (rld_fin, kv_done, remaining, min_s, frac, max_frac)), = seen
    lag = sim.wan.owd + sim.md_owd  # a byte's send on the line -> MD's report of it at the gateway
    done = RATE * 0.1 + RATE / 10 * (IVL - 0.1)  # bytes MD had 0.5 s after the first frame
    assert done == pytest.approx(175e6)
    gbps = done * 8 / IVL / 1e9
    assert gbps == pytest.approx(2.8)
    estimate = TOTAL * 8 / 10e9 - (now - r.t_prefill_done)
    assert 0 < estimate < 0.5  # the estimate of finished transfers lets it through
    assert remaining == pytest.approx(inflight_remaining_s(TOTAL, done, gbps, now - (t0 + IVL + lag)), rel=1e-12)
    assert remaining == pytest.approx(2.5283, abs=1e-4)
    assert rld_fin and not kv_done and min_s == 0.5
    assert frac == pytest.approx(done / TOTAL, rel=1e-12) and frac < max_frac == 0.25  # 16% received
    assert sim.cutoffs == 1 and sim.late_cutoffs == 0 and r.cut_off
    sent = done + RATE / 10 * (now - (t0 + IVL))  # what had left P when RLD finished
    assert sim.wan_saved_bytes == pytest.approx(TOTAL - sent, rel=1e-9)
    assert sim.wan.bytes_sent == pytest.approx(sent, rel=1e-9)
    assert r.wan_bytes == pytest.approx(sent, rel=1e-9)
    assert all(not i.private for t in sim.tiers.values() for i in t)


def test_a_transfer_let_through_is_cut_off_on_a_later_report(monkeypatch):
    """60 output tokens: RLD finishes 0.42 s in, before MD's first report, and the estimate leaves
    0.44 s (let through). The line falls to 0.1 Gbit/s 0.45 s in: MD's first report (563 MB at
    9.01 Gbit/s) still says 0.45 s (let through); its second (6.25 MB more in 0.5 s: 0.1 Gbit/s)
    says 40.3 s: cut off when it reaches the gateway, the rest cancelled. (With
    ``cutoff_max_sent_fraction`` at 1: by default more than a quarter received lets it finish,
    the next test.)"""
    t0 = first_byte_s(60)
    cfg = CFG.replace(wan_cross_traffic=((t0 + 0.45, 9.9),), cutoff_max_sent_fraction=1.0)
    sim, seen = run(cfg, rec(60), monkeypatch)
    r = sim.reqs[0]
    lag = sim.wan.owd + sim.md_owd
    assert [round(now - t0, 9) for now, _ in seen][1:] == [round(IVL + lag, 9), round(2 * IVL + lag, 9)]
    (t_end, a_end), (t_1, a_1), (t_2, a_2) = seen
    assert t_end - t0 < IVL + lag  # RLD finished before MD's first report reached the gateway
    assert a_end[2] == pytest.approx(TOTAL * 8 / 10e9 - (t_end - r.t_prefill_done), rel=1e-12)  # the estimate
    assert a_end[2] < 0.5
    d1 = RATE * 0.45 + RATE / 100 * 0.05
    g1 = d1 * 8 / IVL / 1e9
    assert a_1[2] == pytest.approx(inflight_remaining_s(TOTAL, d1, g1, 0.0), abs=1e-9)
    assert a_1[2] == pytest.approx(0.4533, abs=1e-4) and a_1[2] < 0.5
    d2 = d1 + RATE / 100 * IVL
    assert a_2[2] == pytest.approx(inflight_remaining_s(TOTAL, d2, 0.1, 0.0), rel=1e-9)
    assert a_2[2] == pytest.approx(40.3, abs=0.1)
    assert sim.cutoffs == sim.late_cutoffs == 1 and r.cut_off and r.rld_finished and not r.md_kv_complete
    sent = d2 + RATE / 100 * lag  # what had left P when the second report reached the gateway
    assert sim.wan_saved_bytes == pytest.approx(TOTAL - sent, rel=1e-9)
    assert sim.wan.bytes_sent == pytest.approx(sent, rel=1e-9)
    assert r.wan_flow.done and not sim.wan.flows  # nothing crawls on after the cut-off
    assert all(not i.private for t in sim.tiers.values() for i in t)


def test_a_transfer_more_than_a_quarter_received_finishes_however_slow(monkeypatch):
    """The line of the test before, at the default ``cutoff_max_sent_fraction`` (0.25): MD's
    second report says 40.3 s left but 569 MB of the 1,074 MB received (53%), so the transfer is
    let through on it and on every later report, and finishes; MD caches the prompt."""
    t0 = first_byte_s(60)
    sim, seen = run(CFG.replace(wan_cross_traffic=((t0 + 0.45, 9.9),)), rec(60), monkeypatch)
    r = sim.reqs[0]
    (_, a_end), (_, a_1), (_, a_2) = seen[:3]
    d2 = RATE * 0.45 + RATE / 100 * 0.05 + RATE / 100 * IVL
    assert a_2[2] == pytest.approx(40.3, abs=0.1) and a_2[4] == pytest.approx(d2 / TOTAL, rel=1e-9)
    assert a_2[4] > a_2[5] == 0.25
    assert len(seen) > 3 and all(a[4] >= 0.25 for _, a in seen[2:])  # each later report: let through
    assert sim.cutoffs == sim.late_cutoffs == 0 and not r.cut_off and r.md_kv_complete
    assert sim.wan.bytes_sent == pytest.approx(TOTAL)
    assert sim.tiers["MD"][0].cache.match(list(range(PROMPT // 512))) == PROMPT // 512


def test_reports_that_keep_it_short_let_it_finish(monkeypatch):
    """The same request on a quiet line: MD's report says what the estimate says, and the
    transfer finishes; MD caches the prompt (as before)."""
    sim, seen = run(CFG, rec(60), monkeypatch)
    r = sim.reqs[0]
    assert sim.cutoffs == 0 and not r.cut_off and r.md_kv_complete
    lag = sim.wan.owd + sim.md_owd
    (t_end, _), (t_1, a_1) = seen  # at RLD's end (the estimate), then MD's first report
    assert t_1 == pytest.approx(r.wan_flow.t_served + IVL + lag, abs=1e-9)
    assert a_1[2] == pytest.approx((TOTAL - RATE * IVL) * 8 / 10e9, rel=1e-9) and a_1[2] < 0.5
    assert sim.wan.bytes_sent == pytest.approx(TOTAL)
    assert sim.tiers["MD"][0].cache.match(list(range(PROMPT // 512))) == PROMPT // 512


def test_a_transfer_let_through_before_its_send_started_is_watched_from_its_start(monkeypatch):
    """One output token on a 200 ms line: RLD finishes (28 ms) before MD's admission starts the
    WAN send (0.2 s), with nothing planned yet (let through). The send starts on a line already
    down to 0.1 Gbit/s: MD's first report, 0.5 s after the first byte and a round trip (the line's
    and MD's one-way delays) later, says 10.2 s: cut off then, the rest cancelled. (Nothing is
    polled before the send starts: a send that never starts leaves the simulation to end.)"""
    prompt = 1024
    total = prompt * 131072
    recs = [{"timestamp": 0, "input_length": prompt, "output_length": 1, "hash_ids": [0, 1]}]
    cfg = CFG.replace(wan_rtt_ms=200.0, ttft_budget_ms=0.0, md_predicted_send=False, wan_cross_traffic=((0.15, 9.9),))
    sim, seen = run(cfg, recs, monkeypatch)
    r = sim.reqs[0]
    (t_end, a_end), (t_1, a_1) = seen
    assert t_end < r.wan_flow.t_start == r.wan_flow.t_served == pytest.approx(0.2)
    assert a_end[2] == 0.0  # nothing planned to MD yet: let through
    assert t_1 == pytest.approx(0.2 + IVL + 0.2, abs=1e-9)
    done = RATE / 100 * IVL
    assert a_1[2] == pytest.approx(inflight_remaining_s(total, done, 0.1, 0.0), rel=1e-9)
    assert a_1[2] == pytest.approx(10.2374, abs=1e-4)
    assert sim.cutoffs == sim.late_cutoffs == 1 and r.cut_off
    assert sim.wan_saved_bytes == pytest.approx(total - RATE / 100 * (IVL + 0.2), rel=1e-9)  # sent from 0.2 s to the cut


def test_a_send_that_never_starts_is_not_polled(monkeypatch):
    """A let-through request whose MD never admits it (its send never starts, as in a stalled
    run) is not looked at again: nothing is scheduled for it, so the run ends (polling every
    report interval kept a stalled simulation going for ever)."""
    monkeypatch.setattr(ClusterSim, "_md_enqueue", lambda self, req, reply_owd=None: None)
    checks = []
    real = ClusterSim._recheck_cutoff
    monkeypatch.setattr(ClusterSim, "_recheck_cutoff", lambda self, req: (checks.append(self.env.now), real(self, req)))
    recs = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}]
    sim = ClusterSim(CFG.replace(wan_rtt_ms=200.0, ttft_budget_ms=0.0, md_predicted_send=False)).run(recs, until=60.0)
    r = sim.reqs[0]
    assert r.rld_finished and r.wan_flow is None and not r.cut_off
    assert checks == []
