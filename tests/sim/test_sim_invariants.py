"""Randomized invariants of the cluster simulator (hypothesis, derandomized: the same examples on
every run). Small random workloads (1-10 requests: 1-token prompts, prompts at page, block and
chunk boundaries, shared prefixes, outputs of 1..24 tokens, arrivals together or spread) on small
random topologies (the four modes, 1-3 instances a role, tight or roomy KV pools, the WAN's rate,
RTT, loss, cross traffic and send order, layer-wise streaming, budgets, handoff modes, the
ablations, decode caps, MD routing load caps, the live-fit delays, autoscaling), each checked after its run:

- every request ends exactly once (``_complete`` is called once), with ``out_len`` tokens emitted,
  or the run is refused before it starts (``RequestTooLarge``) exactly when a request cannot fit
  one instance's pool;
- its tokens come from P's prefill (one), RLD and MD (or D / colocated): the per-request and the
  per-role counts add up to the outputs;
- its times are ordered (arrival <= prefill end <= first token <= end, every token at or after
  the one before, no negative inter-token gap);
- every instance ends with no private KV, no cache lock, no decode slot, no sequence, no queued
  admission; the lines have no flow left; P holds no request's pages;
- WAN bytes: each request's bytes are its missing tokens (prompt less MD's hit, in whole pages)
  x MD's KV bytes a token unless cut off; the line sent their sum; sent + saved by cut-offs =
  planned; the fast path carries each relayed prompt whole;
- every recorded pipeline and handoff decision is what the policy function returns for its
  recorded inputs; every routing choice is made on the loads ``Instance.load`` gives (an MD's by
  the gateway's index: the pages it cannot evict); one pipeline per request, never P->RLD unless
  the ablation allows it;
- autoscaling: every decision is ``decide_mix`` of its logged inputs, membership moves only
  standby/removed -> active -> draining -> removed, and active counts stay within [min, max];
- the same inputs give a bit-identical run.

More examples: ``PDD_SIM_INV_EXAMPLES=2000 pytest tests/sim/test_sim_invariants.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import pdd.policy.handoff as pol_handoff
import pdd.policy.pipeline as pol_pipeline
import pdd.policy.routing as pol_routing
from pdd.config import AutoscaleConfig
from pdd.policy.autoscale import AutoscaleInputs, RoleLoad, decide_mix
from pdd.sim.autoscale import SIM_ROLE, SimAutoscaler
from pdd.sim.cluster import ClusterSim, RequestTooLarge, SimConfig
from pdd.sim.report import summarize
from pdd.sim.sim_config import SimEngine
from pdd.types import Pipeline

EXAMPLES = int(os.environ.get("PDD_SIM_INV_EXAMPLES", "40"))
MODES = ("pdd", "cross_dc_pd", "same_dc_pd", "colocated")
COUNT = {"P": "n_p", "RLD": "n_rld", "MD": "n_md", "D": "n_d", "C": "n_c"}
REL = 1e-9  # float sums over flows: the line's bytes are added in another order than the requests'


class CheckedSim(ClusterSim):
    """The simulator with its decisions recorded and every completion, token emission and
    routing choice kept for the checks (behaviour unchanged)."""

    def __init__(self, cfg: SimConfig):
        super().__init__(cfg)
        self.record_decisions = True
        self.completions: Counter = Counter()
        self.emits: dict[int, list] = defaultdict(list)
        self.routes: list = []

    def _complete(self, req):
        self.completions[req.rid] += 1
        super()._complete(req)

    def _emit(self, req, t, n, dt):
        self.emits[req.rid].append((t + self.cfg.client_delay_s, n, dt))
        super()._emit(req, t, n, dt)

    def _route(self, role, req, with_cache, policy=None):
        insts = self.tiers[role] if self.autoscaler is None else self.autoscaler.routable(role)
        want = [self._expected_load(i, role, req, with_cache) for i in insts]
        real = pol_routing.choose_instance
        seen = []

        def spy(loads, *a, **k):
            i = real(loads, *a, **k)
            seen.append((list(loads), a, k, i))
            return i

        pol_routing.choose_instance = spy
        try:
            inst = super()._route(role, req, with_cache, policy)
        finally:
            pol_routing.choose_instance = real
        self.routes.append((role, req.rid, [i.name for i in insts], want, seen, inst.name))
        return inst

    def _expected_load(self, inst, role, req, with_cache):
        """``inst.load(hit)``: its cache's match, or on an MD the gateway's index's, where the pages
        used are those MD cannot evict (private and locked cache blocks, as ``_route`` says)."""
        ix = self.md_index.get(inst.name) if role == "MD" and with_cache else None
        if ix is not None:
            c = inst.cache
            return dataclasses.replace(inst.load(ix.match_keys(self._page_keys(req, inst.page)) * inst.page),
                                       pages_used=inst.private + (len(c.locks) * self.block if c is not None else 0))
        if not with_cache or inst.cache is None:
            return inst.load(0)
        return inst.load(inst.cache.match(req.blocks[: req.n_full]) * self.block)


# --- drawing a scenario ------------------------------------------------------------------------------

@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from(MODES))
    block = draw(st.sampled_from((8, 16)))
    page = draw(st.sampled_from([p for p in (2, 4, 8, 16) if block % p == 0]))
    chunk = draw(st.sampled_from((4, 16, 64)))
    n_req = draw(st.integers(1, 10))
    out_max = draw(st.sampled_from((1, 4, 24)))
    edge = sorted({1, 2, max(1, page - 1), page, page + 1, block - 1, block, block + 1, chunk + 1, 3 * block})
    prompt = st.one_of(st.sampled_from(edge), st.integers(1, 6 * block))
    together = draw(st.booleans())
    recs = []
    for rid in range(n_req):
        n = draw(prompt)
        nb = -(-n // block)
        fam = draw(st.integers(0, 2))
        shared = draw(st.integers(0, nb))  # leading blocks shared with the family's other prompts
        ids = [1000 * (fam + 1) + j for j in range(shared)] + [100000 + 100 * rid + j for j in range(shared, nb)]
        t_ms = 0 if together else draw(st.integers(0, 3000))
        recs.append({"timestamp": t_ms, "input_length": n, "output_length": draw(st.integers(1, out_max)),
                     "hash_ids": ids})
    need = max(r["input_length"] + r["output_length"] for r in recs)
    too_small = draw(st.integers(0, 9)) == 0  # now and then a pool no request can fit: the refusal
    roles = {"colocated": ("C",), "same_dc_pd": ("P", "D"), "cross_dc_pd": ("P", "MD"),
             "pdd": ("P", "RLD", "MD")}[mode]
    engines = {}
    for role in roles:
        slack = draw(st.sampled_from((0, 0, block, 4 * block, 1000)))
        pool = max(1, need - 1) if too_small and role != "P" else need + slack
        engines[role] = SimEngine(kv_pool_tokens=pool)
    gbps = draw(st.sampled_from((0.02, 0.5, 5.0, 100.0)))
    rtt = draw(st.sampled_from((0.0, 1.0, 30.0, 200.0)))
    kw = dict(
        mode=mode, block_tokens=block, page_tokens=page, prefill_chunk_tokens=chunk,
        max_batch_tokens=draw(st.sampled_from((chunk, 2 * chunk, 8192))),
        max_running_seqs=draw(st.integers(1, 8)), prefill_order=draw(st.sampled_from(("fcfs", "short_first"))),
        tier_engines=engines, warmup_frac=0.0,
        wan_gbps=gbps, wan_rtt_ms=rtt, wan_loss_rate=draw(st.sampled_from((0.0, 0.0, 1e-4, 0.01))),
        wan_cross_traffic=draw(st.sampled_from(((), ((0.0, 0.3 * gbps),), ((0.5, 0.5 * gbps), (2.0, 0.0))))),
        wan_order=draw(st.sampled_from(("ps", "fifo", "srf"))),
        wan_express_lane_bdp=draw(st.sampled_from((0.0, 1.0))),
        kv_stream=draw(st.sampled_from(("whole", "layerwise"))),
        kv_stream_layer_group=draw(st.sampled_from((1, 8, 32))),
        ttft_budget_ms=draw(st.sampled_from((0.0, 40.0, 250.0, 1e6))),
        handoff_mode=draw(st.sampled_from(("one_shot", "catch_up", "auto"))),
        catchup_threshold=draw(st.integers(0, 6)),
        allow_p_rld=draw(st.booleans()) and draw(st.booleans()),
        allow_p_rld_after_s=draw(st.sampled_from((0.0, 1.0))),
        md_predicted_send=draw(st.booleans()), md_prefix_index=draw(st.booleans()),
        md_index_drops_cut_offs=draw(st.booleans()), early_handoff=draw(st.booleans()),
        cutoff=draw(st.booleans()), cutoff_min_remaining_s=draw(st.sampled_from((0.0, 0.5))),
        wan_estimate=draw(st.sampled_from(("live", "config"))),
        drc=draw(st.booleans()), p_cache=draw(st.booleans()),
        routing=draw(st.sampled_from(("cache_aware", "load", "round_robin"))),
        md_cache_frac=draw(st.sampled_from((1.0, 0.5))), p_cache_frac=draw(st.sampled_from((1.0, 0.5))),
        max_running_d=draw(st.integers(0, 2)), max_running_rld=draw(st.integers(0, 2)),
        max_running_md=draw(st.integers(0, 2)), max_prefill_inflight=draw(st.integers(0, 1)),
        md_load_cap=draw(st.integers(0, 2)),
        min_step_s=draw(st.sampled_from((0.0, 0.002))),
        p_dispatch_s=draw(st.sampled_from((0.0, 0.01))),
        p_reply_lag_s_per_token=draw(st.sampled_from((0.0, 1e-4))),
        wan_send_buffer_bytes=draw(st.sampled_from((0.0, 1e5, 1e7))),
        wan_written_lead_bytes=draw(st.sampled_from((None, 0.0, 5e4))),
        client_delay_s=draw(st.sampled_from((0.0, 0.005))),
        wan_rtt_estimate_ms=draw(st.sampled_from((None, rtt + 5.0))),
        wan_backlog_in_plan=draw(st.booleans()),
        host_cores=draw(st.sampled_from((0.0, 0.0, 2.0))),
        decode_interference=draw(st.sampled_from((None, {"RLD": 1.5, "MD": 2.0, "D": 1.2, "C": 1.3}))),
        prefill_interference=draw(st.sampled_from((1.0, 1.4))),
    )
    for role in roles:
        kw[COUNT[role]] = draw(st.integers(1, 3))
    scaled = [r for r in ("P", "RLD", "MD") if r in roles]
    auto = None
    if scaled and draw(st.integers(0, 3)) == 0:
        role = draw(st.sampled_from(scaled))
        name = {v: k for k, v in SIM_ROLE.items()}[role]
        auto = (AutoscaleConfig(enabled=True, interval_s=draw(st.sampled_from((0.3, 1.0))), sample_s=0.1,
                                cooldown_s=draw(st.sampled_from((0.0, 1.0))),
                                max={name: kw[COUNT[role]] + draw(st.integers(0, 2))},
                                up_at=draw(st.sampled_from((0.2, 0.75))), down_at=0.05),
                draw(st.sampled_from((0.0, 0.2))))
    return SimConfig(**kw), recs, auto


def build(cfg: SimConfig, auto) -> CheckedSim:
    """A :class:`CheckedSim` of ``cfg``; with ``auto`` (an AutoscaleConfig, start seconds) the
    scaled role's ``max`` instances, the extra ones in standby (as ``autoscaled_sim``)."""
    if auto is None:
        return CheckedSim(cfg)
    acfg, start_s = auto
    tiers = cfg.tiers()
    initial = {role: tiers[SIM_ROLE[role]][0] for role in acfg.max}
    grow = {COUNT[SIM_ROLE[role]]: n for role, n in acfg.max.items()}
    sim = CheckedSim(cfg.replace(**grow))
    SimAutoscaler(sim, acfg, initial, start_s)
    return sim


# --- the checks -------------------------------------------------------------------------------------

def check_refusal(sim: CheckedSim, recs, err: RequestTooLarge | None) -> bool:
    """The run is refused exactly when some request's KV exceeds one instance's pool of a tier;
    the refusal names one that does. True when refused."""
    pools = {role: min(i.pool for i in insts) for role, insts in sim.tiers.items()}
    too_big = [(rid, role) for rid, r in enumerate(recs) for role, pool in pools.items()
               if int(r["input_length"]) + (max(1, int(r["output_length"])) if role != "P" else 0) > pool]
    if err is None:
        assert not too_big
        return False
    assert too_big and too_big[0] == (err.rid, err.role), (too_big, err)
    assert err.prompt + (err.out_len if err.role != "P" else 0) > err.pool == pools[err.role]
    return True


def check_requests(sim: CheckedSim) -> None:
    cfg = sim.cfg
    colocated = cfg.mode == "colocated"
    for r in sim.reqs:
        rid = r.rid
        assert sim.completions[rid] == 1, (rid, sim.completions[rid])
        assert r.finished and r.generated == r.out_len and r.n_emitted == r.out_len, \
            (rid, r.generated, r.n_emitted, r.out_len)
        # tokens: one from P's prefill, the rest decoded on RLD and MD (per request)
        if r.pipeline == Pipeline.P_RLD_MD:
            assert 1 + r.rld_tokens + r.md_tokens == r.out_len, (rid, r.rld_tokens, r.md_tokens, r.out_len)
        elif r.pipeline == Pipeline.P_MD:
            assert (r.rld_tokens, r.md_tokens) == (0, r.out_len - 1), (rid, r.rld_tokens, r.md_tokens)
        elif r.pipeline == Pipeline.P_RLD:
            assert (r.rld_tokens, r.md_tokens) == (r.out_len - 1, 0), (rid, r.rld_tokens, r.md_tokens)
        else:
            assert (r.rld_tokens, r.md_tokens) == (0, 0)
        if r.cut_off:
            assert r.pipeline == Pipeline.P_RLD_MD and r.md_tokens == 0 and r.rld_finished, rid
        # times
        assert r.arrival <= r.t_first <= r.t_done == r.t_last, (rid, r.arrival, r.t_first, r.t_done, r.t_last)
        if not colocated:
            assert r.arrival <= r.t_prefill_done <= r.t_first, (rid, r.arrival, r.t_prefill_done, r.t_first)
        if r.t_md_kv is not None:
            assert r.t_md_kv >= r.arrival, rid
        if r.t_handoff_start is not None:
            assert r.t_prefill_done <= r.t_handoff_start, rid
        ems = sim.emits[rid]
        assert sum(n for _t, n, _dt in ems) == r.out_len, (rid, ems)
        assert ems[0][0] == r.t_first, rid
        last = None
        for t, n, dt in ems:
            assert dt >= 0.0 and n >= 1, (rid, ems)
            if last is not None:
                assert t >= last, (rid, "a token before the one before it", ems)
            last = t + (n - 1) * dt
        assert last == r.t_last and r.max_gap >= 0.0, rid
        # cache hits: whole pages, at least one prompt token computed on P
        page = cfg.page_tokens or cfg.block_tokens
        assert 0 <= r.p_hit <= r.prompt - 1 and r.p_hit % page == 0, (rid, r.p_hit, r.prompt)
        if r.md is not None:
            assert 0 <= r.md_hit <= r.prompt and r.md_hit % r.md.page == 0, (rid, r.md_hit, r.prompt)
            assert r.md_missing == r.prompt - r.md_hit, (rid, r.md_missing, r.prompt, r.md_hit)
        assert r.p_locked is None and not r.md_waiting and r.p_pending_flows == 0, \
            (rid, r.p_locked, r.md_waiting, r.p_pending_flows)
    assert min(sim.itl_v, default=0.0) >= 0.0
    # tokens per role: P's first tokens (every request but colocated ones) + the decoded ones
    firsts = 0 if colocated else len(sim.reqs)
    assert sum(sim.decode_tokens.values()) + firsts == sum(r.out_len for r in sim.reqs), sim.decode_tokens
    assert sim.decode_tokens["RLD"] == sum(r.rld_tokens for r in sim.reqs)
    assert sim.decode_tokens["MD"] == sum(r.md_tokens for r in sim.reqs)


def check_settled(sim: CheckedSim) -> None:
    for insts in sim.tiers.values():
        for i in insts:
            assert (i.private, i.slots, len(i.seqs), len(i.waiting), len(i.inbox), i.routed, i.prefilling) == \
                (0, 0, 0, 0, 0, 0, 0), (i.name, i.private, i.slots, i.seqs, i.waiting, i.routed, i.prefilling)
            assert i.cache is None or not i.cache.locks, (i.name, i.cache.locks)
            if i.slot_cap:
                assert i.peak_slots <= i.slot_cap, (i.name, i.peak_slots, i.slot_cap)
    lines = list(sim.fast.values()) + ([sim.wan] if sim.wan is not None else [])
    for ln in lines:
        assert not ln.flows and ln.n_held == 0 and not ln.lanes, (ln.name, ln.flows, ln.n_held, ln.lanes)
    assert not sim.kv_ready and not sim.kv_dispatched


def check_bytes(sim: CheckedSim) -> None:
    fast = 0
    for r in sim.reqs:
        to = r.rld if r.rld is not None else r.d
        if to is not None:
            fast += r.prompt * to.kvb
    assert sum(ln.bytes_sent for ln in sim.fast.values()) == pytest.approx(fast, rel=REL)
    if sim.wan is None:
        assert sim.cutoffs == 0 and all(r.wan_bytes == 0 for r in sim.reqs)
        return
    planned = 0
    for r in sim.reqs:
        if r.pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
            want = (r.prompt - r.md_hit) * r.md.kvb
            planned += want
            if not r.cut_off:
                assert r.wan_bytes == want, (r.rid, r.wan_bytes, want)
            else:
                assert 0 <= r.wan_bytes <= want, (r.rid, r.wan_bytes, want)
        else:
            assert r.wan_bytes == 0, r.rid
    assert sim.wan.bytes_sent == pytest.approx(sum(r.wan_bytes for r in sim.reqs), rel=REL, abs=1e-6)
    assert sim.wan.bytes_sent + sim.wan_saved_bytes == pytest.approx(planned, rel=REL, abs=1e-6)
    assert sim.cutoffs == sum(r.cut_off for r in sim.reqs)


def check_decisions(sim: CheckedSim) -> None:
    cfg = sim.cfg
    n = len(sim.reqs)
    assert sorted(rid for rid, _ in sim.decisions) == list(range(n))  # one pipeline a request
    assert sum(sim.pipelines.values()) == n
    finals = 0
    for r in sim.reqs:
        log = sim.decision_log.get(r.rid, [])
        pipes = [d for d in log if d["policy"] == "pipeline"]
        if cfg.cross_dc():
            assert len(pipes) == 1, (r.rid, pipes)
            inp = pol_pipeline.PipelineInputs(**pipes[0]["inputs"])
            assert pol_pipeline.choose_pipeline(inp).value == pipes[0]["result"] == r.pipeline.value, r.rid
            assert r.pipeline != Pipeline.P_RLD or inp.allow_p_rld, r.rid
            assert (r.rld is not None) == (r.pipeline in (Pipeline.P_RLD_MD, Pipeline.P_RLD)), r.rid
            if cfg.mode == "cross_dc_pd":
                assert r.pipeline == Pipeline.P_MD, r.rid
        else:
            assert not pipes
            assert r.pipeline == (Pipeline.COLOCATED if cfg.mode == "colocated" else Pipeline.P_D), r.rid
        hands = [d for d in log if d["policy"] == "handoff"]
        assert len(hands) == r.handoff_round, (r.rid, len(hands), r.handoff_round)
        for k, d in enumerate(hands):
            inp = pol_handoff.HandoffInputs(**d["inputs"])
            got = pol_handoff.decide_handoff(inp)
            assert {"mode": got.mode, "final": got.final} == d["result"], (r.rid, d)
            assert inp.round_index == k and inp.mode_config == cfg.handoff_mode
            assert not got.final or k == len(hands) - 1, (r.rid, "a round after the final one")
        if hands and hands[-1]["result"]["final"]:
            finals += 1
            assert r.handed == r.rld_tokens + 1 and r.md_tokens == r.out_len - r.handed, \
                (r.rid, r.handed, r.rld_tokens, r.md_tokens)
    assert sum(sim.handoffs.values()) == finals
    assert sim.early_handoffs <= sum(r.handoff_started for r in sim.reqs)  # started: RLD may finish first
    for role, _rid, names, want, seen, chosen in sim.routes:
        if len(names) == 1:
            assert not seen and chosen == names[0]
            continue
        (loads, a, k, i), = seen
        assert loads == want, (role, loads, want)  # the loads the policy reads are the instances'
        assert names[i] == chosen and pol_routing.choose_instance(loads, *a, **k) == i


def check_autoscale(sim: CheckedSim) -> None:
    a = sim.autoscaler
    if a is None:
        return
    for d in a.decisions:
        x = dict(d["inputs"])
        inp = AutoscaleInputs(roles=tuple(RoleLoad(**r) for r in x.pop("roles")), **x)
        assert decide_mix(inp, a.rule).as_dict() == d["decision"]
    legal = {("standby", "active"), ("removed", "active"), ("active", "draining"), ("draining", "removed")}
    state = {}
    for name, st0 in a.initial.items():
        state[name] = st0[1]
    active = Counter(a.role_of[n] for n, s in state.items() if n in a.role_of and s == "active")
    for e in a.events:
        assert (e["from"], e["to"]) in legal and state[e["instance"]] == e["from"], e
        state[e["instance"]] = e["to"]
        active[e["role"]] += {"active": 1, "draining": -1}.get(e["to"], 0)
        assert a.rule.min_n.get(e["role"], 1) <= active[e["role"]] <= a.rule.max_n[e["role"]], (e, active)


def check_stall(sim: CheckedSim) -> None:
    """A run left with unfinished requests stalled for real: nothing is left to happen, nothing
    admitted is running or waiting for a message, and the head of every admission queue cannot
    be admitted (its KV does not fit even after evicting every unlocked cache block, or its
    decode slot or prefill cap is taken)."""
    assert sim.stalled is not None and sim.env.peek() == math.inf
    queued = 0
    for insts in sim.tiers.values():
        for i in insts:
            assert not i.seqs and not i.inbox and i.prefilling == 0 and i.routed == 0, (i.name, i.seqs, i.prefilling)
            if not i.waiting:
                continue
            queued += len(i.waiting)
            need, _admit, prefill, slot = i.waiting[0]
            n = need() if callable(need) else need
            evictable = sum(1 for b in i.cache.lru if b not in i.cache.locks) if i.cache is not None else 0
            cap = sim.cfg.max_prefill_inflight
            assert (n > i.pool - i.used + evictable * sim.block or (slot and i.slot_cap and i.slots >= i.slot_cap)
                    or (prefill and cap and i.prefilling >= cap)), (i.name, n, i.pool, i.used, evictable)
    assert queued > 0


def fingerprint(sim: CheckedSim) -> str:
    rows = []
    for r in sim.reqs:
        rows.append([repr(getattr(r, f)) for f in ("arrival", "t_first", "t_last", "t_done", "n_emitted", "p_hit",
                                                  "md_hit", "wan_bytes", "rld_tokens", "md_tokens", "cut_off",
                                                  "handoff_round", "t_prefill_done", "t_md_kv", "t_handoff")]
                    + [r.pipeline.value] + [getattr(x, "name", None) for x in (r.p, r.rld, r.md, r.d)])
    blob = json.dumps({"reqs": rows, "summary": summarize(sim), "log": sim.decision_log,
                       "itl": [repr(x) for x in sim.itl_v], "now": repr(sim.env.now),
                       "auto": sim.autoscaler.summary() if sim.autoscaler is not None else None},
                      sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_checked(cfg: SimConfig, recs, auto=None) -> CheckedSim | None:
    """Run ``recs`` on ``cfg`` (``auto``: autoscaling) and check every invariant (a stalled run:
    that it stalled for real); None when the run is refused (checked to be refused rightly)."""
    sim = build(cfg, auto)
    try:
        sim.run(recs)
    except RequestTooLarge as e:
        assert check_refusal(sim, recs, e)
        return None
    check_refusal(sim, recs, None)
    assert math.isfinite(sim.env.now)
    if any(not r.finished for r in sim.reqs):
        check_stall(sim)  # a documented outcome (ClusterSim.stalled): KV admissions waiting on each other
        return sim
    assert sim.stalled is None
    check_requests(sim)
    check_settled(sim)
    check_bytes(sim)
    check_decisions(sim)
    check_autoscale(sim)
    return sim


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_random_runs_keep_the_simulators_invariants(sc):
    cfg, recs, auto = sc
    note(f"cfg={cfg!r}\nrecs={recs!r}\nauto={auto!r}")
    sim = run_checked(cfg, recs, auto)
    if sim is not None:
        again = build(cfg, auto).run(recs)  # the same inputs: a bit-identical run
        assert fingerprint(again) == fingerprint(sim)


# --- the examples the randomized runs found, each once a violation ------------------------------------

def _recs(*shape, block_ids=None):
    """Records at t=0 of ``(prompt, output)`` pairs, each prompt its own hash blocks (``block_ids``:
    one block id each instead)."""
    return [{"timestamp": 0, "input_length": p, "output_length": o,
             "hash_ids": [block_ids[i]] if block_ids else [1000 + 10 * i + j for j in range(-(-p // 8))]}
            for i, (p, o) in enumerate(shape)]


def test_a_prefill_whose_last_chunk_is_one_token_leaves_the_prefill_cap():
    """With one prefill at a time per P (``max_prefill_inflight=1``, the bathtub experiment's
    tail case), a 5-token prompt in 4-token chunks ends on a 1-token chunk: that step did not count
    the prefill as done, P's prefill count stayed 1 and the second request was never admitted (the
    run ended with it unfinished)."""
    cfg = SimConfig(mode="pdd", prefill_chunk_tokens=4, max_batch_tokens=4, max_prefill_inflight=1, warmup_frac=0.0)
    sim = run_checked(cfg, _recs((5, 2), (5, 2)))
    assert [r.finished for r in sim.reqs] == [True, True] and sim.tiers["P"][0].prefilling == 0


def test_layerwise_kv_lands_after_ps_reply_lag_with_its_first_token():
    """Layer-wise, P's last layer group is written when its step ends, but its first token (and the
    transfer's kv_done) only after P's reply lag: the fast path's KV landed first and RLD emitted
    the first token before P had it (TTFT below P's prefill), and the early handoff read P's prefill
    end while it was None (a TypeError: ``pdd sim run --profile data/profiles/this-machine.json
    --kv-stream layerwise --budget-ms 0``). The transfer now ends when P seals it."""
    cfg = SimConfig(mode="pdd", kv_stream="layerwise", p_reply_lag_s_per_token=1e-4, ttft_budget_ms=0.0,
                    wan_gbps=100.0, warmup_frac=0.0)
    sim = run_checked(cfg, _recs((1, 4)))
    r = sim.reqs[0]
    assert r.t_first == r.t_prefill_done + sim.fast["P0"].owd  # the seal, then the fast path's one-way delay
    assert r.t_kv_written == r.t_prefill_done and sim.early_handoffs == 1


def test_a_layerwise_flow_idling_for_its_prefill_counts_the_bytes_it_sent():
    """A layer-wise flow that has sent all its computed bytes but a microsecond's worth idles until
    the prefill releases more; those last bytes were dropped from the line's count (50 of 6,050
    here), so the line's bytes were below what its requests sent."""
    from pdd.sim.cluster import Line

    sim = ClusterSim(SimConfig(mode="cross_dc_pd"))
    line = Line(sim, "x", 8.0, 0.0, "ps")  # 1 GB/s: a microsecond is 1,000 bytes
    fa = line.send("a", 3000.0, lambda: None, held=2000.0)
    fb = line.send("b", 3050.0, lambda: None, held=2000.0)  # 50 bytes behind a when a idles
    sim.after(1e-3, lambda: (line.release(fa, 0.0), line.release(fb, 0.0)))
    sim.env.run()
    assert line.bytes_sent == pytest.approx(6050.0, rel=1e-12) and fa.done and fb.done


def test_a_transfer_cut_off_before_its_plan_counts_as_saved():
    """RLD finished the request (one output token) before MD's reservation reply reached the
    gateway: the cut-off saved the whole transfer, but its bytes were unknown then and it counted
    0, so the line's bytes plus the saved ones fell short of what was planned."""
    cfg = SimConfig(mode="pdd", wan_rtt_ms=30.0, ttft_budget_ms=0.0, md_predicted_send=False,
                    cutoff_min_remaining_s=0.0, warmup_frac=0.0)
    sim = run_checked(cfg, _recs((1, 1)))
    assert (sim.cutoffs, sim.wan.bytes_sent, sim.wan_saved_bytes) == (1, 0.0, 131072.0)


def test_a_fill_a_cut_off_stops_counts_as_saved():
    """The second of two equal prompts is predicted held on MD (the gateway's index holds the
    first, still on the line), MD lacks it, so its reply asks P for a fill; RLD finished first and
    the cut-off dropped the fill, whose bytes counted neither as sent nor as saved. (Without
    ``md_wait_claims``: with it the second waits for the first's KV instead, no fill.)"""
    cfg = SimConfig(mode="pdd", wan_gbps=0.02, wan_rtt_ms=200.0, block_tokens=8, page_tokens=2, ttft_budget_ms=0.0,
                    early_handoff=False, cutoff_min_remaining_s=0.0, drc=False, warmup_frac=0.0,
                    md_wait_claims=False)
    sim = run_checked(cfg, _recs((8, 1), (8, 1), block_ids=[7, 7]))
    assert (sim.cutoffs, sim.md_predicted_short) == (2, 1)
    assert sim.wan.bytes_sent + sim.wan_saved_bytes == pytest.approx(2 * 8 * 131072, rel=1e-12)


def test_a_drained_p_is_removed_only_once_its_cache_is_unlocked():
    """A request that ended on RLD while its KV still crossed the WAN (no cut-off) holds P's
    cached blocks until the send drains. The autoscaler removed its drained P before that (nothing
    in flight, no private pages: the prompt is one whole block), dropping the cache, and the send's
    end then unlocked a block the new cache never held (KeyError). It now waits for the locks."""
    from pdd.config import AutoscaleConfig

    cfg = SimConfig(mode="pdd", n_p=2, wan_gbps=0.02, block_tokens=8, page_tokens=8, cutoff=False, warmup_frac=0.0)
    acfg = AutoscaleConfig(enabled=True, interval_s=0.3, sample_s=0.1, cooldown_s=0.0, max={"prefill": 2},
                           up_at=0.75, down_at=0.05)
    recs = _recs((8, 1), (8, 1), (8, 1))
    recs[2]["timestamp"] = 2000  # keeps the loop running past the sends
    sim = run_checked(cfg, recs, (acfg, 0.0))
    assert [r.p.name for r in sim.reqs] == ["P0", "P1", "P0"]
    assert [(e["time"], e["op"], e["instance"]) for e in sim.autoscaler.events] == [
        (0.3, "drain", "P1"), (0.9, "remove", "P1")]  # P1's send to MD drains at 0.845 s
    assert sim.reqs[1].wan_flow.t_end == pytest.approx(0.845322, abs=1e-6)


def test_handoff_rounds_waiting_for_kv_are_dropped_with_the_request():
    """Catch-up rounds whose ids reached MD before its KV wait there; when RLD finished the request
    first they stayed queued on it after MD let the request go."""
    e = SimEngine(kv_pool_tokens=9)
    cfg = SimConfig(mode="pdd", wan_gbps=0.02, wan_rtt_ms=0.0, tier_engines={"P": e, "RLD": e, "MD": e},
                    ttft_budget_ms=0.0, handoff_mode="catch_up", catchup_threshold=0, md_predicted_send=False,
                    wan_send_buffer_bytes=1e7, warmup_frac=0.0)
    sim = run_checked(cfg, _recs((1, 5), (1, 8)))
    assert [len(r.md_waiting) for r in sim.reqs] == [0, 0] and [r.handoff_round for r in sim.reqs] == [0, 1]
    assert [r.rld_tokens for r in sim.reqs] == [4, 7] and sim.reqs[1].rld_finished  # RLD ended both


def test_kv_admissions_waiting_on_each_other_are_reported():
    """MD's pool holds the big relayed request's reservation (predicted send) while its prefill
    waits for P's pool, which the seven small P->MD requests hold until MD admits them: nothing can
    move. The run ended with every request unfinished and said nothing; it now says so
    (``ClusterSim.stalled``; ``pdd sim run`` prints it as a warning)."""
    e = SimEngine(kv_pool_tokens=304)
    # the seven small requests go P->MD: a 250 ms budget, and the gateway's plan without the WAN
    # backlog (with it, as the runtime's, they are relayed and finish on RLD: pdd sim run's test)
    cfg = SimConfig(mode="pdd", wan_gbps=0.5, page_tokens=16, tier_engines={"P": e, "RLD": e, "MD": e},
                    warmup_frac=0.0, ttft_budget_ms=250.0, wan_backlog_in_plan=False)
    recs = [{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [10 + i]} for i in range(7)]
    recs.append({"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [99]})
    sim = run_checked(cfg, recs)
    assert [r.finished for r in sim.reqs] == [False] * 8
    assert sim.stalled == ("the simulation stalled at 0.02 s with 8 of 8 requests unfinished, their KV admissions "
                           "waiting on each other: P0 (112 of 304 tokens held, 1 queued), MD0 (301 of 304 tokens "
                           "held, 7 queued); the live engine would refuse them (OutOfPages): give the tiers larger "
                           "KV pools or a lower load")
