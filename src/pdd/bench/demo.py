"""The side-by-side demo: one Mooncake trace slice replayed through each mode on a fresh topology.

For every mode: start a fresh ``Topology`` (new processes, empty caches), optionally warm it up
(a short private prompt, then ``flush()`` so the replay starts from empty caches), take
``stats()``, replay the requests open-loop, take ``stats()`` and ``flush()`` again, stop. Writes
into ``out_dir``:

- ``requests.jsonl``: one record per request and mode (client times of every token, tier of
  every token, pipeline, bytes; see :class:`pdd.bench.client.RequestRecord`);
- ``server_stats.json``: ``{mode: {"stats_before", "stats", "flush", "proc_cpu_seconds_before",
  "proc_cpu_seconds"}}`` as returned by the topology;
- ``report.json`` (:func:`pdd.bench.report.build_report`), ``ttft_cdf.png``,
  ``timeline_<mode>.png``; and prints the comparison table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

import pydantic

from pdd.bench.args import ShortUsageParser, bench_exit_status, check_numbers, check_workload_args
from pdd.bench.live import _default_topology, _proc_cpu, _warmup, ensure_model, measured_replay  # noqa: F401
from pdd.bench.plots import plot_token_timeline, plot_ttft_cdf
from pdd.bench.report import build_report, compute_modes, print_table, write_jsonl, write_report
from pdd.workload.replay import DEFAULT_TRACE, Scale, TokenSpace, build_requests, fit_scale, workload_summary
from pdd.config import ClusterConfig, validation_summary

DEFAULT_MODES = ("same_dc_pd", "cross_dc_pd", "pdd")
# Tuned on the live system (docs/LINK.md, "Demo scaling"): prompts 1/32 (a 512-token block
# becomes 16 tokens); outputs 1/2 in [16, 320], because the small model decodes ~10x faster
# relative to its prefill than an 8B model on an H200, and halving keeps a request's decode time
# several times its WAN transfer time, as in production; 1 in 100 conversations with all their
# turns (so prefix reuse is the trace's); arrivals compressed to 2 requests/s.
DEFAULT_SCALE = Scale(block_tokens=16, output_scale=1 / 2, min_output_tokens=16, max_output_tokens=320,
                      target_rate_rps=2.0, session_sample=100)
DEFAULT_REQUESTS = 100
# niceness of every demo process (client and topology) unless the config sets process_nice: the
# tiers then take the CPU before other work on the machine, so the comparison does not depend on
# the machine being idle (pdd's TTFT is made of compute, cross_dc_pd's also of emulated WAN time
# that CPU contention does not stretch). Needs CAP_SYS_NICE; without it, logged and inherited.
DEMO_NICE = -10


class NoRequests(ValueError):
    """The demo's workload is refused before anything runs: its slice of the trace holds no
    request (``--start`` past its end), or its flags leave no usable prompt
    (:func:`pdd.workload.replay.fit_scale`: ``--max-output``, ``--block-tokens``)."""


def run_demo(
    out_dir: str | Path = "runs/demo",
    modes: Sequence[str] = DEFAULT_MODES,
    n_requests: int | None = DEFAULT_REQUESTS,
    scale: Scale = DEFAULT_SCALE,
    config: ClusterConfig | None = None,
    seed: int = 0,
    *,
    trace: str | Path = DEFAULT_TRACE,
    start: int | None = None,
    warmup: bool = True,
    request_timeout_s: float | None = None,
    progress: bool = True,
    console=None,
    topology_factory: Callable[..., object] | None = None,
) -> dict:
    """Replay the same trace slice through each mode on a fresh topology; returns the report dict.

    ``n_requests`` / ``start``: the slice (override ``scale.count`` / ``scale.start``).
    ``scale``: lengths and arrival rate (see :class:`pdd.workload.replay.Scale`); prompts are also capped
    to the engine's limits. ``seed``: token-id generation seed. ``request_timeout_s``: per request
    (default ``config.request_timeout_s``). ``topology_factory(cfg, log_dir=...)`` returns a context
    manager with ``.url``, ``.stats()``, ``.flush()`` (default ``pdd.launch.Topology``).
    """
    from rich.console import Console

    console = console or Console()
    config = config or ClusterConfig()
    factory = topology_factory or _default_topology
    out = Path(out_dir)  # made once the workload is built: a refused run (NoRequests) leaves nothing there
    timeout_s = request_timeout_s or config.request_timeout_s

    from pdd.launch import set_nice

    set_nice(config.process_nice)  # the client timestamps every token: it runs as the tiers do
    model_path = ensure_model(config, console)
    tokens = TokenSpace.from_model(model_path)
    try:
        scale = fit_scale(scale, config, n_requests, start)
    except ValueError as ex:  # named flag (--block-tokens 1000000000 was a traceback)
        raise NoRequests(str(ex)) from None
    requests = build_requests(trace, scale, tokens, seed)
    if not requests:
        from pdd.workload.replay import past_the_end

        beyond = past_the_end(trace, scale)
        if beyond:
            raise NoRequests(beyond)
        hint = ""
        if scale.session_sample > 1:
            hint = (f"; --session-sample {scale.session_sample} keeps 1 in {scale.session_sample} conversations "
                    f"(give --session-sample 1 to replay every record)")
        raise NoRequests(f"--start {scale.start}: no requests in {trace} from there (--requests {scale.count}){hint}")
    workload = workload_summary(requests, scale, trace, page_size=config.engine_for("prefill").page_size)
    rate = f"{workload['rate_rps']:.2f} req/s" if workload["rate_rps"] else "all at once"
    console.print(
        f"workload: {workload['requests']} requests from {workload['trace']} [{scale.start}, "
        f"{scale.start + len(requests)}), {workload['duration_s']:.1f} s of arrivals "
        f"({rate}), prompt mean {workload['input_tokens_mean']:.0f} / max "
        f"{workload['input_tokens_max']} tokens, output mean {workload['output_tokens_mean']:.0f} tokens, "
        f"ideal prefix hit rate {100 * workload['ideal_prefix_hit_rate']:.1f}%"
    )

    out.mkdir(parents=True, exist_ok=True)
    req_path = out / "requests.jsonl"
    req_path.write_text("")
    server_stats: dict[str, dict] = {}
    mode_errors: dict[str, str] = {}
    all_records: list[dict] = []
    timelines: list[Path] = []
    for mode in modes:
        cfg = config.model_copy(update={"mode": mode})
        console.rule(f"[bold]{mode}")
        t_start = time.monotonic()
        entry: dict = {}
        records: list = []
        try:
            with factory(cfg, log_dir=out / "logs" / mode) as topo:
                console.print(f"topology up in {time.monotonic() - t_start:.1f} s at {topo.url}")
                if warmup:
                    _warmup(topo, cfg, tokens, seed, min(timeout_s, 120.0), console)
                records, entry = measured_replay(topo, requests, model=cfg.served_model_name, mode=mode,
                                                 timeout_s=timeout_s, progress=progress, console=console)
        except Exception as ex:  # noqa: BLE001 - one broken mode must not lose the others
            mode_errors[mode] = f"{type(ex).__name__}: {ex}"
            console.print(f"[red]{mode} failed: {mode_errors[mode]}")
        dicts = [r.to_dict() for r in records]
        write_jsonl(req_path, dicts, append=True)
        all_records.extend(dicts)
        server_stats[mode] = {k: v for k, v in entry.items() if v is not None}
        (out / "server_stats.json").write_text(json.dumps(server_stats, indent=1))
        if dicts:
            m = compute_modes(dicts, server_stats)[mode]
            console.print(
                f"{mode}: {m['completed']} completed, {m['failed']} failed; TTFT P50 "
                f"{m['median_ttft_ms'] or 0:,.0f} ms, P90 {m['p90_ttft_ms'] or 0:,.0f} ms; WAN "
                f"{m['wan_bytes'] / 1e6:.2f} MB; leaked pages {m['leaked_pages']}; "
                f"{time.monotonic() - t_start:.0f} s"
            )
            plot_token_timeline(dicts, out / f"timeline_{mode}.png", title=f"{mode}: tokens at the client")
            timelines.append(out / f"timeline_{mode}.png")

    report = build_report(
        all_records, server_stats, config=json.loads(config.model_dump_json()), seed=seed, workload=workload,
        link=config.link.model_dump(),
    )
    if mode_errors:
        report["mode_errors"] = mode_errors
    write_report(out / "report.json", report)
    plot_ttft_cdf(all_records, out / "ttft_cdf.png", title=f"TTFT, {len(requests)} Mooncake requests")
    print_table(report, console=console, title=f"pdd demo ({len(requests)} requests)")
    written = [req_path, out / "server_stats.json", out / "report.json", out / "ttft_cdf.png", *timelines]
    console.print("wrote " + ", ".join(str(p) for p in written if p.exists())
                  + (f"; server logs in {out / 'logs'}" if (out / "logs").is_dir() else ""), soft_wrap=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdd.bench.demo``: the demo with its tuning knobs on the command line."""
    ap = ShortUsageParser(  # pdd bench's: one usage line before the refusal, not the 20 of every flag
        prog="pdd demo", description=__doc__.split("\n")[0],
        epilog="A mode with failed requests gets a WARNING line (count, most common error) and its metrics and "
               "ratios count its completed requests only. Exit status (as pdd bench): 0 when every mode completed "
               "at least one request, 1 when a mode completed none (report.json is still written), 2 for bad "
               "arguments.")
    ap.add_argument("--config", help="cluster config (YAML or JSON)")
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    ap.add_argument("--start", type=int, default=0, help="first trace record")
    ap.add_argument("--block-tokens", type=int, default=DEFAULT_SCALE.block_tokens)
    ap.add_argument("--output-scale", type=float, default=DEFAULT_SCALE.output_scale)
    ap.add_argument("--min-output", type=int, default=DEFAULT_SCALE.min_output_tokens)
    ap.add_argument("--max-output", type=int, default=DEFAULT_SCALE.max_output_tokens)
    ap.add_argument("--max-input", type=int, default=None)
    ap.add_argument("--rate", type=float, default=DEFAULT_SCALE.target_rate_rps,
                    help="mean arrivals, req/s (>= 0.001: one request per 1000 s on average)")
    ap.add_argument("--session-sample", type=int, default=DEFAULT_SCALE.session_sample,
                    help="keep 1 in N conversations (all their turns)")
    ap.add_argument("--session-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                    help="per request: a request with no end after this long fails as a Timeout (default: the "
                         "config's request_timeout_s, 300)")
    ap.add_argument("--nice", type=int, default=None,
                    help=f"niceness of every demo process, -20..19 (default: the config's process_nice, else "
                         f"{DEMO_NICE}; below 0 needs root, else it is logged and the inherited one kept)")
    ap.add_argument("--port", type=int, default=None, help="gateway port (default: the config's, 8000)")
    ap.add_argument("--base-port", type=int, default=None,
                    help="first of the 100 instance ports (default: the config's, 18000)")
    args = ap.parse_args(argv)
    from pdd.config import MODES
    from pdd.cli_args import (config_file_problem, missing_model_problem, out_dir_problem, refuse, stop_on_sigterm,
                              stopped_status)
    from pdd.topology import ports_taken_refusal

    check_workload_args(ap, args)  # the numbers pdd bench checks, with its messages
    check_numbers(ap, (("--request-timeout", args.request_timeout, 0, True),))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        ap.error(f"--modes: no mode given ({args.modes!r}); choose from {', '.join(MODES)}")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    dup = sorted({m for m in modes if modes.count(m) > 1})
    if dup:
        ap.error(f"--modes: {', '.join(dup)} given more than once")

    try:
        cfg = ClusterConfig.load(args.config)
    except pydantic.ValidationError as ex:  # one line per field, not pydantic's text
        ap.error(f"--config {args.config}: invalid config: {validation_summary(ex)}")
    except (OSError, ValueError) as ex:  # missing file, a directory, bad YAML/JSON: as pdd serve says it
        ap.error(config_file_problem(args.config, ex) or f"--config {args.config}: {ex}")
    flags = {"gateway_port": "--port", "base_port": "--base-port", "process_nice": "--nice"}
    given = {k: v for k, v in (("gateway_port", args.port), ("base_port", args.base_port),
                               ("process_nice", args.nice)) if v is not None}
    upd = dict(given)
    if cfg.process_nice is None and args.nice is None:
        upd["process_nice"] = DEMO_NICE
    try:
        cfg = ClusterConfig.model_validate({**cfg.model_dump(), **upd}) if upd else cfg
    except pydantic.ValidationError as ex:  # the flag whose value is out of range (--port 70000) named
        bad = [flags[k] for k in flags if k in given and any(e.get("loc") and e["loc"][0] == k for e in ex.errors())]
        named = bad or [flags[k] for k in given] or ["--config"]
        ap.error(f"{' / '.join(named)}: invalid config: {validation_summary(ex)}")
    missing = missing_model_problem(cfg)
    if missing:  # a model_path with no checkpoint, as pdd serve refuses it (only models/<preset> is made)
        refuse(ap.prog, missing)
    taken = ports_taken_refusal([cfg], ap.prog)
    if taken:  # one line naming the ports and their users, exit 2, as pdd serve and pdd bench refuse
        refuse(ap.prog, taken)
    bad_out = out_dir_problem(args.out, keep=False)  # run_demo makes it once the workload is built
    if bad_out:
        ap.error(bad_out)
    scale = Scale(block_tokens=args.block_tokens, output_scale=args.output_scale, min_output_tokens=args.min_output,
                  max_output_tokens=args.max_output, max_input_tokens=args.max_input, target_rate_rps=args.rate,
                  session_sample=args.session_sample, session_seed=args.session_seed)
    stop_on_sigterm()  # SIGTERM stops the instances and waits for them, as Ctrl-C does, before exiting
    try:
        report = run_demo(args.out, tuple(modes), args.requests, scale, cfg, args.seed, start=args.start,
                          warmup=not args.no_warmup, request_timeout_s=args.request_timeout)
    except NoRequests as ex:  # the slice is empty (--start past the trace) or no prompt fits, named in the message
        ap.error(str(ex))
    except KeyboardInterrupt as ex:  # Ctrl-C or SIGTERM: the mode's topology was stopped on the way out
        return stopped_status(ap.prog, ex)
    return bench_exit_status(report, modes, prog="pdd demo")  # 1 when a mode completed no request


if __name__ == "__main__":
    raise SystemExit(main())
