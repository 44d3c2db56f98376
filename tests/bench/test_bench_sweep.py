"""The sweep's rate search as a pure function, with fake runners (no server)."""

import pytest

from pdd.bench.sweep import (SweepPlan, at_rate, mean_rate, next_rate, parse_sweep, plan_rates, point_requests,
                             sla_goodput)
from pdd.workload.replay import ReplayRequest


def capacity(limit):
    """A fake runner: 100% meet the SLO up to ``limit`` req/s, 50% above."""
    calls = []

    def measure(rate):
        calls.append(rate)
        return 1.0 if rate <= limit else 0.5

    return measure, calls


def test_auto_doubles_then_bisects():
    plan = SweepPlan(start_rps=1.0, max_points=10, bisect_steps=2)
    measure, calls = capacity(5.0)
    hist = plan_rates(plan, measure)
    assert calls == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0]  # x2 until 8 fails; bisect (4, 8) -> 6 F, (4, 6) -> 5 P
    assert sla_goodput(hist) == 5.0


def test_auto_first_rate_fails_halves_then_bisects():
    plan = SweepPlan(start_rps=4.0, max_points=10, bisect_steps=2)
    measure, calls = capacity(1.5)
    hist = plan_rates(plan, measure)
    assert calls == [4.0, 2.0, 1.0, 1.5, 1.75]
    assert sla_goodput(hist) == 1.5


def test_auto_limits():
    measure, calls = capacity(100.0)
    assert plan_rates(SweepPlan(start_rps=1.0, max_points=3), measure) == [(1.0, 1.0), (2.0, 1.0), (4.0, 1.0)]
    measure, calls = capacity(100.0)
    plan_rates(SweepPlan(start_rps=3.0, max_points=10, max_rps=10.0), measure)
    assert calls == [3.0, 6.0]  # 12 > max_rps
    measure, calls = capacity(0.0)
    hist = plan_rates(SweepPlan(start_rps=1.0, max_points=10, min_rps=0.2), measure)
    assert calls == [1.0, 0.5, 0.25] and sla_goodput(hist) is None
    measure, calls = capacity(5.0)
    plan_rates(SweepPlan(start_rps=1.0, max_points=10, bisect_steps=0), measure)
    assert calls == [1.0, 2.0, 4.0, 8.0]


def test_next_rate_is_pure_and_threshold_inclusive():
    plan = SweepPlan(start_rps=2.0, max_points=4)
    assert next_rate(plan, []) == 2.0
    assert next_rate(plan, [(2.0, 0.9)]) == 4.0  # 90% meets the SLA
    assert next_rate(plan, [(2.0, 0.89)]) == 1.0
    assert next_rate(plan, [(2.0, 1.0), (4.0, 0.0)]) == 3.0
    assert next_rate(plan, [(2.0, 1.0), (4.0, 0.0), (3.0, 1.0), (3.5, 1.0)]) is None  # max points


def test_fixed_plan():
    plan = parse_sweep("8,1,2,4")
    assert plan.kind == "fixed" and plan.rates == (1.0, 2.0, 4.0, 8.0)
    measure, calls = capacity(3.0)
    hist = plan_rates(plan, measure)
    assert calls == [1.0, 2.0, 4.0] and sla_goodput(hist) == 2.0  # stops at the first miss
    measure, calls = capacity(3.0)
    hist = plan_rates(SweepPlan(rates=(1.0, 2.0, 4.0, 8.0), stop_on_fail=False), measure)
    assert calls == [1.0, 2.0, 4.0, 8.0] and sla_goodput(hist) == 2.0
    # non-monotone results: the highest passing rate tried counts
    assert sla_goodput([(1.0, 1.0), (2.0, 0.5), (4.0, 0.95)]) == 4.0


def test_parse_sweep():
    assert parse_sweep(None) is None and parse_sweep("none") is None and parse_sweep("") is None
    auto = parse_sweep("auto", start_rps=3.0, max_points=5)
    assert auto.kind == "auto" and auto.start_rps == 3.0 and auto.max_points == 5
    assert auto.to_dict()["kind"] == "auto"
    with pytest.raises(ValueError):
        parse_sweep("fast")
    with pytest.raises(ValueError):
        parse_sweep("1,-2")


def req(i, t):
    return ReplayRequest(idx=i, arrival_s=t, prompt_ids=[10 + i], max_tokens=2, trace_record={})


def test_at_rate():
    reqs = [req(0, 1.0), req(1, 2.0), req(2, 5.0)]  # mean rate 2 / 4 s = 0.5 req/s
    assert mean_rate([r.arrival_s for r in reqs]) == pytest.approx(0.5)
    fast = at_rate(reqs, 2.0)
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.25, 1.0])
    assert mean_rate([r.arrival_s for r in fast]) == pytest.approx(2.0)
    assert [r.idx for r in fast] == [0, 1, 2] and reqs[1].arrival_s == 2.0  # copies
    together = at_rate([req(0, 0.0), req(1, 0.0), req(2, 0.0)], 4.0)
    assert [r.arrival_s for r in together] == pytest.approx([0.0, 0.25, 0.5])
    assert at_rate([], 1.0) == []
    with pytest.raises(ValueError):
        at_rate(reqs, 0)


def test_point_requests_time_bound():
    reqs = [req(i, float(i)) for i in range(50)]  # 1 req/s
    assert len(point_requests(reqs, 2.0)) == 50  # no bound: all
    p = point_requests(reqs, 2.0, max_arrival_s=10.0)
    # 21 one-request conversations (empty trace records), chosen by key hash, in trace order
    assert len(p) == 21 and [r.idx for r in p] == sorted(r.idx for r in p) and p[0].arrival_s == 0.0
    assert mean_rate([r.arrival_s for r in p]) == pytest.approx(2.0)
    assert len(point_requests(reqs, 0.25, max_arrival_s=10.0)) == 8  # min_requests
    assert len(point_requests(reqs, 100.0, max_arrival_s=10.0)) == 50  # all arrive in time


def test_ramp_arrivals_rise_linearly():
    import dataclasses as dc
    import math

    from pdd.bench.sweep import parse_ramp, ramp_arrivals

    @dc.dataclass(frozen=True)
    class R:
        arrival_s: float

    reqs = [R(float(i)) for i in range(101)]  # evenly spaced
    out = ramp_arrivals(reqs, 1.0, 9.0)
    n = 101
    # t(u) = n / (end - start) * ln(r(u) / start): at u = 1, n / 8 * ln 9
    assert out[0].arrival_s == 0.0 and out[-1].arrival_s == pytest.approx(n / 8 * math.log(9.0))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(out, out[1:])]
    assert all(g1 > g2 for g1, g2 in zip(gaps, gaps[1:]))  # rising rate
    # the local rate at the start ~ start, at the end ~ end (req/s)
    assert 1 / gaps[0] == pytest.approx(1.0 * n / 100, rel=0.05) and 1 / gaps[-1] == pytest.approx(9.0 * n / 100, rel=0.05)
    flat = ramp_arrivals(reqs, 2.0, 2.0)
    assert flat[-1].arrival_s == pytest.approx(n / 2.0)
    assert ramp_arrivals([], 1.0, 2.0) == []
    assert parse_ramp("1:8") == (1.0, 8.0) and parse_ramp(None) is None and parse_ramp("") is None
    for bad in ("8", "a:b", "0:4", "1:2:3"):
        with pytest.raises(ValueError, match="--ramp"):
            parse_ramp(bad)
    with pytest.raises(ValueError):
        ramp_arrivals(reqs, 0.0, 1.0)


def test_a_falling_ramp_is_a_ramp_down():
    """``--ramp 9:1`` (START above END) is a supported load shape, a ramp down (scale-in, a
    drain), mirror of ``--ramp 1:9``: the rate falls linearly from 9 to 1 req/s over the requests."""
    import dataclasses as dc
    import math

    from pdd.bench.sweep import parse_ramp, ramp_arrivals

    @dc.dataclass(frozen=True)
    class R:
        arrival_s: float

    assert parse_ramp("9:1") == (9.0, 1.0)
    reqs = [R(float(i)) for i in range(101)]
    out = ramp_arrivals(reqs, 9.0, 1.0)
    n = 101
    # t(u) = n / (end - start) * ln(r(u) / start): at u = 1, n / -8 * ln(1 / 9), the rising ramp's span
    assert out[0].arrival_s == 0.0 and out[-1].arrival_s == pytest.approx(n / 8 * math.log(9.0))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(out, out[1:])]
    assert all(g1 < g2 for g1, g2 in zip(gaps, gaps[1:]))  # falling rate
    assert 1 / gaps[0] == pytest.approx(9.0 * n / 100, rel=0.05) and 1 / gaps[-1] == pytest.approx(1.0 * n / 100, rel=0.05)


def conv_req(i, t, conv):
    """A request of conversation ``conv`` (hash_ids[1] is the conversation key)."""
    return ReplayRequest(idx=i, arrival_s=t, prompt_ids=[10 + i], max_tokens=2,
                         trace_record={"hash_ids": [0, 1000 + conv, 2000 + i]})


def test_session_subset_keeps_whole_conversations():
    from pdd.bench.sweep import session_subset

    # 10 conversations of 5 turns each, interleaved in time (turn k of every conversation, then k+1)
    reqs = [conv_req(5 * c + k, float(10 * k + c), c) for k in range(5) for c in range(10)]
    reqs.sort(key=lambda r: r.arrival_s)
    sub = session_subset(reqs, 15)
    assert len(sub) == 15
    convs = {}
    for r in sub:
        convs.setdefault(r.trace_record["hash_ids"][1], []).append(r.idx)
    assert len(convs) == 3 and all(len(v) == 5 for v in convs.values())  # 3 whole conversations
    assert [r.arrival_s for r in sub] == sorted(r.arrival_s for r in sub)  # trace order kept
    assert session_subset(reqs, 15) == sub  # deterministic
    # the first 15 requests would be first and second turns only
    assert {r.idx % 5 for r in reqs[:15]} == {0, 1}
    # a partial last conversation keeps its earliest turns
    sub7 = session_subset(reqs, 7)
    turns = sorted(r.idx % 5 for r in sub7)
    assert len(sub7) == 7 and turns == [0, 0, 1, 1, 2, 3, 4]
    assert session_subset(reqs, None) == reqs and session_subset(reqs, 500) == reqs
    assert session_subset(reqs, 0) == []
    with pytest.raises(ValueError):
        session_subset(reqs, -1)


def test_session_subset_one_block_records_are_their_own_conversation():
    from pdd.bench.sweep import session_subset

    reqs = [ReplayRequest(idx=i, arrival_s=float(i), prompt_ids=[1], max_tokens=1, trace_record={"hash_ids": [7]})
            for i in range(20)]
    sub = session_subset(reqs, 6)
    assert len(sub) == 6 and len({r.idx for r in sub}) == 6
