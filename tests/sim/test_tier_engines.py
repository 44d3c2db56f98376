"""Each simulated instance runs its own tier's engine settings (``SimConfig.tier_engines``, what
``pdd sim validate`` builds from the runtime's ``tiers.<tier>.engine``, ``ClusterConfig.engine_for``):
batch limits, prefill order, step floor, KV page, pool and the KV size of transfers to it.
Batches are watched through ``pdd.engine.scheduler.schedule``, the function every simulated
instance forms its batches with."""

import sys

import pytest

import pdd.engine.scheduler as eng_sched
from pdd.config import ClusterConfig
from pdd.sim.cluster import ClusterSim, RequestTooLarge, SimConfig
from pdd.sim.sim_config import SimEngine
from pdd.sim.validate import sim_config
from tests.sim.sim_checks import check_settled

PROFILE = "data/profiles/this-machine.json"  # a pdd-profile/1 of the small model (fp32, 2,048 B a token)
PROF = {"model": {"layers": 4, "attn_dim": 256, "kv_bytes_per_token": 2048, "weight_bytes": 19473408.0,
                  "flops_per_token": 7639552.0}, "engine": {"dtype": "float32"}}


def burst(n: int, prompt: int = 256, out: int = 200, block: int = 64) -> list[dict]:
    """``n`` requests at time 0 with nothing in common (their own hash blocks)."""
    k = prompt // block
    return [{"timestamp": 0, "input_length": prompt, "output_length": out, "hash_ids": list(range(i * k, (i + 1) * k))}
            for i in range(n)]


def watched(monkeypatch, cfg: SimConfig, recs: list[dict]) -> tuple[ClusterSim, dict]:
    """``recs`` on ``cfg``; returns the sim and, per instance name, every plan its engine formed
    as ``(sequences, tokens, most tokens of one sequence)``."""
    real = eng_sched.schedule
    plans: dict[str, list] = {}

    def spy(states, c):
        plan = real(states, c)
        if plan:  # the caller is the instance's engine loop (Instance.run)
            name = sys._getframe(1).f_locals["self"].name
            plans.setdefault(name, []).append((len(plan.items), plan.num_tokens,
                                               max(it.num_tokens for it in plan.items)))
        return plan

    monkeypatch.setattr(eng_sched, "schedule", spy)
    sim = ClusterSim(cfg)
    sim.record_decisions = True
    sim.run(recs)
    check_settled(sim)
    return sim, plans


def most(plans, k: int) -> int:
    return max(p[k] for p in plans)


def live_cfg(tiers: dict, **engine) -> ClusterConfig:
    return ClusterConfig(mode="pdd", engine={"max_running": 8, **engine}, tiers=tiers)


def test_md_s_own_max_running_caps_its_batches_and_rld_keeps_the_top_level_one(monkeypatch):
    """The runtime config sets MD's tier to 2 sequences a step; RLD inherits the top-level 8.
    Twelve requests relayed at once (zero budget) crowd both decoders."""
    cfg = live_cfg({"main_decode": {"engine": {"max_running": 2}}})
    scfg = sim_config(cfg, PROFILE, PROF, block_tokens=64, host_cores=0.0).replace(ttft_budget_ms=0.0)
    sim, plans = watched(monkeypatch, scfg, burst(12))
    assert sim.pipelines == {"p_rld_md": 12}
    assert most(plans["MD0"], 0) == 2
    assert most(plans["RLD0"], 0) == 8
    # RLD's handoff decisions read RLD's own capacity (the relay role's engine max_running)
    caps = {d["inputs"]["rld_capacity"] for log in sim.decision_log.values() for d in log if d["policy"] == "handoff"}
    assert caps == {8}


def test_rld_s_own_max_running_caps_its_batches_and_its_handoff_capacity(monkeypatch):
    cfg = live_cfg({"relay_decode": {"engine": {"max_running": 5}}})
    scfg = sim_config(cfg, PROFILE, PROF, block_tokens=64, host_cores=0.0).replace(ttft_budget_ms=0.0)
    sim, plans = watched(monkeypatch, scfg, burst(12))
    assert most(plans["RLD0"], 0) == 5 and most(plans["MD0"], 0) == 8
    caps = {d["inputs"]["rld_capacity"] for log in sim.decision_log.values() for d in log if d["policy"] == "handoff"}
    assert caps == {5}


def test_without_the_tier_block_md_runs_the_top_level_limit(monkeypatch):
    scfg = sim_config(live_cfg({}), PROFILE, PROF, block_tokens=64, host_cores=0.0).replace(ttft_budget_ms=0.0)
    _, plans = watched(monkeypatch, scfg, burst(12))
    assert most(plans["MD0"], 0) == 8


def test_p_s_own_batch_budget_and_chunk_cap_its_prefill_steps(monkeypatch):
    """P's tier: 300 tokens a step, 128 of one prompt; the top-level 512 / 512 stay on RLD and MD."""
    cfg = live_cfg({"prefill": {"engine": {"max_batch_tokens": 300, "prefill_chunk_tokens": 128}}})
    scfg = sim_config(cfg, PROFILE, PROF, block_tokens=64, host_cores=0.0).replace(ttft_budget_ms=0.0)
    sim, plans = watched(monkeypatch, scfg, burst(4, prompt=512, out=20))
    assert most(plans["P0"], 1) == 300 and most(plans["P0"], 2) == 128
    assert sum(p[1] for p in plans["P0"]) == 4 * 512  # every prompt token computed once, none cached
    assert sim.tiers["P"][0].chunk_tokens == 128 and sim.tiers["MD"][0].chunk_tokens == 512


def test_an_instance_block_overrides_its_tier_s(monkeypatch):
    """``tiers.md1`` over ``tiers.main_decode``: md1 runs 1 sequence a step, md0 its tier's 3."""
    cfg = ClusterConfig(mode="pdd", engine={"max_running": 8}, instances={"main_decode": 2},
                        tiers={"main_decode": {"engine": {"max_running": 3}}, "md1": {"engine": {"max_running": 1}}})
    scfg = sim_config(cfg, PROFILE, PROF, block_tokens=64, host_cores=0.0).replace(ttft_budget_ms=0.0,
                                                                                     routing="round_robin")
    assert scfg.tier_engines["MD1"] == SimEngine(max_running_seqs=1)
    _, plans = watched(monkeypatch, scfg, burst(12))
    assert most(plans["MD0"], 0) == 3 and most(plans["MD1"], 0) == 1 and most(plans["RLD0"], 0) == 8


def test_heterogeneous_tiers_map_to_the_simulator():
    """examples/heterogeneous.yaml's kind of config: MD in bf16 on 32-token pages with its own
    pool and limits; RLD receives fp32 KV (P's and its own dtype), MD bf16 (the narrower)."""
    cfg = live_cfg({"main_decode": {"engine": {"dtype": "bfloat16", "page_size": 32, "num_pages": 512,
                                               "max_running": 4, "prefill_order": "short_first",
                                               "min_step_ms": 20}}})
    scfg = sim_config(cfg, PROFILE, PROF, block_tokens=64, host_cores=0.0)
    assert scfg.kv_bytes_per_token == 1024  # the WAN's (P -> MD) wire size, as before
    md, rld, p = scfg.engine_of("MD"), scfg.engine_of("RLD"), scfg.engine_of("P")
    assert (md.max_running_seqs, md.prefill_order, md.min_step_s, md.page_tokens, md.kv_pool_tokens,
            md.kv_bytes_per_token) == (4, "short_first", 0.02, 32, 512 * 32, None)  # None: the model's, 1024
    assert (rld.max_running_seqs, rld.page_tokens, rld.kv_pool_tokens, rld.kv_bytes_per_token) == (8, 16, 32768, 2048)
    assert (p.max_batch_tokens, p.min_step_s, p.page_tokens) == (512, 0.0, 16)
    sim = ClusterSim(scfg)
    md0 = sim.tiers["MD"][0]
    assert (md0.pool, md0.page, md0.kvb, md0.min_step_s) == (16384, 32, 1024, 0.02)
    assert (sim.md_index["MD0"].page_size, sim.md_index["MD0"].capacity) == (32, 512)
    assert sim.tiers["RLD"][0].kvb == 2048


def test_homogeneous_config_carries_only_the_pools():
    scfg = sim_config(live_cfg({}), PROFILE, PROF, block_tokens=64, host_cores=0.0)
    pool = SimEngine(kv_pool_tokens=2048 * 16)  # the top-level engine's num_pages x page_size
    assert scfg.tier_engines == {"P": pool, "RLD": pool, "MD": pool}


# --- SimConfig.tier_engines directly (the simulator's own units) ---------------------------------

RELAY = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=10.0, wan_rtt_ms=40.0, ttft_budget_ms=0.0,
                  warmup_frac=0.0, block_tokens=64, max_running_seqs=8)
KVB = 131072  # llama-3.1-8b KV bytes per token


def test_engine_of_resolves_instance_over_role_over_top_level():
    cfg = RELAY.replace(tier_engines={"MD": {"max_running_seqs": 3, "page_tokens": 32},
                                      "MD1": SimEngine(max_running_seqs=1)})
    assert cfg.engine_of("MD1") == SimEngine(max_batch_tokens=8192, prefill_chunk_tokens=8192, max_running_seqs=1,
                                             prefill_order="fcfs", min_step_s=0.0, page_tokens=32)
    assert cfg.engine_of("MD0").max_running_seqs == 3 and cfg.engine_of("RLD0").max_running_seqs == 8
    assert cfg.engine_of("P").page_tokens == 64  # no page_tokens: the block


@pytest.mark.parametrize("te, msg", [
    ({"X": {}}, "tier_engines has key 'X'"),
    ({"MD": {"max_running": 2}}, "tier_engines['MD']: unknown field(s) max_running"),
    ({"MD": {"max_running_seqs": 0}}, "tier_engines['MD'].max_running_seqs must be a whole number >= 1, got 0"),
    ({"RLD1": {"prefill_order": "lifo"}}, "tier_engines['RLD1'].prefill_order must be one of"),
    ({"MD": {"page_tokens": 48}}, "tier_engines['MD'].page_tokens must be a whole number of tokens >= 1 dividing "
                                  "block_tokens (64), got 48"),
    ({"P": {"min_step_s": -1.0}}, "tier_engines['P'].min_step_s must be a finite number of seconds >= 0"),
])
def test_a_bad_tier_engine_is_refused_naming_it(te, msg):
    with pytest.raises(ValueError) as e:
        RELAY.replace(tier_engines=te)
    assert msg in str(e.value)


def test_transfers_carry_each_target_tier_s_kv_size():
    """The fast path carries RLD's wire size, the WAN MD's (one relayed request, MD holds nothing)."""
    cfg = RELAY.replace(tier_engines={"RLD": {"kv_bytes_per_token": KVB}, "MD": {"kv_bytes_per_token": KVB // 2}})
    sim = ClusterSim(cfg)
    sim.run(burst(1, prompt=1024, out=50))
    check_settled(sim)
    r = sim.reqs[0]
    assert (r.fast_flow.total, r.wan_flow.total, r.wan_bytes) == (1024 * KVB, 1024 * KVB // 2, 1024 * KVB // 2)


def test_a_tier_s_step_floor_holds_every_step_of_its_instances():
    cfg = RELAY.replace(tier_engines={"MD": {"min_step_s": 0.5}})
    sim = ClusterSim(cfg)
    sim.run(burst(1, prompt=1024, out=50))
    check_settled(sim)
    md, rld = sim.tiers["MD"][0], sim.tiers["RLD"][0]
    assert md.steps > 0 and md.busy_s == pytest.approx(0.5 * md.steps, rel=1e-12)
    assert rld.busy_s < 0.5 * rld.steps / 10  # RLD's steps are its own, far under MD's floor


def test_a_tier_s_own_pool_refuses_what_cannot_fit_it():
    cfg = RELAY.replace(tier_engines={"MD": {"kv_pool_tokens": 1000}})
    with pytest.raises(RequestTooLarge) as e:
        ClusterSim(cfg).run(burst(1, prompt=1024, out=50))
    assert (e.value.role, e.value.pool) == ("MD", 1000)
