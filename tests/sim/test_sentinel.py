"""The simulator runs the runtime's own policy and scheduler code: replacing a function with a
sentinel changes the simulator's decisions."""

import pdd.engine.scheduler as eng_sched
import pdd.policy.cutoff as pol_cutoff
import pdd.policy.handoff as pol_handoff
import pdd.policy.pipeline as pol_pipeline
import pdd.policy.wan_order as pol_wan
from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.workload.records import generate_agentic
from pdd.types import Pipeline

RECS = generate_agentic(200, seed=2, rate=2.0)
CFG = SimConfig(mode="pdd", n_p=2, n_rld=1, n_md=2, wan_gbps=10.0, warmup_frac=0.0)


def run(cfg=CFG):
    return ClusterSim(cfg).run(RECS)


def test_pipeline_sentinel_changes_decisions(monkeypatch):
    real = run()
    assert {d for _, d in real.decisions} == {"p_md", "p_rld_md"}
    calls = []

    def sentinel(inp):
        calls.append(inp)
        return Pipeline.P_RLD

    monkeypatch.setattr(pol_pipeline, "choose_pipeline", sentinel)
    fake = run()
    # twice a request (budget 250 ms): on the prefix index's prediction at arrival (no relay at
    # once: the sentinel never says P->RLD->MD), then the plan on MD's reservation reply
    assert len(calls) == 2 * len(RECS)
    assert {d for _, d in fake.decisions} == {"p_rld"}
    assert fake.wan.bytes_sent == 0  # nothing ever went to MD
    assert all(r.finished for r in fake.reqs)


def test_scheduler_is_the_engines(monkeypatch):
    seen = []
    real = eng_sched.schedule

    def spy(states, cfg):
        plan = real(states, cfg)
        seen.append(len(plan))
        return plan

    monkeypatch.setattr(eng_sched, "schedule", spy)
    sim = run()
    assert len(seen) > 100 and all(r.finished for r in sim.reqs)

    def one_token_per_step(states, cfg):  # a different scheduler must change the simulation
        return real(states, eng_sched.SchedulerConfig(cfg.max_batch_tokens, 1, cfg.prefill_chunk_tokens))

    monkeypatch.setattr(eng_sched, "schedule", one_token_per_step)
    slow = ClusterSim(CFG).run(RECS[:40])
    monkeypatch.setattr(eng_sched, "schedule", real)
    fast = ClusterSim(CFG).run(RECS[:40])
    assert max(r.t_done for r in slow.reqs) > max(r.t_done for r in fast.reqs)


def test_handoff_and_cutoff_sentinels(monkeypatch):
    base = run()
    assert base.cutoffs > 0
    monkeypatch.setattr(pol_cutoff, "should_cut_off", lambda *a, **k: False)
    no_cut = run()
    assert no_cut.cutoffs == 0
    monkeypatch.undo()
    modes = []
    real = pol_handoff.decide_handoff

    def sentinel(inp):
        d = real(inp)
        modes.append(inp.mode_config)
        return pol_handoff.HandoffDecision("catch_up", d.tokens_to_send, True)

    monkeypatch.setattr(pol_handoff, "decide_handoff", sentinel)
    s = run()
    assert modes and s.handoffs == {"catch_up": len(modes)}


def test_wan_order_sentinel(monkeypatch):
    calls = []
    real = pol_wan.pick_next

    def spy(transfers, policy):
        calls.append(policy)
        return real(transfers, policy)

    monkeypatch.setattr(pol_wan, "pick_next", spy)
    run(CFG.replace(wan_order="srf"))
    assert calls and set(calls) == {"srf"}
