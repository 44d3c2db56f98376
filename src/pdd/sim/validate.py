"""``pdd sim validate``: one workload through the live topology and through the simulator.

This module is the simulator's half and the comparison; the live run is
``pdd.bench.live_validate`` (the bench client), which passes itself in as ``live_run``.

1. The workload: a slice of the Mooncake conversation trace scaled by ``pdd.workload.replay``
   (``block_tokens`` tokens per 512-token trace block, so prompts are long enough that prefill
   compute is most of TTFT on this machine), replayed open-loop at ``rate`` req/s.
2. Live: a fresh ``pdd.launch.Topology`` in pdd mode (the gateway's admission limits off: the
   simulator does not model 429s), one warm-up request, caches flushed, then the bench
   client's measured replay (``pdd.bench.live_validate``). Each request's usage chunk carries the
   gateway's recorded policy decisions (``pdd.decisions``: inputs and result).
3. Simulated: the same requests (arrival times, prompt lengths, the trace's hash blocks as cache
   blocks, output lengths) on a ``ClusterSim`` mirroring the topology's config (instance
   counts, link rates and RTT, each tier's own engine block: batch limits, step floor, KV page
   and pool, the KV size of transfers to it; policies), step times from the measured profile
   (``pdd profile``, :class:`pdd.step_profile.MeasuredStepModel`).
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
from pdd.sim.sim_config import SIM_ROLE, in_range, with_live_fit
from pdd.sim.runtime_engines import sim_engine_fields
from pdd.sim.live_measures import live_role_steps, live_wan_payload_bytes
from pdd.sim.recorded import (RecordedRunError, check_same_engines, check_same_requests, check_same_run, faults_text,
                              load_profile_checked, read_run, require_completed, run_faults)
from pdd.sim.uncertainty import error_intervals
from pdd.sim.ttft_phases import format_ttft_phases, ttft_phases
from pdd.topology import free_port_block
from pdd.workload.replay import Scale

# The workload's scale before build_workload's arguments (block tokens, rate, sessions, output
# cap) are applied: the demo's scale when validation was calibrated, fixed here so that a
# recorded run's workload is rebuilt identically (pdd sim calibrate-roles, --live-from).
VALIDATE_SCALE = Scale(block_tokens=16, output_scale=1 / 2, min_output_tokens=16, max_output_tokens=320,
                       target_rate_rps=2.0, session_sample=100)


def as_sent(requests, live_records: list[dict]) -> list:
    """The replay requests at the times the live client sent them: each request's ``arrival_s``
    replaced by its live record's ``send_s`` (seconds, the same origin; records matched by
    position, a record without ``send_s`` keeps the schedule's). About a fifth of a trace slice's
    requests share their scheduled instant with another one (a conversation's turns replayed
    together); the live client sends them in an order of its own, a millisecond or two apart,
    and P prefills them in the order they arrive. Simulated on the schedule, such a tie goes in
    index order instead, and the two requests' TTFTs can swap (one waits a whole prefill for the
    other): the simulator is judged on the requests the live system received."""
    import dataclasses

    out = []
    for r, rec in zip(requests, live_records):
        t = rec.get("send_s") if isinstance(rec, dict) else None
        out.append(dataclasses.replace(r, arrival_s=float(t)) if isinstance(t, (int, float)) else r)
    return out + list(requests[len(out):])


def sim_records(requests) -> list[dict]:
    """Mooncake-format records (ms timestamps, token lengths, block hash ids) of replay requests."""
    out = []
    for r in requests:
        out.append({"timestamp": r.arrival_s * 1000.0, "input_length": len(r.prompt_ids),
                    "output_length": int(r.max_tokens), "hash_ids": list(r.hash_ids)})
    return out


def sim_tier_engines(cfg, base: dict, block_tokens: int, wire_kvb, profile_path) -> dict:
    """``SimConfig.tier_engines`` mirroring ``cfg``'s ``tiers`` (pdd mode): for P, RLD and MD the
    fields of its tier's effective engine (``ClusterConfig.engine_for``) that differ from
    ``base`` (the top-level ones the SimConfig carries), its KV pool always (the live pool, not
    the one the step profile was measured with); for each instance (``MD1``) what its own
    block changes over its tier's. ``wire_kvb(dtype)``: bytes a token of P's KV carries to a
    tier of that dtype. A tier's ``profile`` other than P's (RLD's; an instance's own) is that
    role's step model (``profile_path`` when it has none); MD's is SimConfig.profile_b."""
    out = {}
    ep = cfg.engine_for("prefill")
    from pdd.topology import layout

    lay = layout(cfg)
    for tier, role in SIM_ROLE.items():
        et = cfg.engine_for(tier)
        kvb = base["kv_bytes_per_token"] if role == "P" else wire_kvb(et.dtype)  # P receives no KV
        own = sim_engine_fields(et, block_tokens, kvb)
        entry = {k: v for k, v in own.items() if k == "kv_pool_tokens" or v != base[k]}
        if role == "RLD" and et.profile != ep.profile:  # RLD runs on chip A's side: P's profile unless its own
            entry["profile"] = str(et.profile or profile_path)
        out[role] = entry
        for i, spec in enumerate(lay.by_role(tier)):  # the runtime's p0.., rld0.., md0..
            ei = cfg.engine_for(spec.name)
            if ei is et:
                continue
            mine = sim_engine_fields(ei, block_tokens, base["kv_bytes_per_token"] if role == "P"
                                      else wire_kvb(ei.dtype))
            diff = {k: v for k, v in mine.items() if v != own[k]}
            if ei.profile != et.profile:
                diff["profile"] = str(ei.profile or profile_path)
            if diff:
                out[f"{role}{i}"] = diff
    return out


def sim_config(cfg, profile_path: str | Path, prof: dict, block_tokens: int,
               host_cores: float | None = None, profile_b: str | Path | None = None) -> SimConfig:
    """A SimConfig mirroring the live ``ClusterConfig`` ``cfg`` (pdd mode). On a CPU topology
    every instance shares this machine's cores (``host_cores``, default ``os.cpu_count()``).
    Heterogeneous tiers (``cfg.tiers``): datacenter A's chip is P's ``profile`` and B's is MD's
    (each defaulting to ``profile_path``; ``profile_b``, when given, is MD's for the simulator
    alone: the live tier is not held to it), the KV crosses the WAN in the narrower of P's and
    MD's dtypes and the fast path in the narrower of P's and RLD's (``pdd.transfer.layout``), and
    each tier's (and instance's) simulated engine runs its own effective engine block: batch
    limits, prefill order, step floor, KV page and pool (:func:`sim_tier_engines`)."""
    from pdd.transfer.layout import DTYPE_BYTES, wire_dtype
    from pdd.sim.sim_config import runtime_wan_fields

    e, link, pol, n = cfg.engine, cfg.link, cfg.policy, cfg.instances
    ep, emd = cfg.engine_for("prefill"), cfg.engine_for("main_decode")
    kvb = int(prof["model"]["kv_bytes_per_token"])
    per_elem = DTYPE_BYTES[prof.get("engine", {}).get("dtype", "float32")]

    def wire_kvb(dtype: str) -> int:  # bytes a token of P's KV carries to a tier of that dtype
        return kvb // per_elem * DTYPE_BYTES[wire_dtype(ep.dtype, dtype)]

    wan_kvb = wire_kvb(emd.dtype)
    base = dict(max_batch_tokens=e.max_batch_tokens, prefill_chunk_tokens=e.prefill_chunk_tokens,
                max_running_seqs=e.max_running, prefill_order=e.prefill_order, min_step_s=e.min_step_ms / 1000.0,
                page_tokens=ep.page_size if block_tokens % ep.page_size == 0 else block_tokens,
                kv_bytes_per_token=wan_kvb)
    return SimConfig(
        mode=cfg.mode, model="measured", model_spec={**prof["model"], "max_context": e.max_model_len},
        kv_bytes_per_token=wan_kvb if wan_kvb != kvb else None,
        profile_a=str(ep.profile or profile_path), profile_b=str(profile_b or emd.profile or profile_path), price_a=0.0,
        price_b=0.0,
        n_p=n.prefill, n_rld=n.relay_decode, n_md=n.main_decode, n_d=n.relay_decode, n_c=n.prefill,
        **runtime_wan_fields(cfg),  # line rate, RTT, loss, cross traffic, send order, kv_stream
        fast_gbps=link.fast_gbps, fast_rtt_ms=link.fast_rtt_ms,
        max_batch_tokens=e.max_batch_tokens, max_running_seqs=e.max_running,
        prefill_chunk_tokens=e.prefill_chunk_tokens, prefill_order=e.prefill_order, min_step_s=e.min_step_ms / 1000.0,
        tier_engines=sim_tier_engines(cfg, base, block_tokens, wire_kvb, profile_path),
        ttft_budget_ms=pol.pipeline_ttft_budget_ms,
        handoff_mode=pol.handoff_mode, catchup_threshold=pol.catchup_threshold_tokens,
        allow_p_rld=pol.allow_p_rld, md_predicted_send=pol.md_predicted_send, early_handoff=pol.early_handoff,
        md_wait_claims=pol.md_wait_claims, md_load_cap=pol.md_load_cap,
        load_slack=pol.load_slack, md_load_slack=pol.md_load_slack,
        cutoff=pol.cutoff, cutoff_min_remaining_s=pol.cutoff_min_remaining_s,
        cutoff_max_sent_fraction=pol.cutoff_max_sent_fraction,
        routing=pol.routing, wan_estimate=pol.wan_estimate, block_tokens=block_tokens,
        # the bytes a cut-off cannot recall are the live-run fit's measurement
        # (calibrate.calibrate_wan_buffer, applied by with_live_fit), none without one: the
        # calibration is fitted on that, not on the runtime's nominal send buffer
        wan_send_buffer_bytes=0.0,
        page_tokens=ep.page_size if block_tokens % ep.page_size == 0 else None, warmup_frac=0.0, slo_ttft_s=1e9, slo_tpot_s=1e9,
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


def live_tpot_s(token_times_s: list[float]) -> float | None:
    """A live request's TPOT (s): its first to last token over the tokens after the first
    (the client's times, ``token_times_s``); None with fewer than two tokens."""
    tt = token_times_s
    return (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None


def sim_tpot_s(req) -> float | None:
    """A simulated request's TPOT (s), as :func:`live_tpot_s`; None with fewer than two tokens
    or none at all."""
    return (req.t_done - req.t_first) / (req.n_emitted - 1) if req.t_first is not None and req.n_emitted > 1 else None


def compare(live_records: list[dict], sim: ClusterSim) -> dict:
    """Metrics of both runs (requests matched by position) and the decision match; ``err_ci``:
    each percentile error's 95% paired-bootstrap interval over the requests both completed
    (:func:`pdd.sim.uncertainty.error_intervals`)."""
    lt, lp, st, sp = [], [], [], []
    pairs: list[tuple[float, float]] = []  # (live, sim) TTFT of each request both completed
    tpot_pairs: list[tuple[float, float]] = []  # (live, sim) TPOT of each request both decoded past its first token
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
            lp.append(live_tpot_s(tt))
        if req.t_first is not None:
            st.append(req.t_first - req.arrival)
            pairs.append((tt[0] - rec["send_s"], req.t_first - req.arrival))
            if req.n_emitted > 1:
                sp.append(sim_tpot_s(req))
                if len(tt) > 1:
                    tpot_pairs.append((live_tpot_s(tt), sim_tpot_s(req)))
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
                 "p99_ttft_ms": _pct(lt, 99) * 1e3, "p50_tpot_ms": _pct(lp, 50) * 1e3 if lp else None},
        "sim": {"p50_ttft_ms": _pct(st, 50) * 1e3, "p90_ttft_ms": _pct(st, 90) * 1e3,
                "p99_ttft_ms": _pct(st, 99) * 1e3, "p50_tpot_ms": _pct(sp, 50) * 1e3 if sp else None},
        "decision_match_share": match / n if n else None,
        "pipeline_match_share": pl_match / n if n else None,
        "mismatches": mism,
        "recorded_inputs_replayed": {"decisions": tot, "identical": ok, "differing": bad[:10]},
    }
    for k in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms"):
        out[f"err_{k}"] = _err(out["sim"][k], out["live"][k])
    out["ttft_error_per_request"] = per_request_error(pairs)
    # what the errors above could have been with other requests of the same workload
    out["err_ci"] = error_intervals(pairs, tpot_pairs)
    out["tpot_by_path"] = tpot_by_path(live_records, sim)
    out["ttft_phases"] = ttft_phases(live_records, sim)
    return out


def tpot_by_path(live_records: list[dict], sim: ClusterSim) -> dict:
    """Where a TPOT error comes from: the requests both decoded on RLD alone (``relay_only``:
    every live token from ``"rld"``, no simulated MD token) and those both handed over
    (``handed_over``: tokens from RLD then MD in each), each with its count, TPOT P50 live and
    simulated (ms), and each request's longest token gap, P50 live and simulated (ms: for a
    handed-over request, most often the switch from RLD's last token to MD's first). Records
    without per-token ``tiers`` count for neither. Requests matched by position; both need >= 3
    tokens."""
    groups: dict[str, dict[str, list[float]]] = {"relay_only": {}, "handed_over": {}}
    for i, rec in enumerate(live_records):
        tt, tiers, req = rec.get("token_times_s") or [], rec.get("tiers"), sim.reqs[i]
        if not rec.get("ok") or len(tt) < 3 or not isinstance(tiers, list) or len(tiers) != len(tt) \
                or req.t_first is None or req.n_emitted < 3:
            continue
        kinds = set(tiers)
        if kinds == {"rld"} and req.md_tokens == 0:
            g = groups["relay_only"]
        elif kinds == {"rld", "md"} and req.rld_tokens > 0 and req.md_tokens > 0:
            g = groups["handed_over"]
        else:
            continue
        for k, v in (("live_tpot", live_tpot_s(tt)), ("sim_tpot", sim_tpot_s(req)),
                     ("live_gap", max(b - a for a, b in zip(tt, tt[1:]))), ("sim_gap", req.max_gap)):
            g.setdefault(k, []).append(v)
    return {name: {"requests": len(g.get("live_tpot", [])),
                   **({"p50_tpot_ms": {"live": _pct(g["live_tpot"], 50) * 1e3, "sim": _pct(g["sim_tpot"], 50) * 1e3},
                       "p50_max_gap_ms": {"live": _pct(g["live_gap"], 50) * 1e3, "sim": _pct(g["sim_gap"], 50) * 1e3}}
                      if g else {})}
            for name, g in groups.items()}


def error_distribution(errors) -> dict | None:
    """Per-request relative errors ``e`` (dimensionless): the median (the bias), P50 / P90 / P99 of
    ``|e|`` and the shares of requests with ``|e|`` within 5%, 10% and 25%. None when empty."""
    e = np.asarray(list(errors), dtype=float)
    if e.size == 0:
        return None
    a = np.abs(e)
    return {"requests": int(e.size), "median": float(np.median(e)),
            "abs_p50": float(np.percentile(a, 50)), "abs_p90": float(np.percentile(a, 90)),
            "abs_p99": float(np.percentile(a, 99)),
            "within_5pct": float(np.mean(a <= 0.05)), "within_10pct": float(np.mean(a <= 0.10)),
            "within_25pct": float(np.mean(a <= 0.25))}


def per_request_error(pairs: list[tuple[float, float]]) -> dict | None:
    """Request by request, ``(sim - live) / live`` of TTFT over ``(live, sim)`` pairs (seconds),
    as ``error_distribution``: its median (the bias), the P50 / P90 / P99 of its absolute value
    and the shares within 5 / 10 / 25%. A percentile's error compares two distributions at one
    point, where a steep or two-humped CDF turns a few ms per request into tens of percent; this
    one compares each request with itself. None without pairs."""
    return error_distribution((s - lv) / lv for lv, s in pairs if lv > 0)


def compute_share(sim: ClusterSim, live_records: list[dict], overhead_s: float = 0.0, scale: float = 1.0) -> float:
    """Prefill compute of each request alone (measured step model, the engine's chunks over its
    live P-cached prefix, each chunk x ``scale`` + ``overhead_s``) over its live TTFT, summed over
    requests."""
    cm = sim.tiers["P"][0].cm
    chunk = sim.tiers["P"][0].chunk_tokens  # P's own (its tier's engine block)
    num = den = 0.0
    for i, rec in enumerate(live_records):
        if not rec.get("ok") or not rec.get("token_times_s"):
            continue
        cached = int((rec.get("pdd") or {}).get("p_cached_tokens") or 0)
        s0, t = cached, 0.0
        prompt = rec.get("prompt_tokens") or sim.reqs[i].prompt  # the record's is its request's (check_same_requests)
        while s0 < prompt:
            k = min(chunk, prompt - s0)
            t += cm.step_time([(s0, k)]) * scale + overhead_s
            s0 += k
        num += t
        den += rec["token_times_s"][0] - rec["send_s"]
    return num / den if den else 0.0


# a recorded run's validate.json without config.cutoff_max_sent_fraction ran before that rule: the
# cut-off read the remaining time alone (policy.cutoff_max_sent_fraction 1)
RECORDED_BEFORE_SENT_FRACTION = 1.0


def validate_config(config=None, budget_ms: float = 250.0, recorded: dict | None = None):
    """The live topology's config for validation: pdd mode, the pipeline budget, and the gateway's
    429 limits off (the simulator has no admission control; a refused turn would also leave the
    caches unlike the simulator's). Without ``config``, the embedded topology on free ports.
    ``recorded``: a recorded run's ``validate.json`` ``config``, whose policy it re-simulates (its
    ``cutoff_max_sent_fraction``; :data:`RECORDED_BEFORE_SENT_FRACTION` when it has none)."""
    from pdd.config import ClusterConfig

    cfg = config or ClusterConfig()
    if config is None:  # the default ports may be taken (another topology): pick a free block
        base = free_port_block()
        cfg = cfg.model_copy(update={"base_port": base, "gateway_port": base + 95})
    pol = {"pipeline_ttft_budget_ms": budget_ms}
    if recorded is not None:
        frac = recorded.get("cutoff_max_sent_fraction", RECORDED_BEFORE_SENT_FRACTION)
        if not in_range(frac, 0, 1, closed_hi=True):
            raise RecordedRunError(f"validate.json: config.cutoff_max_sent_fraction must be a number in [0, 1], "
                                   f"not {frac!r}")
        pol["cutoff_max_sent_fraction"] = float(frac)
    return cfg.model_copy(update={"mode": "pdd", "policy": cfg.policy.model_copy(update=pol),
                                  "limits": cfg.limits.model_copy(
                                      update={"max_queue_wait_s": 0.0, "max_queued_prompt_tokens": 0})})


def build_workload(cfg, *, n_requests: int, rate: float, block_tokens: int, session_sample: int,
                   session_seed: int = 0, max_output_tokens: int | None = None, seed: int = 0, tokens=None):
    """The replay requests (deterministic in the arguments): a Mooncake conversation-trace slice,
    1 in ``session_sample`` conversations chosen by ``session_seed``, ``block_tokens`` per block.
    ``tokens``: the ``TokenSpace`` prompts are drawn from (default: the config's model's; which
    trace records are used, ``ReplayRequest.idx``, does not depend on it)."""
    import dataclasses

    from pdd.workload.replay import DEFAULT_TRACE, TokenSpace, build_requests, fit_scale

    scale = dataclasses.replace(VALIDATE_SCALE, block_tokens=block_tokens, target_rate_rps=rate,
                                session_sample=session_sample, session_seed=session_seed)
    if max_output_tokens is not None:
        scale = dataclasses.replace(scale, max_output_tokens=max_output_tokens,
                                    min_output_tokens=min(scale.min_output_tokens, max_output_tokens))
    scale = fit_scale(scale, cfg, n_requests, 0)
    return build_requests(DEFAULT_TRACE, scale, tokens or TokenSpace.from_model(cfg.model_path), seed), scale


def sim_role_steps(sim: ClusterSim) -> dict:
    out = {}
    for tier in ("P", "RLD", "MD"):
        insts = sim.tiers.get(tier, [])
        n = sum(i.steps for i in insts)
        busy = sum(i.busy_s for i in insts)
        out[tier] = {"steps": n, "busy_s": busy, "mean_step_s": busy / n if n else None}
    return out


def simulate(cfg, profile, prof: dict, block_tokens: int, requests, overheads: dict | None = None,
             wan_buffer: float | None = None, profile_b: str | Path | None = None) -> ClusterSim:
    """The requests on the simulator mirroring ``cfg``, with the profile's live-run corrections:
    per-role step factors (``role_step_scale``), ``overheads`` (seconds a step, by role), the WAN
    buffer (``wan_buffer``, else the profile's), client delay and fast path; ``profile_b``: MD's
    step profile when its tier runs other engine settings (:func:`sim_config`)."""
    scfg = sim_config(cfg, profile, prof, block_tokens, profile_b=profile_b).replace(wan_backlog_in_plan=True)
    scfg = with_live_fit(scfg, prof, overheads or {}, wan_buffer)  # no overheads given: none (a fit in the making)
    sim = ClusterSim(scfg)
    sim.record_decisions = True
    sim.run(sim_records(requests))
    return sim


def run_validate(out: str | Path, config=None, *, n_requests: int = 220, rate: float = 2.0,
                 block_tokens: int = 64, budget_ms: float = 250.0, session_sample: int = 50,
                 session_seed: int = 0, max_output_tokens: int | None = None,
                 profile: str | Path | None = None, seed: int = 0, live_from: str | Path | None = None,
                 live_run=None, console=None, profile_b: str | Path | None = None, before_model=None) -> dict:
    """Run both and write ``out/validate.json`` (+ ``profile.json`` when it measured one).
    ``live_from``: reuse that directory's live run (its ``requests.jsonl`` and
    ``server_stats.json``, same workload arguments) and only re-simulate. Otherwise
    ``live_run(cfg, requests, out, seed, console) -> (records, server_stats)`` runs the workload
    on the live topology and writes ``out/requests.jsonl`` and ``out/server_stats.json``
    (``pdd.bench.live_validate.live_run``: per-request record dicts, and the gateway's stats
    before and after as one dict); the model directory must exist by the time the workload is
    built: ``before_model(cfg)``, when given, is called with the live topology's config once the
    ``live_from`` run and the profiles are read and checked, before anything needs the model
    (``pdd.bench.live_validate.run_validate`` makes it there). The profile's
    ``role_step_overhead_s`` (``pdd sim calibrate-roles``, from another run) is applied.
    Raises ValueError when neither ``live_from`` nor ``live_run`` is given;
    :class:`RecordedRunError` for a ``live_from`` directory or ``profile`` / ``profile_b`` it
    cannot read (before ``before_model`` and before the profile is measured; each is read once,
    here); :class:`WorkloadMismatch` when the reused run is not the workload's (its validate.json's
    workload arguments or pipeline budget differ, or its request count)."""
    from rich.console import Console

    from pdd.sim import profile as P

    if live_from is None and live_run is None:
        raise ValueError("run_validate needs live_from (a recorded run) or live_run (pdd.bench.live_validate)")
    # a reused run and a given profile are read first: a bad one fails before the profile is measured
    recorded = read_run(live_from, need_validate=False) if live_from is not None else None
    prof = load_profile_checked(profile) if profile is not None else None
    if profile_b is not None:
        try:
            load_profile_checked(profile_b)
        except RecordedRunError as e:
            raise RecordedRunError(str(e), "profile_b") from None
    console = console or Console(stderr=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rec_cfg = None if recorded is None or recorded[0] is None else recorded[0].get("config") or {}
    cfg = validate_config(config, budget_ms, rec_cfg)
    if before_model is not None:
        before_model(cfg)
    t0 = time.time()
    if prof is None:
        console.print("measuring the engine's step times (pdd profile) ...")
        profile = out / "profile.json"
        Path(profile).write_text(json.dumps(P.measure_profile(cfg, log=lambda m: None), indent=1))
        prof = load_profile_checked(profile)  # as a given profile is read
    requests, scale = build_workload(cfg, n_requests=n_requests, rate=rate, block_tokens=block_tokens,
                                     session_sample=session_sample, session_seed=session_seed,
                                     max_output_tokens=max_output_tokens, seed=seed)
    if recorded is not None and recorded[0] is not None:
        check_same_run(recorded[0], {
            "workload": {"requests": len(requests), "rate_rps": rate, "block_tokens": block_tokens,
                         "session_sample": session_sample, "session_seed": session_seed,
                         "max_output_tokens": scale.max_output_tokens, "seed": seed},
            "config": {"pipeline_ttft_budget_ms": budget_ms}})
        check_same_engines(recorded[2], cfg)  # e.g. a heterogeneous run re-simulated without its --config
    console.print(f"{len(requests)} requests, prompts mean {np.mean([len(r.prompt_ids) for r in requests]):.0f} "
                  f"tokens, outputs mean {np.mean([r.max_tokens for r in requests]):.0f}, {rate} req/s")
    if recorded is not None:
        _, live, entry = recorded
        live_s = None
    else:
        t_live = time.time()
        live, entry = live_run(cfg, requests, out, seed, console)
        live_s = time.time() - t_live
    require_completed(live, "compare")  # first: an empty or all-failed run is not a workload mismatch
    check_same_requests(live, [len(r.prompt_ids) for r in requests])
    ovh = prof.get("role_step_overhead_s") or {}
    wb = float(prof.get("wan_send_buffer_bytes", 0.0))
    sent = as_sent(requests, live)  # the requests as the live system received them
    t_sim = time.time()
    sim = simulate(cfg, profile, prof, block_tokens, sent, ovh, profile_b=profile_b)
    sim_s = time.time() - t_sim
    res = {
        "workload": {"requests": len(requests), "rate_rps": rate, "block_tokens": block_tokens,
                     "session_sample": session_sample, "session_seed": session_seed,
                     "max_output_tokens": scale.max_output_tokens, "seed": seed,
                     "prompt_tokens_mean": float(np.mean([len(r.prompt_ids) for r in requests])),
                     "output_tokens_mean": float(np.mean([r.max_tokens for r in requests]))},
        "config": {"pipeline_ttft_budget_ms": budget_ms, "wan_gbps": cfg.link.wan_gbps,
                   "wan_rtt_ms": cfg.link.wan_rtt_ms, "wan_loss_rate": cfg.link.wan_loss_rate,
                   "wan_cross_traffic": [list(x) for x in cfg.link.wan_cross_traffic],
                   "kv_stream": cfg.policy.kv_stream, "cutoff_max_sent_fraction": cfg.policy.cutoff_max_sent_fraction,
                   "instances": cfg.instances.model_dump(),
                   "engine": cfg.engine.model_dump()},
        "profile": {"path": str(profile), "profile_b": str(profile_b) if profile_b is not None else None,
                    "fit": prof.get("fit"), "machine": prof.get("machine"),
                    "role_step_overhead_s": ovh, "role_step_scale": prof.get("role_step_scale") or {},
                    "wan_send_buffer_bytes": wb, "wan_written_lead_bytes": sim.wan_written_lead,
                    "client_delay_s": prof.get("client_delay_s", 0.0), "gateway_rtt_ms": prof.get("gateway_rtt_ms"),
                    "decode_interference": prof.get("decode_interference") or {},
                    "prefill_interference": sim.cfg.prefill_interference,
                    "p_dispatch_s": sim.cfg.p_dispatch_s,
                    "p_reply_lag_s_per_token": sim.cfg.p_reply_lag_s_per_token,
                    "host_cores": sim.cfg.host_cores,
                    "fast_path": prof.get("fast_path"),
                    "role_overhead_from": (prof.get("role_overhead_from") or {}).get("run")},
        "wan_bytes": {"live": live_wan_payload_bytes(entry), "sim": sim.wan.bytes_sent if sim.wan else 0.0},
        **compare(live, sim),
        "compute_share_of_ttft": compute_share(sim, live),
        "compute_share_of_ttft_with_role_overhead": compute_share(sim, live, ovh.get("P", 0.0),
                                                                  (prof.get("role_step_scale") or {}).get("P", 1.0)),
        "role_steps": {"live": live_role_steps(entry), "sim": sim_role_steps(sim)},
        "live_failed": sum(1 for r in live if not r.get("ok")),
        "live_faults": run_faults(live, entry),
        "live_errors": sorted({str(r.get("error"))[:80] for r in live if not r.get("ok")})[:5],
        "live_from": str(live_from) if live_from else None,
        "live_wall_s": live_s, "sim_wall_s": sim_s, "wall_s": time.time() - t0,
        # a reused run keeps its recording's wall time (re-simulated in place, it would be lost)
        "recorded_live_wall_s": live_s if recorded is None else
        ((recorded[0] or {}).get("live_wall_s") or (recorded[0] or {}).get("recorded_live_wall_s")),
        "sim_pipelines": dict(sim.pipelines), "sim_handoffs": dict(sim.handoffs),
    }
    from pdd.sim.p_speed import at_live_p_speed, at_live_speed  # imports this module

    res["at_live_p_speed"] = at_live_p_speed(cfg, profile, prof, block_tokens, sent, live,
                                             (res["role_steps"]["live"].get("P") or {}).get("mean_step_s"), ovh,
                                             profile_b=profile_b)
    res["at_live_speed"] = at_live_speed(cfg, profile, prof, block_tokens, sent, live,
                                         {r: (x or {}).get("mean_step_s") for r, x in res["role_steps"]["live"].items()},
                                         ovh, profile_b=profile_b)
    (out / "validate.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def format_validate(res: dict) -> str:
    from pdd.sim.report import table

    rows = []
    for k, name in (("p50_ttft_ms", "TTFT P50 ms"), ("p90_ttft_ms", "TTFT P90 ms"), ("p99_ttft_ms", "TTFT P99 ms"),
                    ("p50_tpot_ms", "TPOT P50 ms")):
        if k in res["live"]:  # a validate.json written before P99 was reported has none
            ci = (res.get("err_ci") or {}).get(k)
            rows.append({"metric": name, "live": res["live"][k], "sim": res["sim"][k], "rel_err": res[f"err_{k}"],
                         "95% interval": None if not ci else f"{ci[0]:+.3g} .. {ci[1]:+.3g}"})  # rel_err's units
    pr = res.get("ttft_error_per_request")
    if pr:
        rows.append({"metric": "TTFT per request: median (sim-live)/live", "live": None, "sim": None,
                     "rel_err": pr["median"]})
        rows.append({"metric": "TTFT per request: P50 / P90 / P99 |error|", "live": None, "sim": None,
                     "rel_err": f"{pr['abs_p50']:.3g} / {pr['abs_p90']:.3g} / {pr['abs_p99']:.3g}"})
        rows.append({"metric": "TTFT per request: share within 5% / 10% / 25%", "live": None, "sim": None,
                     "rel_err": f"{pr['within_5pct']:.3g} / {pr['within_10pct']:.3g} / {pr['within_25pct']:.3g}"})
    rows.append({"metric": "decision match (pipeline + handoff)", "live": None, "sim": None,
                 "rel_err": res["decision_match_share"]})
    rows.append({"metric": "pipeline match", "live": None, "sim": None, "rel_err": res["pipeline_match_share"]})
    rep = res["recorded_inputs_replayed"]
    rs = res.get("role_steps") or {}
    steps = "".join(f"\n{t}: live step {rs['live'][t]['mean_step_s'] * 1e3:.1f} ms x {rs['live'][t]['steps']}, sim "
                    f"{rs['sim'][t]['mean_step_s'] * 1e3:.1f} ms x {rs['sim'][t]['steps']}"
                    for t in ("P", "RLD", "MD") if rs.get("live", {}).get(t, {}).get("mean_step_s")
                    and rs.get("sim", {}).get(t, {}).get("mean_step_s"))
    pf = res.get("profile", {})
    ovh = pf.get("role_step_overhead_s") or {}
    scale = pf.get("role_step_scale") or {}
    di, cores = pf.get("decode_interference") or {}, pf.get("host_cores") or 0
    inputs = (f"\nsimulated with: profile {pf.get('path')}; MD's step from "
              + (f"--profile-b {pf['profile_b']}" if pf.get("profile_b") else "the same profile (or MD's tier's own)")
              + "; decode step while P prefills: "
              + (", ".join(f"{t} x{v:.2f}" for t, v in di.items()) + (f" ({cores:g} shared cores)" if cores else
                                                                       " (not applied: no shared host)")
                 if di else "no factor"))
    pi = pf.get("prefill_interference") or 1.0
    if pi != 1.0:
        inputs += f"; P's step while decoders run: x{pi:.3f}" + ("" if cores else " (not applied: no shared host)")
    if pf.get("p_dispatch_s"):
        inputs += f"; P's dispatch {pf['p_dispatch_s'] * 1e3:.2f} ms a request"
    if pf.get("p_reply_lag_s_per_token"):
        inputs += f"; P's reply lag {pf['p_reply_lag_s_per_token'] * 1e6:.1f} us a token of the largest prefill step its step finishes"
    if pf.get("wan_written_lead_bytes") is not None:
        inputs += f"; MD's KV written {pf['wan_written_lead_bytes'] / 2 ** 10:.0f} KiB before its last byte leaves"
    paths = "".join(f"\n{name.replace('_', ' ')}: {g['requests']} requests, TPOT P50 live {g['p50_tpot_ms']['live']:.2f} / "
                    f"sim {g['p50_tpot_ms']['sim']:.2f} ms, longest token gap P50 live "
                    f"{g['p50_max_gap_ms']['live']:.1f} / sim {g['p50_max_gap_ms']['sim']:.1f} ms"
                    for name, g in (res.get("tpot_by_path") or {}).items() if g.get("requests"))
    paths += format_ttft_phases(res.get("ttft_phases") or [])
    ps = res.get("at_live_p_speed")
    if ps:
        paths += (f"\nat the run's own P speed (diagnostic: P's step x{ps['level']:.3f}, mean {ps['sim_p_step_ms']:.1f} "
                  f"ms, live {ps['live_p_step_ms']:.1f}): TTFT P50 error {ps['err_p50_ttft_ms'] * 100:+.1f}%, P90 "
                  f"{ps['err_p90_ttft_ms'] * 100:+.1f}% (pdd.sim.p_speed)")
    sp = res.get("at_live_speed")
    if sp:
        paths += ("\nat the run's own speed, every role (diagnostic: steps " + ", ".join(
            f"{r} x{sp['factors'][r]:.3f}" for r in sp["factors"]) + f"): TTFT P50 error {sp['err_p50_ttft_ms'] * 100:+.1f}%, "
                  f"P90 {sp['err_p90_ttft_ms'] * 100:+.1f}%, decision match {sp['decision_match_share'] * 100:.1f}% "
                  "(pdd.sim.p_speed.at_live_speed)")
    from pdd.sim.p_speed import speed_warning, unfitted_warning  # imports this module

    drift = speed_warning(ps, (res.get("profile") or {}).get("role_overhead_from"))
    lost = faults_text(res.get("live_faults") or {"degraded": 0, "unreachable": []}, res["requests_compared"])
    warn = f"\nWARNING: the live run lost an instance ({lost}): it measured another topology than the " \
        "simulated one; do not read its errors as the simulator's" if lost else ""
    warn += f"\n{drift}" if drift else ""
    bare = unfitted_warning(res.get("profile"))
    warn += f"\n{bare}" if bare else ""
    errs = res.get("live_errors") or []
    failed = (f"{res['live_failed']} live failures" + (f" ({'; '.join(errs)})" if errs and res['live_failed'] else ""))
    ci_note = ("\n95% interval: rel_err's paired bootstrap over the compared requests (what a run of this size "
               "could have shown with other requests of the same workload; none for P99, which its top few "
               "requests set; pdd.sim.uncertainty)"
               if res.get("err_ci") else "")
    return (table(rows, ["metric", "live", "sim", "rel_err", "95% interval"]) + ci_note
            + f"\nrecorded inputs replayed through the sim's policy calls: {rep['identical']}/{rep['decisions']} "
              f"identical\ncompute share of TTFT {res['compute_share_of_ttft']:.0%}; "
              f"(with P's role overhead {res.get('compute_share_of_ttft_with_role_overhead', 0):.0%}); "
              f"{res['requests_compared']} requests compared, {failed}; live "
              + (f"{res['live_wall_s']:.0f} s" if res.get("live_wall_s") is not None else
                 f"run reused from {res.get('live_from')}") + f", sim {res['sim_wall_s']:.2f} s"
              f"\nrole step overheads (ms): " + ", ".join(f"{t} {v * 1e3:.1f}" for t, v in ovh.items())
            + ("; step factors: " + ", ".join(f"{t} x{v:.3f}" for t, v in scale.items()) if scale else "") + steps
            + paths + inputs + warn)
