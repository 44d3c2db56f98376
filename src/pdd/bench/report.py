"""Benchmark metrics (names as in ``vllm bench serve``), report.json and the comparison table.

Input is the per-request records the client writes (requests.jsonl, one JSON object per request
and mode; see :mod:`pdd.bench.client` ``RequestRecord``). The fields used here:

``mode``, ``ok`` (bool), ``error``, ``send_s`` (s), ``end_s`` (s), ``prompt_tokens``,
``token_times_s`` (client receive time of every output token, s, same clock as ``send_s``),
``tiers`` (per token: "rld" | "md" | "d" | "colocated" | None), ``pos`` (per token),
``usage`` (the final usage chunk's OpenAI usage) and ``pdd`` (the usage chunk's "pdd" fields:
pipeline, wan_bytes, wan_bytes_expected, md_cached_tokens, p_cached_tokens, handoff_pos).

Definitions (all latencies in ms):
- completed: ``ok`` and at least one token; failed: every other record of the mode.
- ttft_ms = first token time - send time; e2el_ms = last token time - send time;
  tpot_ms = (e2el - ttft) / (n - 1) for requests with n > 1 output tokens (n:
  :func:`output_tokens`, the usage's count when the stream timed fewer); itl_ms = every gap
  between consecutive timed tokens of a request, pooled over requests.
- duration_s = last ``end_s`` - first ``send_s`` of the mode; request_throughput = completed /
  duration (req/s); output_throughput = output tokens of completed requests / duration (tok/s).
- wan_bytes, wan_bytes_expected: from the gateway's /pdd/stats (P's per-request transfer counts
  summed, and the planned missing pages x page bytes), as deltas over the replay; without server
  stats, sums of the usage-chunk fields.
- rld_output_token_share = tokens with tier "rld" / all output tokens of completed requests.
- wan_line_bytes, cpu_seconds (sum over the mode's processes), leaked_pages come from the
  topology's ``stats()`` / ``flush()`` / ``cpu_seconds()`` taken around the mode's replay
  (server_stats.json; see :func:`server_summary`).
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

MODE_ORDER = ("colocated", "same_dc_pd", "cross_dc_pd", "pdd")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
TIERS = ("rld", "md", "d", "colocated")


# ---------------------------------------------------------------- per-request derived values


def is_completed(rec: Mapping) -> bool:
    """A request counts as completed when it ended without error and produced >= 1 token."""
    return bool(rec.get("ok")) and len(rec.get("token_times_s") or []) > 0


def output_tokens(rec: Mapping) -> int:
    """Output tokens of one record: the tokens the stream timed, or the server's
    ``usage.completion_tokens`` when it counts more. The client times a chunk with text as one
    token unless the server gives its token ids, so a server that streams several tokens per
    chunk (vLLM with speculative decoding or a stream interval, without ``return_token_ids``)
    or a token with empty text (a partial UTF-8 character held back) had that chunk timed once:
    counted by chunks, TPOT was the time per chunk (k x too high) and the throughputs k x too
    low. ``vllm bench serve`` counts the usage's tokens too."""
    n = len(rec.get("token_times_s") or [])
    usage = rec.get("usage")
    k = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
    return k if isinstance(k, int) and not isinstance(k, bool) and k > n else n


def cached_tokens(usage: Any) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of one record, 0 where the server's usage has
    none or not as an integer (another server's usage object: a string or list there made the
    report raise after the whole replay)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    k = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return k if isinstance(k, int) and not isinstance(k, bool) else 0


def request_latencies(rec: Mapping) -> dict:
    """ttft_ms, e2el_ms, tpot_ms (None when < 2 output tokens, :func:`output_tokens`) and itl_ms
    (list: the gaps between the stream's timed tokens) of one completed record."""
    times = rec["token_times_s"]
    send = rec["send_s"]
    ttft = (times[0] - send) * 1000.0
    e2el = (times[-1] - send) * 1000.0
    n = output_tokens(rec)
    tpot = (e2el - ttft) / (n - 1) if n > 1 else None
    itl = [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
    return {"ttft_ms": ttft, "e2el_ms": e2el, "tpot_ms": tpot, "itl_ms": itl}


def stream_is_consistent(rec: Mapping) -> bool:
    """Positions are 0..n-1 in order (no gap, no duplicate) when the server reports them."""
    pos = rec.get("pos") or []
    if not pos or any(p is None for p in pos):
        return True
    return list(pos) == list(range(pos[0], pos[0] + len(pos))) and pos[0] == 0


# ---------------------------------------------------------------- aggregation


def _stats(prefix: str, values: list[float]) -> dict:
    out: dict[str, float | None] = {}
    arr = np.asarray(values, dtype=np.float64)
    has = arr.size > 0
    out[f"mean_{prefix}_ms"] = float(arr.mean()) if has else None
    out[f"std_{prefix}_ms"] = float(arr.std()) if has else None
    for p in PERCENTILES:
        name = "median" if p == 50 else f"p{p}"
        out[f"{name}_{prefix}_ms"] = float(np.percentile(arr, p)) if has else None
    return out


def _instances_cpu(stats: Mapping | None) -> float | None:
    inst = (stats or {}).get("instances") or {}
    vals = [i.get("cpu_seconds") for i in inst.values() if i.get("cpu_seconds") is not None]
    return float(sum(vals)) if vals else None


def _proc_cpu(per_proc: Mapping | None) -> float | None:
    vals = [float(v) for v in (per_proc or {}).values() if v is not None and not math.isnan(float(v))]
    return float(sum(vals)) if vals else None


def server_summary(entry: Mapping | None) -> dict:
    """wan_line_bytes, cpu_seconds (s) and leaked_pages of one mode's server_stats.json entry.

    ``entry``: ``{"stats": stats() after the run, "flush": flush() after that, optional
    "stats_before": stats() just before the replay, "proc_cpu_seconds" / "proc_cpu_seconds_before":
    {process: CPU s} from Topology.cpu_seconds()}``. cpu_seconds sums the processes (from /proc
    when given, else the instances' own ``cpu_seconds``); with a "before" it is the replay's
    share (after - before), as is wan_line_bytes.
    """
    entry = entry or {}
    stats, flush, before = entry.get("stats") or {}, entry.get("flush") or {}, entry.get("stats_before")
    line = stats.get("wan_line_bytes")
    if line is not None and before and before.get("wan_line_bytes") is not None:
        line = int(line) - int(before["wan_line_bytes"])
    if entry.get("proc_cpu_seconds") is not None:
        cpu = _proc_cpu(entry["proc_cpu_seconds"])
        if cpu is not None and entry.get("proc_cpu_seconds_before") is not None:
            cpu -= _proc_cpu(entry["proc_cpu_seconds_before"]) or 0.0
    else:
        cpu = _instances_cpu(stats)
        if cpu is not None and before:
            cpu -= _instances_cpu(before) or 0.0
    out: dict = {}
    # KV payload bytes P's transfer layer sent across the WAN (summed per request there) and the
    # bytes planned from MD's cache state: authoritative over the usage chunks, which a request
    # that ends on RLD before its WAN transfer drains reports before the count is final.
    for key in ("wan_bytes", "wan_bytes_expected"):
        if stats.get(key) is not None:
            v = int(stats[key])
            if before and before.get(key) is not None:
                v -= int(before[key])
            out[key] = v
    return {
        **out,
        "wan_line_bytes": int(line) if line is not None else None,
        "cpu_seconds": cpu,
        "leaked_pages": int(flush["leaked_pages"]) if flush.get("leaked_pages") is not None else None,
        # False: the server was still busy when the wait before the final stats ended (counts may be short)
        **({"stats_settled": bool(entry["idle"])} if entry.get("idle") is not None else {}),
    }


def mode_metrics(records: Iterable[Mapping], server: Mapping | None = None) -> dict:
    """All metrics of one mode's records; ``server`` is its server_stats.json entry (see server_summary)."""
    recs = list(records)
    done = [r for r in recs if is_completed(r)]
    lat = [request_latencies(r) for r in done]
    ttft = [x["ttft_ms"] for x in lat]
    e2el = [x["e2el_ms"] for x in lat]
    tpot = [x["tpot_ms"] for x in lat if x["tpot_ms"] is not None]
    itl = [g for x in lat for g in x["itl_ms"]]

    out_tokens = sum(output_tokens(r) for r in done)
    in_tokens = sum(int(r.get("prompt_tokens") or 0) for r in done)
    sends = [r["send_s"] for r in recs if r.get("send_s") is not None]
    ends = [r["end_s"] for r in recs if r.get("end_s") is not None]
    duration = (max(ends) - min(sends)) if sends and ends else 0.0

    tiers: Counter = Counter()
    for r in done:
        tiers.update(t if t is not None else "unknown" for t in (r.get("tiers") or []))
    pipelines: Counter = Counter()
    wan = wan_expected = md_cached = p_cached = cached = 0
    for r in recs:
        pd = r.get("pdd") or {}
        wan += int(pd.get("wan_bytes") or 0)
        wan_expected += int(pd.get("wan_bytes_expected") or 0)
        md_cached += int(pd.get("md_cached_tokens") or 0)
        p_cached += int(pd.get("p_cached_tokens") or 0)
        if pd.get("pipeline") is not None:
            pipelines[str(pd["pipeline"])] += 1
        cached += cached_tokens(r.get("usage"))

    m: dict[str, Any] = {
        "completed": len(done),
        "failed": len(recs) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
    }
    m.update(_stats("ttft", ttft))
    m.update(_stats("tpot", tpot))
    m.update(_stats("itl", itl))
    m.update(_stats("e2el", e2el))
    m.update(
        {
            "wan_bytes": wan,
            "wan_bytes_expected": wan_expected,
            # over the tokens the stream tagged with their tier (one per timed token)
            "rld_output_token_share": tiers.get("rld", 0) / sum(tiers.values()) if tiers else 0.0,
            "tier_tokens": dict(sorted(tiers.items())),
            "pipelines": dict(sorted(pipelines.items())),
            "cached_tokens": cached,
            "md_cached_tokens": md_cached,
            "p_cached_tokens": p_cached,
            "stream_errors": sum(1 for r in done if not stream_is_consistent(r)),
            "errors": dict(Counter(_error_kind(r.get("error")) for r in recs if not is_completed(r))),
            "error_examples": _error_examples(recs),
        }
    )
    m.update(server_summary(server))
    return m


def _error_examples(recs: Iterable[Mapping]) -> dict:
    """``{error kind: its first message}``, so a warning can say what the kind was."""
    out: dict[str, str] = {}
    for r in recs:
        if not is_completed(r):
            out.setdefault(_error_kind(r.get("error")), str(r.get("error") or "no tokens"))
    return out


def _error_kind(err: Any) -> str:
    if not err:
        return "no tokens"
    return str(err).split(":", 1)[0][:80]


def _mode_key(mode: str) -> tuple:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


def failure_warnings(modes: Mapping[str, Mapping]) -> list[str]:
    """One warning line per mode with failed requests: the count, the most common error kind with
    an example message, and that its metrics (and the ratios built on them) count only its
    completed requests (a mode whose slowest requests timed out otherwise looks fast)."""
    out = []
    for name, m in modes.items():
        failed = int(m.get("failed") or 0)
        if not failed:
            continue
        done = int(m.get("completed") or 0)
        errs = m.get("errors") or {}
        kind, n = max(errs.items(), key=lambda kv: kv[1]) if errs else ("unknown", failed)
        example = (m.get("error_examples") or {}).get(kind, kind)
        out.append(f"WARNING: {name}: {failed} of {failed + done} requests failed (most common error, {n}x: "
                   f"{example}); its metrics and ratios are over its {done} completed requests only")
    return out


def ratio_caveat(modes: Mapping[str, Mapping], names: Sequence[str]) -> str:
    """`` (over completed requests only: pdd 65/100, ...)`` when one of ``names`` has failed requests, else ''."""
    part = [(n, modes[n]) for n in names if n in modes and (modes[n].get("failed") or 0)]
    if not part:
        return ""
    return " (over completed requests only: " + ", ".join(
        f"{n} {m['completed']}/{m['completed'] + m['failed']}" for n, m in part) + ")"


def print_failure_warnings(modes: Mapping[str, Mapping], console) -> None:
    """:func:`failure_warnings` in bold red, never wrapped (the line stays greppable) nor read as markup."""
    for line in failure_warnings(modes):
        console.print(line, style="bold red", markup=False, highlight=False, soft_wrap=True)


def compute_modes(records: Iterable[Mapping], server_stats: Mapping[str, Mapping] | None = None) -> dict:
    """``{mode: metrics}`` for every mode present in the records (canonical mode order)."""
    by_mode: dict[str, list] = {}
    for r in records:
        by_mode.setdefault(r["mode"], []).append(r)
    server_stats = server_stats or {}
    return {mode: mode_metrics(by_mode[mode], server_stats.get(mode)) for mode in sorted(by_mode, key=_mode_key)}


def ratios(modes: Mapping[str, Mapping]) -> dict:
    """pdd / baseline ratios of TTFT percentiles (None when a side is missing)."""
    out: dict[str, float | None] = {}
    for base in ("cross_dc_pd", "same_dc_pd"):
        for key in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"):
            a = (modes.get("pdd") or {}).get(key)
            b = (modes.get(base) or {}).get(key)
            out[f"pdd_over_{base}_{key}"] = a / b if a is not None and b else None
    return out


def output_agreement(records: Iterable[Mapping], reference: str | None = None) -> dict:
    """Greedy output contract across modes: each mode's token ids vs the reference mode's.

    Compares requests (by ``idx``) completed in both modes. Returns ``{"reference": mode,
    "modes": {mode: {"compared", "identical", "diverged": [{"idx", "pos"}, ...]}}}`` where ``pos``
    is the first differing position (or the shorter length). Near-ties of a random-weight model
    may legitimately diverge; this lists them rather than hiding them.
    """
    by_mode: dict[str, dict[int, list]] = {}
    for r in records:
        if is_completed(r):
            by_mode.setdefault(r["mode"], {})[r["idx"]] = list(r.get("token_ids") or [])
    names = sorted(by_mode, key=_mode_key)
    if reference is None:
        reference = names[0] if names else None
    out: dict[str, Any] = {"reference": reference, "modes": {}}
    ref = by_mode.get(reference or "", {})
    for mode in names:
        if mode == reference:
            continue
        compared = identical = 0
        diverged = []
        for idx, ids in sorted(by_mode[mode].items()):
            if idx not in ref:
                continue
            compared += 1
            if ids == ref[idx]:
                identical += 1
                continue
            pos = next((i for i, (a, b) in enumerate(zip(ids, ref[idx])) if a != b), min(len(ids), len(ref[idx])))
            diverged.append({"idx": idx, "pos": pos})
        out["modes"][mode] = {"compared": compared, "identical": identical, "diverged": diverged}
    return out


# ---------------------------------------------------------------- files


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, records: Iterable[Mapping], append: bool = False) -> None:
    with open(path, "a" if append else "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def recompute_report(requests_jsonl: str | Path, server_stats_json: str | Path | None = None) -> dict:
    """Recompute the report's ``modes`` from requests.jsonl (+ server_stats.json beside it)."""
    requests_jsonl = Path(requests_jsonl)
    if server_stats_json is None:
        server_stats_json = requests_jsonl.with_name("server_stats.json")
    server = json.loads(Path(server_stats_json).read_text()) if Path(server_stats_json).exists() else {}
    return compute_modes(read_jsonl(requests_jsonl), server)


def git_commit(cwd: str | Path | None = None) -> str:
    """HEAD's hash, with ``-dirty`` when tracked files differ from it; "unknown" outside git."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_report(
    records: Iterable[Mapping],
    server_stats: Mapping[str, Mapping] | None = None,
    *,
    config: Mapping | None = None,
    seed: int = 0,
    workload: Mapping | None = None,
    link: Mapping | None = None,
    commit: str | None = None,
) -> dict:
    """The report.json document (schema in docs and the module docstring)."""
    config = dict(config or {})
    link = dict(link or config.get("link") or {})
    records = list(records)
    modes = compute_modes(records, server_stats)
    return {
        "git_commit": commit if commit is not None else git_commit(),
        "config": config,
        "seed": seed,
        "workload": dict(workload or {}),
        "link": {k: link.get(k) for k in ("wan_gbps", "wan_rtt_ms", "fast_gbps")},
        "modes": modes,
        "ratios": ratios(modes),
        "output_agreement": output_agreement(records),
    }


def write_report(path: str | Path, report: Mapping) -> None:
    Path(path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")


# ---------------------------------------------------------------- console table


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table_rows(modes: Mapping[str, Mapping]) -> list[tuple[str, list[str]]]:
    """The comparison table as (label, one cell per mode) rows (used by print_table and tests)."""
    names = list(modes)

    def row(label: str, fn) -> tuple[str, list[str]]:
        return label, [fn(modes[n]) for n in names]

    mb = lambda v: None if v is None else v / 1e6  # noqa: E731
    return [
        row("completed / failed", lambda m: f"{m['completed']} / {m['failed']}"),
        row("TTFT P50 (ms)", lambda m: _fmt(m.get("median_ttft_ms"))),
        row("TTFT P90 (ms)", lambda m: _fmt(m.get("p90_ttft_ms"))),
        row("TTFT P99 (ms)", lambda m: _fmt(m.get("p99_ttft_ms"))),
        row("TPOT median (ms)", lambda m: _fmt(m.get("median_tpot_ms"))),
        row("ITL median (ms)", lambda m: _fmt(m.get("median_itl_ms"))),
        row("ITL P99 (ms)", lambda m: _fmt(m.get("p99_itl_ms"))),
        row("E2E median (ms)", lambda m: _fmt(m.get("median_e2el_ms"))),
        row("output tok/s", lambda m: _fmt(m.get("output_throughput"))),
        row("WAN MB (requests)", lambda m: _fmt(mb(m.get("wan_bytes")), 2)),
        row("WAN MB expected", lambda m: _fmt(mb(m.get("wan_bytes_expected")), 2)),
        row("WAN MB (line)", lambda m: _fmt(mb(m.get("wan_line_bytes")), 2)),
        row("RLD token share", lambda m: "-" if m.get("rld_output_token_share") is None else
            f"{100 * m['rld_output_token_share']:.1f}%"),
        row("CPU s", lambda m: _fmt(m.get("cpu_seconds"))),
        row("leaked pages", lambda m: _fmt(m.get("leaked_pages"))),
        row("stream errors", lambda m: _fmt(m.get("stream_errors"))),
    ]


def print_table(report_or_modes: Mapping, console=None, title: str = "pdd benchmark") -> None:
    """Print modes side by side (rich), then the pdd / baseline TTFT ratios."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    modes = report_or_modes.get("modes", report_or_modes)
    table = Table(title=title)
    table.add_column("metric")
    for name in modes:
        table.add_column(name, justify="right")
    for label, cells in table_rows(modes):
        table.add_row(label, *cells)
    console.print(table)
    print_failure_warnings(modes, console)
    r = ratios(modes)
    parts = [
        f"{base}: P50 x{_fmt(r[f'pdd_over_{base}_median_ttft_ms'], 2)}, "
        f"P90 x{_fmt(r[f'pdd_over_{base}_p90_ttft_ms'], 2)}, P99 x{_fmt(r[f'pdd_over_{base}_p99_ttft_ms'], 2)}"
        + ratio_caveat(modes, ("pdd", base))
        for base in ("cross_dc_pd", "same_dc_pd")
        if r[f"pdd_over_{base}_p90_ttft_ms"] is not None
    ]
    if parts:
        console.print("TTFT pdd / " + "; pdd / ".join(parts), soft_wrap=True)
    agree = report_or_modes.get("output_agreement")
    if agree and agree.get("modes"):
        console.print(
            f"greedy outputs identical to {agree['reference']}: "
            + ", ".join(f"{m} {a['identical']}/{a['compared']}" for m, a in agree["modes"].items())
            + (" (over requests completed in both)" if any((m.get("failed") or 0) for m in modes.values()) else ""),
            soft_wrap=True,
        )
