"""NVIDIA's aiperf as an independent client beside ``pdd bench`` (``scripts/aiperf_compare.py``).

Both clients replay one workload against one gateway: the requests ``pdd bench`` builds from
its workload flags (:func:`bench_requests`, the same code and arguments as ``pdd bench``) are
written as an aiperf Mooncake trace (:func:`aiperf_trace`): one record per request, its send time
(``timestamp``, ms, replayed with ``--fixed-schedule``) and the ``/v1/completions`` body ``pdd
bench`` sends (``payload``: the same prompt token ids, ``max_tokens``, ``ignore_eos``,
streaming), so the server sees the same requests from either client. aiperf must not synthesise
prompts from ``input_length`` / ``hash_ids`` here: its text would tokenise differently and the
prefix sharing would be aiperf's, not the trace's.

Metric names (aiperf ``profile_export_aiperf.json`` -> ``pdd bench`` report): TTFT
``time_to_first_token`` -> ``ttft``; TPOT ``inter_token_latency`` (``(request_latency - ttft) /
(output tokens - 1)`` per request) -> ``tpot`` (the same definition); ITL ``inter_chunk_latency``
(every gap between consecutive stream chunks, pooled over requests) -> ``itl`` (every gap
between consecutive tokens; pdd streams one token per chunk). Nothing here needs aiperf
installed: it parses the files aiperf writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

#: (label, aiperf metric tag, pdd bench metric prefix)
METRICS = (("TTFT", "time_to_first_token", "ttft"),
           ("TPOT", "inter_token_latency", "tpot"),
           ("ITL", "inter_chunk_latency", "itl"),
           ("E2E", "request_latency", "e2el"))
STATS = (("P50", "p50", "median"), ("P90", "p90", "p90"))


# ---- the workload ---------------------------------------------------------------------------
def bench_requests(bench_argv: Sequence[str]):
    """``(requests, scale, config)``: the main run's requests of ``pdd bench BENCH_ARGV``, built as
    ``pdd bench`` builds them (its parser, ``Scale``, ``fit_scale``, token space and
    ``build_requests``). ``BENCH_ARGV`` holds the workload flags (``--trace``, ``--requests``,
    ``--rate``, ``--session-sample``, ``--block-tokens``, ``--output-scale``, ...) and may hold
    ``--config``/``--url``; ramps are not supported."""
    from pdd.bench.args import build_parser
    from pdd.bench.live import ensure_model
    from pdd.workload.replay import Scale, TokenSpace, build_requests, fit_scale
    from pdd.config import ClusterConfig

    a = build_parser().parse_args(list(bench_argv))
    if a.ramp:
        raise ValueError("--ramp: not supported by the aiperf comparison (aiperf replays fixed times)")
    config = ClusterConfig.load(a.config)
    if a.model:
        config = config.model_copy(update={"served_model_name": a.model})
    scale = Scale(block_tokens=a.block_tokens, output_scale=a.output_scale, min_output_tokens=a.min_output,
                  max_output_tokens=a.max_output, max_input_tokens=a.max_input, target_rate_rps=a.rate,
                  session_sample=a.session_sample, session_seed=a.session_seed)
    if a.url and not (Path(config.model_path) / "config.json").exists():  # as run_bench does
        tokens = TokenSpace()
    else:
        tokens = TokenSpace.from_model(ensure_model(config))
    scale = fit_scale(scale, config, a.requests, a.start)
    return build_requests(a.trace, scale, tokens, a.seed), scale, config


def check_workload(bench_argv: Sequence[str]) -> None:
    """``pdd bench BENCH_ARGV``'s workload flags checked as ``pdd bench`` checks them
    (:func:`pdd.bench.args.check_workload_args`: ``--rate`` at least
    :data:`pdd.load_profile.MIN_RATE_RPS`, ``--requests`` >= 1, ...), before anything starts: a bad
    one exits 2 through ``pdd bench``'s parser, one line naming the flag (SystemExit)."""
    from pdd.bench.args import build_parser, check_workload_args

    ap = build_parser()
    check_workload_args(ap, ap.parse_args(list(bench_argv)))


def check_model(bench_argv: Sequence[str], url: str | None = None, timeout_s: float = 10.0) -> str:
    """The served model name both clients request for ``pdd bench BENCH_ARGV`` (its ``--model``,
    else ``served_model_name`` of its ``--config``), checked before anything starts: a wrong one
    made every request of both clients a 404 (aiperf's ``--model`` and every payload carry it),
    found only once the server had started and ``pdd bench``'s whole run had failed. ``url``: a
    running gateway, whose ``GET /v1/models`` must list the name; None: the ``pdd serve`` the
    comparison starts serves the config's name, so a ``--model`` other than it is refused.
    Raises ValueError naming ``--model`` (or the config's ``served_model_name`` and ``--url``),
    or ``--config`` when it is missing or invalid; a malformed flag (an empty ``--model``) exits
    2 through ``pdd bench``'s parser, naming it."""
    import httpx
    import pydantic

    from pdd.bench.args import build_parser
    from pdd.config import ClusterConfig, validation_summary

    a = build_parser().parse_args(list(bench_argv))
    try:
        served = ClusterConfig.load(a.config).served_model_name
    except pydantic.ValidationError as ex:  # one line per field, as pdd bench says it
        raise ValueError(f"--config {a.config}: invalid config: {validation_summary(ex)}") from None
    except (OSError, ValueError) as ex:  # missing file, bad YAML/JSON
        raise ValueError(f"--config {a.config}: {ex}") from None
    src = f"served_model_name {served!r} of {f'--config {a.config}' if a.config else 'the default config'}"
    if url is None:
        if a.model is not None and a.model != served:
            raise ValueError(f"--model {a.model!r}: the pdd serve this comparison starts serves {src}; leave "
                             f"--model out, or give --url for a server that serves {a.model!r}")
        return served
    model = served if a.model is None else a.model
    named = src if a.model is None else f"--model {a.model!r}"
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, trust_env=False)
        r.raise_for_status()
        names = [m["id"] for m in r.json()["data"]]
    except httpx.HTTPError as ex:
        raise ValueError(f"--url {url}: GET /v1/models failed ({type(ex).__name__}: {ex}), so {named} "
                         f"cannot be checked") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--url {url}: GET /v1/models is not an OpenAI model list, so {named} cannot be "
                         f"checked") from None
    if model not in names:
        raise ValueError(f"{named}: the server at {url} serves {', '.join(map(repr, names)) or 'no model'} "
                         f"(GET /v1/models); give that name with --model after `--`")
    return model


def aiperf_trace(requests: Iterable, model: str) -> list[dict]:
    """aiperf ``mooncake_trace`` records replaying ``requests`` (``ReplayRequest``s) verbatim:
    ``timestamp`` = the request's send time (ms after the first), ``payload`` = ``pdd bench``'s
    request body, ``output_length`` = its ``max_tokens``."""
    from pdd.bench.client import completion_body

    return [{"timestamp": round(r.arrival_s * 1000.0, 3), "output_length": int(r.max_tokens),
             "payload": completion_body(list(r.prompt_ids), int(r.max_tokens), model)} for r in requests]


def write_jsonl(path: str | Path, records: Iterable[Mapping]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def aiperf_command(aiperf: str, url: str, model: str, input_file: str | Path, out_dir: str | Path,
                   tokenizer: str | Path, slo: Mapping[str, float] | None = None,
                   timeout_s: float | None = None) -> list[str]:
    """The ``aiperf profile`` command line: completions endpoint, streaming, the trace replayed
    at its timestamps, token counts from the server's usage chunk, ``--goodput`` from ``slo``
    (``{"ttft_ms", "tpot_ms"}``: ``time_to_first_token`` / ``inter_token_latency`` in ms). One
    worker and one record processor: on a small shared machine aiperf's own processes compete
    with the server's for the cores (it times requests, it does not generate load)."""
    cmd = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
           "--input-file", str(input_file), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
           "--tokenizer", str(tokenizer), "--use-server-token-count", "--ui-type", "none",
           "--artifact-dir", str(out_dir), "--export-level", "records", "--no-server-metrics",
           "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1"]
    goodput = []
    if slo and slo.get("ttft_ms") is not None:
        goodput.append(f"time_to_first_token:{slo['ttft_ms']:g}")
    if slo and slo.get("tpot_ms") is not None:
        goodput.append(f"inter_token_latency:{slo['tpot_ms']:g}")
    if goodput:
        cmd += ["--goodput", " ".join(goodput)]
    if timeout_s:
        cmd += ["--request-timeout-seconds", f"{timeout_s:g}"]
    return cmd


# ---- reading both clients' results ----------------------------------------------------------
def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def read_aiperf_summary(out_dir: str | Path) -> dict:
    """``{metric_tag: {"p50", "p90", "avg", "count"}}`` and ``completed``, ``errors``,
    ``goodput_rps``, ``good_requests``, ``duration_s``, ``aiperf_version`` from aiperf's
    ``profile_export_aiperf.json`` in ``out_dir``."""
    path = Path(out_dir) / "profile_export_aiperf.json"
    d = json.loads(path.read_text())
    out: dict = {"aiperf_version": d.get("aiperf_version")}
    for _, tag, _p in METRICS:
        m = d.get(tag) or {}
        out[tag] = {k: _num(m.get(k)) for k in ("p50", "p90", "avg", "count")}
    out["completed"] = _num((d.get("request_count") or {}).get("avg"))
    errs = d.get("error_summary") or []
    out["errors"] = int(sum(e.get("count", 0) for e in errs)) if isinstance(errs, list) else 0
    out["goodput_rps"] = _num((d.get("goodput") or {}).get("avg"))
    out["good_requests"] = _num((d.get("good_request_count") or {}).get("avg"))
    out["duration_s"] = _num((d.get("benchmark_duration") or {}).get("avg"))
    # the client's own overhead: how late it sent against the schedule, connection set-up
    out["client"] = {"send_lag_p50_ms": _num((d.get("replay_sched_lag_p50") or {}).get("avg")),
                     "send_lag_p90_ms": _num((d.get("replay_sched_lag_p90") or {}).get("avg")),
                     "connect_avg_ms": _num((d.get("http_req_connecting") or {}).get("avg")),
                     "connection_reused": _num((d.get("http_req_connection_reused") or {}).get("avg"))}
    return out


def pdd_send_lag(records: Iterable[Mapping]) -> dict:
    """How late ``pdd bench`` sent against its schedule: P50 / P90 of ``send_s - arrival_s`` (ms)."""
    lag = [1000.0 * (r["send_s"] - r["arrival_s"]) for r in records if r.get("send_s") is not None]
    if not lag:
        return {"send_lag_p50_ms": None, "send_lag_p90_ms": None}
    return {"send_lag_p50_ms": float(np.percentile(lag, 50)), "send_lag_p90_ms": float(np.percentile(lag, 90))}


def read_aiperf_records(out_dir: str | Path) -> list[dict]:
    """aiperf's per-request records (``profile_export.jsonl``), in send order: ``start_ns``,
    ``ttft_ms``, ``tpot_ms``, ``e2e_ms``, ``tokens``, ``chunk_gaps_ms`` (list), ``error``."""
    rows = []
    for line in (Path(out_dir) / "profile_export.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        m, md = r.get("metrics") or {}, r.get("metadata") or {}

        def val(k):
            return (m.get(k) or {}).get("value")

        gaps = val("inter_chunk_latency")
        rows.append({"start_ns": md.get("request_start_ns"), "ttft_ms": _num(val("time_to_first_token")),
                     "tpot_ms": _num(val("inter_token_latency")), "e2e_ms": _num(val("request_latency")),
                     "tokens": val("output_sequence_length"),
                     "chunk_gaps_ms": [float(g) for g in gaps] if isinstance(gaps, list) else [],
                     "error": r.get("error")})
    rows.sort(key=lambda x: (x["start_ns"] is None, x["start_ns"] or 0))
    return rows


def contentless_tokens(rows: Sequence[Mapping]) -> dict:
    """Tokens whose stream chunk aiperf did not time: ``output tokens - 1 - chunk gaps`` summed
    over aiperf's records (aiperf times only chunks with text, ``content_responses``; a token
    whose text delta is empty merges two gaps into one), against all tokens."""
    tokens = sum(int(r["tokens"] or 0) for r in rows if not r.get("error"))
    gaps = sum(len(r["chunk_gaps_ms"]) for r in rows if not r.get("error"))
    timed = sum(1 for r in rows if not r.get("error") and r["tokens"])
    return {"tokens": tokens, "untimed": max(0, tokens - timed - gaps)}


def pdd_summary(report: Mapping, mode: str | None = None) -> dict:
    """The same shape as :func:`read_aiperf_summary` from a ``pdd bench`` report.json (its one mode,
    or ``mode``), keyed by aiperf's metric tags."""
    modes = report["modes"]
    m = modes[mode] if mode else next(iter(modes.values()))
    out: dict = {}
    for _, tag, pre in METRICS:
        out[tag] = {"p50": _num(m.get(f"median_{pre}_ms")), "p90": _num(m.get(f"p90_{pre}_ms")),
                    "avg": _num(m.get(f"mean_{pre}_ms")), "count": None}
    out["completed"] = m.get("completed")
    out["errors"] = m.get("failed")
    out["goodput_rps"] = _num(m.get("request_goodput"))
    out["good_requests"] = m.get("slo_met")
    out["duration_s"] = _num(m.get("duration_s"))
    return out


def pdd_per_request(records: Iterable[Mapping]) -> list[dict]:
    """``pdd bench`` requests.jsonl records as :func:`read_aiperf_records` rows, in send order."""
    from pdd.bench.report import request_latencies

    rows = []
    for r in sorted(records, key=lambda x: (x.get("arrival_s", 0.0), x.get("idx", 0))):
        ok = r.get("ok") and r.get("token_times_s")
        lat = request_latencies(r) if ok else {}
        rows.append({"idx": r.get("idx"), "ttft_ms": lat.get("ttft_ms"), "tpot_ms": lat.get("tpot_ms"),
                     "e2e_ms": lat.get("e2el_ms"), "tokens": len(r.get("token_times_s") or []),
                     "error": r.get("error")})
    return rows


def paired_ttft(a: Sequence[Mapping], b: Sequence[Mapping]) -> dict | None:
    """Request-by-request TTFT of two runs of one workload (both in send order): the median and
    P90 of ``b / a - 1`` and of ``|b - a|`` (ms), over requests both completed."""
    pairs = [(x["ttft_ms"], y["ttft_ms"]) for x, y in zip(a, b) if x.get("ttft_ms") and y.get("ttft_ms")]
    if not pairs:
        return None
    rel = np.array([y / x - 1.0 for x, y in pairs])
    ab = np.array([abs(y - x) for x, y in pairs])
    return {"n": len(pairs), "median_rel": float(np.median(rel)), "p90_abs_rel": float(np.percentile(np.abs(rel), 90)),
            "median_abs_ms": float(np.median(ab)), "p90_abs_ms": float(np.percentile(ab, 90))}


# ---- the table ------------------------------------------------------------------------------
def comparison_rows(pdd: Mapping, aiperf: Mapping, pdd_again: Mapping | None = None) -> list[dict]:
    """One row per metric and statistic: both clients' values (ms), ``ratio`` = aiperf / pdd bench,
    and with ``pdd_again`` (a second ``pdd bench`` run of the workload after aiperf's)
    ``noise`` = pdd bench run 2 / run 1: the run-to-run ratio the clients' ratio is read against,
    and ``ratio_aba`` = aiperf / the mean of the two pdd bench runs (before and after aiperf's)."""
    rows = []
    for label, tag, _ in METRICS:
        for slabel, key, _k in STATS:
            p = (pdd.get(tag) or {}).get(key)
            a = (aiperf.get(tag) or {}).get(key)
            row = {"metric": f"{label} {slabel}", "pdd_bench_ms": p, "aiperf_ms": a,
                   "ratio": a / p if p and a is not None else None}
            if pdd_again is not None:
                q = (pdd_again.get(tag) or {}).get(key)
                row["pdd_bench_run2_ms"] = q
                row["noise"] = q / p if p and q is not None else None
                # A B A: a drift of the machine's load between the runs cancels to first order
                row["ratio_aba"] = 2 * a / (p + q) if p and q is not None and a is not None else None
            rows.append(row)
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(rows: Sequence[Mapping]) -> str:
    """Markdown: metric, pdd bench, aiperf, aiperf / pdd bench (and run 2, run 2 / run 1)."""
    again = any("noise" in r for r in rows)
    head = "| metric | pdd bench ms | aiperf ms | aiperf / pdd bench |"
    if again:
        head += " pdd bench run 2 ms | run 2 / run 1 | aiperf / mean(run 1, run 2) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['metric']} | {_f(r['pdd_bench_ms'], '.2f')} | {_f(r['aiperf_ms'], '.2f')} | "
                f"{_f(r['ratio'], '.3f')} |")
        if again:
            line += (f" {_f(r.get('pdd_bench_run2_ms'), '.2f')} | {_f(r.get('noise'), '.3f')} |"
                     f" {_f(r.get('ratio_aba'), '.3f')} |")
        lines.append(line)
    return "\n".join(lines)


def within(rows: Sequence[Mapping], tol: float = 0.10) -> bool:
    """Every ratio present lies within ``1 +- tol``."""
    rs = [r["ratio"] for r in rows if r.get("ratio") is not None]
    return bool(rs) and all(abs(r - 1.0) <= tol for r in rs)
