"""``pdd bench``: replay a trace through modes, with a fixed SLO, goodput and an SLA-goodput sweep.

One invocation:

1. builds the workload from a Mooncake-format JSONL trace (the shared Mooncake trace, a generated
   agentic trace, any file of ``{"timestamp", "input_length", "output_length", "hash_ids"}``
   records), scaled as in ``pdd demo`` (:class:`pdd.bench.trace.Scale`);
2. fixes the SLO (:mod:`pdd.bench.slo`) before anything is measured: a *reference run* of the
   workload's requests (all of them by default, or ``--ref-requests`` of whole conversations) through
   ``same_dc_pd``, one request in flight at a time (back to back), so the reference has the
   run's prompts, outputs and prefix reuse; SLO = TTFT <= 3 x its median TTFT and TPOT <= 1.5 x
   its median TPOT, unless ``--slo ttft:MS tpot:MS`` gives them. The reference runs on the
   ``same_dc_pd`` topology of the modes (flushed afterwards) or, when that mode is not
   benchmarked, on a topology of its own; with ``--url`` it runs on the external server;
3. for each mode, on a fresh topology (new processes, empty caches): a warm-up request then a
   cache flush; the *main run* (all requests at the offered rate, open loop, or rising with
   ``--ramp START:END``); then, with ``--sweep-rate``, the *sweep*: the point at the offered
   rate is the main run itself; other rates (picked by :mod:`pdd.bench.sweep`) run on the same
   topology. When the trace holds enough requests after the main run's (``--requests`` of a
   longer trace: points x ``--sweep-requests`` more), each rate replays the **next requests of
   the trace** (as many as arrive within ``--sweep-seconds``, at least ``--sweep-min-requests``)
   on the caches the main run left: the same conversations go on, so every point measures the
   workload's steady state (its prefix hit rate) and not a cold start. Otherwise each rate
   replays ``--sweep-requests`` requests made of whole conversations
   (:func:`pdd.bench.sweep.session_subset`) on flushed caches. Caches are flushed (and leaked
   pages counted) after the main run and the sweep. SLA goodput = the highest swept rate
   at which >= 90% of requests meet the SLO.
   A mode is a label: a mode name, optionally with policy overrides (``pdd+allow_p_rld``,
   ``pdd+routing=round_robin``, :func:`parse_mode_label`), so ablations run side by side.
   With ``--url`` nothing is started: the one mode is the server's (GET /pdd/stats, else /health;
   an explicit ``--modes`` must name that mode, and is refused when the server reports none), and
   stats come from that endpoint;
4. writes ``--out``: ``report.json``, ``requests.jsonl`` (main runs), ``reference_requests.jsonl``,
   ``sweep_requests.jsonl`` (with ``rate_rps``), ``server_stats.json``, ``ttft_cdf.png``,
   ``handoff_gaps.png``, ``wan_throughput.png``, ``sweep.png`` (with a sweep),
   ``timeline_<mode>.png``; prints the comparison table and the total wall time.

Exit status (:func:`bench_exit_status`): 0 when every mode completed at least one request (failed
requests are measured results, in the report); 1 when a mode completed none, after the report is
written; 2 for arguments refused before anything runs (:func:`check_args`).

report.json = :func:`pdd.bench.report.build_report`'s document (git_commit, config, seed,
workload, link, modes, ratios, output_agreement) plus ``bench``, ``seeds``, ``slo``, ``sweep``,
``wan_timeline`` and, in every ``modes[mode]``, the fields of :func:`bench_mode_extras`
(``slo_met``, ``slo_attainment``, ``request_goodput``, ``meets_sla``, ``sla_goodput_rps``,
``pipeline_mix``, ``handoff``, ``p_hit_rate``, ``md_hit_rate``, ``cutoffs``,
``cpu_seconds_by_process``). See :data:`REPORT_FIELDS`. With ``--fault SPEC`` (repeatable) faults
are injected during the main runs and report.json gets ``faults`` (:mod:`pdd.bench.faults`,
docs/FAULTS.md). The ``vllm_colocated`` mode runs stock vLLM's server on the same checkpoint
(:mod:`pdd.bench.vllm_mode`); with it report.json gets ``vllm_agreement`` (its greedy outputs
against ``colocated``'s) and its mode entry lists the fields it has no counterpart for under
``not_applicable`` (None there, "n/a" in the table).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import httpx
import numpy as np
import pydantic

from pdd.bench.demo import _default_topology, _proc_cpu, _warmup, ensure_model, fit_scale, measured_replay
from pdd.bench.plots import (handoff_index, plot_handoff_gaps, plot_sweep, plot_token_timeline, plot_ttft_cdf,
                             plot_wan_throughput)
from pdd.bench.report import (MODE_ORDER, _fmt, build_report, is_completed, mode_metrics, request_latencies,
                              table_rows, write_jsonl, write_report)
from pdd.bench.slo import SLA_ATTAINMENT, SLO, goodput, make_slo, parse_slo, reference_summary
from pdd.bench.sweep import (SweepPlan, at_rate, mean_rate, next_rate, parse_ramp, parse_sweep, point_requests,
                             point_size, ramp_arrivals, session_subset,
                             sla_goodput)
from pdd.bench.trace import DEFAULT_TRACE, Scale, TokenSpace, build_requests, ideal_prefix_hits, workload_summary
from pdd.bench import vllm_mode
from pdd.config import MODES, ClusterConfig, validation_summary
from pdd.transfer.layout import wire_dtype

DEFAULT_MODES = MODES  # colocated, same_dc_pd, cross_dc_pd, pdd
# flags that shape the topologies pdd bench starts (argparse dests = apply_overrides keys); with --url
# the server runs its own config, so they are refused there
TOPOLOGY_OVERRIDES = ("wan_gbps", "wan_rtt_ms", "fast_gbps", "min_step_ms", "allow_p_rld", "wan_order",
                      "handoff_mode", "pipeline_ttft_budget_ms", "base_port", "gateway_port", "wan_loss_rate",
                      "wan_cross_traffic")
REFERENCE_MODE = "same_dc_pd"
# The demo's scale (docs: tuned on the live system) with 1 in 50 conversations, so the shared
# trace yields ~240 requests (the demo's 1 in 100 gives ~150) and a 200-request run keeps the
# trace's multi-turn prefix reuse (ideal hit rate ~30%).
DEFAULT_SCALE = Scale(block_tokens=16, output_scale=1 / 4, min_output_tokens=16, max_output_tokens=160,
                      target_rate_rps=2.0, session_sample=50)
DEFAULT_REQUESTS = 200
DEFAULT_REF_REQUESTS = 0  # 0: the whole workload (its own prompts, outputs and prefix reuse), one in flight
DEFAULT_SWEEP = "auto"
DEFAULT_SWEEP_REQUESTS = 48
DEFAULT_SWEEP_POINTS = 3
DEFAULT_SWEEP_SECONDS = 20.0  # a sweep point's arrivals span at most this (fewer requests at low rates)
DEFAULT_SWEEP_TIMEOUT_S = 60.0
DEFAULT_SWEEP_MIN_REQUESTS = 20  # a point's attainment over fewer requests is too coarse (90% = at most 1 of 10 missed)
HANDOFF_WINDOW = 3  # tokens either side of MD's first token whose gaps count as the handoff's gap
HANDOFF_WINDOW_BEFORE = 3
WIDE_WINDOW_BEFORE = 24  # the wide window also covers the catch-up jitter buffer's paced tokens

# report.json: top-level fields and the fields bench adds to every modes[mode] (the rest of a mode's
# fields are report.mode_metrics', named as in vllm bench serve)
REPORT_FIELDS = ("git_commit", "config", "seed", "seeds", "workload", "link", "modes", "ratios",
                 "output_agreement", "bench", "slo", "sweep", "wan_timeline", "pipeline_preview")
MODE_EXTRA_FIELDS = ("slo_met", "slo_attainment", "request_goodput", "meets_sla", "slo_misses", "sla_goodput_rps",
                     "pipeline_mix", "handoff", "p_hit_rate", "md_hit_rate", "cutoffs", "cpu_seconds_by_process",
                     "hardware")


# ---------------------------------------------------------------- per-mode metrics beyond report.mode_metrics


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


# ---------------------------------------------------------------- pipeline budget preview

PREVIEW_BUDGETS_MS = (25.0, 40.0, 50.0, 60.0, 80.0, 100.0)


def kv_bytes_per_token(model_dir: str | Path, dtype: str = "float32") -> int:
    """KV bytes per token of the model in ``model_dir`` (config.json): layers x 2 (K, V) x KV
    heads x head_dim x bytes per element (float32 4, bfloat16/float16 2)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return int(c["num_hidden_layers"]) * 2 * heads * head_dim * (4 if dtype == "float32" else 2)


def pipeline_preview(requests: Sequence, config: ClusterConfig, kv_bytes: int,
                     budgets_ms: Sequence[float] = PREVIEW_BUDGETS_MS) -> dict:
    """What pdd's pipeline choice would do with this workload, per TTFT budget, before any run.

    Each request's missing KV is its prompt minus its ideal prefix hit (an infinite cache holding
    every earlier prompt, whole pages, one token always computed:
    :func:`pdd.bench.trace.ideal_prefix_hits`), priced by :func:`pdd.policy.pipeline.expected_wan_seconds`
    at the configured line rate and RTT. Per budget (ms): ``relayed_share`` (requests planned
    P->RLD->MD), ``relayed_output_share`` (their share of output tokens: an upper bound of RLD's
    share of output tokens, reached when RLD decodes them to the end), ``p_md_expected_wan_ms_p90``
    (P90 of the planned P->MD requests' expected WAN time). ``configured_budget_ms`` is the
    config's. Live MD caches are finite and the live WAN estimate varies, so the run's mix differs a
    little; the run reports its own (``pipeline_mix``).
    """
    from pdd.bench.trace import ideal_prefix_hits
    from pdd.policy.pipeline import PipelineInputs, expected_wan_seconds

    hits = ideal_prefix_hits(requests, config.engine_for("main_decode").page_size, 1)  # MD's cache: its pages
    exp_ms = [1000.0 * expected_wan_seconds(PipelineInputs(
        mode="pdd", prompt_tokens=len(r.prompt_ids), md_cached_tokens=h, kv_bytes_per_token=kv_bytes,
        wan_gbps_estimate=config.link.wan_gbps, wan_rtt_ms=config.link.wan_rtt_ms)) for r, h in zip(requests, hits)]
    outs = [r.max_tokens for r in requests]
    total_out = sum(outs) or 1
    rows = {}
    for b in sorted({*budgets_ms, float(config.policy.pipeline_ttft_budget_ms)}):
        relay = [e > b + 1e-9 or b <= 0 for e in exp_ms]
        pmd = [e for e, rl in zip(exp_ms, relay) if not rl]
        rows[f"{b:g}"] = {"relayed_share": sum(relay) / len(relay) if relay else 0.0,
                          "relayed_output_share": sum(o for o, rl in zip(outs, relay) if rl) / total_out,
                          "p_md_expected_wan_ms_p90": _pct(pmd, 90)}
    return {"configured_budget_ms": float(config.policy.pipeline_ttft_budget_ms), "kv_bytes_per_token": kv_bytes,
            "expected_wan_ms": {"p50": _pct(exp_ms, 50), "p90": _pct(exp_ms, 90), "p95": _pct(exp_ms, 95)},
            "by_budget_ms": rows}


# ---------------------------------------------------------------- topologies


class RemoteTopology:
    """A running gateway at ``url`` used like a Topology (nothing started or stopped).

    ``stats()``: GET /pdd/stats (``{}`` when the server has none, e.g. vLLM); ``flush()``: POST
    /pdd/flush, best effort.
    """

    def __init__(self, url: str, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def __enter__(self) -> "RemoteTopology":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def stats(self) -> dict:
        try:
            r = httpx.get(f"{self.url}/pdd/stats", timeout=self.timeout_s, trust_env=False)
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def flush(self) -> dict:
        try:
            r = httpx.post(f"{self.url}/pdd/flush", timeout=60, trust_env=False)
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def reported_mode(self) -> str | None:
        """The mode the server says it runs: /pdd/stats ``mode``, else /health ``mode`` (pdd's
        gateway answers both; /health stays open behind API keys); None when neither says."""
        m = self.stats().get("mode")
        if not m:
            try:
                r = httpx.get(f"{self.url}/health", timeout=self.timeout_s, trust_env=False)
                body = r.json() if r.status_code in (200, 503) else {}
                m = body.get("mode") if isinstance(body, dict) else None
            except (httpx.HTTPError, ValueError):
                m = None
        return str(m) if m else None

    def mode(self) -> str:
        return self.reported_mode() or "external"


class WanSampler:
    """Samples the cumulative WAN line bytes (both directions) every ``interval_s`` in a thread.

    ``read() -> int | None`` returns the counter (None: skip this sample). ``t_s`` are seconds
    since :meth:`start`.
    """

    def __init__(self, read: Callable[[], int | None], interval_s: float = 0.5):
        self.read, self.interval_s = read, interval_s
        self.t_s: list[float] = []
        self.bytes: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        try:
            v = self.read()
        except Exception:  # noqa: BLE001 - sampling is best effort
            v = None
        if v is not None:
            self.t_s.append(round(time.perf_counter() - self._t0, 4))
            self.bytes.append(int(v))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "WanSampler":
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sample()
        return {"interval_s": self.interval_s, "t_s": self.t_s, "bytes": self.bytes}


def wan_reader(topo) -> Callable[[], int | None] | None:
    """How to read ``topo``'s WAN line counter: the link's control port for a local topology
    with a link, GET /pdd/stats for a remote gateway; None when there is nothing to read."""
    lay = getattr(topo, "layout", None)
    if lay is not None and getattr(lay, "link_control_port", None) is not None:
        from pdd.transfer.link import query_stats

        host, port = topo.cfg.host, lay.link_control_port

        def read_link() -> int:
            s = asyncio.run(query_stats(host, port, timeout=2.0))
            return int(s.get("bytes_a_to_b", 0)) + int(s.get("bytes_b_to_a", 0))

        return read_link
    if isinstance(topo, RemoteTopology):
        def read_remote() -> int | None:
            s = topo.stats()
            return int(s["wan_line_bytes"]) if s.get("link") and s.get("wan_line_bytes") is not None else None

        return read_remote
    return None


# ---------------------------------------------------------------- config


def apply_overrides(cfg: ClusterConfig, **kw) -> ClusterConfig:
    """``cfg`` with flag overrides (None = keep), validated. Keys: ``wan_gbps``, ``wan_rtt_ms``,
    ``wan_jitter_ms``, ``fast_gbps`` (link), ``allow_p_rld``, ``wan_order``, ``handoff_mode``,
    ``pipeline_ttft_budget_ms`` (policy), ``min_step_ms`` (engine), ``base_port``, ``gateway_port``, ``model_path``,
    ``served_model_name``, ``request_timeout_s`` (top level)."""
    sections = {"link": ("wan_gbps", "wan_rtt_ms", "wan_jitter_ms", "fast_gbps", "wan_loss_rate", "wan_cross_traffic"),
                "policy": ("allow_p_rld", "wan_order", "handoff_mode", "pipeline_ttft_budget_ms"),
                "engine": ("min_step_ms",),
                "": ("base_port", "gateway_port", "model_path", "served_model_name", "request_timeout_s")}
    data = cfg.model_dump()
    known = {k for ks in sections.values() for k in ks}
    bad = set(kw) - known
    if bad:
        raise TypeError(f"unknown overrides: {sorted(bad)}")
    for sec, keys in sections.items():
        for k in keys:
            if kw.get(k) is None:
                continue
            (data[sec] if sec else data)[k] = kw[k]
    return ClusterConfig.model_validate(data)


# ---------------------------------------------------------------- the run


def parse_mode_label(label: str) -> tuple[str, dict]:
    """A mode label -> ``(mode, overrides)``.

    ``"pdd"`` -> ``("pdd", {})``; ``"pdd+allow_p_rld"`` -> ``("pdd", {"allow_p_rld": True})``;
    ``"pdd+routing=round_robin+handoff_mode=auto"`` -> ``("pdd", {"routing": "round_robin",
    "handoff_mode": "auto"})``. Keys are :class:`pdd.config.PolicyConfig` fields, or
    ``engine.<field>`` for an :class:`pdd.config.EngineConfig` one (``pdd+engine.prefill_order=short_first``);
    values are validated by them (``true``/``false`` for flags, numbers as text). A variant runs
    on its own fresh topology beside the others, so ablations are compared side by side in one
    invocation; its records and report entry carry the whole label. Raises ValueError naming the
    bad part.
    """
    from pdd.config import EngineConfig, PolicyConfig

    base, *parts = [x.strip() for x in label.split("+")]
    if base == vllm_mode.VLLM_MODE:  # stock vLLM (pdd.bench.vllm_mode): pdd's policies do not apply
        if parts:
            raise ValueError(f"mode {label!r}: {base} takes no overrides (it runs stock vLLM)")
        return base, {}
    if base not in MODES:
        raise ValueError(f"mode {label!r}: unknown mode {base!r}; choose from {', '.join(MODES)}, "
                         f"{vllm_mode.VLLM_MODE}")
    over: dict[str, Any] = {}
    for part in parts:
        key, eq, val = part.partition("=")
        key = key.strip()
        section, dot, field = key.partition(".")
        known = EngineConfig.model_fields if dot and section == "engine" else (
            {} if dot else PolicyConfig.model_fields)
        if field not in known if dot else key not in known:
            raise ValueError(f"mode {label!r}: {key!r} is neither a policy setting ({sorted(PolicyConfig.model_fields)}) "
                             f"nor engine.<setting> ({sorted(EngineConfig.model_fields)})")
        over[key] = True if not eq else val.strip()
    try:
        PolicyConfig.model_validate({k: v for k, v in over.items() if "." not in k})
        EngineConfig.model_validate({k.partition(".")[2]: v for k, v in over.items() if "." in k})
    except pydantic.ValidationError as ex:
        err = ex.errors()[0]
        raise ValueError(f"mode {label!r}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return base, over


def mode_config(config: ClusterConfig, label: str) -> ClusterConfig:
    """``config`` for one mode label (:func:`parse_mode_label`): its mode, policy and engine
    overrides."""
    base, over = parse_mode_label(label)
    data = config.model_dump()
    data["mode"] = "colocated" if base == vllm_mode.VLLM_MODE else base  # vLLM: colocated's engine settings
    for key, val in over.items():
        section, dot, field = key.partition(".")
        if dot:
            data[section][field] = val
        else:
            data["policy"][key] = val
    return ClusterConfig.model_validate(data)


def _order_modes(modes: Sequence[str]) -> list[str]:
    """Modes with the reference mode first (its topology also serves the reference run)."""
    modes = list(dict.fromkeys(modes))
    if REFERENCE_MODE in modes:
        modes.remove(REFERENCE_MODE)
        modes.insert(0, REFERENCE_MODE)
    return modes


def run_bench(
    out_dir: str | Path = "runs/bench",
    modes: Sequence[str] = DEFAULT_MODES,
    n_requests: int | None = DEFAULT_REQUESTS,
    scale: Scale = DEFAULT_SCALE,
    config: ClusterConfig | None = None,
    seed: int = 0,
    *,
    trace: str | Path = DEFAULT_TRACE,
    start: int | None = None,
    url: str | None = None,
    slo: Mapping[str, float] | None = None,
    ref_requests: int = DEFAULT_REF_REQUESTS,
    sweep: SweepPlan | None = None,
    sweep_requests: int | None = DEFAULT_SWEEP_REQUESTS,
    sweep_timeout_s: float = DEFAULT_SWEEP_TIMEOUT_S,
    sweep_seconds: float | None = DEFAULT_SWEEP_SECONDS,
    sweep_min_requests: int = DEFAULT_SWEEP_MIN_REQUESTS,
    warmup: bool = True,
    request_timeout_s: float | None = None,
    wan_sample_s: float = 0.5,
    progress: bool = True,
    console=None,
    topology_factory: Callable[..., object] | None = None,
    argv: Sequence[str] | None = None,
    ramp: tuple[float, float] | None = None,
    faults: Sequence[str] = (),
    fault_recover_after_s: float | None = 5.0,
    vllm_python: str | None = None,
    vllm_factory: Callable[..., object] | None = None,
) -> dict:
    """Run the benchmark (see the module docstring); returns the report dict (also in ``out_dir``).

    ``ramp``: ``(start_rps, end_rps)``: the main run's arrival rate rises linearly from the first to
    the second (:func:`pdd.bench.sweep.ramp_arrivals`, the trace's gap pattern kept) instead of
    the constant ``scale.target_rate_rps``.
    ``slo``: absolute bounds ``{"ttft_ms", "tpot_ms"}`` (either or both; :func:`pdd.bench.slo.parse_slo`).
    ``sweep``: None = no sweep. ``sweep_requests``: the sweep's requests (N of whole
    conversations, :func:`pdd.bench.sweep.session_subset`; None = all); a point keeps only those arriving within ``sweep_seconds`` at its rate
    (:func:`pdd.bench.sweep.point_requests`; None = no bound). ``sweep_timeout_s``: per request
    during the sweep (s).
    ``topology_factory(cfg, log_dir=...)`` as in :func:`pdd.bench.demo.run_demo`.
    ``faults``: ``KIND[:ARG]@PHASE[#N]`` specs injected during each applicable mode's main run,
    killed instances restarted / slowdowns lifted ``fault_recover_after_s`` later (None: at the end
    of the run); report.json ``faults[mode]`` (:mod:`pdd.bench.faults`).
    ``vllm_python``: the interpreter of vLLM's venv for the ``vllm_colocated`` mode (default:
    :func:`pdd.bench.vllm_mode.vllm_python`'s search); ``vllm_factory(cfg, log_dir=...)`` replaces
    :class:`pdd.bench.vllm_mode.VllmServer` for that mode.
    """
    from pdd.bench.faults import FaultRunner, fault_report, parse_bench_fault
    from rich.console import Console

    t_wall = time.monotonic()
    cpu0 = time.process_time()
    console = console or Console()
    config = config or ClusterConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timeout_s = request_timeout_s or config.request_timeout_s
    absolute = dict(slo or {})
    need_ref = not ("ttft_ms" in absolute and "tpot_ms" in absolute)

    bench_faults = [parse_bench_fault(f) for f in faults]  # FaultError naming a bad spec before anything starts
    if bench_faults and url:
        raise ValueError("--fault needs topologies pdd bench starts (not --url)")
    if bench_faults and vllm_mode.VLLM_MODE in modes:
        raise ValueError(f"--fault: not supported with {vllm_mode.VLLM_MODE} (stock vLLM has none of pdd's tiers)")
    vllm_factory = vllm_factory or (lambda c, log_dir=None: vllm_mode.VllmServer(c, log_dir=log_dir, python=vllm_python))
    vllm_servers: dict[str, dict] = {}
    fault_out: dict[str, dict] = {}
    remote = RemoteTopology(url) if url else None
    if remote is not None:
        modes = [remote.mode()]
        factory: Callable[..., object] = lambda cfg, log_dir=None: remote  # noqa: E731
        console.print(f"external gateway {remote.url}: mode {modes[0]}")
    else:
        factory = topology_factory or _default_topology
        for m in modes:
            parse_mode_label(m)  # ValueError naming a bad label before anything starts
    run_order = _order_modes(modes)

    # ---- workload
    if remote is not None and not (Path(config.model_path) / "config.json").exists():
        tokens = TokenSpace()
    else:
        tokens = TokenSpace.from_model(ensure_model(config, console))
    scale = fit_scale(scale, config, n_requests, start)
    requests = build_requests(trace, scale, tokens, seed)
    if not requests:
        hint = ""
        if scale.session_sample > 1:  # the default keeps 1 in 50 conversations: a small trace may keep none
            hint = (f": --session-sample {scale.session_sample} keeps 1 in {scale.session_sample} conversations "
                    f"and kept none of this trace's; give --session-sample 1 to replay every record")
        raise ValueError(f"no requests in {trace} (start={scale.start} count={scale.count}){hint}")
    if ramp is not None:
        requests = ramp_arrivals(requests, *ramp)
    workload = workload_summary(requests, scale, trace, page_size=config.engine_for("prefill").page_size)
    if ramp is not None:
        workload["ramp_rps"] = list(ramp)
    preview = None
    try:
        # as the KV crosses the WAN: the narrower of P's and MD's dtypes (pdd.transfer.layout)
        kvb = kv_bytes_per_token(config.model_path, wire_dtype(config.engine_for("prefill").dtype,
                                                               config.engine_for("main_decode").dtype))
    except (OSError, KeyError, ValueError, TypeError):
        kvb = None  # no readable model config (e.g. --url without the model): no preview
    if kvb:
        preview = pipeline_preview(requests, config, kvb)
        console.print("pipeline preview (ideal caches): budget ms -> relayed requests / their output tokens: "
                      + ", ".join(f"{b}: {100 * v['relayed_share']:.1f}% / {100 * v['relayed_output_share']:.1f}%"
                                  for b, v in preview["by_budget_ms"].items()))
    offered = workload["rate_rps"]
    console.print(
        f"workload: {workload['requests']} requests from {workload['trace']}, {workload['duration_s']:.1f} s of "
        f"arrivals ({f'{offered:.2f} req/s' if offered else 'all at once'}), prompt mean "
        f"{workload['input_tokens_mean']:.0f} / max {workload['input_tokens_max']} tokens, output mean "
        f"{workload['output_tokens_mean']:.0f} tokens, ideal prefix hit rate {100 * workload['ideal_prefix_hit_rate']:.1f}%"
    )
    if not url and config.engine.min_step_ms > 0:  # says why TPOT sits at a floor
        console.print(f"emulated accelerator step: every forward pass takes >= {config.engine.min_step_ms:g} ms "
                      f"(engine.min_step_ms; docs/LINK.md)")
    # whole conversations, not the first requests (a multi-turn trace starts with cold first turns)
    ref_reqs = [dataclasses.replace(r, arrival_s=0.0) for r in session_subset(requests, ref_requests or None)]
    sweep_reqs = session_subset(requests, sweep_requests or None)
    sweep_same_as_main = len(sweep_reqs) == len(requests)
    sweep_next = continuation_requests(trace, scale, tokens, seed, sweep, sweep_requests) if sweep else None
    if sweep is not None:
        console.print("sweep: " + (f"continuation of the trace ({len(sweep_next)} more requests after the main run's; "
                                   "caches stay warm from the main run)" if sweep_next is not None else
                                   "the trace has too few requests after the main run's for a continuation; "
                                   "each point replays whole conversations of the workload on flushed caches"))

    # ---- outputs
    paths = {k: out / f"{k}.jsonl" for k in ("requests", "reference_requests", "sweep_requests")}
    for p in paths.values():
        p.write_text("")
    server_stats: dict[str, dict] = {}
    mode_errors: dict[str, str] = {}
    all_records: list[dict] = []
    wan_timeline: dict[str, dict] = {}
    sweep_out: dict[str, dict] = {}
    slo_obj: SLO | None = None
    slo_info: dict = {}
    ref_entry: dict | None = None
    mode_wall: dict[str, float] = {}  # per mode: topology start to stop, its sweep included (s)
    ref_wall: float | None = None  # the reference run alone (s)

    def fix_slo(ref_records: list[dict] | None, where: str) -> None:
        nonlocal slo_obj, slo_info
        summary = reference_summary(ref_records, where) if ref_records is not None else None
        try:
            slo_obj = make_slo(summary, absolute)
            slo_info = {**slo_obj.to_dict(), "sla_attainment": SLA_ATTAINMENT}
            console.print(f"[bold]SLO[/] ({slo_obj.source}): {slo_obj.describe()}"
                          + (f"  (reference {where}: {summary['completed']}/{summary['requests']} completed, TTFT P50 "
                             f"{_fmt(summary['median_ttft_ms'])} ms, TPOT P50 {_fmt(summary['median_tpot_ms'], 2)} ms)"
                             if summary else ""))
        except ValueError as ex:
            slo_info = {"error": str(ex), "reference": summary}
            console.print(f"[red]no SLO: {ex}; goodput and the sweep are skipped")

    def reference_run(topo, cfg: ClusterConfig, where: str) -> None:
        nonlocal ref_entry, slo_info, ref_wall
        t_ref = time.monotonic()
        console.print(f"reference run: {len(ref_reqs)} requests through {where}, one in flight at a time")
        try:
            recs, ref_entry = measured_replay(topo, ref_reqs, model=cfg.served_model_name, mode=where,
                                              timeout_s=timeout_s, progress=progress, console=console,
                                              max_in_flight=1, label=f"reference ({where})")
        except Exception as ex:  # noqa: BLE001 - the modes still run, without an SLO
            slo_info = {"error": f"reference run failed: {type(ex).__name__}: {ex}"}
            console.print(f"[red]{slo_info['error']}")
            return
        dicts = [r.to_dict() for r in recs]
        write_jsonl(paths["reference_requests"], dicts, append=True)
        ref_wall = time.monotonic() - t_ref
        fix_slo(dicts, where)

    if not need_ref:
        fix_slo(None, "")
    elif remote is None and REFERENCE_MODE not in run_order:
        cfg = config.model_copy(update={"mode": REFERENCE_MODE})
        console.rule(f"[bold]reference: {REFERENCE_MODE}")
        try:
            with factory(cfg, log_dir=out / "logs" / f"reference_{REFERENCE_MODE}") as topo:
                if warmup:
                    _warmup(topo, cfg, tokens, seed, min(timeout_s, 120.0), console)
                reference_run(topo, cfg, REFERENCE_MODE)
        except Exception as ex:  # noqa: BLE001 - the modes still run, without an SLO
            slo_info = slo_info or {"error": f"reference topology failed: {type(ex).__name__}: {ex}"}
            console.print(f"[red]{slo_info['error']}")

    warm_sweep = sweep is not None and sweep_next is not None
    for k, mode in enumerate(run_order, 1):
        cfg = config if remote is not None else mode_config(config, mode)
        console.rule(f"[bold]{mode}[/] ({k}/{len(run_order)})")
        t_start = time.monotonic()
        entry: dict = {}
        records: list = []
        points: list[dict] = []
        try:
            mode_factory = vllm_factory if mode == vllm_mode.VLLM_MODE and remote is None else factory
            with mode_factory(cfg, log_dir=out / "logs" / mode) as topo:
                if remote is None:
                    console.print(f"topology up in {time.monotonic() - t_start:.1f} s at {topo.url}")
                if mode == vllm_mode.VLLM_MODE and hasattr(topo, "describe"):
                    vllm_servers[mode] = topo.describe()
                if warmup:
                    _warmup(topo, cfg, tokens, seed, min(timeout_s, 120.0), console)
                if need_ref and slo_obj is None and not slo_info and (remote is not None or mode == REFERENCE_MODE):
                    reference_run(topo, cfg, mode)
                reader = wan_reader(topo)
                sampler = WanSampler(reader, wan_sample_s).start() if reader is not None else None
                runner, skipped = None, {}
                if bench_faults:
                    from pdd.bench.faults import applicable
                    from pdd.topology import layout as _layout

                    lay = _layout(cfg)
                    skipped = {f.text: why for f in bench_faults if (why := applicable(f, lay)) is not None}
                    todo = [f for f in bench_faults if f.text not in skipped]
                    runner = FaultRunner(topo, todo, fault_recover_after_s).start() if todo else None
                try:
                    records, entry = measured_replay(
                        topo, requests, model=cfg.served_model_name, mode=mode, timeout_s=timeout_s,
                        progress=progress, console=console, label=f"{mode} @ {_fmt(offered, 2)} req/s",
                        after_replay=runner.finish if runner is not None else None, flush=not warm_sweep)
                finally:
                    if runner is not None:
                        runner.finish()  # idempotent: restarts whatever is still down if the replay failed
                    if sampler is not None:
                        wan_timeline[mode] = sampler.stop()
                if bench_faults:
                    fault_out[mode] = fault_report(runner, [r.to_dict() for r in records], skipped,
                                                   fault_recover_after_s)
                    fr = fault_out[mode]
                    console.print(f"faults {mode}: {len(fr['injections'])} injected "
                                  + "".join(f"[{i['spec']} -> {i.get('target') or ''} in {i.get('phase')}"
                                            f"{' ERROR ' + i['error'] if i.get('error') else ''}]"
                                            for i in fr["injections"])
                                  + f"; not injected {fr['not_injected'] or '-'}; requests {fr['requests']}")
                main_dicts = [r.to_dict() for r in records]
                try:
                    if sweep is not None and slo_obj is not None:
                        points = _sweep_mode(topo, cfg, mode, sweep, sweep_next if warm_sweep else sweep_reqs,
                                             slo_obj, main_dicts, entry, offered,
                                             min(timeout_s, sweep_timeout_s), sweep_seconds, paths["sweep_requests"],
                                             sweep_min_requests, progress, console, warm=warm_sweep,
                                             per_point=sweep_requests, main_before=requests)
                finally:
                    if warm_sweep:  # one flush after the main run and the sweep: leaked pages of both
                        entry["flush"] = topo.flush()
        except Exception as ex:  # noqa: BLE001 - one broken mode must not lose the others
            mode_errors[mode] = f"{type(ex).__name__}: {ex}"
            console.print(f"[red]{mode} failed: {mode_errors[mode]}")
        dicts = [r.to_dict() for r in records]
        write_jsonl(paths["requests"], dicts, append=True)
        all_records.extend(dicts)
        server_stats[mode] = {k2: v for k2, v in entry.items() if v is not None}
        mode_wall[mode] = time.monotonic() - t_start
        (out / "server_stats.json").write_text(json.dumps(server_stats, indent=1))
        if sweep is not None:
            hist = [(p["rate_rps"], p["slo_attainment"]) for p in points if p["slo_attainment"] is not None]
            sweep_out[mode] = {"points": points, "sla_goodput_rps": sla_goodput(hist, sweep.threshold)}
        if dicts:
            m = mode_metrics(dicts, server_stats[mode])
            g = goodput(dicts, slo_obj) if slo_obj is not None else {}
            console.print(
                f"{mode}: {m['completed']} completed, {m['failed']} failed; TTFT P50 {_fmt(m['median_ttft_ms'])} ms, "
                f"P90 {_fmt(m['p90_ttft_ms'])} ms; TPOT P50 {_fmt(m['median_tpot_ms'], 2)} ms"
                + (f"; SLO met {100 * (g['slo_attainment'] or 0):.1f}%" if g else "")
                + (f"; SLA goodput {_fmt(sweep_out[mode]['sla_goodput_rps'], 2)} req/s" if mode in sweep_out else "")
                + f"; leaked pages {m['leaked_pages']}; {time.monotonic() - t_start:.0f} s")
            plot_token_timeline(dicts, out / f"timeline_{mode}.png", title=f"{mode}: tokens at the client")

    # ---- report
    report = build_report(all_records, server_stats, config=json.loads(config.model_dump_json()), seed=seed,
                          workload=workload, link=config.link.model_dump())
    for mode, m in report["modes"].items():
        m.update(bench_mode_extras([r for r in all_records if r["mode"] == mode], server_stats.get(mode), slo_obj,
                                   m.get("median_itl_ms")))
        m["sla_goodput_rps"] = (sweep_out.get(mode) or {}).get("sla_goodput_rps")
        m["hardware"] = instance_hardware(server_stats.get(mode))
    vllm_mode.apply_to_report(report, all_records, vllm_servers)
    wall = time.monotonic() - t_wall
    report["seeds"] = {"token_seed": seed, "session_seed": scale.session_seed, "model_seed": config.model_seed,
                       "link_jitter": "unseeded"}
    report["slo"] = slo_info
    report["sweep"] = None if sweep is None else {
        "plan": sweep.to_dict(), "requests": len(sweep_next if warm_sweep else sweep_reqs), "max_arrival_s": sweep_seconds,
        "min_requests": sweep_min_requests,
        "request_timeout_s": min(timeout_s, sweep_timeout_s),
        "method": "continuation" if warm_sweep else "flushed",
        "topology": ("same topology as the mode's main run; each rate replays the next requests of the trace "
                     "after the main run's, caches kept warm (no flush until the sweep ends)" if warm_sweep else
                     "same topology as the mode's main run, caches flushed before every rate; each rate replays "
                     "whole conversations of the workload"),
        "definition": f"sla_goodput_rps = highest swept rate with slo_attainment >= {sweep.threshold}",
        "modes": sweep_out,
    }
    report["wan_timeline"] = wan_timeline
    if bench_faults:
        report["faults"] = {"specs": [f.text for f in bench_faults], "recover_after_s": fault_recover_after_s,
                            "modes": fault_out}
    report["pipeline_preview"] = preview
    report["bench"] = {
        "argv": list(argv) if argv is not None else None,
        "command": "pdd bench " + shlex.join(argv) if argv is not None else None,
        "url": url,
        "modes": list(modes),
        "run_order": run_order,
        "mode_wall_s": mode_wall,
        "reference_wall_s": ref_wall,
        "reference_requests": len(ref_reqs) if need_ref else 0,
        "reference_server_stats": ref_entry,
        "wall_s": wall,
        "client_cpu_seconds": time.process_time() - cpu0,
        "python": sys.version.split()[0],
    }
    if mode_errors:
        report["mode_errors"] = mode_errors
    write_report(out / "report.json", report)

    # ---- plots and table
    plot_ttft_cdf(all_records, out / "ttft_cdf.png", title=f"TTFT, {len(requests)} requests",
                  slo_ttft_ms=slo_obj.ttft_ms if slo_obj else None)
    plot_handoff_gaps(all_records, out / "handoff_gaps.png")
    plot_wan_throughput(wan_timeline, out / "wan_throughput.png", line_gbps=config.link.wan_gbps)
    if sweep_out:
        plot_sweep({m: s["points"] for m, s in sweep_out.items()}, out / "sweep.png", threshold=sweep.threshold)
    print_bench_table(report, console=console, title=f"pdd bench ({len(requests)} requests)")
    console.print(f"wrote {out / 'report.json'} and plots in {out}; total wall time {wall:.0f} s ({wall / 60:.1f} min)")
    return report


def continuation_requests(trace, scale: Scale, tokens: TokenSpace, seed: int, plan: SweepPlan,
                          per_point: int | None) -> list | None:
    """The trace's requests after the main run's (``scale.count`` of them), enough for every point
    of ``plan`` at ``per_point`` requests each, built with the main run's prompts (same token space
    and seed, so a continued conversation extends the main run's prompts). None when the main run
    is not a slice (``count`` None), ``per_point`` is None, or the trace has too few requests."""
    if scale.count is None or not per_point:
        return None
    n_points = len(plan.rates) if plan.rates is not None else plan.max_points
    need = n_points * per_point
    more = build_requests(trace, dataclasses.replace(scale, count=scale.count + need), tokens, seed)[scale.count:]
    return more if len(more) >= need else None


def _sweep_mode(topo, cfg: ClusterConfig, mode: str, plan: SweepPlan, reqs: Sequence, slo: SLO,
                main_records: list[dict] | None, main_entry: dict, offered: float | None, timeout_s: float,
                max_arrival_s: float | None, path: Path, min_requests: int, progress: bool,
                console, warm: bool = False, per_point: int | None = None,
                main_before: Sequence = ()) -> list[dict]:
    """The sweep on a running topology; returns its points. ``warm``: ``reqs`` is the trace's
    continuation after the main run, each point replays its next requests on the caches the main
    run (and earlier points) left; else every point replays whole conversations of ``reqs``
    (:func:`pdd.bench.sweep.point_requests`) on flushed caches. ``per_point``: most requests of a
    warm point. ``main_before``: the main run's requests (a warm point's ideal prefix hits count
    what they left in the caches)."""
    history: list[tuple[float, float]] = []
    points: list[dict] = []
    used = 0
    while (rate := next_rate(plan, history)) is not None:
        t0 = time.monotonic()
        if warm:
            n = point_size(min(per_point or len(reqs), len(reqs) - used), rate, max_arrival_s, min_requests)
            point = at_rate(list(reqs[used: used + n]), rate)
        else:
            point = point_requests(reqs, rate, max_arrival_s, min_requests=min_requests)
        if main_records is not None and offered and abs(rate - offered) <= 1e-6 * offered:
            dicts, entry, reused = main_records, main_entry, True  # exactly the main run's replay
        else:
            if warm:
                used += len(point)
            console.print(f"sweep {mode}: {rate:g} req/s ({len(point)} requests)")
            recs, entry = measured_replay(topo, point, model=cfg.served_model_name, mode=mode,
                                          timeout_s=timeout_s, progress=progress, console=console,
                                          label=f"{mode} sweep @ {rate:g} req/s", flush=not warm)
            dicts, reused = [dict(r.to_dict(), rate_rps=rate) for r in recs], False
            write_jsonl(path, dicts, append=True)
        p = sweep_point(rate, dicts, entry, slo, time.monotonic() - t0)
        p["reused_main_run"] = reused
        # with a warm point, what an infinite cache holding everything replayed before would hit
        before = (list(main_before) + list(reqs[: used - len(point)])) if warm and not reused else []
        hits = ideal_prefix_hits(before + list(point))[len(before):]
        p["ideal_prefix_hit_rate"] = sum(hits) / max(1, sum(len(r.prompt_ids) for r in point))
        p["prompt_tokens_mean"] = sum(len(r.prompt_ids) for r in point) / max(1, len(point))
        points.append(p)
        history.append((rate, p["slo_attainment"] if p["slo_attainment"] is not None else 0.0))
        console.print(f"  {rate:g} req/s: SLO met {100 * (p['slo_attainment'] or 0):.1f}% "
                      f"({p['slo_met']}/{p['requests']}), goodput {_fmt(p['request_goodput'], 2)} req/s, "
                      f"TTFT P90 {_fmt(p['p90_ttft_ms'])} ms, ideal prefix hits "
                      f"{100 * p['ideal_prefix_hit_rate']:.0f}%, prompt mean {p['prompt_tokens_mean']:.0f} tokens"
                      + (" (main run)" if reused else ""))
    return points


# ---------------------------------------------------------------- console table


def bench_rows(modes: Mapping[str, Mapping]) -> list[tuple[str, list[str]]]:
    """Rows bench adds under report.table_rows (label, one cell per mode)."""
    names = list(modes)

    def row(label: str, fn) -> tuple[str, list[str]]:
        return label, [fn(modes[n]) for n in names]

    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    mix = lambda m: ", ".join(f"{k} {100 * v:.0f}%" for k, v in (m.get("pipeline_mix") or {}).items()) or "-"  # noqa: E731

    def hand(m):
        h = m.get("handoff") or {}
        if not h.get("handoffs"):
            return "-"
        return f"{h['handoffs']} (" + ", ".join(f"{k} {v}" for k, v in h["by_mode"].items()) + ")"

    return [
        row("TTFT mean (ms)", lambda m: _fmt(m.get("mean_ttft_ms"))),
        row("TPOT P90 (ms)", lambda m: _fmt(m.get("p90_tpot_ms"), 2)),
        row("request_throughput (req/s)", lambda m: _fmt(m.get("request_throughput"), 2)),
        row("SLO met", lambda m: pct(m.get("slo_attainment"))),
        row("SLO missed: TTFT/TPOT/both/failed", lambda m: "-" if not m.get("slo_misses") else
            "/".join(str(m["slo_misses"][k]) for k in ("ttft", "tpot", "both", "failed"))),
        row("request_goodput (req/s)", lambda m: _fmt(m.get("request_goodput"), 2)),
        row("SLA goodput (req/s)", lambda m: _fmt(m.get("sla_goodput_rps"), 2)),
        row("pipelines", mix),
        row("handoffs", hand),
        row("handoff gap P50/P95 (ms)", lambda m: "-" if not (m.get("handoff") or {}).get("handoffs") else
            f"{_fmt(m['handoff']['gap_ms']['median'])} / {_fmt(m['handoff']['gap_ms']['p95'])}"),
        row("handoff gap P95 / median ITL", lambda m: ", ".join(
            [f"{k} x{_fmt(v['gap_over_median_itl']['p95'], 2)}" for k, v in
             ((m.get("handoff") or {}).get("gaps_by_mode") or {}).items()]
            + ([f"no switch x{_fmt(m['handoff']['baseline']['gap_over_median_itl']['p95'], 2)}"]
               if (m.get("handoff") or {}).get("handoffs") and m["handoff"].get("baseline", {}).get("n") else []))
            or "-"),
        row("RLD mode switches", lambda m: _fmt((m.get("handoff") or {}).get("mode_switches"))),
        row("P hit rate", lambda m: pct(m.get("p_hit_rate"))),
        row("MD (D) hit rate", lambda m: pct(m.get("md_hit_rate"))),
        row("cut-offs", lambda m: _fmt((m.get("cutoffs") or {}).get("requests"))),
    ]


def print_bench_table(report: Mapping, console=None, title: str = "pdd bench") -> None:
    """The demo's comparison table plus the bench rows, then the SLO and sweep lines."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    modes = report.get("modes") or {}
    table = Table(title=title)
    table.add_column("metric")
    for name in modes:
        table.add_column(name, justify="right")
    for label, cells in vllm_mode.mark_rows(table_rows(modes) + bench_rows(modes), modes):
        table.add_row(label, *cells)
    console.print(table)
    slo = report.get("slo") or {}
    if slo.get("ttft_ms") is not None or slo.get("tpot_ms") is not None:
        console.print(f"SLO ({slo.get('source')}): TTFT <= {_fmt(slo.get('ttft_ms'))} ms, TPOT <= "
                      f"{_fmt(slo.get('tpot_ms'), 2)} ms; SLA = >= {100 * SLA_ATTAINMENT:.0f}% of requests meet it")
    sw = report.get("sweep") or {}
    for mode, s in (sw.get("modes") or {}).items():
        pts = ", ".join(f"{p['rate_rps']:g}: {100 * (p['slo_attainment'] or 0):.0f}%" for p in s["points"])
        console.print(f"sweep {mode}: {pts or 'no points'} -> SLA goodput {_fmt(s.get('sla_goodput_rps'), 2)} req/s")
    r = report.get("ratios") or {}
    if r.get("pdd_over_cross_dc_pd_p90_ttft_ms") is not None:
        console.print(f"TTFT pdd / cross_dc_pd: P50 x{_fmt(r['pdd_over_cross_dc_pd_median_ttft_ms'], 2)}, "
                      f"P90 x{_fmt(r['pdd_over_cross_dc_pd_p90_ttft_ms'], 2)}, "
                      f"P99 x{_fmt(r['pdd_over_cross_dc_pd_p99_ttft_ms'], 2)}")
    agree = report.get("output_agreement") or {}
    if agree.get("modes"):
        console.print(f"greedy outputs identical to {agree['reference']}: "
                      + ", ".join(f"{m} {a['identical']}/{a['compared']}" for m, a in agree["modes"].items()))
    if (line := vllm_mode.agreement_line(report.get("vllm_agreement"))) is not None:
        console.print(line)
    if report.get("mode_errors"):
        console.print(f"[red]mode errors: {report['mode_errors']}")


# ---------------------------------------------------------------- CLI


class ShortUsageParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (argparse's own and the ``ap.error`` calls of
    :func:`check_args` and :func:`main` alike) print one usage line pointing at ``--help``, then
    ``PROG: error: MESSAGE``, on stderr, and exit with status 2. argparse printed the whole usage
    first: 24 lines for ``pdd bench``, which pushed the message naming the flag off the screen."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [-h] [options]  (see {self.prog} --help)\n{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = ShortUsageParser(
        prog="pdd bench",
        description="Replay a Mooncake-format trace through modes on fresh topologies (or --url), with an SLO fixed "
                    "by a same_dc_pd reference run, goodput at the offered rate and an SLA-goodput rate sweep.",
        epilog="SLO: TTFT <= 3 x and TPOT <= 1.5 x the medians of a same_dc_pd reference run (one request in "
               "flight), unless --slo gives them. SLA goodput: the highest swept rate with >= 90% of requests "
               "meeting the SLO. Sweep points run on the mode's topology: the trace's next requests on warm caches when it has enough, else whole conversations on flushed caches. "
               "Exit status: 0 when every mode completed at least one request (failed requests are measured "
               "results), 1 when a mode completed none (its report is still written), 2 for bad arguments.")
    ap.add_argument("--config", help="cluster config (YAML or JSON)")
    ap.add_argument("--out", default="runs/bench", help="output directory (report.json, plots, records)")
    ap.add_argument("--modes", default=None,
                    help="comma-separated mode labels (default: all four pdd modes; vllm_colocated runs stock vLLM's "
                         "server on the same checkpoint, from the venv `make vllm` builds). With --url the one mode is the "
                         "server's: --modes may only name that mode (checked against its /pdd/stats or /health; "
                         "refused when the server does not report a mode)")
    ap.add_argument("--vllm-python", metavar="PATH",
                    help=f"Python of vLLM's venv for the {vllm_mode.VLLM_MODE} mode (default: ${vllm_mode.PYTHON_ENV}, "
                         f"else {vllm_mode.VENV_DIR}/bin/python, which `make vllm` builds)")
    ap.add_argument("--url", help="benchmark a running gateway instead (one mode: the server's; its caches are "
                                  "flushed between runs through POST /pdd/flush when it has one)")
    g = ap.add_argument_group("workload")
    g.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL")
    g.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    g.add_argument("--start", type=int, default=0, help="first request (after session sampling)")
    g.add_argument("--block-tokens", type=int, default=DEFAULT_SCALE.block_tokens, help="tokens per 512-token trace block")
    g.add_argument("--output-scale", type=float, default=DEFAULT_SCALE.output_scale)
    g.add_argument("--min-output", type=int, default=DEFAULT_SCALE.min_output_tokens)
    g.add_argument("--max-output", type=int, default=DEFAULT_SCALE.max_output_tokens)
    g.add_argument("--max-input", type=int, default=None, help="prompt cap in tokens (default: none)")
    g.add_argument("--rate", type=float, default=DEFAULT_SCALE.target_rate_rps, help="offered rate, mean req/s")
    g.add_argument("--ramp", metavar="START:END",
                   help="load ramp: the main run's rate rises linearly from START to END req/s (overrides --rate "
                        "for the main run; the sweep, if any, still starts at --rate)")
    g.add_argument("--session-sample", type=int, default=DEFAULT_SCALE.session_sample,
                   help=f"keep 1 in N conversations (all their turns); default {DEFAULT_SCALE.session_sample}, sized "
                        f"for the shared Mooncake trace: give 1 for a short or generated trace (pdd workload)")
    g.add_argument("--session-seed", type=int, default=0)
    g.add_argument("--seed", type=int, default=0, help="token-id seed")
    g = ap.add_argument_group("SLO and sweep")
    g.add_argument("--slo", nargs="+", metavar="KEY:MS", help="absolute bounds, e.g. --slo ttft:500 tpot:20")
    g.add_argument("--ref-requests", type=int, default=DEFAULT_REF_REQUESTS,
                   help="requests of the same_dc_pd reference run: N of whole conversations (0 = all of it, "
                        "the default: the reference then has the run's prompts, outputs and prefix reuse)")
    g.add_argument("--sweep-rate", default=DEFAULT_SWEEP,
                   help="'auto' (start at --rate, x2 until the SLA fails, then bisect), rates '1,2,4', or 'none'")
    g.add_argument("--sweep-requests", type=int, default=DEFAULT_SWEEP_REQUESTS,
                   help="requests per sweep point (N of whole conversations; 0 = all)")
    g.add_argument("--sweep-seconds", type=float, default=DEFAULT_SWEEP_SECONDS,
                   help="a point keeps as many requests as arrive within this many s at its rate (0 = all)")
    g.add_argument("--sweep-min-requests", type=int, default=DEFAULT_SWEEP_MIN_REQUESTS,
                   help="a point keeps at least this many requests, even if they arrive after --sweep-seconds")
    g.add_argument("--sweep-points", type=int, default=DEFAULT_SWEEP_POINTS, help="auto sweep: most points per mode")
    g.add_argument("--sweep-bisect", type=int, default=2, help="auto sweep: bisection steps")
    g.add_argument("--sweep-timeout", type=float, default=DEFAULT_SWEEP_TIMEOUT_S, help="per request in the sweep, s")
    g = ap.add_argument_group("config overrides")
    g.add_argument("--wan-gbps", type=float)
    g.add_argument("--wan-rtt-ms", type=float)
    g.add_argument("--fast-gbps", type=float)
    g.add_argument("--min-step-ms", type=float,
                   help="emulated accelerator step time: every engine's forward pass takes at least this long, ms, "
                        "0..10000 (default: the config's engine.min_step_ms, 0 = off; docs/LINK.md)")
    g.add_argument("--allow-p-rld", action="store_true", default=None)
    g.add_argument("--wan-order", choices=("fifo", "srf"))
    g.add_argument("--handoff-mode", choices=("one_shot", "catch_up", "auto"))
    g.add_argument("--pipeline-ttft-budget-ms", type=float)
    g.add_argument("--wan-loss-rate", type=float,
                   help="WAN packet loss probability in [0, 1): each connection is capped at TCP's loss-limited "
                        "(Mathis) rate (link.wan_loss_rate; docs/LINK.md)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--cross-traffic-gbps", dest="wan_cross_traffic", type=_cross_traffic_gbps, metavar="GBPS",
                   help="other traffic taking this many Gbit/s of the WAN line, per direction, from its start "
                        "(below --wan-gbps; link.wan_cross_traffic)")
    x.add_argument("--cross-traffic", dest="wan_cross_traffic", type=_cross_traffic_schedule, metavar="T:GBPS,...",
                   help="cross traffic as a schedule, seconds since the line started:Gbit/s, e.g. 0:0.01,60:0.025")
    g.add_argument("--base-port", type=int)
    g.add_argument("--gateway-port", type=int)
    g.add_argument("--model", help="served model name to request (default: the config's)")
    g.add_argument("--request-timeout", type=float, help="per request, s (default: the config's)")
    g = ap.add_argument_group("fault injection (docs/FAULTS.md)")
    g.add_argument("--fault", action="append", default=[], metavar="KIND[:ARG]@PHASE[#N]",
                   help="inject once when the N-th (default 1st) request reaches PHASE, in every mode that has the "
                        "phase and target; repeatable. KIND: wan_outage:SECONDS, wan_slowdown:FACTOR, "
                        "kill:NAME|p|rld|md. PHASE: prefill, transfer, rld_decode, handoff, md_decode")
    g.add_argument("--fault-recover-after", default="5", metavar="SECONDS|end",
                   help="restart a killed instance / lift a slowdown this long after the injection, or 'end' "
                        "(after the run's last request); default 5")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def parse_fault_args(specs: Sequence[str], recover_after: str, url: str | None) -> tuple[list[str], float | None]:
    """``--fault`` specs (checked) and ``--fault-recover-after`` (None = 'end'); ValueError if bad."""
    from pdd.bench.faults import parse_bench_fault
    from pdd.faults import FaultError

    try:
        for f in specs:
            parse_bench_fault(f)
    except FaultError as ex:
        raise ValueError(str(ex)) from None
    if specs and url:
        raise ValueError("--fault needs topologies pdd bench starts (not --url)")
    if str(recover_after).strip().lower() == "end":
        return list(specs), None
    try:
        v = float(recover_after)
    except ValueError:
        raise ValueError(f"--fault-recover-after: seconds or 'end', not {recover_after!r}") from None
    if v < 0:
        raise ValueError("--fault-recover-after must be >= 0")
    return list(specs), v


def _override_error(err: dict) -> str:
    """One pydantic error of a flag override as ``--flag: message``: a range error gets the value
    (``, got 0.0``); a validator's own message already names it and loses pydantic's ``Value error, ``."""
    if err["type"] == "value_error":
        return f"{_override_flag(err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
    return f"{_override_flag(err['loc'])}: {err['msg']}, got {err.get('input')!r}"


def _cross_traffic_gbps(text: str) -> list[tuple[float, float]]:
    """``--cross-traffic-gbps X`` -> ``[(0.0, X)]``; argparse names the flag on a bad value."""
    from pdd.policy.tcp_model import check_schedule

    try:
        gbps = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Gbit/s, got {text!r}") from None
    try:
        return list(check_schedule([(0.0, gbps)], ""))
    except ValueError as ex:
        raise argparse.ArgumentTypeError(str(ex).split(" at ")[0]) from None


def _cross_traffic_schedule(text: str) -> list[tuple[float, float]]:
    """``--cross-traffic 0:0.5,10:2.0`` -> ``[(0.0, 0.5), (10.0, 2.0)]`` (pdd.policy.tcp_model.parse_cross_traffic)."""
    from pdd.policy.tcp_model import parse_cross_traffic

    try:
        return list(parse_cross_traffic(text, "schedule"))
    except ValueError as ex:
        raise argparse.ArgumentTypeError(str(ex)) from None


def _override_flag(loc: Sequence) -> str:
    """The flag of a config field :func:`apply_overrides` set (``("link", "wan_gbps")`` -> ``--wan-gbps``)."""
    if not loc:
        return "config overrides"
    name = {"served_model_name": "model", "wan_cross_traffic": "cross_traffic"}.get(str(loc[-1]), str(loc[-1]))
    return "--" + name.replace("_", "-")


def check_numbers(ap: argparse.ArgumentParser, checks: Iterable[tuple[str, Any, float, bool]]) -> None:
    """``(flag, value, lo, strict)``: refuse a value not ``> lo`` (strict) or ``>= lo``, naming the flag
    (None: not given, passes; NaN fails)."""
    for flag, v, lo, strict in checks:
        if v is not None and not (v > lo if strict else v >= lo):  # NaN fails both
            ap.error(f"{flag}: must be {'>' if strict else '>='} {lo}, got {v}")


def check_workload_args(ap: argparse.ArgumentParser, args) -> None:
    """The workload flags ``pdd bench`` and ``pdd demo`` share (--rate, --requests, --start, the
    Scale knobs): refused naming the flag (argparse ``error``: exit status 2)."""
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate: must be > 0 req/s, got {args.rate}")
    if args.requests is not None and args.requests < 1:
        ap.error(f"--requests: must be >= 1, got {args.requests}")
    if args.start is not None and args.start < 0:
        ap.error(f"--start: must be >= 0, got {args.start}")
    check_numbers(ap, (
        ("--max-input", args.max_input, 1, False), ("--block-tokens", args.block_tokens, 1, False),
        ("--min-output", args.min_output, 1, False), ("--max-output", args.max_output, 1, False),
        ("--session-sample", args.session_sample, 1, False), ("--output-scale", args.output_scale, 0, True)))
    if args.max_output < args.min_output:
        ap.error(f"--max-output: must be >= --min-output ({args.min_output}), got {args.max_output}")


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Refuse, naming the flag, what would otherwise fail later with a traceback or run something
    other than asked (argparse ``error``: exit status 2)."""
    check_workload_args(ap, args)
    check_numbers(ap, (
        ("--ref-requests", args.ref_requests, 0, False), ("--sweep-requests", args.sweep_requests, 0, False),
        ("--sweep-min-requests", args.sweep_min_requests, 0, False),
        ("--sweep-points", args.sweep_points, 1, False), ("--sweep-bisect", args.sweep_bisect, 0, False),
        ("--sweep-seconds", args.sweep_seconds, 0, False), ("--sweep-timeout", args.sweep_timeout, 0, True),
        ("--request-timeout", args.request_timeout, 0, True)))
    modes_given = args.modes is not None
    args.modes = args.modes if modes_given else ",".join(DEFAULT_MODES)
    labels = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not labels:
        ap.error(f"--modes: no mode given ({args.modes!r}); choose from {', '.join(MODES)}")
    for m in labels:
        try:
            parse_mode_label(m)
        except ValueError as ex:
            ap.error(f"--modes: {ex}")
    if vllm_mode.VLLM_MODE in labels and not args.url:
        try:
            vllm_mode.check_vllm_importable(vllm_mode.vllm_python(args.vllm_python))
        except vllm_mode.VllmMissing as ex:  # before a model, a reference run or a topology is made
            ap.error(f"--modes: {ex}")
    if Path(args.trace).is_dir():
        ap.error(f"--trace: {args.trace} is a directory, not a trace file")
    if not Path(args.trace).is_file():
        ap.error(f"--trace: no such file: {args.trace}")
    from pdd.bench.trace import load_trace

    try:  # ~0.1 s for the shared trace; a bad line is refused before a model or topology is made
        records = load_trace(args.trace)
    except (OSError, ValueError) as ex:  # names the file and line
        ap.error(f"--trace: {ex}")
    if not records:
        ap.error(f"--trace: {args.trace} holds no trace records")
    if args.config is not None and not Path(args.config).is_file():
        ap.error(f"--config: no such file: {args.config}")
    if args.url:
        # the server at --url runs its own config: a topology flag would be recorded in the report
        # as if it had applied (found by a new user: --min-step-ms 20 against a server without it)
        shaping = [_override_flag((k,)) for k in TOPOLOGY_OVERRIDES if getattr(args, k) is not None]
        if shaping:
            ap.error(f"{', '.join(shaping)}: with --url the server runs its own config; these flags shape "
                     f"the topologies pdd bench starts (set them in the server's config instead)")
        try:
            httpx.get(f"{args.url.rstrip('/')}/v1/models", timeout=10, trust_env=False)
        except httpx.HTTPError as ex:
            ap.error(f"--url: cannot reach {args.url}: {type(ex).__name__}: {ex}")
        if modes_given:  # --url benchmarks the server's one mode: an explicit --modes must be that mode
            server = RemoteTopology(args.url, timeout_s=10).reported_mode()
            if server is None:
                ap.error(f"--modes {args.modes}: the server at {args.url} does not report its mode (GET /pdd/stats "
                         f"or /health), so it cannot be checked; with --url leave --modes out (the one mode "
                         f"benchmarked is the server's)")
            if labels != [server]:
                ap.error(f"--modes {args.modes}: the server at {args.url} runs mode {server}; with --url the one "
                         f"mode benchmarked is the server's (give --modes {server} or leave --modes out)")


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd bench``'s entry point (``python -m pdd.bench.bench``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    try:
        ramp = parse_ramp(args.ramp)
        slo = parse_slo(args.slo)
        sweep = parse_sweep(args.sweep_rate, start_rps=args.rate, max_points=args.sweep_points,
                            bisect_steps=args.sweep_bisect)
        faults, recover_after = parse_fault_args(args.fault, args.fault_recover_after, args.url)
    except ValueError as ex:
        ap.error(str(ex))
    try:
        base_cfg = ClusterConfig.load(args.config)
    except pydantic.ValidationError as ex:  # a field out of range: one line per field, not pydantic's text
        ap.error(f"--config {args.config}: invalid config: {validation_summary(ex)}")
    except (OSError, ValueError) as ex:  # missing file, bad YAML/JSON
        ap.error(f"--config {args.config}: {ex}")
    try:
        config = apply_overrides(base_cfg, served_model_name=args.model,
                                 **{k: getattr(args, k) for k in TOPOLOGY_OVERRIDES})
    except pydantic.ValidationError as ex:  # an override out of the config's range (--wan-gbps 0, a port)
        ap.error("; ".join(_override_error(e) for e in ex.errors()))
    try:
        scale = Scale(block_tokens=args.block_tokens, output_scale=args.output_scale,
                      min_output_tokens=args.min_output, max_output_tokens=args.max_output,
                      max_input_tokens=args.max_input, target_rate_rps=args.rate,
                      session_sample=args.session_sample, session_seed=args.session_seed)
    except ValueError as ex:  # check_args names the flags; this is the backstop for a combination it misses
        ap.error(f"workload scaling: {ex}")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        ap.error(f"--out {args.out}: cannot create the output directory: a file of that name exists")
    except OSError as ex:
        ap.error(f"--out {args.out}: cannot create the output directory: {ex.strerror or ex}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    try:
        report = run_bench(args.out, modes, args.requests, scale, config, args.seed, trace=args.trace,
                           start=args.start, url=args.url, slo=slo, ref_requests=args.ref_requests, sweep=sweep,
                           sweep_requests=args.sweep_requests or None, sweep_timeout_s=args.sweep_timeout,
                           sweep_seconds=args.sweep_seconds or None, sweep_min_requests=args.sweep_min_requests,
                           warmup=not args.no_warmup, request_timeout_s=args.request_timeout,
                           progress=not args.no_progress, argv=argv, ramp=ramp, faults=faults,
                           fault_recover_after_s=recover_after, vllm_python=args.vllm_python)
    except ValueError as ex:  # the workload or a label refused before anything ran (named in the message)
        ap.error(str(ex))
    return bench_exit_status(report)


def bench_exit_status(report: Mapping, run_order: Sequence[str] | None = None, prog: str = "pdd bench") -> int:
    """0 when every benchmarked mode completed at least one request (failed requests are measured
    results: the report has them); 1 when a mode completed none (a wrong --model, a server that
    refuses everything, a mode whose topology failed), said on stderr; the report is written first.
    ``run_order``: the modes run (default ``report["bench"]["run_order"]``; ``pdd demo`` has no
    ``bench`` section)."""
    order = report["bench"]["run_order"] if run_order is None else run_order
    empty = [m for m in order if not ((report.get("modes") or {}).get(m) or {}).get("completed")]
    if not empty:
        return 0
    errors = report.get("mode_errors") or {}
    print(f"{prog}: no request completed in {', '.join(empty)}"
          + "".join(f" ({m}: {errors[m]})" for m in empty if m in errors), file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
