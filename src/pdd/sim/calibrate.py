"""``pdd sim calibrate-roles``: fit, on one recorded live run, what the bare-engine profile does
not hold: P's step as ``scale x profile + overhead`` and its reply lag (:func:`fit_quiet_step` on
the prefills P ran alone, nothing decoding beside), how much slower its steps run while other
requests decode (:func:`calibrate_p_interference`, on the engine's own step time), the other
roles' per-step overheads
(:func:`calibrate_role_overheads`), the decode slow-down while P prefills, the WAN bytes a
cut-off cannot recall (:func:`calibrate_wan_buffer`), when P has written MD's KV
(:func:`calibrate_wan_written_lead`), the client delay, the gateway's WAN RTT
and the fast path, written into the profile (:func:`calibrate_roles`). The method and its
results: docs/SIM.md "Measure this machine and validate the simulator".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdd.sim.live_measures import (isolated_prefills, live_client_delay_s, live_decode_interference, live_decode_scale,
                                   live_fast_path, live_gateway_rtt_ms, live_role_steps, live_wan_payload_bytes)
from pdd.sim.recorded import (RecordedRunError, check_same_engines, check_same_requests, faults_text,
                              load_profile_checked, read_run, require_completed, run_faults)
from pdd.sim.validate import as_sent, build_workload, sim_role_steps, simulate, validate_config
from pdd.step_profile import MeasuredStepModel


PREFILL_QUIET_BELOW = 0.05  # an isolated prefill decoded beside for under this share of it is "quiet"


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


def calibrate_p_level(cfg, profile, prof: dict, block_tokens: int, requests, live_mean_step_s: float,
                      scale: float, overhead_s: float, overheads: dict, wan_buffer: float | None = None,
                      iters: int = 12, profile_b: str | Path | None = None) -> float:
    """The factor ``level`` on P's fitted step shape (``scale`` x profile + ``overhead_s``, from
    :func:`fit_quiet_step`) at which the simulated mean P step equals the live one
    (``engine_busy_s / engine_steps``; fixed point, the other roles at ``overheads``): the
    calibration's fallback when the quiet fit is slower than the run's engine even with no
    prefill interference (:func:`calibrate_p_interference`), and the P speed diagnostic
    (:mod:`pdd.sim.p_speed`). ``profile_b``: MD's step profile (:func:`pdd.sim.validate.simulate`).

    The mean step is not continuous in the level: a slower P batches other chunks together, so
    the step count jumps. When the fixed point does not settle (to 1e-4) in ``iters`` rounds, the
    level is bisected between the closest levels found below and above the live step (20 rounds)
    and the one whose simulated mean step is nearest the live one is returned."""
    def mean_step(lam):
        p = {**prof, "role_step_scale": {**(prof.get("role_step_scale") or {}), "P": lam * scale}}
        sim = simulate(cfg, profile, p, block_tokens, requests, {**overheads, "P": lam * overhead_s}, wan_buffer,
                       profile_b=profile_b)
        return sim_role_steps(sim)["P"]["mean_step_s"]

    lam, seen = 1.0, []
    for _ in range(iters):
        sv = mean_step(lam)
        if not sv:
            return lam
        seen.append((lam, sv))
        r = live_mean_step_s / sv
        if abs(r - 1.0) < 1e-4:
            return lam
        lam *= r
    lo = max((x for x in seen if x[1] < live_mean_step_s), default=None)
    hi = min((x for x in seen if x[1] > live_mean_step_s), default=None)
    if lo is not None and hi is not None and lo[0] < hi[0]:
        for _ in range(20):
            mid = (lo[0] + hi[0]) / 2
            sv = mean_step(mid)
            seen.append((mid, sv))
            if sv < live_mean_step_s:
                lo = (mid, sv)
            else:
                hi = (mid, sv)
    return min(seen, key=lambda x: abs(x[1] - live_mean_step_s))[0]


def quiet_prefills(prefills: list[dict], below: float = PREFILL_QUIET_BELOW) -> list[dict]:
    """The isolated prefills (:func:`isolated_prefills`) other requests were decoding beside for
    under ``below`` of their time."""
    return [r for r in prefills if r.get("decode_busy_frac", 0.0) < below]


def fit_quiet_step(prefills: list[dict], chunk_tokens: int, min_samples: int = 8,
                   quiet_below: float = PREFILL_QUIET_BELOW, with_lag: bool = True) -> dict | None:
    """P's step and its reply lag from the isolated prefills (:func:`isolated_prefills`) decoded
    beside for under ``quiet_below`` of their time: least squares, in relative error, of
    ``live_s = scale x profile_s + overhead_s x steps + lag x min(tokens, chunk_tokens)``. The
    first two terms are P's engine steps (what a step costs in proportion to its compute, and per
    step), the third the part of the interval that grows with the prefill's largest step but is
    no engine time (``SimConfig.p_reply_lag_s_per_token``): 14.5 us a token on the committed fit
    (``data/profiles/this-machine.json``), which also stands in for the linear step model being
    under a short chunk's measured time; 4.7 us with the chunk grid
    (``MeasuredStepModel(chunk_grid=True)``, off by default; docs/SIM.md "The step between
    measured points"). A negative ``overhead_s`` or ``lag`` is refitted as 0;
    ``with_lag`` False fits the first two terms alone (``scripts/sim_ablation.py``). Quiet
    prefills only (:func:`quiet_prefills`): how much decoding beside slows P is fitted on the
    engine's own step time (:func:`calibrate_p_interference`).

    Returns ``{"scale", "overhead_s", "lag_s_per_token", "samples", "mean_abs_rel_err"}``, or None
    with fewer than ``min_samples`` quiet prefills or a non-positive scale."""
    q = quiet_prefills(prefills, quiet_below)
    if len(q) < min_samples:
        return None
    y = np.array([r["live_s"] for r in q], dtype=float)
    cols = {"scale": np.array([r["profile_s"] for r in q], dtype=float),
            "overhead_s": np.array([r["steps"] for r in q], dtype=float),
            "lag_s_per_token": np.array([min(r["tokens"], chunk_tokens) for r in q], dtype=float)}
    keep = list(cols) if with_lag else ["scale", "overhead_s"]
    while True:
        a = np.vstack([cols[k] for k in keep]).T / y[:, None]
        c, *_ = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)
        fit = dict(zip(keep, (float(v) for v in c)))
        neg = [k for k in keep if k != "scale" and fit[k] < 0]
        if not neg:
            break
        keep.remove(min(neg, key=lambda k: fit[k] * float(np.mean(cols[k]))))  # the most negative share first
    if fit["scale"] <= 0:
        return None
    out = {k: fit.get(k, 0.0) for k in cols}
    pred = sum(out[k] * cols[k] for k in cols)
    return {**out, "samples": len(q), "mean_abs_rel_err": float(np.mean(np.abs(pred / y - 1.0)))}


def calibrate_p_interference(cfg, profile, prof: dict, block_tokens: int, requests, live_mean_step_s: float,
                             overheads: dict, wan_buffer: float | None = None, f_max: float = 5.0,
                             iters: int = 30, profile_b: str | Path | None = None) -> float | None:
    """The prefill interference (``SimConfig.prefill_interference``) at which the simulated mean
    P step equals the live one (``engine_busy_s / engine_steps``), P's step as ``prof`` has it
    (fitted on the quiet prefills, :func:`fit_quiet_step`), bisected on [1, ``f_max``]: the
    engine's own time says how much slower its steps run while other requests decode. None when
    no factor in that range gives the live mean step: at 1 the simulated one already reaches it
    (the quiet fit is too slow for this run's engine), or even ``f_max`` falls short of it (the
    run decodes beside P too little for a factor to matter, or its instances share no host);
    :func:`calibrate_p_level` then fits P's level on the quiet fit instead."""
    def mean_step(f):
        sim = simulate(cfg, profile, {**prof, "prefill_interference": f}, block_tokens, requests, overheads,
                       wan_buffer, profile_b=profile_b)
        return sim_role_steps(sim)["P"]["mean_step_s"] or 0.0

    lo, m_lo = 1.0, mean_step(1.0)
    if m_lo >= live_mean_step_s:
        return None
    hi, m_hi = f_max, mean_step(f_max)
    if m_hi <= live_mean_step_s:
        return None
    seen = [(lo, m_lo), (hi, m_hi)]
    for _ in range(iters):
        mid = (lo + hi) / 2
        m = mean_step(mid)
        seen.append((mid, m))
        if m < live_mean_step_s:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-4:
            break
    return min(seen, key=lambda x: abs(x[1] - live_mean_step_s))[0]


def calibrate_p_dispatch(cfg, profile, prof: dict, block_tokens: int, requests, prefills: list[dict],
                         overheads: dict, wan_buffer: float | None = None) -> dict | None:
    """P's dispatch delay (``SimConfig.p_dispatch_s``): the median, over ``prefills`` (the run's
    isolated ones, :func:`isolated_prefills`; the calibration passes the quiet ones), of the live
    P interval (the client's send to the gateway's ``p_first_token``) less the simulated one
    (arrival to P's reply) with every other fit in place: what the steps and the reply lag
    (:func:`fit_quiet_step`) leave of the interval, the same for every request (the gateway's RLD
    expect call, P's RPC each way). Returns ``{"dispatch_s"`` (that median, or 0 when it is
    negative), ``"median_diff_s"`` (the median itself), ``"samples"``, ``"median_live_s"``,
    ``"median_sim_s"}``, or None without isolated prefills."""
    sim = simulate(cfg, profile, prof, block_tokens, requests, overheads, wan_buffer)
    res, lv, sv = [], [], []
    for r in prefills:
        q = sim.reqs[r["index"]]
        if q.t_prefill_done is None:
            continue
        s_ = q.t_prefill_done - q.arrival
        res.append(r["live_s"] - s_)
        lv.append(r["live_s"])
        sv.append(s_)
    if not res:
        return None
    med = float(np.median(res))
    return {"dispatch_s": max(0.0, med), "median_diff_s": med, "samples": len(res),
            "median_live_s": float(np.median(lv)), "median_sim_s": float(np.median(sv))}


WRITTEN_LEAD_MAX_BYTES = 4 * 2 ** 20  # the bisection's top: net.ipv4.tcp_wmem's autotuned maximum here


def live_kv_written_s(live_records: list[dict]) -> dict:
    """Request index -> seconds from the client's send to the gateway's ``xfer_done`` event (P
    reported MD's KV written to its sockets), for the requests relayed to MD (``p_rld_md``) that
    have one."""
    out = {}
    for i, rec in enumerate(live_records):
        p = rec.get("pdd") or {}
        x = (p.get("events_ms") or {}).get("xfer_done")
        if rec.get("ok") and p.get("pipeline") == "p_rld_md" and isinstance(x, (int, float)) \
                and not isinstance(x, bool):
            out[i] = float(x) / 1000.0
    return out


def calibrate_wan_written_lead(cfg, profile, prof: dict, block_tokens: int, requests, live_records: list[dict],
                               overheads: dict, wan_buffer: float | None = None, min_samples: int = 8,
                               hi_bytes: float = WRITTEN_LEAD_MAX_BYTES, tol_bytes: float = 1024.0,
                               profile_b: str | Path | None = None) -> dict | None:
    """The bytes of MD's KV still to go on the line when P has written it
    (``SimConfig.wan_written_lead_bytes``: P's send buffer and the link's) at which the simulated
    written point of the relayed requests (``Req.t_kv_written``, which starts an early handoff's
    wait) falls, at the median, on the live one (:func:`live_kv_written_s`), each from the
    request's send: bisected on [0, ``hi_bytes``] to ``tol_bytes`` (a larger lead writes earlier).
    The live point comes when P's sockets took the last byte, about one bandwidth-delay product
    of the line before it leaves (``policy.wan_send_buffer_bdp``), which the bytes a cut-off cannot
    recall (``wan_buffer``, :func:`calibrate_wan_buffer`: the link's receive side too) overstate.
    Returns ``{"lead_bytes", "samples", "median_diff_s"}`` (simulated less live at that lead), or
    None with fewer than ``min_samples`` requests written both live and simulated (no early
    handoff, no relayed requests)."""
    live = live_kv_written_s(live_records)

    def diff(lead):
        sim = simulate(cfg, profile, {**prof, "wan_written_lead_bytes": lead}, block_tokens, requests, overheads,
                       wan_buffer, profile_b=profile_b)
        d = [sim.reqs[i].t_kv_written - sim.reqs[i].arrival - t for i, t in live.items()
             if i < len(sim.reqs) and sim.reqs[i].t_kv_written is not None]
        return (float(np.median(d)) if d else 0.0), len(d)

    lo, (d_lo, n) = 0.0, diff(0.0)
    if n < min_samples:
        return None
    if d_lo <= 0.0:  # even written as its last byte leaves, the simulated point is not late
        return {"lead_bytes": 0.0, "samples": n, "median_diff_s": d_lo}
    hi, (d_hi, _) = float(hi_bytes), diff(float(hi_bytes))
    if d_hi >= 0.0:
        return {"lead_bytes": hi, "samples": n, "median_diff_s": d_hi}
    best = min(((lo, d_lo), (hi, d_hi)), key=lambda x: abs(x[1]))
    while hi - lo > tol_bytes:
        mid = (lo + hi) / 2
        d_mid, _ = diff(mid)
        if abs(d_mid) < abs(best[1]):
            best = (mid, d_mid)
        if d_mid > 0.0:
            lo = mid
        else:
            hi = mid
    return {"lead_bytes": float(round(best[0])), "samples": n, "median_diff_s": best[1]}


def calibrate_roles(run_dir: str | Path, profile: str | Path, out_profile: str | Path | None = None,
                    config=None, *, before_model=None) -> dict:
    """``pdd sim calibrate-roles``: fit each role's step correction on the live run in ``run_dir``
    (a ``pdd sim validate`` output: its workload arguments, ``requests.jsonl``,
    ``server_stats.json``) and write it into the profile: P's step as ``scale x profile +
    overhead`` (``role_step_scale["P"]``, ``role_step_overhead_s["P"]``) and its reply lag
    (``p_reply_lag_s_per_token``) from the run's isolated prefills with nothing decoding beside
    (:func:`fit_quiet_step`); the factor on P's step while other requests decode
    (``prefill_interference``) where the simulated mean P step equals P's mean live step
    (:func:`calibrate_p_interference`; when no factor in [1, 5] does, :func:`calibrate_p_level`
    scales the quiet fit to that step instead); the part of P's interval that is neither
    (``p_dispatch_s``, :func:`calibrate_p_dispatch`); RLD's step as a factor over its bare engine's
    (``role_step_scale["RLD"]``, :func:`live_decode_scale`: the median token gap of a request
    decoding alone over the bare step at its context); the other roles' per-step overheads
    (:func:`calibrate_role_overheads`; P's too, with no factor, when the run has too few isolated
    prefills); how much a decode step slows while P prefills beside it (``decode_interference``,
    :func:`live_decode_interference`, fitted before the overheads, which then hold the rest); the
    WAN RTT the gateway's decisions read (``gateway_rtt_ms``,
    :func:`live_gateway_rtt_ms`); the bytes of MD's KV still to go when P has written it
    (``wan_written_lead_bytes``, :func:`calibrate_wan_written_lead`); ``role_overhead_from``:
    which run and the fits. Raises
    :class:`RecordedRunError` naming the path for a run directory or profile it cannot use, before
    anything is fitted and before anything needs the model checkpoint (the workload's tokens):
    each is read once, here. ``before_model(cfg)``, when given, is called with the run's
    ``ClusterConfig`` once they are read and checked, before that (``pdd sim calibrate-roles``
    checks the checkpoint and ``--out`` there, so a bad run or profile is named first)."""
    run_dir = Path(run_dir)
    v, live_recs, entry = read_run(run_dir)
    prof = load_profile_checked(profile)
    w = v["workload"]
    budget = (v.get("config") or {}).get("pipeline_ttft_budget_ms")
    if not isinstance(budget, (int, float)):
        raise RecordedRunError(f"{run_dir / 'validate.json'}: no config.pipeline_ttft_budget_ms (not a `pdd sim "
                               "validate` output)")
    missing = [k for k in ("requests", "rate_rps", "block_tokens", "session_sample") if k not in w]
    if missing:
        raise RecordedRunError(f"{run_dir / 'validate.json'}: workload lacks {', '.join(missing)} (not a `pdd sim "
                               "validate` output)")
    cfg = validate_config(config, budget, v.get("config") or {})
    check_same_engines(entry, cfg)  # fitted on the topology the run had, not the default one
    require_completed(live_recs, "fit")
    bad = faults_text(run_faults(live_recs, entry), len(live_recs))
    if bad:  # fitted on a run that lost an instance, every fit would hold the fault
        raise RecordedRunError(f"{run_dir}: the live run lost an instance ({bad}): not a calibration run; record "
                               "another")
    if before_model is not None:
        before_model(cfg)
    prof.pop("role_step_overhead_s", None)
    prof.pop("p_dispatch_s", None)  # fitted last, from the other fits' simulation
    prof.pop("p_reply_lag_s_per_token", None)
    requests, _ = build_workload(cfg, n_requests=w["requests"], rate=w["rate_rps"], block_tokens=w["block_tokens"],
                                 session_sample=w["session_sample"], session_seed=w.get("session_seed", 0),
                                 max_output_tokens=w.get("max_output_tokens"), seed=w.get("seed", 0))
    check_same_requests(live_recs, [len(r.prompt_ids) for r in requests])  # fitted on the run's own requests
    requests = as_sent(requests, live_recs)  # as the live system received them
    live = live_role_steps(entry)
    live_bytes = live_wan_payload_bytes(entry)
    prof.pop("wan_send_buffer_bytes", None)
    prof.pop("wan_written_lead_bytes", None)
    prof["client_delay_s"] = live_client_delay_s(live_recs) or 0.0
    prof.pop("gateway_rtt_ms", None)
    prof.pop("gateway_rtt_line_ms", None)
    g = live_gateway_rtt_ms(live_recs)
    if g is not None:
        prof["gateway_rtt_ms"] = g
        prof["gateway_rtt_line_ms"] = float(cfg.link.wan_rtt_ms)  # the line it was measured on
    prof.pop("fast_path", None)
    fp = live_fast_path(live_recs, int(prof["model"]["kv_bytes_per_token"]), cfg.link.fast_gbps)
    if fp is not None:
        prof["fast_path"] = fp
    prof.pop("decode_interference", None)
    di = live_decode_interference(live_recs)
    if di is not None:
        prof["decode_interference"] = di["factors"]
    prof.pop("role_step_scale", None)
    # RLD's step against its bare engine's, from the gaps of a request decoding alone (a factor:
    # the live gap grows with the context faster than the bare step); the per-step
    # overheads below then hold what is left of its mean engine step. MD keeps an overhead alone:
    # a run is often re-simulated with MD on another engine (tier B's own bare profile,
    # --profile-b: bf16 on this CPU steps 1.5-2.2x as long), which a factor fitted against this
    # one would scale with it (the heterogeneous runs' MD step 9.0 ms simulated, 7.2 live),
    # where a per-step overhead carries over (7.5 ms)
    ep_rld = cfg.engine_for("relay_decode")
    ds = live_decode_scale(live_recs, {"RLD": MeasuredStepModel(load_profile_checked(ep_rld.profile)
                                                                if ep_rld.profile else prof)})
    scales = dict(ds["factors"]) if ds is not None else {}
    ep = cfg.engine_for("prefill")  # P's chip: its tier's profile, else the given one
    p_prof = load_profile_checked(ep.profile) if ep.profile else prof
    iso = isolated_prefills(live_recs, MeasuredStepModel(p_prof), min(ep.prefill_chunk_tokens, ep.max_batch_tokens))
    prof.pop("prefill_interference", None)
    sc = fit_quiet_step(iso, min(ep.prefill_chunk_tokens, ep.max_batch_tokens))
    if sc is not None:
        scales["P"] = sc["scale"]
    if scales:
        prof["role_step_scale"] = dict(scales)
    if sc is not None:
        if sc["lag_s_per_token"] > 0:
            prof["p_reply_lag_s_per_token"] = sc["lag_s_per_token"]
    bt = w["block_tokens"]
    # two rounds: the buffer moves WAN queueing (not step times), the overheads move step times
    # (and so when transfers start); each fitted with the other fixed
    wb, _ = calibrate_wan_buffer(cfg, profile, prof, bt, requests, live_bytes)
    fx = {"P": sc["overhead_s"]} if sc is not None else None  # P's level is fitted below
    ovh, hist = calibrate_role_overheads(cfg, profile, prof, bt, requests, live, wan_buffer=wb, fixed=fx)
    wb, sim_bytes = calibrate_wan_buffer(cfg, profile, prof, bt, requests, live_bytes, overheads=ovh)
    ovh, hist = calibrate_role_overheads(cfg, profile, prof, bt, requests, live, wan_buffer=wb, fixed=fx)
    if sc is not None and (live.get("P") or {}).get("mean_step_s"):
        f = calibrate_p_interference(cfg, profile, prof, bt, requests, live["P"]["mean_step_s"], ovh, wb)
        sc["prefill_interference"], sc["level"] = f or 1.0, 1.0
        if f is not None and f > 1.0:
            prof["prefill_interference"] = f
        elif f is None:  # no factor gives the engine's mean step: P's level on the quiet fit does
            sc["level"] = calibrate_p_level(cfg, profile, prof, bt, requests, live["P"]["mean_step_s"],
                                            sc["scale"], sc["overhead_s"], ovh, wb)
            prof["role_step_scale"] = {**scales, "P": sc["level"] * sc["scale"]}
            ovh = {**ovh, "P": sc["level"] * sc["overhead_s"]}
    quiet = quiet_prefills(iso)
    disp = calibrate_p_dispatch(cfg, profile, prof, bt, requests, quiet if len(quiet) >= 8 else iso, ovh, wb) \
        if iso else None
    if disp is not None and disp["dispatch_s"] > 0:
        prof["p_dispatch_s"] = disp["dispatch_s"]
    prof["role_step_overhead_s"] = ovh
    prof["wan_send_buffer_bytes"] = wb
    wl = calibrate_wan_written_lead(cfg, profile, prof, bt, requests, live_recs, ovh, wb)
    if wl is not None:
        prof["wan_written_lead_bytes"] = wl["lead_bytes"]
    prof["role_overhead_from"] = {"run": str(run_dir), "workload": w, "live_steps": live,
                                  "live_wan_payload_bytes": live_bytes, "sim_wan_bytes": sim_bytes,
                                  "step_scale_fit": {"P": sc}, "decode_interference_fit": di,
                                  "decode_scale_fit": ds,
                                  "p_dispatch_fit": disp, "wan_written_lead_fit": wl,
                                  "iterations": hist}
    Path(out_profile or profile).write_text(json.dumps(prof, indent=1))
    return prof
