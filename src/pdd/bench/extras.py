"""The per-mode metrics ``pdd bench`` adds to :func:`pdd.bench.report.mode_metrics`: handoff gaps,
prefix hit rates, cut-offs, hardware, SLO attainment and goodput, and one sweep point's summary."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from pdd.bench.plots import handoff_index
from pdd.bench.report import is_completed, mode_metrics
from pdd.bench.slo import SLO, goodput
from pdd.bench.sweep import mean_rate

HANDOFF_WINDOW = 3  # tokens either side of MD's first token whose gaps count as the handoff's gap
HANDOFF_WINDOW_BEFORE = 3
WIDE_WINDOW_BEFORE = 24  # the wide window also covers the catch-up jitter buffer's paced tokens
MODE_EXTRA_FIELDS = ("slo_met", "slo_attainment", "request_goodput", "meets_sla", "slo_misses", "sla_goodput_rps",
                     "pipeline_mix", "handoff", "p_hit_rate", "md_hit_rate", "cutoffs", "cpu_seconds_by_process",
                     "hardware")


def _pct(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), p)) if len(values) else None


def _gap_summary(gaps: Sequence[float], median_itl_ms: float | None) -> dict:
    ratio = [g / median_itl_ms for g in gaps] if median_itl_ms else []
    return {"n": len(gaps),
            "gap_ms": {"median": _pct(gaps, 50), "p90": _pct(gaps, 90), "p95": _pct(gaps, 95), "p99": _pct(gaps, 99),
                       "max": max(gaps) if gaps else None},
            "gap_over_median_itl": {"median": _pct(ratio, 50), "p90": _pct(ratio, 90), "p95": _pct(ratio, 95),
                                    "max": max(ratio) if ratio else None}}


def handoff_gap_ms(rec: Mapping, before: int = HANDOFF_WINDOW_BEFORE, after: int = HANDOFF_WINDOW) -> float | None:
    """A handed-over record's *handoff gap*: the largest client inter-token gap (ms) ending at a
    token from ``before`` tokens before MD's first token to ``after`` tokens after it (the gaps
    into tokens handoff-before .. handoff+after). None without a handoff or token times."""
    idx = handoff_index(rec)
    t = rec.get("token_times_s") or []
    if idx is None:
        return None
    g = [(t[j] - t[j - 1]) * 1000.0 for j in range(max(1, idx - before), min(len(t), idx + after + 1))]
    return max(g) if g else None


def handoff_stats(records: Iterable[Mapping], median_itl_ms: float | None = None,
                  window: int = HANDOFF_WINDOW, entry: Mapping | None = None,
                  window_before: int = HANDOFF_WINDOW_BEFORE) -> dict:
    """Handoffs of one mode's completed records.

    A record was handed over when ``pdd.handoff_pos`` is set (the position of MD's first token).
    Its *handoff gap* is :func:`handoff_gap_ms` (``window_before`` tokens before, ``window`` after),
    in ms. ``gap_over_median_itl`` divides it by ``median_itl_ms`` (the mode's median ITL).
    ``by_mode``: ``pdd.handoff_mode`` counts ("one_shot" when absent); ``gaps_by_mode``: per
    handoff mode, the gap percentiles (median, P90, P95, P99, max) in ms and over the median ITL,
    and ``wide``: the same over a wide window (``WIDE_WINDOW_BEFORE`` tokens before MD's first
    token to ``window`` after: it covers the catch-up jitter buffer's paced tokens).
    ``baseline`` / ``baseline_wide``: the noise floor of these statistics without a switch: per
    completed record with enough tokens, the largest gap among its last ``window_before + window
    + 1`` (``WIDE_WINDOW_BEFORE + window + 1``) gaps, all ending at least ``window`` tokens after
    any handoff (ordinary decoding); percentiles as above;
    ``rounds``: ``pdd.handoff_rounds`` (1 when absent); ``md_diverged``: records with
    ``pdd.md_diverged``. ``server``: the gateway's ``handoffs*`` counters over the run (deltas; from
    ``entry``, the server_stats entry); ``mode_switches``: RLD's auto-mode switches over the run
    (delta of its ``mode_switches`` counter, summed over RLD instances; None when not reported).
    """
    done = [r for r in records if is_completed(r)]
    gaps: list[float] = []
    gaps_by: dict[str, list[float]] = {}
    wide_by: dict[str, list[float]] = {}
    positions: list[int] = []
    rounds: list[int] = []
    by_mode: dict[str, int] = {}
    for r in done:
        pd = r.get("pdd") or {}
        if pd.get("handoff_pos") is None:
            continue
        hm = str(pd.get("handoff_mode") or "one_shot")
        positions.append(int(pd["handoff_pos"]))
        by_mode[hm] = by_mode.get(hm, 0) + 1
        rounds.append(int(pd.get("handoff_rounds") or 1))
        g = handoff_gap_ms(r, window_before, window)
        if g is not None:
            gaps.append(g)
            gaps_by.setdefault(hm, []).append(g)
            gw = handoff_gap_ms(r, WIDE_WINDOW_BEFORE, window)
            wide_by.setdefault(hm, []).append(gw)
    ratio = [g / median_itl_ms for g in gaps] if median_itl_ms else []
    entry = entry or {}
    after = (entry.get("stats") or {}).get("totals") or {}
    before = (entry.get("stats_before") or {}).get("totals") or {}
    server = {k: v - (before.get(k) or 0) for k, v in sorted(after.items())
              if k.startswith("handoffs") and isinstance(v, (int, float))}
    return {
        "handoffs": len(positions),
        "md_diverged": sum(1 for r in done if (r.get("pdd") or {}).get("md_diverged")),
        "server": server,
        "mode_switches": _role_delta(entry, ("relay_decode",), "mode_switches", absent_is_zero=True),
        "handed_over_share": len(positions) / len(done) if done else 0.0,
        "by_mode": dict(sorted(by_mode.items())),
        "rounds_mean": float(np.mean(rounds)) if rounds else None,
        "rounds_max": max(rounds) if rounds else None,
        "handoff_pos_mean": float(np.mean(positions)) if positions else None,
        "handoff_pos_median": _pct(positions, 50),
        "window_tokens": window,
        "window_tokens_before": window_before,
        "gap_ms": {"median": _pct(gaps, 50), "p90": _pct(gaps, 90), "p95": _pct(gaps, 95), "p99": _pct(gaps, 99),
                   "max": max(gaps) if gaps else None},
        "median_itl_ms": median_itl_ms,
        "gap_over_median_itl": {"median": _pct(ratio, 50), "p90": _pct(ratio, 90), "p95": _pct(ratio, 95),
                                "max": max(ratio) if ratio else None},
        "gaps_by_mode": {m: {**_gap_summary(v, median_itl_ms), "wide": _gap_summary(wide_by[m], median_itl_ms)}
                         for m, v in sorted(gaps_by.items())},
        "wide_window_tokens_before": WIDE_WINDOW_BEFORE,
        "baseline": _gap_summary(_baseline_gaps(done, window_before + window + 1, window), median_itl_ms),
        "baseline_wide": _gap_summary(_baseline_gaps(done, WIDE_WINDOW_BEFORE + window + 1, window), median_itl_ms),
    }


def _baseline_gaps(records: Sequence[Mapping], n_gaps: int, after: int) -> list[float]:
    """Per record: the largest of its last ``n_gaps`` client gaps, if they all end >= ``after``
    tokens past its handoff (or it has none) and it has that many gaps."""
    out = []
    for r in records:
        t = r.get("token_times_s") or []
        if len(t) < n_gaps + 1:
            continue
        idx = handoff_index(r)
        if idx is not None and len(t) - n_gaps < idx + after + 1:
            continue
        out.append(max((t[j] - t[j - 1]) * 1000.0 for j in range(len(t) - n_gaps, len(t))))
    return out


def _inst_value(inst: Mapping | None, key: str):
    """An instance's stat ``key``, at the top level or in its ``counters``."""
    inst = inst if isinstance(inst, Mapping) else {}
    v = inst.get(key)
    return v if v is not None else (inst.get("counters") or {}).get(key)


def _role_delta(entry: Mapping | None, roles: tuple[str, ...], key: str, absent_is_zero: bool = False) -> int | None:
    """Sum over the instances of ``roles`` of ``key``'s increase over the run (stats before/after);
    None when no such instance reports it (``absent_is_zero``: a counter the instances report only
    once it is nonzero counts as 0 when absent; still None without such instances)."""
    entry = entry or {}
    after = ((entry.get("stats") or {}).get("instances")) or {}
    before = ((entry.get("stats_before") or {}).get("instances")) or {}
    insts = [(name, inst) for name, inst in after.items() if isinstance(inst, Mapping) and inst.get("role") in roles]
    vals = [(name, _inst_value(inst, key)) for name, inst in insts]
    if not insts or (all(v is None for _, v in vals) and not absent_is_zero):
        return None
    return sum(int(v or 0) - int(_inst_value(before.get(name), key) or 0) for name, v in vals)


def instance_hardware(entry: Mapping | None) -> dict:
    """Each engine instance's emulated hardware as it reported it (``/pdd/stats``
    ``instances[name].hardware``: device, dtype, page_size, num_pages, min_step_ms, profile, ...),
    by instance name; empty when the stats have none."""
    insts = (((entry or {}).get("stats") or {}).get("instances")) or {}
    return {name: dict(v["hardware"]) for name, v in sorted(insts.items())
            if isinstance(v, Mapping) and isinstance(v.get("hardware"), Mapping)}


def hit_rates(records: Iterable[Mapping], entry: Mapping | None = None) -> dict:
    """``p_hit_rate`` and ``md_hit_rate`` (0..1, None when unknown) of one mode's run.

    From the server stats around the run (``prefix_hit_tokens / prompt_tokens`` of the instances
    with role "prefill" (or "colocated") and "main_decode" (same_dc_pd's D too)), else from the
    usage chunks (``p_cached_tokens``, ``md_cached_tokens`` over prompt tokens).
    """
    recs = list(records)
    out: dict[str, float | None] = {}
    for name, roles, field in (("p_hit_rate", ("prefill", "colocated"), "p_cached_tokens"),
                               ("md_hit_rate", ("main_decode",), "md_cached_tokens")):
        hits, prompts = _role_delta(entry, roles, "prefix_hit_tokens"), _role_delta(entry, roles, "prompt_tokens")
        if hits is not None and prompts:
            out[name] = hits / prompts
            continue
        with_info = [r for r in recs if (r.get("pdd") or {}).get(field) is not None]
        if name == "md_hit_rate":
            with_info = [r for r in with_info if (r.get("pdd") or {}).get("pipeline") not in ("colocated", None)]
        total = sum(int(r.get("prompt_tokens") or 0) for r in with_info)
        out[name] = sum(int(r["pdd"][field]) for r in with_info) / total if total else None
    return out


def cutoff_stats(records: Iterable[Mapping], entry: Mapping | None = None) -> dict:
    """Anomaly cut-offs of one mode's run.

    From the gateway's counters when it has them (deltas over the run of ``totals.cut_offs``,
    ``totals.rld_finished_first``, ``totals.wan_bytes_cancelled``; a cut-off happens after the
    request's usage chunk went out, so only the server knows it): ``requests`` (cut-offs),
    ``rld_finished_first``, ``wan_bytes_cancelled``, ``source`` "server". Otherwise from the usage
    chunks (``pdd.cut_off`` when the gateway sends it, else ``pdd.rld_finished_first``; bytes =
    expected - sent of those requests), ``source`` "records". ``share`` = requests / requests of the run. ``server``: every server counter whose
    name mentions a cut-off, a cancel or rld_finished_first (deltas).
    """
    recs = list(records)
    first = [r for r in recs if (r.get("pdd") or {}).get("rld_finished_first")]
    has_flag = any("cut_off" in (r.get("pdd") or {}) for r in recs)
    cut = [r for r in recs if (r.get("pdd") or {}).get("cut_off")] if has_flag else first
    unsent = sum(max(0, int(r["pdd"].get("wan_bytes_expected") or 0) - int(r["pdd"].get("wan_bytes") or 0))
                 for r in cut)
    entry = entry or {}
    after = (entry.get("stats") or {}).get("totals") or {}
    before = (entry.get("stats_before") or {}).get("totals") or {}
    server = {k: v - (before.get(k) or 0) for k, v in after.items()
              if isinstance(v, (int, float)) and any(w in k for w in ("cut", "cancel", "rld_finished_first"))}
    if "cut_offs" in server:
        n, n_first = int(server["cut_offs"]), int(server.get("rld_finished_first", len(first)))
        cancelled, source = int(server.get("wan_bytes_cancelled", unsent)), "server"
    else:
        n, n_first, cancelled, source = len(cut), len(first), unsent, "records"
    out: dict[str, Any] = {"requests": n, "share": n / len(recs) if recs else 0.0, "rld_finished_first": n_first,
                           "wan_bytes_cancelled": cancelled, "source": source}
    if server:
        out["server"] = server
    return out


def bench_mode_extras(records: Iterable[Mapping], entry: Mapping | None, slo: SLO | None,
                      median_itl_ms: float | None) -> dict:
    """The fields bench adds to a mode's metrics (:data:`MODE_EXTRA_FIELDS` but ``sla_goodput_rps``)."""
    recs = list(records)
    pipes: dict[str, int] = {}
    for r in recs:
        p = (r.get("pdd") or {}).get("pipeline")
        if p is not None:
            pipes[str(p)] = pipes.get(str(p), 0) + 1
    n_p = sum(pipes.values())
    g = goodput(recs, slo) if slo is not None else {"slo_met": None, "slo_attainment": None,
                                                     "request_goodput": None, "meets_sla": None, "slo_misses": None}
    cpu = None
    entry = entry or {}
    if entry.get("proc_cpu_seconds") is not None:
        before = entry.get("proc_cpu_seconds_before") or {}
        cpu = {k: (None if v is None else v - (before.get(k) or 0.0)) for k, v in entry["proc_cpu_seconds"].items()}
    return {
        **g,
        "pipeline_mix": {k: v / n_p for k, v in sorted(pipes.items())} if n_p else {},
        "handoff": handoff_stats(recs, median_itl_ms, entry=entry),
        **hit_rates(recs, entry),
        "cutoffs": cutoff_stats(recs, entry),
        "cpu_seconds_by_process": cpu,
    }


def sweep_point(rate: float, records: Sequence[Mapping], entry: Mapping | None, slo: SLO, wall_s: float) -> dict:
    """One sweep point's summary (rates req/s, latencies ms)."""
    m = mode_metrics(records, entry)
    g = goodput(records, slo)
    return {
        "rate_rps": rate,
        "offered_rate_rps": mean_rate([r["arrival_s"] for r in records]),
        "requests": len(records),
        "completed": m["completed"],
        "failed": m["failed"],
        **g,
        "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        "median_ttft_ms": m["median_ttft_ms"],
        "p90_ttft_ms": m["p90_ttft_ms"],
        "median_tpot_ms": m["median_tpot_ms"],
        "p90_tpot_ms": m["p90_tpot_ms"],
        "duration_s": m["duration_s"],
        "leaked_pages": m["leaked_pages"],
        "wall_s": wall_s,
    }
