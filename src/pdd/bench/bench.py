"""``pdd bench``: replay a trace through modes, with a fixed SLO, goodput and an SLA-goodput sweep.

One invocation:

1. builds the workload from a Mooncake-format JSONL trace (the shared Mooncake trace, a generated
   agentic trace, any file of ``{"timestamp", "input_length", "output_length", "hash_ids"}``
   records), scaled as in ``pdd demo`` (:class:`pdd.workload.replay.Scale`);
2. fixes the SLO (:mod:`pdd.bench.slo`) before anything is measured: a *reference run* of the
   workload's requests (all of them by default, or ``--ref-requests`` of whole conversations) through
   ``same_dc_pd``, one request in flight at a time (back to back), so the reference has the
   run's prompts, outputs and prefix reuse; SLO = TTFT <= 3 x its median TTFT and TPOT <= 1.5 x
   its median TPOT, unless ``--slo ttft:MS tpot:MS`` gives them. The reference runs on the
   ``same_dc_pd`` topology of the modes (flushed afterwards) or, when that mode is not
   benchmarked, on a topology of its own; with ``--url`` it runs on the external server;
3. for each mode, on a fresh topology (new processes, empty caches): a warm-up request then a
   cache flush; the *main run* (all requests at the offered rate, open loop, or rising with
   ``--ramp START:END``, or falling with START above END); then, with ``--sweep-rate``, the *sweep*: the point at the offered
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
4. writes ``--out``: ``report.json``, ``requests.jsonl`` (main runs), ``reference_requests.jsonl``
   (with a reference run), ``sweep_requests.jsonl`` (with a sweep; with ``rate_rps``), ``server_stats.json``, ``ttft_cdf.png``,
   ``handoff_gaps.png``, ``wan_throughput.png``, ``sweep.png`` (with a sweep),
   ``timeline_<mode>.png``, ``autoscale.png`` (with a rate schedule or an autoscaled mode);
   prints the comparison table and the total wall time.

Exit status (:func:`bench_exit_status`): 0 when every mode completed at least one request (failed
requests are measured results, in the report); 1 when a mode completed none, after the report is
written; 2 for arguments refused before anything runs (:func:`check_args`).

report.json = :func:`pdd.bench.report.build_report`'s document (git_commit, config, seed,
workload, link, modes, ratios, output_agreement) plus ``bench``, ``seeds``, ``slo``, ``sweep``,
``wan_timeline`` and, in every ``modes[mode]``, the fields of :func:`bench_mode_extras`
(``slo_met``, ``slo_attainment``, ``request_goodput``, ``meets_sla``, ``sla_goodput_rps``,
``pipeline_mix``, ``handoff``, ``p_hit_rate``, ``md_hit_rate``, ``cutoffs``,
``cpu_seconds_by_process``) and ``autoscale`` (instance-seconds and the autoscaling loop's
decisions over the main run, :mod:`pdd.bench.autoscaling`; None without a pdd gateway). See :data:`REPORT_FIELDS`. With ``--fault SPEC`` (repeatable) faults
are injected during the main runs and report.json gets ``faults`` (:mod:`pdd.bench.faults`,
docs/FAULTS.md). The ``vllm_colocated`` mode runs stock vLLM's server on the same checkpoint
(:mod:`pdd.bench.vllm_mode`); with it report.json gets ``vllm_agreement`` (its greedy outputs
against ``colocated``'s) and its mode entry lists the fields it has no counterpart for under
``not_applicable`` (None there, "n/a" in the table).

This module runs the modes (:func:`run_bench`) and is the entry point (:func:`main`); its pieces,
all re-exported here: :mod:`pdd.bench.args` (flags, checks, exit status), :mod:`pdd.bench.modes`
(mode labels, overrides), :mod:`pdd.bench.live` (driving a topology), :mod:`pdd.bench.extras`
(per-mode metrics), :mod:`pdd.bench.preview`, :mod:`pdd.bench.table` (console output).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pydantic

# the pieces of ``pdd bench``, one job each, all still importable from here
from pdd.bench.args import (DEFAULT_MODES, DEFAULT_REF_REQUESTS, DEFAULT_REQUESTS, DEFAULT_SCALE,  # noqa: F401
                            DEFAULT_SWEEP, DEFAULT_SWEEP_MIN_REQUESTS, DEFAULT_SWEEP_POINTS, DEFAULT_SWEEP_REQUESTS,
                            DEFAULT_SWEEP_SECONDS, DEFAULT_SWEEP_TIMEOUT_S, TOPOLOGY_OVERRIDES, ShortUsageParser,
                            bench_exit_status, build_parser, check_args, check_numbers, check_workload_args,
                            load_schedule, parse_fault_args, _override_error, _override_flag)
from pdd.bench.extras import (HANDOFF_WINDOW, HANDOFF_WINDOW_BEFORE, MODE_EXTRA_FIELDS,  # noqa: F401
                              WIDE_WINDOW_BEFORE, bench_mode_extras, cutoff_stats, handoff_gap_ms, handoff_stats,
                              hit_rates, instance_hardware, sweep_point)
from pdd.bench.live import (RemoteTopology, WanSampler, _default_topology, _warmup, ensure_model,  # noqa: F401
                            check_remote_vocab, measured_replay, wan_reader)
from pdd.bench.modes import (REFERENCE_MODE, PortsTaken, apply_overrides, check_ports_free,  # noqa: F401
                             check_vllm_tiers, mode_config, parse_mode_label)
from pdd.bench.autoscaling import mode_autoscale, snapshot as autoscale_snapshot
from pdd.bench.plots import (handoff_index, plot_autoscale, plot_handoff_gaps, plot_sweep, plot_token_timeline, plot_ttft_cdf,
                             plot_wan_throughput)
from pdd.bench.preview import PREVIEW_BUDGETS_MS, kv_bytes_per_token, pipeline_preview  # noqa: F401
from pdd.bench.report import (MODE_ORDER, _fmt, build_report, is_completed, mode_metrics, request_latencies,
                              table_rows, write_jsonl, write_report)
from pdd.bench.slo import SLA_ATTAINMENT, SLO, goodput, make_slo, parse_slo, reference_summary
from pdd.bench.sweep import (SweepPlan, at_rate, mean_rate, next_rate, parse_ramp, parse_sweep, point_requests,
                             point_size, ramp_arrivals, session_subset,
                             sla_goodput)
from pdd.bench.table import bench_rows, print_bench_table  # noqa: F401
from pdd.workload.replay import (DEFAULT_TRACE, Scale, TokenSpace, build_requests, fit_scale, ideal_prefix_hits,
                                 workload_summary)
from pdd.bench import vllm_mode
from pdd.cli_args import config_file_problem, out_dir_problem, refuse, stop_on_sigterm, stopped_status
from pdd.config import MODES, ClusterConfig, validation_summary
from pdd.transfer.layout import wire_dtype

# report.json: top-level fields and the fields bench adds to every modes[mode] (the rest of a mode's
# fields are report.mode_metrics', named as in vllm bench serve)
REPORT_FIELDS = ("git_commit", "config", "seed", "seeds", "workload", "link", "modes", "ratios",
                 "output_agreement", "bench", "slo", "sweep", "wan_timeline", "pipeline_preview")


# ---------------------------------------------------------------- the run


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
    rate_schedule: Sequence[tuple[float, float]] | None = None,
) -> dict:
    """Run the benchmark (see the module docstring); returns the report dict (also in ``out_dir``).

    ``ramp``: ``(start_rps, end_rps)``: the main run's arrival rate goes linearly from the first to
    the second (rising, or falling when the first is larger) (:func:`pdd.bench.sweep.ramp_arrivals`, the trace's gap pattern kept) instead of
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
    ``rate_schedule``: ``[(t_s, rate_rps), ...]`` (:mod:`pdd.load_profile`; ``--load-profile
    ramp``, ``--rate-schedule``): the main run's arrivals are a Poisson process with that rate,
    drawn with ``seed``, given to the workload's requests in order (those past the schedule's
    end are not sent); each mode's report entry gets ``autoscale`` (instance-seconds, scale-ups
    and -downs, :mod:`pdd.bench.autoscaling`) and ``autoscale.png`` plots them.
    ``vllm_python``: the interpreter of vLLM's venv for the ``vllm_colocated`` mode (default:
    :func:`pdd.vllm_tier.venv.vllm_python`'s search); ``vllm_factory(cfg, log_dir=...)`` replaces
    :class:`pdd.bench.vllm_mode.VllmServer` for that mode.
    """
    from pdd.bench.faults import FaultRunner, fault_line, fault_report, parse_bench_fault
    from rich.console import Console

    t_wall = time.monotonic()
    cpu0 = time.process_time()
    console = console or Console()
    config = config or ClusterConfig()
    out = Path(out_dir)  # made once the checks below passed: a refused run leaves nothing there
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
            mode_config(config, m)  # ... or a label the config cannot run (+autoscale without autoscale.max)
        _check_faults_apply(bench_faults, config, modes)
        if topology_factory is None:  # a mode with MD on vLLM and no vLLM venv: ValueError naming `make vllm`
            check_vllm_tiers(config, modes, vllm_python)
            # a port taken (another pdd serve, demo or bench): ValueError naming it, as pdd serve refuses
            check_ports_free(config, modes, reference=need_ref and REFERENCE_MODE not in modes)
    run_order = _order_modes(modes)

    # ---- workload
    if remote is not None and not (Path(config.model_path) / "config.json").exists():
        tokens = TokenSpace()
        # the server refuses ids past its model's vocabulary (a pdd make-model checkpoint has 4,096)
        console.print(f"note: no checkpoint at {config.model_path} (the config's model_path): prompt token ids are "
                      f"drawn from [0, {tokens.vocab_size}); a server whose model has a smaller vocabulary refuses "
                      f"them: give --config with the server's model_path")
    else:
        tokens = TokenSpace.from_model(ensure_model(config, console))
    if remote is not None:  # a server with a smaller vocabulary would refuse every request: say so first
        have = (Path(config.model_path) / "config.json").exists()
        check_remote_vocab(remote.url, tokens, config.served_model_name,
                           f"the checkpoint at {config.model_path}" if have else "no local checkpoint",
                           min(timeout_s, 120.0))
    scale = fit_scale(scale, config, n_requests, start)
    requests = build_requests(trace, scale, tokens, seed)
    if not requests:
        from pdd.workload.replay import past_the_end

        beyond = past_the_end(trace, scale)
        if beyond:  # --start 99999999 was blamed on --session-sample
            raise ValueError(beyond)
        hint = ""
        if scale.session_sample > 1:  # the default keeps 1 in 50 conversations: a small trace may keep none
            hint = (f": --session-sample {scale.session_sample} keeps 1 in {scale.session_sample} conversations "
                    f"and kept none of this trace's; give --session-sample 1 to replay every record")
        raise ValueError(f"no requests in {trace} (start={scale.start} count={scale.count}){hint}")
    if ramp is not None:
        requests = ramp_arrivals(requests, *ramp)
    schedule_note = None
    if rate_schedule is not None:
        from pdd.load_profile import describe, expected_arrivals, schedule_arrivals

        arrivals = schedule_arrivals(rate_schedule, len(requests), seed)
        if not arrivals:
            raise ValueError(f"rate schedule {describe(rate_schedule)}: no arrival within it")
        schedule_note = (f"rate schedule {describe(rate_schedule)} (req/s): {len(arrivals)} arrivals of "
                         f"{len(requests)} requests (expected {expected_arrivals(rate_schedule):.1f} within the "
                         f"schedule); last at {arrivals[-1]:.1f} s")
        requests = [dataclasses.replace(r, arrival_s=t) for r, t in zip(requests, arrivals)]
    workload = workload_summary(requests, scale, trace, page_size=config.engine_for("prefill").page_size)
    if ramp is not None:
        workload["ramp_rps"] = list(ramp)
    if rate_schedule is not None:
        workload["rate_schedule"] = [list(p) for p in rate_schedule]
        workload["rate_schedule_seed"] = seed
        console.print(schedule_note)
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
        f"arrivals ({rate_text(workload)}), prompt mean "
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
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"{k}.jsonl" for k in ("requests", "reference_requests", "sweep_requests")}
    paths["requests"].write_text("")
    # the reference run's and the sweep's records: written (appended) only by a run that happens, so
    # none is there without it (not an empty file, nor an earlier run's in the same --out)
    paths["reference_requests"].unlink(missing_ok=True)
    paths["sweep_requests"].unlink(missing_ok=True)
    server_stats: dict[str, dict] = {}
    mode_errors: dict[str, str] = {}
    all_records: list[dict] = []
    wan_timeline: dict[str, dict] = {}
    sweep_out: dict[str, dict] = {}
    slo_obj: SLO | None = None
    slo_info: dict = {}
    ref_entry: dict | None = None
    mode_wall: dict[str, float] = {}  # per mode: topology start to stop, its sweep included (s)
    autoscale_out: dict[str, dict] = {}  # per mode: instance-seconds and decisions over the main run
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
    constant_rate = ramp is None and rate_schedule is None  # main_run_as_point
    for k, mode in enumerate(run_order, 1):
        cfg = config if remote is not None else mode_config(config, mode, vllm_python)
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
                snaps: list = [None, None]

                def after_main_replay() -> None:
                    snaps[1] = autoscale_snapshot(topo.url) if snaps[0] is not None else None
                    if runner is not None:
                        runner.finish()

                snaps[0] = autoscale_snapshot(topo.url)
                try:
                    records, entry = measured_replay(
                        topo, requests, model=cfg.served_model_name, mode=mode, timeout_s=timeout_s,
                        progress=progress, console=console, label=f"{mode} @ {rate_label(workload)}",
                        after_replay=after_main_replay, flush=not warm_sweep)
                finally:
                    if runner is not None:
                        runner.finish()  # idempotent: restarts whatever is still down if the replay failed
                    if sampler is not None:
                        wan_timeline[mode] = sampler.stop()
                    if (auto := mode_autoscale(*snaps)) is not None:
                        autoscale_out[mode] = auto
                        console.print(f"{mode}: {auto['instance_seconds']:.1f} instance-s over {auto['window_s']:.1f} s "
                                      f"({', '.join(f'{r} {v:.1f}' for r, v in auto['instance_seconds_by_role'].items())}); "
                                      f"autoscale {'on' if auto['enabled'] else 'off'}: {auto['scale_ups']} up, "
                                      f"{auto['scale_downs']} down, {auto['errors']} failed")
                if bench_faults:
                    fault_out[mode] = fault_report(runner, [r.to_dict() for r in records], skipped,
                                                   fault_recover_after_s)
                    fr = fault_out[mode]
                    console.print(fault_line(mode, fr), markup=False, highlight=False)
                main_dicts = [r.to_dict() for r in records]
                try:
                    if sweep is not None and slo_obj is not None:
                        points = _sweep_mode(topo, cfg, mode, sweep, sweep_next if warm_sweep else sweep_reqs,
                                             slo_obj, main_run_as_point(main_dicts, constant_rate,
                                                                        runner.injections if runner else ()),
                                             entry, offered,
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
        m["autoscale"] = autoscale_out.get(mode)
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
    if autoscale_out and (rate_schedule is not None or any(a["enabled"] for a in autoscale_out.values())):
        plot_autoscale(autoscale_out, all_records, out / "autoscale.png", schedule=rate_schedule)
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


def rate_text(workload: dict) -> str:
    """How a bench's workload line states its main run's rate: ``"2.36 req/s"`` (the mean,
    ``workload["rate_rps"]``), ``"ramp 5 -> 1 req/s, mean 2.36 req/s"`` for a ``--ramp`` run
    (``workload["ramp_rps"]``, rising or falling), ``"schedule 0s:1, 10s:4, 20s:1 req/s, mean
    2.36 req/s"`` for a ``--rate-schedule`` / ``--load-profile`` run (``workload["rate_schedule"]``,
    :func:`pdd.load_profile.describe`), ``"all at once"`` when the mean is undefined."""
    from pdd.load_profile import describe

    offered = workload.get("rate_rps")
    mean = f"{offered:.2f} req/s" if offered else "all at once"
    ramp, sched = workload.get("ramp_rps"), workload.get("rate_schedule")
    if ramp:
        return f"ramp {ramp[0]:g} -> {ramp[1]:g} req/s, mean {mean}"
    if sched:
        return f"schedule {describe(sched)} req/s, mean {mean}"
    return mean


def rate_label(workload: dict) -> str:
    """The main run's rate in its progress bar's title: ``"2.36 req/s"``, for a ``--ramp`` run
    ``"ramp 5 -> 1 req/s (mean 2.36)"``, for a rate schedule ``"schedule 1 -> 4 -> 1 req/s over
    70 s (mean 2.36)"`` (:func:`pdd.load_profile.shape`)."""
    from pdd.load_profile import shape

    offered = workload.get("rate_rps")
    ramp, sched = workload.get("ramp_rps"), workload.get("rate_schedule")
    if ramp:
        return f"ramp {ramp[0]:g} -> {ramp[1]:g} req/s (mean {_fmt(offered, 2)})"
    if sched:
        return f"schedule {shape(sched)} (mean {_fmt(offered, 2)})"
    return f"{_fmt(offered, 2)} req/s"


def main_run_as_point(main_records: list[dict], constant_rate: bool, injections: Sequence) -> list[dict] | None:
    """The main run's records (dicts) if they may stand in for the sweep point at its offered rate
    (``reused_main_run``), else None (the point is run). They may only when the run's rate was
    constant (``constant_rate``: not ``--ramp`` or a rate schedule, whose mean is not the load a
    constant-rate point puts on the topology) and no ``--fault`` was injected in it
    (``injections``: :class:`pdd.bench.faults.FaultRunner`'s, one failed to inject included: it
    may have taken effect); a fault that never fired left the run as a plain one."""
    if not constant_rate or len(injections):
        return None
    return main_records


def _sweep_mode(topo, cfg: ClusterConfig, mode: str, plan: SweepPlan, reqs: Sequence, slo: SLO,
                main_records: list[dict] | None, main_entry: dict, offered: float | None, timeout_s: float,
                max_arrival_s: float | None, path: Path, min_requests: int, progress: bool,
                console, warm: bool = False, per_point: int | None = None,
                main_before: Sequence = ()) -> list[dict]:
    """The sweep on a running topology; returns its points. ``main_records``: the main run's
    records, taken as the point at rate ``offered`` (``reused_main_run``); None when they may not
    stand in (:func:`main_run_as_point`: a ``--ramp``, rate-schedule or faulted main run): every point is run. ``warm``: ``reqs`` is the trace's
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


def _check_faults_apply(bench_faults, config: ClusterConfig, modes: Sequence[str]) -> None:
    """Raises ValueError naming a ``--fault`` that can happen in none of ``modes`` (each mode's
    topology, :func:`pdd.bench.faults.applicable`): ``kill:rld1`` on a topology of one RLD ran a
    whole benchmark with the fault only listed as not applicable. One that applies to some of the
    modes runs (the others record it as not applicable, as before)."""
    from pdd.bench.faults import applicable
    from pdd.topology import layout

    for f in bench_faults:
        why = {m: applicable(f, layout(mode_config(config, m))) for m in modes}
        if modes and all(w is not None for w in why.values()):
            raise ValueError(f"--fault {f.text}: applies to none of the modes benchmarked ("
                             + "; ".join(f"{m}: {w}" for m, w in why.items()) + ")")


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
        faults, recover_after = parse_fault_args(args.fault, args.fault_recover_after, args.url, args.requests)
        rate_schedule = load_schedule(args)
    except ValueError as ex:
        ap.error(str(ex))
    try:
        base_cfg = ClusterConfig.load(args.config)
    except pydantic.ValidationError as ex:  # a field out of range: one line per field, not pydantic's text
        ap.error(f"--config {args.config}: invalid config: {validation_summary(ex)}")
    except (OSError, ValueError) as ex:  # missing file, bad YAML/JSON: as pdd serve says it
        ap.error(config_file_problem(args.config, ex) or f"--config {args.config}: {ex}")
    try:
        config = apply_overrides(base_cfg, served_model_name=args.model,
                                 **{k: getattr(args, k) for k in TOPOLOGY_OVERRIDES})
    except pydantic.ValidationError as ex:  # an override out of the config's range (--wan-gbps 0, a port)
        given = [k for k in TOPOLOGY_OVERRIDES if getattr(args, k) is not None]
        given += ["served_model_name"] if args.model is not None else []
        ap.error("; ".join(_override_error(e, given, args.config) for e in ex.errors()))
    try:
        scale = Scale(block_tokens=args.block_tokens, output_scale=args.output_scale,
                      min_output_tokens=args.min_output, max_output_tokens=args.max_output,
                      max_input_tokens=args.max_input, target_rate_rps=args.rate,
                      session_sample=args.session_sample, session_seed=args.session_seed)
    except ValueError as ex:  # check_args names the flags; this is the backstop for a combination it misses
        ap.error(f"workload scaling: {ex}")
    bad_out = out_dir_problem(args.out, keep=False)  # run_bench makes it once its own checks passed
    if bad_out:
        ap.error(bad_out)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    stop_on_sigterm()  # SIGTERM stops the instances and waits for them, as Ctrl-C does, before exiting
    try:
        report = run_bench(args.out, modes, args.requests, scale, config, args.seed, trace=args.trace,
                           start=args.start, url=args.url, slo=slo, ref_requests=args.ref_requests, sweep=sweep,
                           sweep_requests=args.sweep_requests or None, sweep_timeout_s=args.sweep_timeout,
                           sweep_seconds=args.sweep_seconds or None, sweep_min_requests=args.sweep_min_requests,
                           warmup=not args.no_warmup, request_timeout_s=args.request_timeout,
                           progress=not args.no_progress, argv=argv, ramp=ramp, faults=faults,
                           fault_recover_after_s=recover_after, vllm_python=args.vllm_python,
                           rate_schedule=rate_schedule)
    except PortsTaken as ex:  # one line, as pdd serve and pdd demo refuse a taken port
        refuse(ap.prog, str(ex))
    except ValueError as ex:  # the workload or a label refused before anything ran (named in the message)
        ap.error(str(ex))
    except KeyboardInterrupt as ex:  # Ctrl-C or SIGTERM: the mode's topology was stopped on the way out
        return stopped_status(ap.prog, ex)
    return bench_exit_status(report)


if __name__ == "__main__":
    raise SystemExit(main())
