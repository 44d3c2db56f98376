"""The runtime's two relay-timing features in the simulator: the predicted MD send
(``md_predicted_send``) and the early handoff (``early_handoff``), each against its ablation on
plain inputs (one relayed request on an idle cluster, event times in simulated seconds)."""

import pytest

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.instance import Instance
from pdd.types import Pipeline
from pdd.workload.records import generate_agentic
from tests.sim.sim_checks import PRE_RUNTIME_LINE, check_settled

KVB = 131072  # llama-3.1-8b KV bytes per token
# one 4,096-token prompt (8 blocks) relayed at once over a 10 Gbit/s, 400 ms RTT line: P's prefill
# (~0.1 s) ends well inside the reservation's round trip
ONE = [{"timestamp": 0, "input_length": 4096, "output_length": 200, "hash_ids": list(range(8))}]
RELAY = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=10.0, wan_rtt_ms=400.0, ttft_budget_ms=0.0,
                  warmup_frac=0.0)


def run(cfg, recs=ONE):
    sim = ClusterSim(cfg).run(recs)
    check_settled(sim)
    return sim


def test_predicted_send_starts_md_s_kv_when_prefill_is_done():
    owd = 0.2
    xfer = 4096 * KVB * 8 / 10e9
    old = run(RELAY.replace(md_predicted_send=False, early_handoff=False))
    new = run(RELAY.replace(md_predicted_send=True, early_handoff=False))
    ro, rn = old.reqs[0], new.reqs[0]
    assert ro.pipeline == rn.pipeline == Pipeline.P_RLD_MD
    assert ro.t_prefill_done == rn.t_prefill_done < 2 * owd
    # ablation: P's send waits for MD's reservation reply (a round trip after arrival)
    assert ro.wan_flow.t_start == pytest.approx(2 * owd)
    assert ro.t_md_kv == pytest.approx(2 * owd + xfer + owd)
    # predicted: the send starts as P's prefill ends, the same bytes (MD's cache is empty)
    assert rn.wan_flow.t_start == rn.t_prefill_done
    assert rn.t_md_kv == pytest.approx(rn.t_prefill_done + xfer + owd)
    assert rn.wan_bytes == ro.wan_bytes == 4096 * KVB
    assert ro.t_md_kv - rn.t_md_kv == pytest.approx(2 * owd - rn.t_prefill_done)
    assert (old.md_predicted_sends, new.md_predicted_sends, new.md_predicted_short) == (0, 1, 0)
    # MD's kv_ready (so the handoff) comes earlier: RLD decodes fewer of the tokens
    assert rn.rld_tokens < ro.rld_tokens and rn.rld_tokens + rn.md_tokens == ro.rld_tokens + ro.md_tokens
    assert rn.t_first == ro.t_first  # the first token comes from RLD either way


def test_predicted_send_sends_only_what_md_lacks():
    """A second turn whose prefix MD cached from the first: the predicted send ships only the
    missing blocks, the same bytes as after the reservation."""
    second = {"timestamp": 5000, "input_length": 6000, "output_length": 20, "hash_ids": list(range(12))}
    recs = ONE + [second]
    old = run(RELAY.replace(md_predicted_send=False, early_handoff=False), recs)
    new = run(RELAY.replace(md_predicted_send=True, early_handoff=False), recs)
    ro, rn = old.reqs[1], new.reqs[1]
    assert rn.md_hit == ro.md_hit == 4096 and rn.md_predicted and not ro.md_predicted
    assert rn.wan_bytes == ro.wan_bytes == (6000 - 4096) * KVB
    assert rn.wan_flow.t_start == rn.t_prefill_done < ro.wan_flow.t_start


def test_predicted_send_only_for_requests_relayed_at_once():
    # 1 s budget: the cold prompt's 0.83 s (KV + RTT) fits, so it is planned P->MD on MD's reply
    # and the send waits for that reply
    sim = run(RELAY.replace(ttft_budget_ms=1000.0))
    assert sim.reqs[0].pipeline == Pipeline.P_MD
    assert sim.md_predicted_sends == 0 and not sim.reqs[0].md_predicted
    assert sim.reqs[0].wan_flow.t_start >= 0.4


@pytest.mark.parametrize("early", [False, True])
def test_relay_timing_under_md_pressure_keeps_every_invariant(early):
    """One MD decode slot: predicted sends land before MD admits their requests (MD holds the
    frames, then imports them), with cut-offs and requests finished on RLD meanwhile; the early
    handoff waits for MD's reservation reply (its admission) as the runtime does, so a queued
    admission never leaves RLD stopped: every early handoff starts after that reply, and any
    ids that still reach MD before its KV wait for it. (Without md_wait_claims, so that every
    request is a predicted send: one waiting for another's KV on MD is not.)"""
    recs = generate_agentic(300, seed=4, rate=2.0)
    cfg = SimConfig(mode="pdd", n_p=2, n_rld=1, n_md=1, wan_gbps=50.0, ttft_budget_ms=0.0, warmup_frac=0.0,
                    md_cache_frac=0.05, max_running_md=1, early_handoff=early, md_wait_claims=False)
    sim = run(cfg, recs)
    assert sim.md_predicted_sends == len(recs) and sim.cutoffs > 0
    held = [r for r in sim.reqs if r.wan_flow is not None and r.t_md_kv is not None
            and r.wan_flow.t_end + sim.owd < r.t_md_kv - 1e-9]
    assert held, "no KV landed before MD admitted its request: the case is not exercised"
    ids_first = [r for r in sim.reqs if r.t_handoff_start is not None and r.t_md_kv is not None
                 and r.t_handoff_start + sim.owd < r.t_md_kv - 1e-9]
    assert (sim.early_handoffs > 0) == early and (not ids_first or early)
    started_early = [r for r in sim.reqs if r.t_handoff_start is not None and r.t_md_kv is not None
                     and r.t_handoff_start < r.t_md_kv + sim.owd - 1e-9]
    assert bool(started_early) == early
    assert all(r.t_handoff_start >= r.t_md_replied - 1e-9 for r in started_early)
    for r in ids_first:  # handed over (unless RLD finished first): MD decoded the rest after its KV
        if r.handed:
            assert r.md_tokens == r.out_len - r.handed and r.t_done > r.t_md_kv
        else:
            assert r.rld_finished and r.md_tokens == 0


def test_early_handoff_asks_rld_when_the_kv_has_left_p():
    """Without the predicted send (the two effects apart): the handoff starts when the WAN
    flow's last byte left P, a round trip before MD's kv_ready would be back at the gateway, so
    RLD stops a round trip earlier and decodes fewer tokens; MD's extend still starts when the
    KV lands, so the client's switch gap is the same (within RLD's step in flight)."""
    owd = 0.2
    # nothing committed to the sockets ahead of the line, so P has written the KV when its last
    # byte leaves (with the runtime's 1-BDP send buffer, a BDP before: wan_written_lead)
    base = RELAY.replace(wan_send_buffer_bytes=0.0)
    old = run(base.replace(md_predicted_send=False, early_handoff=False))
    new = run(base.replace(md_predicted_send=False, early_handoff=True))
    ro, rn = old.reqs[0], new.reqs[0]
    assert (old.early_handoffs, new.early_handoffs) == (0, 1)
    assert rn.t_md_kv == ro.t_md_kv  # the KV's transfer is unchanged
    assert ro.t_handoff_start == pytest.approx(ro.t_md_kv + owd)  # MD's kv_ready crossed back
    assert rn.t_handoff_start == rn.wan_flow.t_end  # the KV's last byte left P
    assert rn.t_handoff_start == pytest.approx(rn.t_md_kv - owd)
    assert ro.t_handoff_start - rn.t_handoff_start == pytest.approx(2 * owd)
    rld = new.tiers["RLD"][0]
    step = rld.busy_s / rld.steps  # RLD's decode step: it hands over after the step in flight
    for r in (ro, rn):
        assert r.t_handoff_start <= r.t_handoff < r.t_handoff_start + step + 1e-9
    assert rn.rld_tokens < ro.rld_tokens and rn.rld_tokens + rn.md_tokens == ro.rld_tokens + ro.md_tokens
    assert ro.rld_tokens - rn.rld_tokens == pytest.approx(2 * owd / step, abs=1.5)
    assert rn.max_gap == pytest.approx(ro.max_gap, abs=step)
    assert rn.t_done < ro.t_done  # MD decodes the rest from a round trip earlier
    assert new.tiers["MD"][0].private == 0


def test_both_flags_together_on_one_relayed_request():
    """Both on (the runtime's defaults): the send starts at prefill end and the handoff when it
    has left, so RLD is asked at t_prefill_done + transfer time instead of 2 RTT + transfer
    time after arrival (the reservation's round trip, then kv_ready's crossing back)."""
    owd = 0.2
    xfer = 4096 * KVB * 8 / 10e9
    old = run(RELAY.replace(md_predicted_send=False, early_handoff=False))
    new = run(RELAY)
    assert RELAY.md_predicted_send and RELAY.early_handoff  # the defaults
    ro, rn = old.reqs[0], new.reqs[0]
    assert ro.t_handoff_start == pytest.approx(2 * owd + xfer + 2 * owd)
    assert rn.t_handoff_start == pytest.approx(rn.t_prefill_done + xfer)
    assert rn.rld_tokens < ro.rld_tokens


def test_early_handoff_waits_for_the_estimated_last_byte(monkeypatch):
    """The wait is the runtime's pure rule (policy.handoff.early_handoff_delay_s, looked up at
    call time) on the planned bytes at the gateway's WAN estimate, counted from P's prefill
    end: an estimate at half the line's rate waits the rest of the estimated transfer."""
    import pdd.policy.handoff as pol_handoff

    seen = []
    real = pol_handoff.early_handoff_delay_s

    def spy(*a):
        seen.append(a)
        return real(*a)

    monkeypatch.setattr(pol_handoff, "early_handoff_delay_s", spy)
    sim = ClusterSim(RELAY)
    sim.wan_gbps_estimate = lambda: 8.0  # the gateway believes the 10 Gbit/s line runs at 8
    sim.run(ONE)
    r = sim.reqs[0]
    assert (4096 * KVB, 8.0) in [a[:2] for a in seen]
    assert r.t_handoff_start == pytest.approx(r.t_prefill_done + 4096 * KVB * 8 / 8e9)
    assert r.wan_flow.t_end < r.t_handoff_start < r.t_md_kv + 0.2 and sim.early_handoffs == 1
    # at 5 the estimated last byte leaves after MD's kv_ready is back: that starts the handoff
    slow = ClusterSim(RELAY)
    slow.wan_gbps_estimate = lambda: 5.0
    slow.run(ONE)
    r = slow.reqs[0]
    assert r.t_prefill_done + 4096 * KVB * 8 / 5e9 > r.t_md_kv + 0.2
    assert r.t_handoff_start == pytest.approx(r.t_md_kv + 0.2) and slow.early_handoffs == 0


def test_p_has_written_md_s_kv_when_the_lead_is_left_to_go():
    """P's xfer_done (which starts the early handoff's wait) comes when all but
    ``wan_written_lead_bytes`` of the flow have left P (its socket buffer and the link's hold the
    rest); without one, the committed bytes a cut-off cannot recall (``wan_send_buffer_bytes``);
    at 0, as the last byte leaves. With an estimate far above the line the wait is 0 and the
    handoff starts at that point (after MD's reservation reply at 0.4 s)."""
    n, mib = 4096 * KVB, 2 ** 20

    def written(**kw):
        sim = ClusterSim(RELAY.replace(**kw))
        sim.wan_gbps_estimate = lambda: 1e9
        sim.run(ONE)
        r = sim.reqs[0]
        assert r.t_handoff_start == pytest.approx(r.t_kv_written) and sim.early_handoffs == 1
        return r

    r = written(wan_written_lead_bytes=100 * mib, wan_send_buffer_bytes=300 * mib)
    assert r.t_kv_written == pytest.approx(r.wan_flow.t_start + (n - 100 * mib) * 8 / 10e9)
    assert r.t_kv_written > 0.4
    assert written(wan_send_buffer_bytes=100 * mib).t_kv_written == pytest.approx(r.t_kv_written)
    r0 = written(wan_written_lead_bytes=0.0, wan_send_buffer_bytes=100 * mib)
    assert r0.t_kv_written == pytest.approx(r0.wan_flow.t_end) and r0.t_kv_written > r.t_kv_written
    with pytest.raises(ValueError, match="wan_written_lead_bytes"):
        RELAY.replace(wan_written_lead_bytes=-1.0)


def test_early_handoff_only_for_relayed_requests():
    """A P->MD request has no handoff; a relay ablation (P->RLD) has no MD: neither starts one."""
    recs = generate_agentic(60, seed=3, rate=2.0)
    pmd = run(SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=100.0, ttft_budget_ms=1e6,
                        warmup_frac=0.0), recs)
    assert {d for _, d in pmd.decisions} == {"p_md"} and pmd.early_handoffs == 0
    xdc = run(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1, wan_gbps=100.0, warmup_frac=0.0), recs)
    assert xdc.early_handoffs == 0


# The pre-flag simulator's results (commit 1bc6592, before md_predicted_send / early_handoff and
# the gateway's prefix index of MD) on 150 agentic requests: with the flags off the simulator must
# reproduce them. That simulator's cut-off read the WAN estimate only, and its MD routing counted
# an MD's sequences and queued admissions: here MD's progress reports (ClusterSim.md_progress, read
# by the cut-off since) are left out and an MD's routing load is its sequences and queued
# admissions again (Instance.assigned, the gateway's in-flight count since); with both as now the
# results differ (the second assertion).
OLD = {
    (0.0, "one_shot"): (4530.567940908989, 4747.96738196902, 12631, 15009, 64879419457.18563, 61),
    (250.0, "one_shot"): (4533.369887129273, 4747.510145402302, 12240, 15400, 64724370834.59725, 61),
    (0.0, "catch_up"): (4530.631270405294, 4753.850724714376, 13974, 13666, 64945532022.80533, 61),
}


@pytest.mark.parametrize("budget,mode", sorted(OLD))
def test_both_flags_off_reproduce_the_old_simulator(budget, mode, monkeypatch):
    recs = generate_agentic(150, seed=4, rate=2.0)
    # that simulator's line and plan (PRE_RUNTIME_LINE: processor-shared, one connection, no
    # committed bytes, no WAN backlog in the plan)
    cfg = SimConfig(mode="pdd", n_p=2, n_rld=1, n_md=2, wan_gbps=10.0, warmup_frac=0.0, ttft_budget_ms=budget,
                    handoff_mode=mode, catchup_threshold=4, md_predicted_send=False, early_handoff=False,
                    md_prefix_index=False, **PRE_RUNTIME_LINE)
    now = run(cfg, recs)
    monkeypatch.setattr(ClusterSim, "md_progress", lambda self, req: None)
    monkeypatch.setattr(Instance, "assigned", property(lambda self: len(self.seqs) + len(self.waiting),
                                                       lambda self, v: None), raising=False)
    sim = ClusterSim(cfg).run(recs)  # (check_settled reads assigned, which is no count here)
    assert (now.cutoffs, now.wan.bytes_sent) != (sim.cutoffs, sim.wan.bytes_sent)
    rs = sim.reqs
    got = (sum(r.t_first for r in rs), sum(r.t_done for r in rs), sum(r.rld_tokens for r in rs),
           sum(r.md_tokens for r in rs), sim.wan.bytes_sent, sim.cutoffs)
    assert got == pytest.approx(OLD[(budget, mode)], rel=1e-12)
    assert sim.md_predicted_sends == sim.early_handoffs == 0
    on = run(cfg.replace(md_predicted_send=True, early_handoff=True), recs)
    assert sum(r.rld_tokens for r in on.reqs) < got[2]  # and the defaults do change them


def test_flags_follow_the_cli_and_the_live_policy():
    """`pdd sim run` and `pdd sim validate`'s mirror of a ClusterConfig carry both flags, on by
    default as the runtime's policy fields."""
    import argparse

    from pdd.config import ClusterConfig
    from pdd.sim import cli
    from pdd.sim.validate import sim_config

    ap = argparse.ArgumentParser(prog="pdd")
    cli.add_sim_parser(ap.add_subparsers(dest="cmd", required=True))
    c = cli._make_cfg(ap.parse_args(["sim", "run"]))
    assert (c.md_predicted_send, c.early_handoff) == (True, True)
    c = cli._make_cfg(ap.parse_args(["sim", "run", "--no-md-predicted-send", "--no-early-handoff"]))
    assert (c.md_predicted_send, c.early_handoff) == (False, False)
    live = ClusterConfig()
    assert (live.policy.md_predicted_send, live.policy.early_handoff) == (True, True)
    prof = {"model": {"layers": 4, "attn_dim": 256, "kv_bytes_per_token": 2048, "weight_bytes": 2e7,
                      "flops_per_token": 8e6}}
    for ps, eh in ((True, False), (False, True)):
        live = ClusterConfig(policy={"md_predicted_send": ps, "early_handoff": eh})
        s = sim_config(live, "p.json", prof, 16)
        assert (s.md_predicted_send, s.early_handoff) == (ps, eh)


def test_a_positive_budget_relays_what_misses_it_at_once_and_waits_for_md_on_what_fits():
    """Budget 500 ms on the 400 ms RTT line: the cold 4,096-token prompt (0.43 s of KV + the RTT)
    misses it by the index, so it is relayed at once with the predicted send, exactly as with a
    zero budget; the second turn (64 missing tokens of 4,160: 6.7 ms of KV + the RTT) fits and
    waits for MD's reservation (P->MD)."""
    second = {"timestamp": 5000, "input_length": 4160, "output_length": 20, "hash_ids": list(range(9))}
    recs = ONE + [second]
    zero = run(RELAY.replace(md_predicted_send=True, early_handoff=False), recs)
    budget = run(RELAY.replace(md_predicted_send=True, early_handoff=False, ttft_budget_ms=500.0), recs)
    rz, rb = zero.reqs[0], budget.reqs[0]
    assert rb.pipeline == Pipeline.P_RLD_MD and rb.md_predicted
    assert rb.wan_flow.t_start == rb.t_prefill_done == rz.wan_flow.t_start  # not after the round trip
    assert rb.t_first == rz.t_first and rb.t_md_kv == pytest.approx(rz.t_md_kv)
    warm = budget.reqs[1]
    assert warm.pipeline == Pipeline.P_MD and not warm.md_predicted and warm.md_hit == 4096
    assert warm.wan_bytes == 64 * KVB
    assert warm.t_first > warm.arrival + 2 * 0.2  # P->MD: the first token after MD's reply, the KV and the way back


def test_md_s_messages_to_the_gateway_take_the_gateways_measured_round_trip():
    """With the gateway's RTT estimate above the line's (``wan_rtt_estimate_ms``: the live round
    trip, software included), MD's messages to the gateway (``ClusterSim.md_owd``) come that much
    later: the reservation reply, so the ablation's send, which waits for it, starts 20 ms later
    for an estimate 20 ms above the 400 ms line; the predicted send (not waiting) is unchanged;
    a P -> MD request's first token comes 40 ms later (the reply, then the token itself)."""
    base = RELAY.replace(md_predicted_send=False, early_handoff=False)
    line = run(base)
    slow = run(base.replace(wan_rtt_estimate_ms=420.0))
    rl, rs = line.reqs[0], slow.reqs[0]
    assert rl.wan_flow.t_start == pytest.approx(0.4)
    assert rs.wan_flow.t_start == pytest.approx(0.42)
    assert rs.t_md_kv - rl.t_md_kv == pytest.approx(0.02)
    # an estimate below the line's (a profile measured on a faster line) adds nothing
    assert run(base.replace(wan_rtt_estimate_ms=380.0)).reqs[0].wan_flow.t_start == pytest.approx(0.4)
    pred = RELAY.replace(md_predicted_send=True, early_handoff=False)
    rp, rq = run(pred).reqs[0], run(pred.replace(wan_rtt_estimate_ms=420.0)).reqs[0]
    assert rq.wan_flow.t_start == rp.wan_flow.t_start == rp.t_prefill_done
    # a P->MD request (the budget's warm second turn): the reply and the token, 20 ms each
    second = {"timestamp": 5000, "input_length": 4160, "output_length": 20, "hash_ids": list(range(9))}
    cfg = RELAY.replace(md_predicted_send=True, early_handoff=False, ttft_budget_ms=500.0)
    a, b = run(cfg, ONE + [second]).reqs[1], run(cfg.replace(wan_rtt_estimate_ms=420.0), ONE + [second]).reqs[1]
    assert a.pipeline == b.pipeline == Pipeline.P_MD
    assert b.wan_flow.t_start - a.wan_flow.t_start == pytest.approx(0.02)
    assert (b.t_first - b.arrival) - (a.t_first - a.arrival) == pytest.approx(0.04)
    # a relayed request: MD's kv_ready reaches the gateway 20 ms later, so does its handoff
    c, d = run(base).reqs[0], run(base.replace(wan_rtt_estimate_ms=420.0)).reqs[0]
    assert c.pipeline == d.pipeline == Pipeline.P_RLD_MD
    assert d.t_handoff_start - d.t_md_kv - (c.t_handoff_start - c.t_md_kv) == pytest.approx(0.02)
