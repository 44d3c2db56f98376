"""``pdd sim validate``: one workload through the live topology and through the simulator.

1. The workload: a slice of the Mooncake conversation trace scaled by ``pdd.bench.trace``
   (``block_tokens`` tokens per 512-token trace block, so prompts are long enough that prefill
   compute is most of TTFT on this machine), replayed open-loop at ``rate`` req/s.
2. Live: a fresh ``pdd.launch.Topology`` in pdd mode (the gateway's admission limits off: the
   simulator does not model 429s), one warm-up request, caches flushed, then
   ``pdd.bench.demo.measured_replay`` (the bench client). Each request's usage chunk carries the
   gateway's recorded policy decisions (``pdd.decisions``: inputs and result).
3. Simulated: the same requests (arrival times, prompt lengths, the trace's hash blocks as cache
   blocks, output lengths) on a ``ClusterSim`` mirroring the topology's config (instance
   counts, link rates and RTT, engine batch limits, KV pool, policies), step times from the
   measured profile (``pdd profile``, :class:`pdd.sim.profile.MeasuredStepModel`).
4. Report: TTFT P50/P90 and TPOT P50 of both and their relative errors; the share of requests
   for which both made the same decisions (pipeline; handoff mode of the final round, or no
   handoff); the live decisions' recorded inputs replayed through the simulator's policy calls
   (must all agree: same code); the prefill-compute share of TTFT.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from pdd.sim.cluster import ClusterSim, SimConfig


def sim_records(requests) -> list[dict]:
    """Mooncake-format records (ms timestamps, token lengths, block hash ids) of replay requests."""
    out = []
    for r in requests:
        out.append({"timestamp": r.arrival_s * 1000.0, "input_length": len(r.prompt_ids),
                    "output_length": int(r.max_tokens), "hash_ids": list(r.hash_ids)})
    return out


def sim_config(cfg, profile_path: str | Path, prof: dict, block_tokens: int,
               host_cores: float | None = None) -> SimConfig:
    """A SimConfig mirroring the live ``ClusterConfig`` ``cfg`` (pdd mode). On a CPU topology
    every instance shares this machine's cores (``host_cores``, default ``os.cpu_count()``)."""
    e, link, pol, n = cfg.engine, cfg.link, cfg.policy, cfg.instances
    return SimConfig(
        mode=cfg.mode, model="measured", model_spec={**prof["model"], "max_context": e.max_model_len},
        profile_a=str(profile_path), profile_b=str(profile_path), price_a=0.0, price_b=0.0,
        n_p=n.prefill, n_rld=n.relay_decode, n_md=n.main_decode, n_d=n.relay_decode, n_c=n.prefill,
        wan_gbps=link.wan_gbps, wan_rtt_ms=link.wan_rtt_ms, wan_order=pol.wan_order,
        fast_gbps=link.fast_gbps, fast_rtt_ms=link.fast_rtt_ms,
        max_batch_tokens=e.max_batch_tokens, max_running_seqs=e.max_running,
        prefill_chunk_tokens=e.prefill_chunk_tokens, ttft_budget_ms=pol.pipeline_ttft_budget_ms,
        handoff_mode=pol.handoff_mode, catchup_threshold=pol.catchup_threshold_tokens,
        allow_p_rld=pol.allow_p_rld, cutoff=pol.cutoff, cutoff_min_remaining_s=pol.cutoff_min_remaining_s,
        routing=pol.routing, block_tokens=block_tokens, warmup_frac=0.0, slo_ttft_s=1e9, slo_tpot_s=1e9,
        host_cores=host_cores if host_cores is not None else (0.0 if e.device != "cpu" else float(os.cpu_count() or 1)))


def decisions_of(entries) -> dict:
    """``{"pipeline": result | None, "handoff": mode of the final round | None}`` from a list of
    recorded decisions (live ``pdd.decisions`` or the simulator's log)."""
    pl, ho = None, None
    for d in entries or []:
        if d["policy"] == "pipeline" and pl is None:
            pl = d["result"]
        elif d["policy"] == "handoff" and d["result"].get("final"):
            ho = d["result"]["mode"]
    return {"pipeline": pl, "handoff": ho}


def replay_recorded(entries, sim: ClusterSim | None = None) -> tuple[int, int, list]:
    """Feed recorded decision inputs to the simulator's policy calls; returns (agreeing, total,
    disagreements)."""
    from pdd.policy.handoff import HandoffInputs
    from pdd.policy.pipeline import PipelineInputs

    sim = sim or ClusterSim(SimConfig(mode="pdd"))
    ok, tot, bad = 0, 0, []
    for d in entries:
        tot += 1
        if d["policy"] == "pipeline":
            got = sim.decide_pipeline(PipelineInputs(**d["inputs"])).value
            want = d["result"]
        else:
            dec = sim.decide_handoff(HandoffInputs(**d["inputs"]))
            got = {"mode": dec.mode, "final": dec.final}
            want = {"mode": d["result"]["mode"], "final": d["result"]["final"]}
        if got == want:
            ok += 1
        else:
            bad.append({"decision": d, "sim": got})
    return ok, tot, bad


def _pct(v, p):
    return float(np.percentile(v, p)) if len(v) else None


def _err(sim, live):
    return None if not live or sim is None else sim / live - 1.0


def compare(live_records: list[dict], sim: ClusterSim) -> dict:
    """Metrics of both runs (requests matched by position) and the decision match."""
    lt, lp, st, sp = [], [], [], []
    match = pl_match = n = 0
    mism = []
    recorded = []
    for i, rec in enumerate(live_records):
        req = sim.reqs[i]
        if not rec.get("ok") or not rec.get("token_times_s"):
            continue
        n += 1
        tt = rec["token_times_s"]
        lt.append(tt[0] - rec["send_s"])
        if len(tt) > 1:
            lp.append((tt[-1] - tt[0]) / (len(tt) - 1))
        if req.t_first is not None:
            st.append(req.t_first - req.arrival)
            if req.n_emitted > 1:
                sp.append((req.t_done - req.t_first) / (req.n_emitted - 1))
        live_dec = (rec.get("pdd") or {}).get("decisions") or []
        recorded.extend(live_dec)
        a, b = decisions_of(live_dec), decisions_of(sim.decision_log.get(req.rid))
        pl_match += a["pipeline"] == b["pipeline"]
        if a == b:
            match += 1
        elif len(mism) < 20:
            mism.append({"request": i, "live": a, "sim": b})
    ok, tot, bad = replay_recorded(recorded, sim)
    out = {
        "requests_compared": n,
        "live": {"p50_ttft_ms": _pct(lt, 50) * 1e3, "p90_ttft_ms": _pct(lt, 90) * 1e3,
                 "p50_tpot_ms": _pct(lp, 50) * 1e3 if lp else None},
        "sim": {"p50_ttft_ms": _pct(st, 50) * 1e3, "p90_ttft_ms": _pct(st, 90) * 1e3,
                "p50_tpot_ms": _pct(sp, 50) * 1e3 if sp else None},
        "decision_match_share": match / n if n else None,
        "pipeline_match_share": pl_match / n if n else None,
        "mismatches": mism,
        "recorded_inputs_replayed": {"decisions": tot, "identical": ok, "differing": bad[:10]},
    }
    for k in ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms"):
        out[f"err_{k}"] = _err(out["sim"][k], out["live"][k])
    return out


def compute_share(sim: ClusterSim, live_records: list[dict]) -> float:
    """Prefill compute of each request alone (measured step model, the engine's chunks over its
    live P-cached prefix) over its live TTFT, summed over requests."""
    cm = sim.tiers["P"][0].cm
    chunk = sim.cfg.prefill_chunk_tokens
    num = den = 0.0
    for i, rec in enumerate(live_records):
        if not rec.get("ok") or not rec.get("token_times_s"):
            continue
        cached = int((rec.get("pdd") or {}).get("p_cached_tokens") or 0)
        s0, t = cached, 0.0
        prompt = rec["prompt_tokens"] or len(sim.reqs[i].blocks)
        while s0 < prompt:
            k = min(chunk, prompt - s0)
            t += cm.step_time([(s0, k)])
            s0 += k
        num += t
        den += rec["token_times_s"][0] - rec["send_s"]
    return num / den if den else 0.0


def _free_port_block(n: int = 100) -> int:
    import random
    import socket

    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        try:
            for p in range(base, base + n):
                with socket.socket() as sk:
                    sk.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports for the topology")


def run_validate(out: str | Path, config=None, *, n_requests: int = 220, rate: float = 2.0,
                 block_tokens: int = 64, budget_ms: float = 250.0, session_sample: int = 50,
                 profile: str | Path | None = None, seed: int = 0, console=None) -> dict:
    """Run both and write ``out/validate.json`` (+ ``requests.jsonl``, ``profile.json``)."""
    from rich.console import Console

    from pdd.bench.client import run_one_sync
    from pdd.bench.demo import DEFAULT_SCALE, ensure_model, fit_scale, measured_replay
    from pdd.bench.report import write_jsonl
    from pdd.bench.trace import DEFAULT_TRACE, Scale, TokenSpace, block_token_ids, build_requests
    from pdd.config import ClusterConfig
    from pdd.launch import Topology
    from pdd.sim import profile as P

    console = console or Console(stderr=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config or ClusterConfig()
    if config is None:  # the default ports may be taken (another topology): pick a free block
        base = _free_port_block()
        cfg = cfg.model_copy(update={"base_port": base, "gateway_port": base + 95})
    # the simulator has no gateway admission control: turn the gateway's 429 limits off so that
    # every request runs (a refused turn would also leave the caches unlike the simulator's)
    cfg = cfg.model_copy(update={"mode": "pdd", "policy": cfg.policy.model_copy(
        update={"pipeline_ttft_budget_ms": budget_ms}), "limits": cfg.limits.model_copy(
        update={"max_queue_wait_s": 0.0, "max_queued_prompt_tokens": 0})})
    ensure_model(cfg, console)
    t0 = time.time()
    if profile is None:
        console.print("measuring the engine's step times (pdd profile) ...")
        prof = P.measure_profile(cfg, log=lambda m: None)
        profile = out / "profile.json"
        Path(profile).write_text(json.dumps(prof, indent=1))
    prof = P.load(profile)
    tokens = TokenSpace.from_model(cfg.model_path)
    import dataclasses

    scale = dataclasses.replace(DEFAULT_SCALE, block_tokens=block_tokens, target_rate_rps=rate,
                                session_sample=session_sample)
    scale = fit_scale(scale, cfg, n_requests, 0)
    requests = build_requests(DEFAULT_TRACE, scale, tokens, seed)
    console.print(f"{len(requests)} requests, prompts mean {np.mean([len(r.prompt_ids) for r in requests]):.0f} "
                  f"tokens, outputs mean {np.mean([r.max_tokens for r in requests]):.0f}, {rate} req/s")
    t_live = time.time()
    with Topology(cfg, log_dir=out / "logs") as topo:
        warm = block_token_ids((1 << 65) + seed, 2 * cfg.engine.page_size + 3, tokens, seed)
        run_one_sync(topo.url, warm, 4, model=cfg.served_model_name, timeout_s=120.0)
        topo.flush()
        records, entry = measured_replay(topo, requests, model=cfg.served_model_name, mode="pdd",
                                         timeout_s=cfg.request_timeout_s, progress=False, console=console)
    live = [r.to_dict() for r in records]
    live_s = time.time() - t_live
    write_jsonl(out / "requests.jsonl", live)
    (out / "server_stats.json").write_text(json.dumps(entry, indent=1, default=str))
    scfg = sim_config(cfg, profile, prof, block_tokens)
    sim = ClusterSim(scfg)
    sim.record_decisions = True
    t_sim = time.time()
    sim.run(sim_records(requests))
    sim_s = time.time() - t_sim
    res = {
        "workload": {"requests": len(requests), "rate_rps": rate, "block_tokens": block_tokens,
                     "session_sample": session_sample,
                     "prompt_tokens_mean": float(np.mean([len(r.prompt_ids) for r in requests])),
                     "output_tokens_mean": float(np.mean([r.max_tokens for r in requests]))},
        "config": {"pipeline_ttft_budget_ms": budget_ms, "wan_gbps": cfg.link.wan_gbps,
                   "wan_rtt_ms": cfg.link.wan_rtt_ms, "instances": cfg.instances.model_dump(),
                   "engine": cfg.engine.model_dump()},
        "profile": {"path": str(profile), "fit": prof.get("fit"), "machine": prof.get("machine")},
        **compare(live, sim),
        "compute_share_of_ttft": compute_share(sim, live),
        "live_failed": sum(1 for r in live if not r.get("ok")),
        "live_wall_s": live_s, "sim_wall_s": sim_s, "wall_s": time.time() - t0,
        "sim_pipelines": dict(sim.pipelines), "sim_handoffs": dict(sim.handoffs),
    }
    (out / "validate.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def format_validate(res: dict) -> str:
    from pdd.sim.report import table

    rows = []
    for k, name in (("p50_ttft_ms", "TTFT P50 ms"), ("p90_ttft_ms", "TTFT P90 ms"), ("p50_tpot_ms", "TPOT P50 ms")):
        rows.append({"metric": name, "live": res["live"][k], "sim": res["sim"][k], "rel_err": res[f"err_{k}"]})
    rows.append({"metric": "decision match (pipeline + handoff)", "live": None, "sim": None,
                 "rel_err": res["decision_match_share"]})
    rows.append({"metric": "pipeline match", "live": None, "sim": None, "rel_err": res["pipeline_match_share"]})
    rep = res["recorded_inputs_replayed"]
    return (table(rows, ["metric", "live", "sim", "rel_err"])
            + f"\nrecorded inputs replayed through the sim's policy calls: {rep['identical']}/{rep['decisions']} "
              f"identical\ncompute share of TTFT {res['compute_share_of_ttft']:.0%}; "
              f"{res['requests_compared']} requests compared, {res['live_failed']} live failures; live "
              f"{res['live_wall_s']:.0f} s, sim {res['sim_wall_s']:.2f} s")
