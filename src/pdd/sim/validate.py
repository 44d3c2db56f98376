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
   counts, link rates and RTT, engine batch limits, KV pool, policies), step times from the
   measured profile (``pdd profile``, :class:`pdd.step_profile.MeasuredStepModel`).
4. Report: TTFT P50/P90 and TPOT P50 of both and their relative errors; the share of requests
   for which both made the same decisions (pipeline; handoff mode of the final round, or no
   handoff); the live decisions' recorded inputs replayed through the simulator's policy calls
   (must all agree: same code); the prefill-compute share of TTFT.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.sim_config import DECODE_ROLES
from pdd.step_profile import MeasuredStepModel
from pdd.topology import free_port_block
from pdd.workload.replay import Scale

# The workload's scale before build_workload's arguments (block tokens, rate, sessions, output
# cap) are applied: the demo's scale when validation was calibrated, fixed here so that a
# recorded run's workload is rebuilt identically (pdd sim calibrate-roles, --live-from).
VALIDATE_SCALE = Scale(block_tokens=16, output_scale=1 / 2, min_output_tokens=16, max_output_tokens=320,
                       target_rate_rps=2.0, session_sample=100)


class RecordedRunError(ValueError):
    """A recorded run (``pdd sim validate --live-from DIR``, ``pdd sim calibrate-roles --run DIR``)
    or a profile that cannot be used: missing, not a directory, a file of it missing, unreadable or
    not JSON. The message names the path (the CLI prints it as a usage error); ``source`` is
    ``"run"`` (the recorded run), ``"profile"`` or ``"profile_b"`` (MD's profile)."""

    def __init__(self, message: str, source: str = "run"):
        super().__init__(message)
        self.source = source


class WorkloadMismatch(RecordedRunError):
    """A reused live run (``--live-from``) was made with other workload arguments."""


# validate.json "workload" / "config" keys a reused live run must share, and their flags
_RUN_ARGS = (("workload", "requests", "--requests"), ("workload", "rate_rps", "--rate"),
             ("workload", "block_tokens", "--block-tokens"), ("workload", "session_sample", "--session-sample"),
             ("workload", "session_seed", "--session-seed"),
             ("workload", "max_output_tokens", "--max-output-tokens"), ("workload", "seed", "seed"),
             ("config", "pipeline_ttft_budget_ms", "--budget-ms"))


def read_run(run_dir: str | Path, *, need_validate: bool = True) -> tuple[dict | None, list[dict], dict]:
    """A recorded ``pdd sim validate --out`` directory: (its ``validate.json``, or None when absent
    and not ``need_validate``; the ``requests.jsonl`` records; ``server_stats.json``). Raises
    :class:`RecordedRunError` naming the directory and the file (missing, not a directory, a file
    missing, unreadable or not JSON) before anything is computed."""
    d = Path(run_dir)
    what = "a `pdd sim validate --out` directory"
    if not d.exists():
        raise RecordedRunError(f"{d}: no such directory ({what})")
    if not d.is_dir():
        raise RecordedRunError(f"{d}: not a directory; give {what}")

    def text(name: str) -> str:
        try:
            return (d / name).read_text()
        except FileNotFoundError:
            raise RecordedRunError(f"{d}: no {name} in it (not {what})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise RecordedRunError(f"{d / name}: cannot read it ({getattr(e, 'strerror', None) or e})") from None

    def parse(raw: str, where: str):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise RecordedRunError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise RecordedRunError(f"{where}: not a JSON object ({type(obj).__name__})")
        return obj

    v = parse(text("validate.json"), str(d / "validate.json")) \
        if need_validate or (d / "validate.json").exists() else None
    if v is not None and not isinstance(v.get("workload"), dict):
        raise RecordedRunError(f"{d / 'validate.json'}: no 'workload' object (not a `pdd sim validate` output)")
    recs = [check_record(parse(x, f"{d / 'requests.jsonl'} line {i}"), f"{d / 'requests.jsonl'} line {i}")
            for i, x in enumerate(text("requests.jsonl").splitlines(), 1) if x.strip()]
    return v, recs, parse(text("server_stats.json"), str(d / "server_stats.json"))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_record(rec: dict, where: str) -> dict:
    """``rec`` (one ``requests.jsonl`` record) when the fields the fits read have their types:
    ``send_s`` a number (present on a completed record with token times or gateway events),
    ``token_times_s`` a list of numbers, ``pdd`` an object whose ``events_ms`` is an object of
    numbers. Raises :class:`RecordedRunError` naming ``where`` and the field."""
    def bad(field: str, why: str):
        raise RecordedRunError(f"{where}: {field} {why} (not a `pdd sim validate` record)")

    tt = rec.get("token_times_s")
    if tt is not None and not (isinstance(tt, list) and all(_number(t) for t in tt)):
        bad("token_times_s", "must be a list of numbers")
    p = rec.get("pdd")
    if p is not None and not isinstance(p, dict):
        bad("pdd", "must be an object")
    ev = (p or {}).get("events_ms")
    if ev is not None and not (isinstance(ev, dict) and all(_number(t) for t in ev.values())):
        bad("pdd.events_ms", "must be an object of numbers")
    if "send_s" in rec:
        if not _number(rec["send_s"]):
            bad("send_s", "must be a number")
    elif rec.get("ok") and (tt or ev):
        bad("send_s", "is missing")
    return rec


def check_same_run(recorded: dict, now: dict) -> None:
    """Raise :class:`WorkloadMismatch` naming every argument (and its flag) of ``now`` (a
    validate.json-shaped ``{"workload": ..., "config": ...}``) that differs from the recorded
    run's; an argument the recorded run lacks is not compared."""
    diff = []
    for sec, key, flag in _RUN_ARGS:
        rec, cur = (recorded.get(sec) or {}).get(key), (now.get(sec) or {}).get(key)
        if rec is None or cur is None:
            continue
        same = abs(float(rec) - float(cur)) <= 1e-9 * max(1.0, abs(float(rec))) \
            if isinstance(rec, (int, float)) and isinstance(cur, (int, float)) else rec == cur
        if not same:
            diff.append(f"{flag} {cur} (the run's: {rec})")
    if diff:
        raise WorkloadMismatch("not the same workload: " + ", ".join(diff) + "; give the run's own workload "
                               "arguments (its validate.json 'workload' and 'config.pipeline_ttft_budget_ms')")


def load_profile_checked(path: str | Path) -> dict:
    """``pdd.step_profile.load`` with its failures as :class:`RecordedRunError` naming the file."""
    from pdd.step_profile import load

    p = Path(path)
    if p.is_dir():
        raise RecordedRunError(f"{p}: is a directory; give a `pdd profile` JSON file", "profile")
    try:
        prof = load(p)
    except FileNotFoundError:
        raise RecordedRunError(f"{p}: no such file (a `pdd profile` JSON)", "profile") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordedRunError(f"{p}: cannot read it ({getattr(e, 'strerror', None) or e})", "profile") from None
    except json.JSONDecodeError as e:
        raise RecordedRunError(f"{p}: not JSON ({e})", "profile") from None
    except ValueError as e:  # not a pdd-profile/1 object: the message names the file
        raise RecordedRunError(str(e), "profile") from None
    check_role_fits(prof, p)
    return prof


SIM_ROLES = ("P", "RLD", "MD", "D", "C")  # the simulator's roles (SimConfig.tiers)
# the per-role corrections calibrate-roles writes into a profile: field -> (lowest value, closed)
ROLE_FITS = {"role_step_scale": (0.0, False), "role_step_overhead_s": (0.0, True), "decode_interference": (1.0, True)}


def check_role_fits(prof: dict, path: Path) -> None:
    """Raises :class:`RecordedRunError` naming the file and field when a per-role correction
    (``ROLE_FITS``) is not an object of role -> finite number in its range (a hand-edited
    profile)."""
    for field, (lo, closed) in ROLE_FITS.items():
        v = prof.get(field)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise RecordedRunError(f"{path}: {field} must be an object of role -> number, got {v!r}", "profile")
        for role, x in v.items():
            roles = DECODE_ROLES if field == "decode_interference" else SIM_ROLES
            if role not in roles:  # e.g. "rld": the simulator would ignore it; "P" has no decode step
                raise RecordedRunError(f"{path}: {field} has role {role!r}; roles are {', '.join(roles)}",
                                       "profile")
            if not (_number(x) and (x >= lo if closed else x > lo)):
                raise RecordedRunError(f"{path}: {field}[{role!r}] must be a finite number "
                                       f"{'>=' if closed else '>'} {lo:g}, got {x!r}", "profile")


def sim_records(requests) -> list[dict]:
    """Mooncake-format records (ms timestamps, token lengths, block hash ids) of replay requests."""
    out = []
    for r in requests:
        out.append({"timestamp": r.arrival_s * 1000.0, "input_length": len(r.prompt_ids),
                    "output_length": int(r.max_tokens), "hash_ids": list(r.hash_ids)})
    return out


def sim_config(cfg, profile_path: str | Path, prof: dict, block_tokens: int,
               host_cores: float | None = None, profile_b: str | Path | None = None) -> SimConfig:
    """A SimConfig mirroring the live ``ClusterConfig`` ``cfg`` (pdd mode). On a CPU topology
    every instance shares this machine's cores (``host_cores``, default ``os.cpu_count()``).
    Heterogeneous tiers (``cfg.tiers``): datacenter A's chip is P's ``profile`` and B's is MD's
    (each defaulting to ``profile_path``; ``profile_b``, when given, is MD's for the simulator
    alone: the live tier is not held to it), and the KV crosses the WAN in the narrower of P's and
    MD's dtypes (``pdd.transfer.layout``)."""
    from pdd.transfer.layout import DTYPE_BYTES, wire_dtype
    from pdd.sim.sim_config import runtime_wan_fields

    e, link, pol, n = cfg.engine, cfg.link, cfg.policy, cfg.instances
    ep, emd = cfg.engine_for("prefill"), cfg.engine_for("main_decode")
    kvb = int(prof["model"]["kv_bytes_per_token"])
    wire_kvb = kvb // DTYPE_BYTES[prof.get("engine", {}).get("dtype", "float32")] \
        * DTYPE_BYTES[wire_dtype(ep.dtype, emd.dtype)]
    return SimConfig(
        mode=cfg.mode, model="measured", model_spec={**prof["model"], "max_context": e.max_model_len},
        kv_bytes_per_token=wire_kvb if wire_kvb != kvb else None,
        profile_a=str(ep.profile or profile_path), profile_b=str(profile_b or emd.profile or profile_path), price_a=0.0,
        price_b=0.0,
        n_p=n.prefill, n_rld=n.relay_decode, n_md=n.main_decode, n_d=n.relay_decode, n_c=n.prefill,
        **runtime_wan_fields(cfg),  # line rate, RTT, loss, cross traffic, send order, kv_stream
        fast_gbps=link.fast_gbps, fast_rtt_ms=link.fast_rtt_ms,
        max_batch_tokens=e.max_batch_tokens, max_running_seqs=e.max_running,
        prefill_chunk_tokens=e.prefill_chunk_tokens, prefill_order=e.prefill_order,
        ttft_budget_ms=pol.pipeline_ttft_budget_ms,
        handoff_mode=pol.handoff_mode, catchup_threshold=pol.catchup_threshold_tokens,
        allow_p_rld=pol.allow_p_rld, md_predicted_send=pol.md_predicted_send, early_handoff=pol.early_handoff,
        cutoff=pol.cutoff, cutoff_min_remaining_s=pol.cutoff_min_remaining_s,
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
    pairs: list[tuple[float, float]] = []  # (live, sim) TTFT of each request both completed
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
            pairs.append((tt[0] - rec["send_s"], req.t_first - req.arrival))
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
    return out


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
            t += cm.step_time([(s0, k)]) * scale + overhead_s
            s0 += k
        num += t
        den += rec["token_times_s"][0] - rec["send_s"]
    return num / den if den else 0.0


ROLE_TIER = {"prefill": "P", "relay_decode": "RLD", "main_decode": "MD"}


def validate_config(config=None, budget_ms: float = 250.0):
    """The live topology's config for validation: pdd mode, the pipeline budget, and the gateway's
    429 limits off (the simulator has no admission control; a refused turn would also leave the
    caches unlike the simulator's). Without ``config``, the embedded topology on free ports."""
    from pdd.config import ClusterConfig

    cfg = config or ClusterConfig()
    if config is None:  # the default ports may be taken (another topology): pick a free block
        base = free_port_block()
        cfg = cfg.model_copy(update={"base_port": base, "gateway_port": base + 95})
    return cfg.model_copy(update={"mode": "pdd", "policy": cfg.policy.model_copy(
        update={"pipeline_ttft_budget_ms": budget_ms}), "limits": cfg.limits.model_copy(
        update={"max_queue_wait_s": 0.0, "max_queued_prompt_tokens": 0})})


def build_workload(cfg, *, n_requests: int, rate: float, block_tokens: int, session_sample: int,
                   session_seed: int = 0, max_output_tokens: int | None = None, seed: int = 0):
    """The replay requests (deterministic in the arguments): a Mooncake conversation-trace slice,
    1 in ``session_sample`` conversations chosen by ``session_seed``, ``block_tokens`` per block."""
    import dataclasses

    from pdd.workload.replay import DEFAULT_TRACE, TokenSpace, build_requests, fit_scale

    scale = dataclasses.replace(VALIDATE_SCALE, block_tokens=block_tokens, target_rate_rps=rate,
                                session_sample=session_sample, session_seed=session_seed)
    if max_output_tokens is not None:
        scale = dataclasses.replace(scale, max_output_tokens=max_output_tokens,
                                    min_output_tokens=min(scale.min_output_tokens, max_output_tokens))
    scale = fit_scale(scale, cfg, n_requests, 0)
    return build_requests(DEFAULT_TRACE, scale, TokenSpace.from_model(cfg.model_path), seed), scale


def live_role_steps(entry: dict) -> dict:
    """Per tier (P, RLD, MD): engine steps, their summed wall time (the worker thread's
    ``engine.step()`` inside the live role: GIL and core contention included) and the mean, over
    the measured replay (``stats`` less ``stats_before``)."""
    out = {}
    before = (entry.get("stats_before") or {}).get("instances", {})
    for name, st in (entry.get("stats") or {}).get("instances", {}).items():
        tier = ROLE_TIER.get(st.get("role"))
        if tier is None:
            continue
        b = before.get(name, {})
        n = st.get("engine_steps", 0) - b.get("engine_steps", 0)
        busy = st.get("engine_busy_s", 0.0) - b.get("engine_busy_s", 0.0)
        d = out.setdefault(tier, {"steps": 0, "busy_s": 0.0})
        d["steps"] += n
        d["busy_s"] += busy
    for d in out.values():
        d["mean_step_s"] = d["busy_s"] / d["steps"] if d["steps"] else None
    return out


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
    if overheads:
        scfg = scfg.replace(step_overhead_s=dict(overheads))
    if prof.get("role_step_scale"):
        scfg = scfg.replace(step_scale=dict(prof["role_step_scale"]))
    wb = prof.get("wan_send_buffer_bytes", 0.0) if wan_buffer is None else wan_buffer
    if prof.get("client_delay_s"):
        scfg = scfg.replace(client_delay_s=float(prof["client_delay_s"]))
    if prof.get("gateway_rtt_ms"):
        scfg = scfg.replace(wan_rtt_estimate_ms=float(prof["gateway_rtt_ms"]))
    if prof.get("decode_interference"):
        scfg = scfg.replace(decode_interference=dict(prof["decode_interference"]))
    fp = prof.get("fast_path")
    if fp:  # measured on a live run (live_fast_path): the Python KV path, not the configured pacing
        scfg = scfg.replace(fast_gbps=float(fp["gbps"]), fast_rtt_ms=2000.0 * float(fp["latency_s"]))
    if wb:
        scfg = scfg.replace(wan_send_buffer_bytes=float(wb))
    sim = ClusterSim(scfg)
    sim.record_decisions = True
    sim.run(sim_records(requests))
    return sim


def live_client_delay_s(live_records: list[dict]) -> float | None:
    """Median of (client's first token - the gateway's ``first_token`` event) over a live run: the
    HTTP streaming path the simulator does not otherwise see."""
    d = [rec["token_times_s"][0] - rec["send_s"] - rec["pdd"]["events_ms"]["first_token"] / 1000.0
         for rec in live_records if rec.get("ok") and rec.get("token_times_s")
         and "first_token" in ((rec.get("pdd") or {}).get("events_ms") or {})]
    return float(np.median(d)) if d else None


def live_gateway_rtt_ms(live_records: list[dict]) -> float | None:
    """Median WAN RTT (ms) the live gateway's pipeline decisions read (their recorded
    ``wan_rtt_ms`` input: its windowed minimum of MD reservation round trips, software included),
    over a run's requests; None without recorded pipeline decisions."""
    v = [d["inputs"]["wan_rtt_ms"] for rec in live_records if rec.get("ok")
         for d in ((rec.get("pdd") or {}).get("decisions") or [])
         if d.get("policy") == "pipeline" and isinstance((d.get("inputs") or {}).get("wan_rtt_ms"), (int, float))]
    return float(np.median(v)) if v else None


HANDOFF_EVENTS = ("handoff_call", "handoff", "switch")


def live_decode_gaps(live_records: list[dict], margin_s: float = 0.02) -> dict:
    """A live run's decode inter-token gaps (seconds, as the client saw them), by the tier that
    decoded both tokens (the record's per-token ``tiers``: ``"rld"``, ``"md"``, ...; ``"all"``
    for a record without them) and by what P did meanwhile: ``{tier: {"busy": [...], "quiet":
    [...]}}``. Busy: the gap's midpoint inside another request's P interval (its send to the
    gateway's ``p_first_token``: queued or prefilling at P); quiet: the gap overlaps no P
    interval (gaps that overlap one only in part are left out). A request's first token, gaps
    between two tiers' tokens and the gaps within ``margin_s`` of its handoff events
    (``handoff_call``, ``handoff``, ``switch``: RLD's stream giving way to MD's) are not decode
    gaps."""
    iv = []
    for rec in live_records:
        ev = (rec.get("pdd") or {}).get("events_ms") or {}
        if rec.get("ok") and "p_first_token" in ev:
            t0 = float(rec["send_s"])
            iv.append((id(rec), t0, t0 + ev["p_first_token"] / 1000.0))
    iv.sort(key=lambda x: x[1])
    starts = np.array([x[1] for x in iv])
    # the latest end among the intervals up to each one (sorted by start): those before the first
    # index whose running end passes a gap's start all ended before it, so none is scanned
    reach = np.maximum.accumulate([x[2] for x in iv]) if iv else np.array([])
    out: dict[str, dict[str, list[float]]] = {}
    for rec in live_records:
        tt = rec.get("token_times_s") or []
        if not rec.get("ok") or len(tt) < 3:
            continue
        tiers = rec.get("tiers")
        if not (isinstance(tiers, list) and len(tiers) == len(tt) and all(isinstance(t, str) for t in tiers)):
            tiers = ["all"] * len(tt)  # absent or malformed per-token tiers: the gaps count for no tier
        ev = (rec.get("pdd") or {}).get("events_ms") or {}
        t0 = float(rec["send_s"])
        ho = [t0 + ev[k] / 1000.0 for k in HANDOFF_EVENTS if k in ev]
        lo, hi = (min(ho) - margin_s, max(ho) + margin_s) if ho else (None, None)
        for i in range(1, len(tt) - 1):
            a, b = tt[i], tt[i + 1]
            if tiers[i] != tiers[i + 1] or (lo is not None and a < hi and b > lo):
                continue
            mid, over, inside = (a + b) / 2, False, False
            # P intervals that start before b, from the first that may end after a
            for j in range(int(np.searchsorted(reach, a, side="right")), int(np.searchsorted(starts, b))):
                rid, pa, pb = iv[j]
                if rid == id(rec) or pb <= a:
                    continue
                over = True
                if pa <= mid < pb:
                    inside = True
                    break
            g = out.setdefault(str(tiers[i]), {"busy": [], "quiet": []})
            if inside:
                g["busy"].append(b - a)
            elif not over:
                g["quiet"].append(b - a)
    return out


DECODE_GAPS_MIN = 50  # token gaps of a tier with P busy, and with it quiet, to fit its factor


def live_decode_interference(live_records: list[dict], min_samples: int = DECODE_GAPS_MIN) -> dict | None:
    """How much slower each tier's decode step runs while P prefills on the same machine: the
    median decode gap while P is busy over the median while it is quiet (:func:`live_decode_gaps`;
    within one tier, so RLD's and MD's different step times do not mix), floored at 1, for each
    tier with ``min_samples`` gaps of both kinds. Returns ``{"factors": {role: factor}`` (roles as
    the simulator names them: ``"RLD"``, ``"MD"``), ``"tiers": {tier: {"ratio",
    "busy_median_s", "quiet_median_s", "busy_samples", "quiet_samples"}}}``, or None when no tier
    has enough gaps (records without per-token ``tiers`` count for none). A ratio also holds the
    larger decode batches that come with a busy P, which on a CPU, where a decode step reads the
    weights once whatever its batch, adds little."""
    tiers = {}
    for tier, g in sorted(live_decode_gaps(live_records).items()):
        if tier.upper() not in DECODE_ROLES or len(g["busy"]) < min_samples or len(g["quiet"]) < min_samples:
            continue
        b, q = float(np.median(g["busy"])), float(np.median(g["quiet"]))
        if q > 0:
            tiers[tier] = {"ratio": b / q, "busy_median_s": b, "quiet_median_s": q,
                           "busy_samples": len(g["busy"]), "quiet_samples": len(g["quiet"])}
    if not tiers:
        return None
    return {"factors": {t.upper(): max(1.0, g["ratio"]) for t, g in tiers.items()}, "tiers": tiers}


def live_fast_path(live_records: list[dict], kv_bytes_per_token: int, max_gbps: float,
                   min_samples: int = 20) -> dict | None:
    """The in-datacenter KV path P -> RLD as the live run shows it: least squares of (gateway's
    first token - P's prefill reply) over the prompt's KV bytes, for relayed requests whose plan
    was known before P finished (``md_reserved`` before ``p_first_token``), so the interval is
    the KV's trip, RLD's receive and its first token's trip to the gateway.

    Returns ``{"latency_s", "gbps", "samples", "median_s"}`` (latency >= 0, rate capped at
    ``max_gbps``, the configured pacing), or None with fewer than ``min_samples`` such requests
    or a non-positive fitted per-byte cost. The simulator then uses it as its fast line (rate,
    and twice the latency as RTT) instead of the configured rate: on this CPU the Python sender
    and receiver, not the 4 Gbit/s pacing, set the pace (2026-12-01: ~1.9-2.8 Gbit/s effective
    and a median of 18 ms for ~1,000-token prompts, against 4 ms at the configured rate)."""
    xs, ys = [], []
    for rec in live_records:
        p = rec.get("pdd") or {}
        ev = p.get("events_ms") or {}
        if (not rec.get("ok") or p.get("pipeline") != "p_rld_md" or "first_token" not in ev
                or "p_first_token" not in ev or ev.get("md_reserved", float("inf")) > ev["p_first_token"]):
            continue
        xs.append(float(rec.get("prompt_tokens") or 0) * kv_bytes_per_token)
        ys.append((ev["first_token"] - ev["p_first_token"]) / 1000.0)
    if len(xs) < min_samples:
        return None
    a = np.vstack([np.ones(len(xs)), np.array(xs)]).T
    (c0, c1), *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    if c1 <= 0:
        return None
    gbps = min(max_gbps, 8.0 / c1 / 1e9)
    return {"latency_s": max(0.0, float(c0)), "gbps": float(gbps), "samples": len(xs),
            "median_s": float(np.median(ys))}


def isolated_prefills(live_records: list[dict], step_model, chunk_tokens: int) -> list[dict]:
    """The live requests P prefilled alone: P's interval (the client's send to the gateway's
    ``p_first_token`` event) overlaps no other request's. Each as ``{"tokens"`` (computed: prompt
    less P's cached prefix), ``"steps"`` (chunks of ``chunk_tokens``), ``"profile_s"`` (those
    chunks on ``step_model``, a ``MeasuredStepModel``: seconds), ``"live_s"`` (the interval,
    seconds)``}``, in request order."""
    iv = []
    for rec in live_records:
        p = rec.get("pdd") or {}
        ev = p.get("events_ms") or {}
        if not rec.get("ok") or "p_first_token" not in ev or not rec.get("prompt_tokens"):
            continue
        prompt, cached = int(rec["prompt_tokens"]), int(p.get("p_cached_tokens") or 0)
        if prompt - cached < 1:
            continue
        t0 = float(rec["send_s"])
        iv.append((t0, t0 + ev["p_first_token"] / 1000.0, prompt, cached))
    out = []
    for i, (a, b, prompt, cached) in enumerate(iv):
        if any(j != i and x[0] < b and x[1] > a for j, x in enumerate(iv)):
            continue
        s0, t, k = cached, 0.0, 0
        while s0 < prompt:
            n = min(chunk_tokens, prompt - s0)
            t += step_model.step_time([(s0, n)])
            s0 += n
            k += 1
        out.append({"tokens": prompt - cached, "steps": k, "profile_s": t, "live_s": b - a})
    return out


def fit_step_scale(prefills: list[dict], min_samples: int = 8) -> dict | None:
    """P's live step over the profile's from isolated live prefills (:func:`isolated_prefills`):
    least squares, in relative error, of ``live_s = scale x profile_s + overhead_s x steps``
    (``overhead_s`` >= 0: refitted without it when negative). A per-step overhead alone, fitted
    to P's mean step, adds the same to a 16-token and a 512-token chunk; on this CPU the live P is
    slower in proportion to the chunk's compute, plus a few ms a step.

    Returns ``{"scale", "overhead_s", "samples", "mean_abs_rel_err"}`` (the last: of the fitted
    times over the samples), or None with fewer than ``min_samples`` prefills or a non-positive
    scale."""
    if len(prefills) < min_samples:
        return None
    x = np.array([r["profile_s"] for r in prefills], dtype=float)
    k = np.array([r["steps"] for r in prefills], dtype=float)
    y = np.array([r["live_s"] for r in prefills], dtype=float)
    a = np.vstack([x, k]).T / y[:, None]
    (sc, ov), *_ = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)
    if ov < 0:
        (sc,), *_ = np.linalg.lstsq((x / y)[:, None], np.ones(len(y)), rcond=None)
        ov = 0.0
    if sc <= 0:
        return None
    return {"scale": float(sc), "overhead_s": float(ov), "samples": int(len(y)),
            "mean_abs_rel_err": float(np.mean(np.abs((sc * x + ov * k) / y - 1.0)))}


def live_wan_payload_bytes(entry: dict) -> float:
    """KV bytes the live P senders wrote for the WAN over the replay (planned less cancelled before
    sending, the gateway's totals): what crossed the line, cut-off transfers' written part included."""
    def tot(st):
        t = (st or {}).get("totals", {})
        return t.get("wan_bytes_planned", 0) - t.get("wan_bytes_cancelled", 0)

    return float(tot(entry.get("stats")) - tot(entry.get("stats_before")))


def calibrate_wan_buffer(cfg, profile, prof: dict, block_tokens: int, requests, live_bytes: float,
                         overheads: dict | None = None, hi: float = 64 * 2 ** 20, iters: int = 14) -> tuple[float, float]:
    """The committed-bytes allowance (``SimConfig.wan_send_buffer_bytes``) at which the simulated
    WAN carries the bytes the live one did on the same workload (bisection; the carried bytes grow
    with it, and only through cut-offs). When even ``hi`` carries less than the live run, the
    smallest allowance that carries what ``hi`` does: 0 when the run's cut-offs (if any) do not
    depend on it, so an unexplained shortfall is never booked as a buffer. Returns (bytes,
    simulated bytes at it)."""
    def carried(b):
        return simulate(cfg, profile, prof, block_tokens, requests, overheads, wan_buffer=b).wan.bytes_sent

    c0 = carried(0.0)
    if c0 >= live_bytes:
        return 0.0, c0
    target = min(live_bytes, carried(hi))
    if target <= c0 * (1 + 1e-6):
        return 0.0, c0
    lo_b, hi_b = 0.0, hi
    for _ in range(iters):
        mid = (lo_b + hi_b) / 2
        if carried(mid) < target * (1 - 1e-6):
            lo_b = mid
        else:
            hi_b = mid
    return hi_b, carried(hi_b)


def calibrate_role_overheads(cfg, profile, prof: dict, block_tokens: int, requests, live_steps: dict,
                             iters: int = 8, wan_buffer: float | None = None,
                             fixed: dict | None = None) -> tuple[dict, list]:
    """Per-step overhead of each live role over the bare engine: the constant that, added to every
    simulated step of that tier, makes the simulated mean step equal the live run's (fixed point:
    the overheads also change the simulated core sharing and batches). Roles in ``fixed`` (seconds
    a step) keep that overhead. Fitted on one live run (a calibration workload); validation then
    uses another workload."""
    fixed = fixed or {}
    ovh = {t: float(fixed.get(t, 0.0)) for t in live_steps}
    hist = []
    for _ in range(iters):
        sim = simulate(cfg, profile, prof, block_tokens, requests, ovh, wan_buffer)
        ss = sim_role_steps(sim)
        hist.append({t: {"overhead_s": ovh[t], "sim_mean_step_s": ss[t]["mean_step_s"],
                         "live_mean_step_s": live_steps[t]["mean_step_s"]} for t in ovh})
        new = {}
        for t in ovh:
            lv, sv = live_steps[t]["mean_step_s"], ss[t]["mean_step_s"]
            new[t] = max(0.0, ovh[t] + (lv - sv)) if lv is not None and sv is not None and t not in fixed \
                else ovh[t]
        if all(abs(new[t] - ovh[t]) < 1e-5 for t in ovh):
            ovh = new
            break
        ovh = new
    return ovh, hist


def run_validate(out: str | Path, config=None, *, n_requests: int = 220, rate: float = 2.0,
                 block_tokens: int = 64, budget_ms: float = 250.0, session_sample: int = 50,
                 session_seed: int = 0, max_output_tokens: int | None = None,
                 profile: str | Path | None = None, seed: int = 0, live_from: str | Path | None = None,
                 live_run=None, console=None, profile_b: str | Path | None = None) -> dict:
    """Run both and write ``out/validate.json`` (+ ``profile.json`` when it measured one).
    ``live_from``: reuse that directory's live run (its ``requests.jsonl`` and
    ``server_stats.json``, same workload arguments) and only re-simulate. Otherwise
    ``live_run(cfg, requests, out, seed, console) -> (records, server_stats)`` runs the workload
    on the live topology and writes ``out/requests.jsonl`` and ``out/server_stats.json``
    (``pdd.bench.live_validate.live_run``: per-request record dicts, and the gateway's stats
    before and after as one dict); the model directory must exist
    (``pdd.bench.live_validate.run_validate`` makes it, then calls this). The profile's
    ``role_step_overhead_s`` (``pdd sim calibrate-roles``, from another run) is applied.
    Raises ValueError when neither ``live_from`` nor ``live_run`` is given;
    :class:`RecordedRunError` for a ``live_from`` directory or ``profile`` it cannot read (before
    the profile is measured); :class:`WorkloadMismatch` when the reused run is not the workload's
    (its validate.json's workload arguments or pipeline budget differ, or its request count)."""
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
    cfg = validate_config(config, budget_ms)
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
    console.print(f"{len(requests)} requests, prompts mean {np.mean([len(r.prompt_ids) for r in requests]):.0f} "
                  f"tokens, outputs mean {np.mean([r.max_tokens for r in requests]):.0f}, {rate} req/s")
    if recorded is not None:
        _, live, entry = recorded
        live_s = None
    else:
        t_live = time.time()
        live, entry = live_run(cfg, requests, out, seed, console)
        live_s = time.time() - t_live
    if len(live) != len(requests):
        raise WorkloadMismatch(f"live run has {len(live)} requests, the workload {len(requests)}: not the same "
                               "workload (give the run's own workload arguments: its validate.json 'workload')")
    require_completed(live, "compare")
    ovh = prof.get("role_step_overhead_s") or {}
    wb = float(prof.get("wan_send_buffer_bytes", 0.0))
    t_sim = time.time()
    sim = simulate(cfg, profile, prof, block_tokens, requests, ovh, profile_b=profile_b)
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
                   "kv_stream": cfg.policy.kv_stream, "instances": cfg.instances.model_dump(),
                   "engine": cfg.engine.model_dump()},
        "profile": {"path": str(profile), "profile_b": str(profile_b) if profile_b is not None else None,
                    "fit": prof.get("fit"), "machine": prof.get("machine"),
                    "role_step_overhead_s": ovh, "role_step_scale": prof.get("role_step_scale") or {},
                    "wan_send_buffer_bytes": wb,
                    "client_delay_s": prof.get("client_delay_s", 0.0), "gateway_rtt_ms": prof.get("gateway_rtt_ms"),
                    "decode_interference": prof.get("decode_interference") or {},
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
        "live_errors": sorted({str(r.get("error"))[:80] for r in live if not r.get("ok")})[:5],
        "live_from": str(live_from) if live_from else None,
        "live_wall_s": live_s, "sim_wall_s": sim_s, "wall_s": time.time() - t0,
        "sim_pipelines": dict(sim.pipelines), "sim_handoffs": dict(sim.handoffs),
    }
    (out / "validate.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def calibrate_p_level(cfg, profile, prof: dict, block_tokens: int, requests, live_mean_step_s: float,
                      scale: float, overhead_s: float, overheads: dict, wan_buffer: float | None = None,
                      iters: int = 12) -> float:
    """The factor ``level`` on P's fitted step shape (``scale`` x profile + ``overhead_s``, from
    :func:`fit_step_scale`) at which the simulated mean P step equals the live one
    (``engine_busy_s / engine_steps``; fixed point, the other roles at ``overheads``). The
    isolated prefills give the shape (what a step costs in proportion to its compute, what per
    step), the engine's own step timing the level: the prefill intervals also hold the request's
    trip gateway -> P -> gateway, which is not step time."""
    lam = 1.0
    for _ in range(iters):
        p = {**prof, "role_step_scale": {**(prof.get("role_step_scale") or {}), "P": lam * scale}}
        sim = simulate(cfg, profile, p, block_tokens, requests, {**overheads, "P": lam * overhead_s}, wan_buffer)
        sv = sim_role_steps(sim)["P"]["mean_step_s"]
        if not sv:
            break
        r = live_mean_step_s / sv
        lam *= r
        if abs(r - 1.0) < 1e-4:
            break
    return lam


def require_completed(live: list[dict], purpose: str) -> None:
    """Raises :class:`RecordedRunError` when no record of the live run completed with tokens
    (every request failed: nothing to ``purpose``), naming up to three of its errors."""
    if not any(r.get("ok") and r.get("token_times_s") for r in live):
        errs = sorted({str(r.get("error"))[:80] for r in live})[:3]
        raise RecordedRunError(f"the live run has no completed request to {purpose} ({len(live)} failed: "
                               f"{'; '.join(errs)})")


def calibrate_roles(run_dir: str | Path, profile: str | Path, out_profile: str | Path | None = None,
                    config=None) -> dict:
    """``pdd sim calibrate-roles``: fit each role's step correction on the live run in ``run_dir``
    (a ``pdd sim validate`` output: its workload arguments, ``requests.jsonl``,
    ``server_stats.json``) and write it into the profile: P's step as ``scale x profile +
    overhead`` (``role_step_scale["P"]``, ``role_step_overhead_s["P"]``): the shape from the run's
    isolated prefills (:func:`fit_step_scale`), its level from P's mean live step
    (:func:`calibrate_p_level`); the other roles' per-step overheads
    (:func:`calibrate_role_overheads`; P's too, with no factor, when the run has too few isolated
    prefills); how much a decode step slows while P prefills beside it (``decode_interference``,
    :func:`live_decode_interference`, fitted before the overheads, which then hold the rest); the
    WAN RTT the gateway's decisions read (``gateway_rtt_ms``,
    :func:`live_gateway_rtt_ms`); ``role_overhead_from``: which run and the fits. Raises
    :class:`RecordedRunError` naming the path for a run directory or profile it cannot use, before
    anything is fitted."""
    run_dir = Path(run_dir)
    v, live_recs, entry = read_run(run_dir)
    w = v["workload"]
    budget = (v.get("config") or {}).get("pipeline_ttft_budget_ms")
    if not isinstance(budget, (int, float)):
        raise RecordedRunError(f"{run_dir / 'validate.json'}: no config.pipeline_ttft_budget_ms (not a `pdd sim "
                               "validate` output)")
    missing = [k for k in ("requests", "rate_rps", "block_tokens", "session_sample") if k not in w]
    if missing:
        raise RecordedRunError(f"{run_dir / 'validate.json'}: workload lacks {', '.join(missing)} (not a `pdd sim "
                               "validate` output)")
    cfg = validate_config(config, budget)
    prof = load_profile_checked(profile)
    require_completed(live_recs, "fit")
    prof.pop("role_step_overhead_s", None)
    requests, _ = build_workload(cfg, n_requests=w["requests"], rate=w["rate_rps"], block_tokens=w["block_tokens"],
                                 session_sample=w["session_sample"], session_seed=w.get("session_seed", 0),
                                 max_output_tokens=w.get("max_output_tokens"), seed=w.get("seed", 0))
    live = live_role_steps(entry)
    live_bytes = live_wan_payload_bytes(entry)
    prof.pop("wan_send_buffer_bytes", None)
    prof["client_delay_s"] = live_client_delay_s(live_recs) or 0.0
    prof.pop("gateway_rtt_ms", None)
    g = live_gateway_rtt_ms(live_recs)
    if g is not None:
        prof["gateway_rtt_ms"] = g
    prof.pop("fast_path", None)
    fp = live_fast_path(live_recs, int(prof["model"]["kv_bytes_per_token"]), cfg.link.fast_gbps)
    if fp is not None:
        prof["fast_path"] = fp
    prof.pop("decode_interference", None)
    di = live_decode_interference(live_recs)
    if di is not None:
        prof["decode_interference"] = di["factors"]
    prof.pop("role_step_scale", None)
    ep = cfg.engine_for("prefill")  # P's chip: its tier's profile, else the given one
    p_prof = load_profile_checked(ep.profile) if ep.profile else prof
    iso = isolated_prefills(live_recs, MeasuredStepModel(p_prof), min(ep.prefill_chunk_tokens, ep.max_batch_tokens))
    sc = fit_step_scale(iso)
    if sc is not None:
        prof["role_step_scale"] = {"P": sc["scale"]}
    bt = w["block_tokens"]
    # two rounds: the buffer moves WAN queueing (not step times), the overheads move step times
    # (and so when transfers start); each fitted with the other fixed
    wb, _ = calibrate_wan_buffer(cfg, profile, prof, bt, requests, live_bytes)
    fx = {"P": sc["overhead_s"]} if sc is not None else None  # P's level is fitted below
    ovh, hist = calibrate_role_overheads(cfg, profile, prof, bt, requests, live, wan_buffer=wb, fixed=fx)
    wb, sim_bytes = calibrate_wan_buffer(cfg, profile, prof, bt, requests, live_bytes, overheads=ovh)
    ovh, hist = calibrate_role_overheads(cfg, profile, prof, bt, requests, live, wan_buffer=wb, fixed=fx)
    if sc is not None and (live.get("P") or {}).get("mean_step_s"):
        sc["level"] = calibrate_p_level(cfg, profile, prof, bt, requests, live["P"]["mean_step_s"], sc["scale"],
                                        sc["overhead_s"], ovh, wb)
        prof["role_step_scale"] = {"P": sc["level"] * sc["scale"]}
        ovh = {**ovh, "P": sc["level"] * sc["overhead_s"]}
    prof["role_step_overhead_s"] = ovh
    prof["wan_send_buffer_bytes"] = wb
    prof["role_overhead_from"] = {"run": str(run_dir), "workload": w, "live_steps": live,
                                  "live_wan_payload_bytes": live_bytes, "sim_wan_bytes": sim_bytes,
                                  "step_scale_fit": {"P": sc}, "decode_interference_fit": di,
                                  "iterations": hist}
    Path(out_profile or profile).write_text(json.dumps(prof, indent=1))
    return prof


def format_validate(res: dict) -> str:
    from pdd.sim.report import table

    rows = []
    for k, name in (("p50_ttft_ms", "TTFT P50 ms"), ("p90_ttft_ms", "TTFT P90 ms"), ("p99_ttft_ms", "TTFT P99 ms"),
                    ("p50_tpot_ms", "TPOT P50 ms")):
        if k in res["live"]:  # a validate.json written before P99 was reported has none
            rows.append({"metric": name, "live": res["live"][k], "sim": res["sim"][k], "rel_err": res[f"err_{k}"]})
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
    errs = res.get("live_errors") or []
    failed = (f"{res['live_failed']} live failures" + (f" ({'; '.join(errs)})" if errs and res['live_failed'] else ""))
    return (table(rows, ["metric", "live", "sim", "rel_err"])
            + f"\nrecorded inputs replayed through the sim's policy calls: {rep['identical']}/{rep['decisions']} "
              f"identical\ncompute share of TTFT {res['compute_share_of_ttft']:.0%}; "
              f"(with P's role overhead {res.get('compute_share_of_ttft_with_role_overhead', 0):.0%}); "
              f"{res['requests_compared']} requests compared, {failed}; live "
              f"{res['live_wall_s'] or 0:.0f} s, sim {res['sim_wall_s']:.2f} s"
              f"\nrole step overheads (ms): " + ", ".join(f"{t} {v * 1e3:.1f}" for t, v in ovh.items())
            + ("; step factors: " + ", ".join(f"{t} x{v:.3f}" for t, v in scale.items()) if scale else "") + steps
            + inputs)
