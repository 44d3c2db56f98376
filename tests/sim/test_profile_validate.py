"""Measured step model (pdd profile) and the recorded-decision replay of pdd sim validate."""

import json
from pathlib import Path

import numpy as np
import pytest

import pdd.policy.pipeline as pol_pipeline
from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.step_profile import FORMAT, MeasuredStepModel, _features, fit_linear
from pdd.sim.validate import decisions_of, replay_recorded

DATA = Path(__file__).parent / "data"


def _synthetic(coef):
    """A profile whose rows follow the step model exactly."""
    c0, ct, cp, cc, ci, ce = coef

    def t(items):
        n = sum(k for _, k in items)
        pairs = sum(k * (s + (k + 1) / 2) for s, k in items)
        ctx = sum(s + k for s, k in items)
        ext = any(k > 1 and s > 0 for s, k in items)
        return c0 + ct * n + cp * pairs + cc * ctx + ci * len(items) + ce * ext

    return {
        "format": FORMAT, "kv_capacity_tokens": 4096,
        "prefill": [{"tokens": n, "seconds": t([(0, n)])} for n in (16, 64, 256, 512)],
        "decode": [{"batch": b, "context": c, "seconds_per_step": t([(c, 1)] * b)} for b in (1, 4, 16) for c in (64, 1024)],
        "extend": [{"tokens": n, "context": c, "seconds": t([(c, n)])} for n in (8, 128) for c in (256, 2048)],
    }


def test_fit_recovers_a_linear_profile_exactly():
    coef = (0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003)
    prof = _synthetic(coef)
    fitted, mare, maxe = fit_linear(prof)
    assert maxe < 1e-9
    assert [fitted[k] for k in ("const", "tokens", "attn_pairs", "ctx_tokens", "items", "extend")] == pytest.approx(coef)
    m = MeasuredStepModel(prof)
    assert m.kv_capacity_tokens() == 4096
    assert m.decode_time(4, 4 * 1024) == pytest.approx(prof["decode"][3]["seconds_per_step"])
    assert m.prefill_time(100, 300) == pytest.approx(0.002 + 1e-4 * 100 + 5e-8 * 100 * 350.5 + 3e-7 * 400 + 1e-4 + 0.003)


def _bent():
    """A linear profile whose chunk rows (prefill at context 0, extend at 1,024 and 3,072 tokens)
    are each measured a known factor off the linear model."""
    prof = _synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))
    lin = MeasuredStepModel(prof)
    bend = {(16, 0): 1.0, (512, 0): 1.25, (16, 1024): 0.9, (512, 1024): 1.1, (16, 3072): 0.8, (512, 3072): 0.95}
    prof["prefill"] = [{"tokens": n, "seconds": lin.step_time([(0, n)]) * bend[(n, 0)]} for n in (16, 512)]
    prof["extend"] = [{"tokens": n, "context": c, "seconds": lin.step_time([(c, n)]) * bend[(n, c)]}
                      for n in (16, 512) for c in (1024, 3072)]
    return prof, bend


def test_a_chunk_step_keeps_the_measured_prefill_and_extend_rows():
    prof, bend = _bent()
    assert MeasuredStepModel(prof)._chunk_grid is None  # only when asked (chunk_grid)
    m = MeasuredStepModel(prof, chunk_grid=True)
    lin = m._t  # the profile's own linear fit (refitted on the bent rows)
    for r in prof["prefill"]:
        assert m.step_time([(0, r["tokens"])]) == pytest.approx(r["seconds"], rel=1e-12)
    for r in prof["extend"]:
        assert m.step_time([(r["context"], r["tokens"])]) == pytest.approx(r["seconds"], rel=1e-12)
    ratio = {k: next(r["seconds"] for r in prof["prefill" if k[1] == 0 else "extend"]
                     if r["tokens"] == k[0] and r.get("context", 0) == k[1]) / lin(_features([(k[1], k[0])]))
             for k in bend}
    # between the points: bilinear in log2 tokens (90.5 is halfway from 16 to 512) and in context
    assert m.step_time([(2048, 90)]) == pytest.approx(lin(_features([(2048, 90)])) * (
        0.5 * (1 - np.log2(90 / 16) / 5) * (ratio[(16, 1024)] + ratio[(16, 3072)])
        + 0.5 * np.log2(90 / 16) / 5 * (ratio[(512, 1024)] + ratio[(512, 3072)])), rel=1e-12)
    # beyond the grid: held at its edge (more context than 3,072, fewer tokens than 16)
    assert m.step_time([(4000, 8)]) == pytest.approx(lin(_features([(4000, 8)])) * ratio[(16, 3072)], rel=1e-12)
    # two chunks in one step: their new tokens and token-weighted mean context (here 1,024 + 3,072 -> 2,048)
    both = [(1024, 256), (3072, 256)]
    assert m.step_time(both) == pytest.approx(lin(_features(both)) * m._chunk_grid(512, 2048), rel=1e-12)
    # a decode step is not a chunk: the decode grid's, unchanged
    assert m.step_time([(1024, 1)] * 4) == pytest.approx(m.decode_time(4, 4 * 1024))


def test_no_chunk_grid_without_rows_at_every_context():
    prof, _ = _bent()
    prof["extend"] = [r for r in prof["extend"] if not (r["tokens"] == 512 and r["context"] == 3072)]
    m = MeasuredStepModel(prof, chunk_grid=True)
    assert m._chunk_grid is None
    assert m.step_time([(1024, 512)]) == pytest.approx(m._t(_features([(1024, 512)])), rel=1e-12)


def test_fit_refuses_too_few_rows():
    with pytest.raises(ValueError, match="rows"):
        fit_linear({"prefill": [{"tokens": 16, "seconds": 0.01}]})


def test_sim_runs_on_a_measured_profile(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(_synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))))
    cfg = SimConfig(mode="pdd", model="measured", model_spec={"layers": 4, "attn_dim": 256, "kv_bytes_per_token": 2048,
                                                              "weight_bytes": 2e7, "flops_per_token": 8e6},
                    profile_a=str(p), profile_b=str(p), block_tokens=16, wan_gbps=0.05, fast_gbps=4.0,
                    max_batch_tokens=512, prefill_chunk_tokens=512, max_running_seqs=64, ttft_budget_ms=250.0,
                    warmup_frac=0.0)
    recs = [{"timestamp": 500.0 * i, "input_length": 300 + 16 * i, "output_length": 20,
             "hash_ids": list(range(1000 * i, 1000 * i + 19 + i))} for i in range(6)]
    sim = ClusterSim(cfg)
    sim.record_decisions = True
    sim.run(recs)
    assert all(r.finished and r.n_emitted == 20 for r in sim.reqs)
    assert sim.tiers["P"][0].pool == 4096  # the profile's KV pool, not a chip's HBM
    # the first prefill (300 tokens, one chunk, cold) took exactly the model's step time
    r0 = sim.reqs[0]
    assert sim.tiers["P"][0].cm.prefill_time(300) == pytest.approx(
        0.002 + 1e-4 * 300 + 5e-8 * 300 * 150.5 + 3e-7 * 300 + 1e-4)
    # P started at arrival, beside MD's reservation round trip (not after it)
    assert r0.t_prefill_done == pytest.approx(r0.arrival + sim.tiers["P"][0].cm.prefill_time(300))
    # each request's decisions were logged with their inputs
    assert all(decisions_of(sim.decision_log[r.rid])["pipeline"] == r.pipeline.value for r in sim.reqs)


def test_recorded_live_decisions_replay_identically(monkeypatch):
    """Inputs the live gateway / RLD recorded (tests/sim/data/live_decisions.json, from a
    `pdd sim validate` run) give the live results through the simulator's policy calls."""
    entries = json.loads((DATA / "live_decisions.json").read_text())["decisions"]
    kinds = {d["policy"] for d in entries}
    assert kinds == {"pipeline", "handoff"}
    assert {d["result"] for d in entries if d["policy"] == "pipeline"} >= {"p_md", "p_rld_md"}
    ok, tot, bad = replay_recorded(entries)
    assert (ok, bad) == (tot, [])
    # the replay goes through the policy module (a sentinel changes the answers)
    monkeypatch.setattr(pol_pipeline, "choose_pipeline", lambda inp: pol_pipeline.Pipeline.P_RLD)
    ok2, tot2, bad2 = replay_recorded(entries)
    assert ok2 < tot2 and len(bad2) == sum(1 for d in entries if d["policy"] == "pipeline")


def test_measure_profile_on_the_live_engine(tmp_path, tiny_model):
    """`pdd profile`'s measurement on a real (tiny) engine: every requested row, positive
    times, the model's KV bytes as the runtime ships them, a fit the sim can load."""
    from pdd.config import ClusterConfig
    from pdd.sim.profile import measure_profile
    from pdd.step_profile import load

    cfg = ClusterConfig(model_path=tiny_model, model_preset="tiny")
    prof = measure_profile(cfg, prefill_tokens=(8, 32), decode_batches=(1, 2), decode_contexts=(16, 64),
                           extend_tokens=(4,), extend_contexts=(32, 64), reps=1, log=lambda m: None)
    assert [r["tokens"] for r in prof["prefill"]] == [8, 32]
    assert [(r["batch"], r["context"]) for r in prof["decode"]] == [(1, 16), (2, 16), (1, 64), (2, 64)]
    assert [(r["tokens"], r["context"]) for r in prof["extend"]] == [(4, 32), (4, 64)]
    assert all(r.get("seconds", r.get("seconds_per_step")) > 0 for k in ("prefill", "decode", "extend") for r in prof[k])
    m = json.loads((Path(tiny_model) / "config.json").read_text())
    assert prof["model"]["kv_bytes_per_token"] == 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 4
    assert prof["kv_capacity_tokens"] == cfg.engine.num_pages * cfg.engine.page_size
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(prof))
    assert MeasuredStepModel(load(p)).decode_time(2, 128) > 0


def _measured_cfg(p, **kw):
    return SimConfig(mode="pdd", model="measured", model_spec={"layers": 4, "attn_dim": 256, "kv_bytes_per_token": 2048,
                                                               "weight_bytes": 2e7, "flops_per_token": 8e6},
                     profile_a=str(p), profile_b=str(p), block_tokens=16, wan_gbps=0.05, fast_gbps=4.0,
                     max_batch_tokens=512, prefill_chunk_tokens=512, max_running_seqs=64, ttft_budget_ms=250.0,
                     warmup_frac=0.0, **kw)


def test_role_step_overhead_adds_to_every_step(tmp_path):
    """SimConfig.step_overhead_s: a live role's per-step cost beyond the bare engine, added to each
    step of that tier only (a lone cold 300-token prefill: one step)."""
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(_synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))))
    recs = [{"timestamp": 0.0, "input_length": 300, "output_length": 20, "hash_ids": list(range(19))}]
    base = ClusterSim(_measured_cfg(p))
    base.run(recs)
    ovh = ClusterSim(_measured_cfg(p, step_overhead_s={"P": 0.05, "MD": 0.01}))
    ovh.run(recs)
    assert ovh.tiers["P"][0].steps == base.tiers["P"][0].steps == 1
    assert ovh.reqs[0].t_prefill_done - base.reqs[0].t_prefill_done == pytest.approx(0.05)
    assert ovh.tiers["P"][0].busy_s - base.tiers["P"][0].busy_s == pytest.approx(0.05)
    for t in ("RLD", "MD"):
        o, b = ovh.tiers[t][0], base.tiers[t][0]
        if b.steps and t == "MD":
            assert o.busy_s / o.steps > b.busy_s / b.steps
        if t == "RLD" and b.steps:
            assert o.busy_s / o.steps == pytest.approx(b.busy_s / b.steps)


def test_live_role_steps_reads_the_replay_delta():
    from pdd.sim.live_measures import live_role_steps

    entry = {"stats_before": {"instances": {"p0": {"role": "prefill", "engine_steps": 1, "engine_busy_s": 0.01}}},
             "stats": {"instances": {"p0": {"role": "prefill", "engine_steps": 11, "engine_busy_s": 1.01},
                                     "md0": {"role": "main_decode", "engine_steps": 4, "engine_busy_s": 0.2},
                                     "x": {"role": "gateway"}}}}
    got = live_role_steps(entry)
    assert got["P"] == {"steps": 10, "busy_s": pytest.approx(1.0), "mean_step_s": pytest.approx(0.1)}
    assert got["MD"]["mean_step_s"] == pytest.approx(0.05) and set(got) == {"P", "MD"}


def _overhead_fixture(tmp_path):
    """A synthetic profile (written to ``tmp_path``), the default config and 40 requests of
    200-712 prompt tokens and 24 output tokens, 0.7 s apart: (profile dict, its path, config,
    requests)."""
    from types import SimpleNamespace

    from pdd.config import ClusterConfig

    prof = _synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))
    prof["model"] = {"layers": 4, "attn_dim": 256, "kv_bytes_per_token": 2048, "weight_bytes": 2e7,
                     "flops_per_token": 8e6}
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(prof))
    reqs = [SimpleNamespace(arrival_s=0.7 * i, prompt_ids=[0] * (200 + 64 * (i % 9)), max_tokens=24,
                            hash_ids=list(range(100 * i, 100 * i + 13 + 4 * (i % 9)))) for i in range(40)]
    return prof, p, ClusterConfig(), reqs


def test_calibrated_overheads_recover_known_ones(tmp_path):
    """calibrate_role_overheads is a fixed point on the simulated mean step per tier: given the
    step statistics of a run with known per-role overheads, it finds them again."""
    from pdd.sim.calibrate import calibrate_role_overheads
    from pdd.sim.validate import sim_role_steps, simulate

    prof, p, cfg, reqs = _overhead_fixture(tmp_path)
    known = {"P": 0.03, "RLD": 0.004, "MD": 0.008}
    target = sim_role_steps(simulate(cfg, p, prof, 16, reqs, known))
    got, hist = calibrate_role_overheads(cfg, p, prof, 16, reqs, target, iters=12)
    for t in ("P", "MD"):
        assert got[t] == pytest.approx(known[t], rel=0.15, abs=1e-3)
    assert len(hist) >= 2


def test_cut_off_flow_keeps_its_committed_bytes_on_the_line():
    """Line.cancel(f, committed): bytes already written to the sockets still cross the line (ahead
    of a later FIFO flow), delivered to nobody; a flow not yet on the line is dropped whole."""
    from pdd.sim.cluster import Line

    sim = ClusterSim(SimConfig(mode="pdd"))
    line = Line(sim, "wan", 0.008, 0.0, "fifo")  # 1 MB/s
    got = []
    a = line.send("a", 4e6, lambda: got.append(("a", sim.env.now)))
    b = line.send("b", 1e6, lambda: got.append(("b", sim.env.now)))
    sim.env.run(until=1.0)
    assert line.cancel(a, committed=0.5e6) == pytest.approx(2.5e6)  # 3 MB left, 0.5 MB committed
    assert line.cancel(b, committed=0.5e6) is not None
    c = line.send("c", 1e6, lambda: got.append(("c", sim.env.now)))
    sim.env.run(until=10.0)
    assert got == [("c", pytest.approx(2.5))]  # after a's committed 0.5 MB; b never started
    assert line.bytes_sent == pytest.approx(2.5e6)
    assert c.done


def test_client_delay_shifts_first_token_not_tpot(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(_synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))))
    recs = [{"timestamp": 0.0, "input_length": 300, "output_length": 20, "hash_ids": list(range(19))}]
    a = ClusterSim(_measured_cfg(p))
    a.run(recs)
    b = ClusterSim(_measured_cfg(p, client_delay_s=0.006))
    b.run(recs)
    ra, rb = a.reqs[0], b.reqs[0]
    assert rb.t_first - ra.t_first == pytest.approx(0.006)
    assert rb.t_done - rb.t_first == pytest.approx(ra.t_done - ra.t_first)


def test_wan_buffer_fit_never_books_an_unexplained_shortfall(monkeypatch):
    """The allowance is fitted only as far as it changes what the simulated WAN carries."""
    from types import SimpleNamespace

    from pdd.sim import calibrate as C

    def fake(carry):
        def simulate(cfg, profile, prof, block_tokens, requests, overheads, wan_buffer=0.0):
            return SimpleNamespace(wan=SimpleNamespace(bytes_sent=carry(wan_buffer)))
        return simulate

    # no cut-off depends on it: 0, whatever the live shortfall
    monkeypatch.setattr(C, "simulate", fake(lambda b: 100.0))
    assert C.calibrate_wan_buffer(None, None, {}, 16, [], live_bytes=120.0) == (0.0, 100.0)
    # grows with it up to 110 at 8 MiB: the smallest allowance reaching 110, not the cap
    mib = 2 ** 20
    monkeypatch.setattr(C, "simulate", fake(lambda b: 100.0 + 10.0 * min(b, 8 * mib) / (8 * mib)))
    b, c = C.calibrate_wan_buffer(None, None, {}, 16, [], live_bytes=120.0)
    assert c == pytest.approx(110.0) and b == pytest.approx(8 * mib, rel=1e-3)
    # reaches the live bytes at 4 MiB
    b, c = C.calibrate_wan_buffer(None, None, {}, 16, [], live_bytes=105.0)
    assert b == pytest.approx(4 * mib, rel=1e-3) and c == pytest.approx(105.0, rel=1e-6)


def test_live_fast_path_fits_latency_and_rate():
    from pdd.sim.live_measures import live_fast_path

    kvb = 2048

    def rec(tokens, pipeline="p_rld_md", reserved=5.0, ok=True):
        # 3 ms fixed + the prompt's KV at 2 Gbit/s between P's reply (at 50 ms) and the first token
        dt_ms = 3.0 + tokens * kvb * 8 / 2e9 * 1e3
        return {"ok": ok, "prompt_tokens": tokens,
                "pdd": {"pipeline": pipeline, "events_ms": {"md_reserved": reserved, "p_first_token": 50.0,
                                                            "first_token": 50.0 + dt_ms}}}

    recs = [rec(100 * k) for k in range(1, 25)]
    fp = live_fast_path(recs, kvb, max_gbps=4.0)
    assert fp["samples"] == 24
    assert fp["latency_s"] == pytest.approx(0.003) and fp["gbps"] == pytest.approx(2.0)
    # requests that say nothing about the P -> RLD path are left out: P->MD, plan known after P's
    # reply (P waited for its target), failed
    noise = [rec(5000, pipeline="p_md"), rec(5000, reserved=60.0), rec(5000, ok=False)] * 10
    assert live_fast_path(recs + noise, kvb, max_gbps=4.0) == fp
    # never faster than the configured pacing; too few samples: nothing
    assert live_fast_path(recs, kvb, max_gbps=1.0)["gbps"] == 1.0
    assert live_fast_path(recs[:5], kvb, max_gbps=4.0) is None


def test_live_fast_path_alone_keeps_requests_that_had_the_path_to_themselves():
    from pdd.sim.live_measures import live_fast_path

    kvb = 2048

    def rec(send, tokens, extra_ms=0.0):
        # sent at `send` s; P replies 50 ms later; then 1 ms + the KV at 2 Gbit/s (+ extra_ms: it waited)
        dt_ms = 1.0 + tokens * kvb * 8 / 2e9 * 1e3 + extra_ms
        return {"ok": True, "prompt_tokens": tokens, "send_s": send,
                "pdd": {"pipeline": "p_rld_md", "events_ms": {"md_reserved": 5.0, "p_first_token": 50.0,
                                                            "first_token": 50.0 + dt_ms}}}

    alone = [rec(10.0 * k, 100 * k) for k in range(1, 25)]  # 10 s apart: nothing overlaps
    # pairs sent 1 ms apart: each one's KV trip overlaps the other's span, both waited 20 ms more
    pairs = [r for k in range(1, 11) for r in (rec(1000.0 + 10 * k, 300 * k, 20.0),
                                               rec(1000.0 + 10 * k + 0.001, 200 * k, 20.0))]
    fp = live_fast_path(alone + pairs, kvb, max_gbps=4.0, alone=True)
    assert fp["samples"] == 24
    assert fp["latency_s"] == pytest.approx(0.001) and fp["gbps"] == pytest.approx(2.0)
    # over every request the waits go into the fit
    both = live_fast_path(alone + pairs, kvb, max_gbps=4.0)
    assert both["samples"] == 44 and both["latency_s"] > 0.005
    # a request that ended 1 ms before this one's reply still counts as beside it (2 ms lead) ...
    near = rec(2000.0, 400)
    before = rec(2000.0 + 0.050 - 0.001 - 0.060, 100)  # its span ends 1 ms before near's P reply
    before["pdd"]["events_ms"].update(p_first_token=30.0, first_token=60.0)
    got = live_fast_path(alone + [near, before], kvb, max_gbps=4.0, alone=True)
    assert got["samples"] == 24
    # ... one that ended 3 ms before does not
    before["send_s"] -= 0.002
    assert live_fast_path(alone + [near, before], kvb, max_gbps=4.0, alone=True)["samples"] == 25
    # a record without send_s cannot be placed: left out when alone
    nosend = dict(near, send_s=None)
    assert live_fast_path(alone + [nosend], kvb, max_gbps=4.0, alone=True)["samples"] == 24


def test_measured_fast_path_replaces_the_configured_fast_line(tmp_path, monkeypatch):
    """validate.simulate gives the simulator the profile's measured fast path (rate, twice the
    latency as RTT) instead of the configured one; and a relayed request's first token, emitted
    when its KV reaches RLD, comes later by exactly the slower line's extra time."""
    import pdd.sim.validate as V

    p = tmp_path / "prof.json"
    p.write_text(json.dumps(_synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))))
    seen = []
    monkeypatch.setattr(V, "sim_config", lambda *a, **k: _measured_cfg(p).replace(ttft_budget_ms=0.0))
    monkeypatch.setattr(V, "sim_records", lambda reqs: reqs)

    class Capture(ClusterSim):
        def __init__(self, cfg):
            seen.append(cfg)
            super().__init__(cfg)

    monkeypatch.setattr(V, "ClusterSim", Capture)
    recs = [{"timestamp": 0.0, "input_length": 1024, "output_length": 4, "hash_ids": list(range(64))}]
    base = V.simulate(None, p, {}, 16, recs)
    slow = V.simulate(None, p, {"fast_path": {"latency_s": 0.005, "gbps": 0.5}}, 16, recs)
    assert (seen[0].fast_gbps, seen[1].fast_gbps, seen[1].fast_rtt_ms) == (4.0, 0.5, pytest.approx(10.0))
    assert base.reqs[0].pipeline == slow.reqs[0].pipeline == "p_rld_md"
    extra = 1024 * 2048 * 8 * (1 / 0.5e9 - 1 / 4e9) + 0.005 - seen[0].fast_rtt_ms / 2000.0
    assert slow.reqs[0].t_first - base.reqs[0].t_first == pytest.approx(extra, abs=1e-6)


def test_per_request_error():
    from pdd.sim.validate import per_request_error

    # live, sim seconds: errors -0.5, 0, +0.1, +0.2 -> median 0.05, |e| P50 0.15
    e = per_request_error([(0.1, 0.05), (0.2, 0.2), (1.0, 1.1), (0.5, 0.6)])
    assert e["requests"] == 4 and e["median"] == pytest.approx(0.05) and e["abs_p50"] == pytest.approx(0.15)
    assert e["abs_p90"] == pytest.approx(0.41)
    assert per_request_error([]) is None and per_request_error([(0.0, 1.0)]) is None


def test_sim_config_takes_each_datacenters_profile_and_the_wan_dtype(tmp_path):
    """`pdd sim validate` on heterogeneous tiers: A's chip is P's profile, B's is MD's, and the
    simulated WAN carries the KV in the narrower dtype (bf16 MD: half of fp32's 2048 bytes)."""
    import json as _json

    from pdd.config import ClusterConfig
    from pdd.sim.validate import sim_config

    prof = _json.loads(open("data/profiles/this-machine.json").read())
    other = tmp_path / "chip-b.json"
    other.write_text(_json.dumps(prof))
    cfg = ClusterConfig.model_validate({"tiers": {"main_decode": {"engine": {"dtype": "bfloat16", "page_size": 32,
                                                                             "profile": str(other)}}}})
    sc = sim_config(cfg, "data/profiles/this-machine.json", prof, 16)
    assert (sc.profile_a, sc.profile_b, sc.kv_bytes_per_token) == ("data/profiles/this-machine.json", str(other), 1024)
    same = sim_config(ClusterConfig(), "data/profiles/this-machine.json", prof, 16)
    assert (same.profile_a, same.profile_b, same.kv_bytes_per_token) == (
        "data/profiles/this-machine.json", "data/profiles/this-machine.json", None)


def test_role_step_scale_multiplies_the_profile_step_before_the_overhead(tmp_path):
    """SimConfig.step_scale: a role's step is scale x profile step + overhead (a lone cold
    300-token prefill: one P step); other roles keep theirs."""
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(_synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))))
    recs = [{"timestamp": 0.0, "input_length": 300, "output_length": 20, "hash_ids": list(range(19))}]
    base = ClusterSim(_measured_cfg(p))
    base.run(recs)
    both = ClusterSim(_measured_cfg(p, step_scale={"P": 2.5}, step_overhead_s={"P": 0.05}))
    both.run(recs)
    step = base.tiers["P"][0].busy_s
    assert step == pytest.approx(0.002 + 1e-4 * 300 + 5e-8 * 300 * 150.5 + 3e-7 * 300 + 1e-4)
    assert both.tiers["P"][0].busy_s == pytest.approx(2.5 * step + 0.05)
    assert both.reqs[0].t_prefill_done - base.reqs[0].t_prefill_done == pytest.approx(1.5 * step + 0.05)
    for t in ("RLD", "MD"):
        b, o = base.tiers[t][0], both.tiers[t][0]
        if b.steps:
            assert o.busy_s / o.steps == pytest.approx(b.busy_s / b.steps)


class _LinearStep:
    """step_time = 2 ms + 0.1 ms a token (the items' new tokens)."""

    @staticmethod
    def step_time(items):
        return 0.002 + 1e-4 * sum(n for _, n in items)


def _rec(send, prompt, cached, p_first_ms, ok=True):
    return {"ok": ok, "send_s": send, "prompt_tokens": prompt,
            "pdd": {"p_cached_tokens": cached, "events_ms": {"p_first_token": p_first_ms}}}


def test_isolated_prefills_keep_requests_p_served_alone_and_chunk_them():
    from pdd.sim.live_measures import isolated_prefills

    recs = [_rec(0.0, 600, 0, 100.0),        # alone: chunks 512 + 88
            _rec(1.0, 100, 64, 12.4),        # alone: 36 tokens over a 64-token hit
            _rec(2.0, 900, 0, 300.0),        # overlaps the next
            _rec(2.2, 300, 0, 50.0),
            _rec(3.0, 200, 0, 30.0, ok=False),   # failed
            _rec(4.0, 128, 128, 5.0),        # all cached: nothing computed
            {"ok": True, "send_s": 5.0, "prompt_tokens": 50, "pdd": {"events_ms": {}}}]  # no P event
    got = isolated_prefills(recs, _LinearStep, 512)
    assert [(g["tokens"], g["steps"]) for g in got] == [(600, 2), (36, 1)]
    assert got[0]["profile_s"] == pytest.approx(0.002 + 0.0512 + 0.002 + 0.0088)
    assert got[0]["live_s"] == pytest.approx(0.1)
    assert got[1]["profile_s"] == pytest.approx(0.0056)
    assert got[1]["live_s"] == pytest.approx(0.0124)
    # a P interval that is no sample itself (all cached, or no prompt_tokens) still occupies P:
    # the prefill beside it is not alone
    beside = [_rec(0.0, 600, 0, 100.0), _rec(0.05, 128, 128, 5.0)]
    assert isolated_prefills(beside, _LinearStep, 512) == []
    nolen = {**_rec(0.05, 100, 0, 5.0)}
    nolen.pop("prompt_tokens")
    assert isolated_prefills([_rec(0.0, 600, 0, 100.0), nolen], _LinearStep, 512) == []


def test_isolated_prefills_measure_the_share_decoded_beside_them():
    """A prefill's ``decode_busy_frac``: the share of its P interval covered by the union of other
    requests' streaming (client first to last token); overlapping streams count once."""
    from pdd.sim.live_measures import isolated_prefills

    alone = _rec(0.0, 600, 0, 100.0)  # P interval [0, 0.1]
    a = {**_rec(-1.0, 100, 0, 1.0), "token_times_s": [0.02, 0.03, 0.06]}  # streams over [0.02, 0.06]
    b = {**_rec(-1.0, 100, 0, 1.0), "token_times_s": [0.04, 0.08]}  # [0.04, 0.08]: union [0.02, 0.08]
    one = {**_rec(-1.0, 100, 0, 1.0), "token_times_s": [0.05]}  # one token: no stream
    got = isolated_prefills([alone, a, b, one], _LinearStep, 512)
    assert got[0]["decode_busy_frac"] == pytest.approx(0.6)


def test_prefill_beside_decode_fit_recovers_a_known_slow_down():
    """live / profile = 1.5 x (1 + 0.8 x share) exactly: the fit's factor is 1.8, the medians split
    at the given shares; too few prefills give None."""
    from pdd.sim.live_measures import live_prefill_beside_decode

    pre = [{"profile_s": 0.05, "live_s": 0.05 * 1.5 * (1 + 0.8 * f), "decode_busy_frac": f}
           for f in (0.0, 0.0, 0.01, 0.02, 0.1, 0.3, 0.5, 1.0)]
    got = live_prefill_beside_decode(pre)
    assert got["fit"]["factor"] == pytest.approx(1.8, rel=1e-9) and got["fit"]["a"] == pytest.approx(1.5, rel=1e-9)
    assert got["quiet"] == {"n": 4, "median_ratio": pytest.approx(1.5 * (1 + 0.8 * 0.005))}
    assert got["busy"]["n"] == 3 and got["busy"]["median_ratio"] == pytest.approx(1.5 * 1.4)
    assert live_prefill_beside_decode(pre[:7]) is None


def test_fit_quiet_step_recovers_scale_overhead_and_reply_lag():
    """live = 1.5 x profile + 4 ms a step + 20 us a token of the largest step exactly: the fit
    returns all three from the quiet prefills (busy ones, decoded beside, are left out); a
    negative overhead or lag is refitted as 0; too few quiet samples or a non-positive scale give
    None."""
    from pdd.sim.calibrate import fit_quiet_step

    pre = [{"tokens": n, "steps": -(-n // 512), "profile_s": 0.002 * -(-n // 512) + 1e-4 * n, "decode_busy_frac": 0.0}
           for n in (16, 64, 128, 256, 400, 512, 700, 1000, 1500, 2100)]
    exact = [{**r, "live_s": 1.5 * r["profile_s"] + 0.004 * r["steps"] + 2e-5 * min(r["tokens"], 512)} for r in pre]
    busy = [{**r, "decode_busy_frac": 0.5, "live_s": 9 * r["live_s"]} for r in exact[:3]]
    got = fit_quiet_step(exact + busy, 512)
    assert got["scale"] == pytest.approx(1.5, rel=1e-9)
    assert got["overhead_s"] == pytest.approx(0.004, rel=1e-9)
    assert got["lag_s_per_token"] == pytest.approx(2e-5, rel=1e-9)
    assert got["samples"] == 10 and got["mean_abs_rel_err"] == pytest.approx(0.0, abs=1e-9)
    assert fit_quiet_step(exact[:7] + busy, 512) is None  # 7 quiet ones
    # live = 2 x profile - 1 ms a step: the negative overhead is dropped and the rest refitted
    # without it, in relative error (least squares of [profile, tokens] / live against 1)
    neg_live = [2.0 * r["profile_s"] - 0.001 * r["steps"] for r in pre]
    neg = fit_quiet_step([{**r, "live_s": y} for r, y in zip(pre, neg_live)], 512)
    assert neg["overhead_s"] == 0.0 and neg["lag_s_per_token"] >= 0.0
    a = np.array([[r["profile_s"] / y, min(r["tokens"], 512) / y] for r, y in zip(pre, neg_live)])
    (sc, lag), *_ = np.linalg.lstsq(a, np.ones(len(pre)), rcond=None)
    assert lag > 0 and (neg["scale"], neg["lag_s_per_token"]) == (pytest.approx(sc, rel=1e-9), pytest.approx(lag, rel=1e-9))
    assert fit_quiet_step([{**r, "live_s": 0.01 * r["steps"] - 0.1 * r["profile_s"]} for r in pre], 512) is None


def test_p_level_recovers_a_known_factor_on_the_step_shape(tmp_path):
    """calibrate_p_level: given P's mean step of a run simulated with 0.8 x (1.5 x profile + 4 ms),
    the level on the shape (1.5, 4 ms) is found again."""
    from pdd.sim.calibrate import calibrate_p_level
    from pdd.sim.validate import sim_role_steps, simulate

    prof, p, cfg, reqs = _overhead_fixture(tmp_path)
    other = {"RLD": 0.004, "MD": 0.008}
    known = {**prof, "role_step_scale": {"P": 0.8 * 1.5}}
    target = sim_role_steps(simulate(cfg, p, known, 16, reqs, {**other, "P": 0.8 * 0.004}))["P"]["mean_step_s"]
    lam = calibrate_p_level(cfg, p, prof, 16, reqs, target, 1.5, 0.004, other)
    assert lam == pytest.approx(0.8, rel=1e-3)


def test_gateway_rtt_is_the_median_of_the_recorded_pipeline_inputs():
    from pdd.sim.live_measures import live_gateway_rtt_ms

    def rec(rtts, ok=True):
        return {"ok": ok, "pdd": {"decisions": [{"policy": "pipeline", "inputs": {"wan_rtt_ms": r}} for r in rtts]
                                  + [{"policy": "handoff", "inputs": {"tokens_pending": 3}}]}}

    assert live_gateway_rtt_ms([rec([22.0]), rec([24.0, 23.0]), rec([99.0], ok=False), {"ok": True}]) == 23.0
    assert live_gateway_rtt_ms([rec([])]) is None


def test_the_pipeline_decision_reads_the_gateway_rtt_estimate(tmp_path):
    """SimConfig.wan_rtt_estimate_ms replaces the line's RTT in the gateway's pipeline inputs
    only; None leaves wan_rtt_ms."""
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(_synthetic((0.002, 1e-4, 5e-8, 3e-7, 1e-4, 0.003))))
    recs = [{"timestamp": 0.0, "input_length": 300, "output_length": 20, "hash_ids": list(range(19))}]
    got = {}
    for est in (None, 23.5):
        sim = ClusterSim(_measured_cfg(p, wan_rtt_ms=20.0, wan_rtt_estimate_ms=est))
        sim.record_decisions = True
        sim.run(recs)
        got[est] = [d["inputs"]["wan_rtt_ms"] for d in sim.decision_log[sim.reqs[0].rid] if d["policy"] == "pipeline"]
    assert got[None] and set(got[None]) == {20.0}
    assert set(got[23.5]) == {23.5}


def test_wan_backlog_counts_undelivered_transfers_to_the_same_md():
    """ClusterSim._wan_backlog_bytes (the gateway's _wan_backlog_bytes): planned bytes of the other
    transfers to the request's MD not yet delivered nor cut off, less what the line can have
    carried since the oldest of them finished its prefill; delivered and cut-off ones leave the
    set."""
    from types import SimpleNamespace as NS

    sim = ClusterSim(SimConfig(mode="pdd", wan_gbps=0.008))  # 1 MB/s
    sim.env.run(until=1.0)
    kvb = sim.model.kv_bytes_per_token
    md, other = sim.tiers["MD"][0], object()  # bytes at the request's MD's KV size (Instance.kvb)

    def req(**kw):
        base = dict(cut_off=False, wan_flow=None, finished=False, md=md, md_missing=1000, t_prefill_done=None)
        return NS(**{**base, **kw})

    me = req()
    sim.wan_planned = {1: req(t_prefill_done=0.5), 2: req(md_missing=300), 3: req(wan_flow=NS(done=True)),
                       4: req(cut_off=True), 5: req(md=other), 6: me}
    assert sim.wan_gbps_estimate() == pytest.approx(0.008)
    assert sim._wan_backlog_bytes(me) == pytest.approx(1300 * kvb - 0.5e6)
    assert sorted(sim.wan_planned) == [1, 2, 5, 6]


def test_tpot_by_path_groups_requests_by_who_decoded_them():
    from types import SimpleNamespace

    from pdd.sim.validate import tpot_by_path

    def req(rld, md, first, done, n, gap):
        return SimpleNamespace(t_first=first, t_done=done, n_emitted=n, rld_tokens=rld, md_tokens=md, max_gap=gap)

    live = [
        {"ok": True, "token_times_s": [0.0, 0.01, 0.03], "tiers": ["rld"] * 3},  # relay only, both
        {"ok": True, "token_times_s": [0.0, 0.01, 0.05, 0.06], "tiers": ["rld", "rld", "md", "md"]},  # handed over
        {"ok": True, "token_times_s": [0.0, 0.01, 0.02]},  # no per-token tiers: neither
        {"ok": True, "token_times_s": [0.0, 0.01, 0.02], "tiers": ["rld"] * 3},  # the sim handed it over: neither
    ]
    sim = SimpleNamespace(reqs=[req(3, 0, 1.0, 1.02, 3, 0.01), req(2, 2, 1.0, 1.09, 4, 0.05),
                                req(3, 0, 1.0, 1.02, 3, 0.01), req(1, 2, 1.0, 1.02, 3, 0.01)])
    got = tpot_by_path(live, sim)
    assert got["relay_only"]["requests"] == 1 and got["handed_over"]["requests"] == 1
    assert got["relay_only"]["p50_tpot_ms"] == pytest.approx({"live": 15.0, "sim": 10.0})
    assert got["relay_only"]["p50_max_gap_ms"] == pytest.approx({"live": 20.0, "sim": 10.0})
    assert got["handed_over"]["p50_tpot_ms"] == pytest.approx({"live": 20.0, "sim": 30.0})
    assert got["handed_over"]["p50_max_gap_ms"] == pytest.approx({"live": 40.0, "sim": 50.0})
    assert tpot_by_path(live[2:3], SimpleNamespace(reqs=sim.reqs[2:3])) == {"relay_only": {"requests": 0},
                                                                            "handed_over": {"requests": 0}}


def test_isolated_prefills_refuse_a_chunk_below_one_token():
    """A chunk of 0 (or less) tokens would chunk a prompt forever: refused, not a hang."""
    from pdd.sim.live_measures import isolated_prefills

    for bad in (0, -5):
        with pytest.raises(ValueError, match="chunk_tokens"):
            isolated_prefills([_rec(0.0, 600, 0, 100.0)], _LinearStep, bad)


def test_prefill_interference_script_refuses_bad_inputs_in_one_line(tmp_path, capsys):
    """scripts/prefill_interference.py: a bad --chunk-tokens, a --runs directory without a
    manifest (a single run's directory, a file, nothing) and a manifest missing its keys each end
    with exit 2 and one line naming the input, no traceback and no hang."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("prefill_interference",
                                                  root / "scripts" / "prefill_interference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit) as e:
            mod.main(["--chunk-tokens", bad])
        assert e.value.code == 2
        assert "--chunk-tokens: must be at least 1" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "manifest.json").write_text("{}")
    for runs, want in ((tmp_path / "nothing", "not a directory of recorded runs"),
                       (tmp_path / "file", "not a directory of recorded runs"),
                       (root / "data" / "validation" / "seed4", "not a directory of recorded runs"),
                       (tmp_path / "keys", "not a runs manifest")):
        assert mod.main(["--runs", str(runs)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err and str(runs) in err
