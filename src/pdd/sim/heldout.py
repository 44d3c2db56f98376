"""Held-out validation: `pdd sim validate-report`.

The profile (``pdd profile`` + ``pdd sim calibrate-roles``) is fitted on one calibration run;
the simulator is then judged on other runs nobody fitted to (``pdd sim validate --out DIR`` with
other ``--session-seed`` / ``--rate`` / ``--max-output-tokens`` / ``--budget-ms``), each read
from its ``validate.json``. Beside the error stands the **noise floor**: the same workload run
live twice (two ``pdd sim validate`` directories with identical workload arguments), compared
with each other exactly as the simulator is compared with a live run (``live_vs_live``).

All inputs are recorded files; nothing here starts a topology or a simulation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdd.sim.recorded import RecordedRunError, faults_text, read_run, run_engines
from pdd.sim.sim_config import LIVE_FIT_FIELDS
from pdd.sim.uncertainty import METRICS, error_intervals, share_interval
from pdd.sim.validate import decisions_of, error_distribution

CI_NAMES = frozenset(name for name, _, _ in METRICS)  # the metrics given an interval (not P99)

# the goals of issue 25 (docs/SIM.md): |TTFT P50| and |TTFT P90| error, decision match
GOALS = {"ttft_p50_abs_err": 0.05, "ttft_p90_abs_err": 0.05, "decision_match": 0.95}
# a goal judged against the run's 95% interval (``judge_against_interval``): met; not met, but the
# interval reaches the goal (the run cannot tell its error from one that meets it); missed beyond it
VERDICTS = ("met", "within the interval", "missed beyond the interval")
WORKLOAD_KEYS = ("requests", "rate_rps", "block_tokens", "session_sample", "session_seed", "max_output_tokens", "seed")


def _ttft_tpot(rec: dict) -> tuple[float, float | None] | None:
    if not rec.get("ok") or not rec.get("token_times_s"):
        return None
    tt = rec["token_times_s"]
    tpot = (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None
    return tt[0] - rec["send_s"], tpot


def _metrics(ttft: list[float], tpot: list[float]) -> dict:
    def pct(v, p):
        return float(np.percentile(v, p)) * 1e3 if v else None

    return {"p50_ttft_ms": pct(ttft, 50), "p90_ttft_ms": pct(ttft, 90), "p99_ttft_ms": pct(ttft, 99),
            "p50_tpot_ms": pct(tpot, 50)}


def live_vs_live(a: list[dict], b: list[dict]) -> dict:
    """The noise floor: run ``b`` against run ``a`` of the same workload (request records of the
    bench client, matched by position), with the metrics the simulator is judged on: TTFT P50 /
    P90 / P99 and TPOT P50 of each and ``b / a - 1``, the TTFT P50 / P90 and TPOT P50 ones with
    their 95% paired-bootstrap interval (``err_ci``, :func:`pdd.sim.uncertainty.error_intervals`);
    per request ``(b - a) / a`` of TTFT
    (``error_distribution``); the share of requests both runs decided alike (pipeline, and the
    final round's handoff mode) and the pipeline alone.

    Raises ValueError when the runs hold different numbers of requests or another request at
    some position (``prompt_tokens`` / ``max_tokens`` differ): not the same workload."""
    if len(a) != len(b):
        raise ValueError(f"the runs hold {len(a)} and {len(b)} requests: not the same workload")
    for i, (ra, rb) in enumerate(zip(a, b)):
        for k in ("prompt_tokens", "max_tokens"):
            if ra.get(k) != rb.get(k):
                raise ValueError(f"request {i}: {k} {ra.get(k)} vs {rb.get(k)}: not the same workload")
    ta, pa, tb, pb, per = [], [], [], [], []
    ttft_pairs, tpot_pairs = [], []  # (run a, run b) of each request both completed
    n = match = pl = 0
    for ra, rb in zip(a, b):
        ma, mb = _ttft_tpot(ra), _ttft_tpot(rb)
        if ma is None or mb is None:
            continue
        n += 1
        ta.append(ma[0])
        tb.append(mb[0])
        ttft_pairs.append((ma[0], mb[0]))
        if ma[1] is not None:
            pa.append(ma[1])
        if mb[1] is not None:
            pb.append(mb[1])
        if ma[1] is not None and mb[1] is not None:
            tpot_pairs.append((ma[1], mb[1]))
        if ma[0] > 0:
            per.append(mb[0] / ma[0] - 1.0)
        da = decisions_of((ra.get("pdd") or {}).get("decisions"))
        db = decisions_of((rb.get("pdd") or {}).get("decisions"))
        match += da == db
        pl += da["pipeline"] == db["pipeline"]
    out = {"requests_compared": n, "live_failed": [sum(1 for r in a if not r.get("ok")),
                                                   sum(1 for r in b if not r.get("ok"))],
           "a": _metrics(ta, pa), "b": _metrics(tb, pb),
           "decision_match_share": match / n if n else None, "pipeline_match_share": pl / n if n else None,
           "ttft_error_per_request": error_distribution(per)}
    for k in out["a"]:
        x, y = out["a"][k], out["b"][k]
        out[f"err_{k}"] = None if not x or y is None else y / x - 1.0
    out["err_ci"] = error_intervals(ttft_pairs, tpot_pairs)
    return out


def read_records(run_dir: str | Path) -> list[dict]:
    """``requests.jsonl`` of a ``pdd sim validate`` directory (ValueError naming the file)."""
    from pdd.files import MAX_DATA_BYTES, read_text

    p = Path(run_dir) / "requests.jsonl"
    try:
        return [json.loads(x) for x in read_text(p, MAX_DATA_BYTES, "give a `pdd sim validate --out` directory's file")
                .splitlines() if x.strip()]
    except (OSError, ValueError) as e:  # json.JSONDecodeError, pdd.files.InputFileError
        raise ValueError(f"{p}: cannot read the live run's requests: {e}") from None


def read_validate(run_dir: str | Path) -> dict:
    """``validate.json`` of a ``pdd sim validate`` directory, with its ``workload``, ``live``
    and ``sim`` objects and decision match (ValueError naming the file and field)."""
    from pdd.files import MAX_DATA_BYTES, read_text

    p = Path(run_dir) / "validate.json"
    try:
        v = json.loads(read_text(p, MAX_DATA_BYTES, "give a `pdd sim validate --out` directory's file"))
    except (OSError, ValueError) as e:  # json.JSONDecodeError, pdd.files.InputFileError
        raise ValueError(f"{p}: cannot read a validate result: {e}") from None
    if not isinstance(v, dict):
        raise ValueError(f"{p}: not a JSON object")
    for k in ("workload", "live", "sim", "decision_match_share"):
        if k not in v:
            raise ValueError(f"{p}: {k} is missing")
    for k in ("workload", "live", "sim"):
        if not isinstance(v[k], dict):
            raise ValueError(f"{p}: {k} must be an object, got {v[k]!r}")
    if v.get("config") is not None and not isinstance(v["config"], dict):
        raise ValueError(f"{p}: config must be an object, got {v['config']!r}")
    _check_err_ci(p, v.get("err_ci"))
    _check_numbers(p, v)
    return v


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and bool(np.isfinite(x))


# the latencies the report reads from ``live`` and ``sim`` (ms) and their errors (``err_*``)
REPORTED = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms")


def _check_numbers(p, v: dict) -> None:
    """ValueError naming the file and field unless every other number the report reads is what
    `pdd sim validate` writes (each may be absent or null: not recorded): ``live`` / ``sim``
    latencies finite ms >= 0; ``err_*``, ``at_live_p_speed``'s and ``at_live_speed``'s errors finite; shares
    (``decision_match_share``, ``pipeline_match_share``, ``ttft_error_per_request.within_*``) in
    [0, 1]; ``requests_compared`` and ``live_failed`` whole numbers >= 0; ``ttft_error_per_request`` an object with finite
    ``median`` and ``abs_p50`` / ``abs_p90`` >= 0; ``at_live_p_speed`` an object with a finite
    ``level`` > 0, ``at_live_speed`` one whose ``factors`` are finite numbers > 0 (what the report
    prints)."""
    def bad(field, what, x):
        raise ValueError(f"{p}: {field} must be {what}, got {json.dumps(x)}")

    for side in ("live", "sim"):
        for k in REPORTED:
            x = v[side].get(k)
            if x is not None and not (_is_num(x) and x >= 0):
                bad(f"{side}.{k}", "null or a finite number of ms >= 0", x)
    for k in REPORTED:
        x = v.get(f"err_{k}")
        if x is not None and not _is_num(x):
            bad(f"err_{k}", "null or a finite number", x)
    for k in ("decision_match_share", "pipeline_match_share"):
        x = v.get(k)
        if x is not None and not (_is_num(x) and 0 <= x <= 1):
            bad(k, "null or a share in [0, 1]", x)
    for k in ("requests_compared", "live_failed"):
        x = v.get(k)
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
            bad(k, "a whole number >= 0", x)
    per = v.get("ttft_error_per_request")
    if per is not None:
        if not isinstance(per, dict):
            bad("ttft_error_per_request", "null or an object", per)
        for k in ("median", "abs_p50", "abs_p90", "abs_p99", "within_5pct", "within_10pct", "within_25pct"):
            x = per.get(k)
            required = k in ("median", "abs_p50", "abs_p90")
            if x is None and not required:
                continue
            if k == "median":
                ok, what = _is_num(x), "a finite number"
            elif k.startswith("abs_"):
                ok, what = _is_num(x) and x >= 0, "a finite number >= 0"
            else:
                ok, what = _is_num(x) and 0 <= x <= 1, "null or a share in [0, 1]"
            if not ok:
                bad(f"ttft_error_per_request.{k}", what, x)
    ps = v.get("at_live_p_speed")
    if ps is not None:
        if not isinstance(ps, dict):
            bad("at_live_p_speed", "null or an object", ps)
        x = ps.get("level")
        if not (_is_num(x) and x > 0):
            bad("at_live_p_speed.level", "a finite number > 0", x)
        for k in ("err_p50_ttft_ms", "err_p90_ttft_ms"):
            x = ps.get(k)
            if x is not None and not _is_num(x):
                bad(f"at_live_p_speed.{k}", "null or a finite number", x)
    phases = v.get("ttft_phases")
    if phases is not None:
        if not isinstance(phases, list):
            bad("ttft_phases", "null or a list", phases)
        for i, ph in enumerate(phases):
            if not isinstance(ph, dict) or not isinstance(ph.get("prompt_tokens_computed"), str):
                bad(f"ttft_phases[{i}]", "an object with a prompt_tokens_computed bucket name", ph)
            x = ph.get("requests")
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                bad(f"ttft_phases[{i}].requests", "a whole number >= 0", x)
            for k in ("to_p_reply_ms", "after_p_reply_ms"):
                for side in ("live", "sim"):
                    d = ph.get(k)
                    x = d.get(side) if isinstance(d, dict) else d
                    if not (isinstance(d, dict) and _is_num(x)):
                        bad(f"ttft_phases[{i}].{k}.{side}", "a finite number of ms", x)
    sp = v.get("at_live_speed")
    if sp is not None:
        if not isinstance(sp, dict) or not isinstance(sp.get("factors"), dict):
            bad("at_live_speed", "null or an object with 'factors'", sp)
        for r, x in sp["factors"].items():
            if not (_is_num(x) and x > 0):
                bad(f"at_live_speed.factors.{r}", "a finite number > 0", x)
        for k in ("err_p50_ttft_ms", "err_p90_ttft_ms"):
            x = sp.get(k)
            if x is not None and not _is_num(x):
                bad(f"at_live_speed.{k}", "null or a finite number", x)


def _check_err_ci(p, ci) -> None:
    """ValueError naming the file and field unless ``err_ci`` (optional: absent or null in a
    validate.json written before it was reported) is an object whose judged metrics are each
    null or ``[lo, hi]``, two finite numbers with lo <= hi (what the report prints)."""
    if ci is None:
        return
    if not isinstance(ci, dict):
        raise ValueError(f"{p}: err_ci must be an object, got {json.dumps(ci)}")
    for name, _, _ in METRICS:
        x = ci.get(name)
        if x is None:
            continue
        if not (isinstance(x, list) and len(x) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and np.isfinite(b) for b in x)
                and x[0] <= x[1]):
            raise ValueError(f"{p}: err_ci.{name} must be null or [lo, hi], two finite numbers with lo <= hi, "
                             f"got {json.dumps(x)}")


# the profile fields a re-simulation applies (pdd.sim.validate.simulate): held-out runs must share them
FIT_FIELDS = (*LIVE_FIT_FIELDS, "role_overhead_from")


def _same_path(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def check_simulated_alike(cal_dir, cal: dict, d, v: dict) -> None:
    """ValueError when the held-out run ``d`` (its validate.json ``v``) cannot be judged against
    the calibration run: its simulation applied another profile fit than the calibration's
    (``FIT_FIELDS``: e.g. a recorded run's own, older simulated half), or the profile was fitted
    on this very run (``profile.role_overhead_from`` is its live run)."""
    pc, pv = cal.get("profile") or {}, v.get("profile") or {}
    diff = [k for k in FIT_FIELDS if pc.get(k) != pv.get(k)]
    if diff:
        raise ValueError(f"{d}: simulated with another profile fit than the calibration run {cal_dir} ("
                         f"{', '.join(diff)} differ); re-simulate both with one profile: pdd sim validate "
                         "--profile FIT --live-from RUN")
    fitted = pv.get("role_overhead_from")
    if _same_path(fitted, v.get("live_from") or d):
        raise ValueError(f"{d}: its profile was fitted on this run ({fitted}): not held out")


def _workload(v: dict) -> dict:
    """The arguments that define a run: the workload's, and the pipeline budget (``--budget-ms``)."""
    w = {k: v["workload"].get(k) for k in WORKLOAD_KEYS}
    w["budget_ms"] = (v.get("config") or {}).get("pipeline_ttft_budget_ms")
    return w


def _judge(row: dict, goals: dict) -> dict:
    p50, p90, dm = row.get("err_p50_ttft_ms"), row.get("err_p90_ttft_ms"), row.get("decision_match_share")
    return {"ttft_p50": p50 is not None and abs(p50) <= goals["ttft_p50_abs_err"],
            "ttft_p90": p90 is not None and abs(p90) <= goals["ttft_p90_abs_err"],
            "decision_match": dm is not None and dm >= goals["decision_match"]}


def judge_against_interval(row: dict, goals: dict) -> dict:
    """Each goal of ``row`` (a held-out row of :func:`held_out_report`) judged against the run's
    95% interval: ``{"ttft_p50" | "ttft_p90" | "decision_match": verdict}``, one of
    ``VERDICTS``: ``met`` (the goal check itself, :func:`_judge`); ``within the interval`` (not
    met, but the error's interval, ``err_ci``, overlaps ``[-goal, +goal]``, or the decision match's,
    ``decision_match_ci``, reaches ``goals["decision_match"]``: a run of this size cannot tell the
    simulator's error from one that meets the goal); ``missed beyond the interval`` (the whole
    interval is outside the goal); None when the run has no interval for it (a validate.json
    written before intervals were reported). What issue 25 asks for: the goal "judged against the
    noise"; the run-to-run noise floor (``noise_floor``) is reported beside it."""
    meets = _judge(row, goals)
    ci = row.get("err_ci") or {}
    out: dict = {}
    for goal, metric in (("ttft_p50", "p50_ttft_ms"), ("ttft_p90", "p90_ttft_ms")):
        band = goals[f"{goal}_abs_err"]
        iv = ci.get(metric)
        if meets[goal]:
            out[goal] = VERDICTS[0]
        elif not iv:
            out[goal] = None
        else:
            out[goal] = VERDICTS[1] if iv[0] <= band and iv[1] >= -band else VERDICTS[2]
    iv = row.get("decision_match_ci")
    if meets["decision_match"]:
        out["decision_match"] = VERDICTS[0]
    elif not iv:
        out["decision_match"] = None
    else:
        out["decision_match"] = VERDICTS[1] if iv[1] >= goals["decision_match"] else VERDICTS[2]
    return out


def held_out_report(calibration: str | Path, held_out: list[str | Path], noise: tuple | None = None,
                    goals: dict | None = None) -> dict:
    """Judge the simulator on ``held_out`` validate directories against the ``calibration`` one.

    Each held-out run must differ from the calibration run in its workload arguments
    (ValueError otherwise: it would not be held out). Per run: TTFT P50 / P90 / P99 and TPOT P50
    live and simulated with their errors, the per-request TTFT error distribution, decision and
    pipeline match, and the goal checks (``GOALS``). ``noise``: two directories of one workload,
    run live twice, compared with ``live_vs_live``."""
    goals = {**GOALS, **(goals or {})}
    for i, d in enumerate(held_out):
        if any(_same_path(d, e) for e in held_out[:i]):
            raise ValueError(f"--held-out: {d} is given twice; each held-out run once")
    cal = read_validate(calibration)
    cw = _workload(cal)
    runs = []
    for d in held_out:
        v = read_validate(d)
        w = _workload(v)
        if w == cw:
            raise ValueError(f"{d}: the same workload as the calibration run {calibration}: not held out")
        check_simulated_alike(calibration, cal, d, v)
        lost = faults_text(v.get("live_faults") or {"degraded": 0, "unreachable": []}, v.get("requests_compared") or 0)
        if lost:
            raise ValueError(f"{d}: its live run lost an instance ({lost}): it measured another topology; not a "
                             "held-out run")
        row = {"run": str(d), "workload": w, "changed": sorted(k for k in w if w[k] != cw[k]),
               "requests_compared": v.get("requests_compared"), "live_failed": v.get("live_failed") or 0,
               "live": v["live"], "sim": v["sim"],
               "decision_match_share": v["decision_match_share"], "pipeline_match_share": v.get("pipeline_match_share"),
               "ttft_error_per_request": v.get("ttft_error_per_request"),
               "err_ci": v.get("err_ci"),  # absent in a validate.json written before it was reported
               "profile_fitted_on": (v.get("profile") or {}).get("role_overhead_from"),
               "at_live_p_speed": v.get("at_live_p_speed"), "at_live_speed": v.get("at_live_speed"),
               "ttft_phases": v.get("ttft_phases")}  # absent in a validate.json written before it was reported
        for k in REPORTED:
            lv, sv = v["live"].get(k), v["sim"].get(k)
            row[f"err_{k}"] = v.get(f"err_{k}", None if not lv or sv is None else sv / lv - 1.0)
        dm, nc = v.get("decision_match_share"), v.get("requests_compared") or 0
        row["decision_match_ci"] = list(share_interval(int(round(dm * nc)), nc)) if dm is not None and nc else None
        row["meets"] = _judge(row, goals)
        row["judged"] = judge_against_interval(row, goals)
        runs.append(row)
    out = {"calibration": str(calibration), "calibration_workload": cw, "goals": goals, "held_out": runs,
           "all_meet": bool(runs) and all(all(r["meets"].values()) for r in runs),
           "judged": {g: {v_: sum(r["judged"][g] == v_ for r in runs) for v_ in VERDICTS}
                      for g in ("ttft_p50", "ttft_p90", "decision_match")}}
    if noise:
        a, b = noise
        if _same_path(a, b):
            raise ValueError(f"--noise {a} {b}: one directory twice; the noise floor needs two live runs")
        va, vb = read_validate(a), read_validate(b)
        if _workload(va) != _workload(vb):
            raise ValueError(f"--noise {a} {b}: different workloads; the noise floor needs one workload run twice")
        (_, ra, ea), (_, rb, eb) = _recorded(a, va), _recorded(b, vb)
        if run_engines(ea) != run_engines(eb):
            raise ValueError(f"--noise {a} {b}: different topologies ({run_engines(ea)} vs {run_engines(eb)}); the "
                             "noise floor needs one topology run twice")
        try:
            nf = live_vs_live(ra, rb)
        except ValueError as e:
            raise ValueError(f"--noise {a} {b}: {e}") from None
        out["noise_floor"] = {"runs": [str(a), str(b)], "workload": _workload(va), **nf}
    return out


def _recorded(run_dir, v: dict | None = None):
    """``read_run`` of a noise-floor directory, its errors as ValueError (the report's usage errors).
    A re-simulation (``pdd sim validate --live-from RUN --out DIR``) writes only validate.json:
    its live run is RUN's, which the error names."""
    try:
        return read_run(run_dir)
    except RecordedRunError as e:
        src = (v or {}).get("live_from")
        if src and not (Path(run_dir) / "requests.jsonl").exists():
            raise ValueError(f"--noise {run_dir}: a re-simulation of the live run {src} (`pdd sim validate "
                             f"--live-from`), which holds no live requests of its own; give --noise the live "
                             f"run's directory ({src})") from None
        raise ValueError(str(e)) from None


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _ci(ci) -> str:
    """`` [lo, hi]`` in percent: whole ones, one decimal under 1% (-0.2 stays visibly below 0)."""
    def pc(x):
        return f"{x * 100:+.1f}" if abs(x) < 0.01 else f"{round(x * 100):+d}"
    return "" if not ci else f" [{pc(ci[0])}, {pc(ci[1])}]"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_report(rep: dict) -> str:
    """Markdown: one row per held-out run (and the noise floor), then the goals."""
    head = ("| run | changed | requests compared | TTFT P50 live / sim ms (error [95% interval]; noise floor: run 1 / run 2) | P90 | P99 | TPOT P50 | per-request "
            "TTFT error: median, \\|e\\| P50 / P90 / P99, within 10% | decision match | pipeline match | goals met | "
            "TTFT P50 / P90 error at the run's own P speed (P step factor); every role at its own speed (diagnostics, "
            "pdd.sim.p_speed) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(name, changed, n, x, y, errs, per, dm, pm, meets, failed="", ps=None, ci=None, dmci=None, sp=None):
        cells = [f"{_ms(x.get(k))} / {_ms(y.get(k))} ({_pct(errs.get(k))}{_ci((ci or {}).get(k) if k in CI_NAMES else None)})"
                 for k in REPORTED]
        pr = "-" if not per else (f"{_pct(per['median'])}, {per['abs_p50'] * 100:.1f}% / {per['abs_p90'] * 100:.1f}% / "
                                  f"{per.get('abs_p99', float('nan')) * 100:.1f}%, "
                                  + ("-" if per.get("within_10pct") is None else f"{per['within_10pct'] * 100:.0f}%"))
        dms = "-" if dm is None else f"{dm * 100:.1f}%" + (f" [{dmci[0] * 100:.0f}, {dmci[1] * 100:.0f}]" if dmci else "")
        pms = "-" if pm is None else f"{pm * 100:.1f}%"
        pss = "-" if not ps else (f"{_pct(ps.get('err_p50_ttft_ms'))} / {_pct(ps.get('err_p90_ttft_ms'))} "
                                  f"(x{ps['level']:.3f})")
        if sp:
            pss += f"; every role: {_pct(sp.get('err_p50_ttft_ms'))} / {_pct(sp.get('err_p90_ttft_ms'))}"
        lines.append(f"| {name} | {changed} | {n}{failed} | " + " | ".join(cells)
                     + f" | {pr} | {dms} | {pms} | {meets} | {pss} |")

    for r in rep["held_out"]:
        errs = {k: r.get(f"err_{k}") for k in REPORTED}
        met = ", ".join(k for k, ok in r["meets"].items() if ok) or "none"
        changed = ", ".join(f"{k}={r['workload'][k]}" for k in r["changed"])
        nf_ = r.get("live_failed") or 0
        row(r["run"], changed, r["requests_compared"], r["live"], r["sim"], errs, r["ttft_error_per_request"],
            r["decision_match_share"], r["pipeline_match_share"], met, f" ({nf_} failed live)" if nf_ else "",
            r.get("at_live_p_speed"), r.get("err_ci"), r.get("decision_match_ci"), r.get("at_live_speed"))
    nf = rep.get("noise_floor")
    if nf:
        errs = {k: nf.get(f"err_{k}") for k in REPORTED}
        fa, fb = nf.get("live_failed") or (0, 0)
        row("noise floor: live run 2 vs run 1", "none", nf["requests_compared"], nf["a"], nf["b"], errs,
            nf["ttft_error_per_request"], nf["decision_match_share"], nf["pipeline_match_share"], "-",
            f" ({fa} / {fb} failed live)" if fa or fb else "", ci=nf.get("err_ci"))
    g = rep["goals"]
    lines.append("")
    lines.append(f"goals: |TTFT P50| and |TTFT P90| error <= {g['ttft_p50_abs_err'] * 100:.0f}% / "
                 f"{g['ttft_p90_abs_err'] * 100:.0f}%, decision match >= {g['decision_match'] * 100:.0f}%, on every "
                 f"held-out run: {'met' if rep['all_meet'] else 'not met'} "
                 f"(calibration run: {rep['calibration']})")
    jd = rep.get("judged")
    if jd and rep["held_out"]:
        names = {"ttft_p50": "TTFT P50", "ttft_p90": "TTFT P90", "decision_match": "decision match"}
        lines.append("judged against each run's 95% interval (met / not met, but the interval reaches the goal / "
                     "missed beyond the interval), of " + f"{len(rep['held_out'])} held-out run(s): "
                     + "; ".join(f"{names[g]} {' / '.join(str(jd[g][v_]) for v_ in VERDICTS)}" for g in names))
    phased = [r for r in rep["held_out"] if r.get("ttft_phases")]
    if phased:
        lines.append("TTFT phases, simulated - live of each phase's median (ms) by prompt tokens P computed, of the "
                     "requests both runs relayed (pdd.sim.ttft_phases):")
        lines.extend(f"- {r['run']}: to P's reply " + ", ".join(
            f"{ph['prompt_tokens_computed']} {ph['to_p_reply_ms']['sim'] - ph['to_p_reply_ms']['live']:+.1f}"
            for ph in r["ttft_phases"]) + "; after it " + ", ".join(
            f"{ph['after_p_reply_ms']['sim'] - ph['after_p_reply_ms']['live']:+.1f}" for ph in r["ttft_phases"])
            for r in phased)
    if any(r.get("err_ci") for r in rep["held_out"]) or (nf or {}).get("err_ci"):
        lines.append("95% interval: the error's paired bootstrap over the run's requests (each drawn with its live "
                     "and simulated value; 2,000 resamples): what a run of this size could have shown with other "
                     "requests of the same workload; none for P99, which a run's top few requests set "
                     "(pdd.sim.uncertainty); the decision match's, its Wilson score interval")
    return "\n".join(lines)
