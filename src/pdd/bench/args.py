"""``pdd bench``'s command line: its defaults, the parser, and the checks that refuse a bad flag
(naming it, exit status 2) before anything runs; :func:`bench_exit_status` is the exit status of
a finished run (``pdd demo`` shares it and the workload checks)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx

from pdd.bench import vllm_mode
from pdd.cli_args import ShortUsageParser  # noqa: F401 - pdd bench's and pdd demo's parser
from pdd.vllm_tier import venv as vllm_venv
from pdd.bench.live import RemoteTopology
from pdd.bench.modes import WAN_MODES, parse_mode_label
from pdd.workload.replay import DEFAULT_TRACE, Scale
from pdd.config import MODES, LinkConfig, check_served_model_name

DEFAULT_MODES = MODES  # colocated, same_dc_pd, cross_dc_pd, pdd
# flags that shape the topologies pdd bench starts (argparse dests = apply_overrides keys); with --url
# the server runs its own config, so they are refused there
TOPOLOGY_OVERRIDES = ("wan_gbps", "wan_rtt_ms", "fast_gbps", "min_step_ms", "allow_p_rld", "wan_order",
                      "handoff_mode", "pipeline_ttft_budget_ms", "kv_stream", "base_port", "gateway_port", "wan_loss_rate",
                      "wan_cross_traffic", "wan_connections")
# the flags (argparse dests) that set the WAN line or its send order: refused when no mode run crosses the WAN
WAN_OVERRIDES = ("wan_gbps", "wan_rtt_ms", "wan_loss_rate", "wan_connections", "wan_cross_traffic", "wan_order")
# the flags (argparse dests) that set pdd-only policy (pdd.config.PDD_ONLY_POLICY): refused when no mode run is pdd
PDD_ONLY_OVERRIDES = ("pipeline_ttft_budget_ms", "allow_p_rld", "handoff_mode")
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


class _StoreNamingFlag(argparse.Action):
    """``store``, also keeping the option string used in ``<dest>_flag`` (two flags share ``dest``:
    an error names the one given)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_flag", option_string)


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
                    help=f"Python of vLLM's venv for the {vllm_mode.VLLM_MODE} mode (default: ${vllm_venv.PYTHON_ENV}, "
                         f"else {vllm_venv.VENV_DIR}/bin/python, which `make vllm` builds)")
    ap.add_argument("--url", help="benchmark a running gateway instead, http://host:port (a trailing /v1, as "
                                  "pdd serve prints it, is dropped; one mode: the server's; its caches are "
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
    g.add_argument("--rate", type=float, default=DEFAULT_SCALE.target_rate_rps,
                   help="offered rate, mean req/s (>= 0.001: one request per 1000 s on average; below that a "
                        "run takes hours)")
    g.add_argument("--ramp", metavar="START:END",
                   help="load ramp: the main run's rate goes linearly from START to END req/s, rising or (START "
                        "above END) falling (overrides --rate for the main run; the sweep, if any, still starts at "
                        "--rate)")
    g.add_argument("--load-profile", choices=("ramp",),
                   help="offered load over time: 'ramp' = --low-rate, rising to --peak-rate, held, falling back "
                        "(--phase-seconds); Poisson arrivals drawn with --seed, prompts and outputs from the trace's "
                        "requests in order (docs/BENCH.md \"Load ramps and autoscaling\")")
    g.add_argument("--peak-rate", type=float, help="ramp: peak req/s (default: --rate)")
    g.add_argument("--low-rate", type=float, help="ramp: low req/s before and after the peak (default: peak / 4)")
    g.add_argument("--phase-seconds", default=None, metavar="LOW:RISE:HOLD:FALL",
                   help="ramp: seconds at the low rate, rising, at the peak, falling (then LOW again); "
                        "default 10:20:10:20")
    g.add_argument("--rate-schedule", metavar="T:RATE,...",
                   help="offered rate as points seconds:req/s, linear between them, ending at the last "
                        "(e.g. 0:0.5,20:4,40:0.5); Poisson arrivals drawn with --seed")
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
    g = ap.add_argument_group("config overrides", "each replaces the config's value for every mode; the WAN flags "
                              "(--wan-*, --cross-traffic*) are refused when no listed mode crosses the WAN "
                              "(cross_dc_pd, pdd)")
    g.add_argument("--wan-gbps", type=float)
    g.add_argument("--wan-rtt-ms", type=float)
    g.add_argument("--fast-gbps", type=float)
    g.add_argument("--min-step-ms", type=float,
                   help="emulated accelerator step time: every engine's forward pass takes at least this long, ms, "
                        "0..10000 (default: the config's engine.min_step_ms, 0 = off; docs/LINK.md)")
    g.add_argument("--allow-p-rld", action="store_true", default=None)
    g.add_argument("--wan-order", choices=("fifo", "srf"))
    g.add_argument("--handoff-mode", choices=("one_shot", "catch_up", "auto"))
    g.add_argument("--kv-stream", choices=("whole", "layerwise"),
                   help="when P sends KV: after the whole prefill, or each layer group as its forward pass is done "
                        "(policy.kv_stream; docs/LINK.md)")
    g.add_argument("--pipeline-ttft-budget-ms", type=float)
    g.add_argument("--wan-loss-rate", type=float,
                   help="WAN packet loss probability in [0, 1): each connection is capped at TCP's loss-limited "
                        "(Mathis) rate (link.wan_loss_rate; docs/LINK.md)")
    g.add_argument("--wan-connections", type=int,
                   help="connections P's bulk KV lane to each MD is striped over, 1..16 (link.wan_connections; "
                        "a mode label can set it per mode: cross_dc_pd+wan_connections=4; docs/LINK.md)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--cross-traffic-gbps", dest="wan_cross_traffic", type=_cross_traffic_gbps, metavar="GBPS",
                   action=_StoreNamingFlag,
                   help="other traffic taking this many Gbit/s of the WAN line, per direction, from its start "
                        "(below --wan-gbps; link.wan_cross_traffic)")
    x.add_argument("--cross-traffic", dest="wan_cross_traffic", type=_cross_traffic_schedule, metavar="T:GBPS,...",
                   action=_StoreNamingFlag,
                   help="cross traffic as a schedule, seconds since the line started:Gbit/s, e.g. 0:0.01,60:0.025")
    g.add_argument("--base-port", type=int)
    g.add_argument("--gateway-port", "--port", dest="gateway_port", type=int,
                   help="the gateway's port (--port, as pdd serve and pdd demo name it)")
    g.add_argument("--model", type=_served_model_name,
                   help="served model name to request (default: the config's)")
    g.add_argument("--request-timeout", type=float, help="per request, s (default: the config's)")
    g = ap.add_argument_group("fault injection (docs/FAULTS.md)")
    g.add_argument("--fault", action="append", default=[], metavar="KIND[:ARG]@PHASE[#N]",
                   help="inject once when the N-th (default 1st) request reaches PHASE, in every mode that has the "
                        "phase and target; repeatable. KIND: wan_outage:SECONDS, wan_slowdown:FACTOR, "
                        "cross_traffic:GBPS, kill:NAME|p|rld|md. "
                        "PHASE: prefill, transfer, rld_decode, handoff, md_decode")
    g.add_argument("--fault-recover-after", default="5", metavar="SECONDS|end",
                   help="restart a killed instance / lift a slowdown this long after the injection, or 'end' "
                        "(after the run's last request); default 5")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def parse_fault_args(specs: Sequence[str], recover_after: str, url: str | None,
                     n_requests: int | None = None) -> tuple[list[str], float | None]:
    """``--fault`` specs (checked) and ``--fault-recover-after`` (None = 'end'); ValueError if bad,
    a spec's ``#N`` past ``n_requests`` (the run's ``--requests``) too: it would never fire."""
    from pdd.bench.faults import parse_bench_fault
    from pdd.faults import FaultError

    try:
        for f in specs:
            nth = parse_bench_fault(f).nth
            if n_requests is not None and nth > n_requests:
                raise ValueError(f"--fault {f.strip()!r}: #{nth} is past the run's {n_requests} requests "
                                 "(--requests): it would never fire")
    except FaultError as ex:  # "fault 'bogus': ..." -> "--fault 'bogus': ...": the line names the flag
        raise ValueError(f"--{ex}" if str(ex).startswith("fault ") else f"--fault: {ex}") from None
    if specs and url:
        raise ValueError("--fault needs topologies pdd bench starts (not --url)")
    if str(recover_after).strip().lower() == "end":
        return list(specs), None
    try:
        v = float(recover_after)
    except ValueError:
        raise ValueError(f"--fault-recover-after: seconds or 'end', not {recover_after!r}") from None
    if not math.isfinite(v):  # NaN passed the >= 0 check; inf is what 'end' says
        raise ValueError(f"--fault-recover-after: seconds or 'end', not {recover_after!r}")
    if v < 0:
        raise ValueError("--fault-recover-after must be >= 0")
    return list(specs), v


def _override_error(err: dict, given: Sequence[str] | None = None, config: str | None = None) -> str:
    """One pydantic error of a flag override as ``--flag: message``: a range error gets the value
    (``, got 0.0``); a validator's own message already names it and loses pydantic's ``Value error, ``.
    ``given``: the overrides set by flags (config field names); a config field refused that no flag
    set was refused because of them (``--wan-gbps`` below the config's ``link.wan_cross_traffic``):
    the message names those flags and the config's field (``config``: the --config file)."""
    msg = err["msg"].removeprefix("Value error, ") if err["type"] == "value_error" else \
        f"{err['msg']}, got {err.get('input')!r}"
    loc = tuple(str(x) for x in err.get("loc", ()))
    if given is not None and loc and loc[-1] not in given:
        flags = ", ".join(_override_flag((g,)) for g in given) or "the flags"
        src = f"--config {config}" if config else "the default config"
        return f"{flags}: with {'.'.join(loc)} of {src}: {msg}"
    return f"{_override_flag(err['loc'])}: {msg}"


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


def _served_model_name(text: str) -> str:
    """``--model``: the rule of the config's ``served_model_name`` (:func:`pdd.config.check_served_model_name`:
    not empty nor only whitespace); argparse names the flag on a bad one."""
    try:
        return check_served_model_name(text)
    except ValueError as ex:
        raise argparse.ArgumentTypeError(str(ex)) from None


def _given_flag(args, dest: str) -> str:
    """The flag that set ``dest`` (``--cross-traffic-gbps`` or ``--cross-traffic`` for ``wan_cross_traffic``)."""
    return getattr(args, dest + "_flag", None) or _override_flag((dest,))


def _override_flag(loc: Sequence) -> str:
    """The flag of a config field :func:`apply_overrides` set (``("link", "wan_gbps")`` -> ``--wan-gbps``)."""
    if not loc:
        return "config overrides"
    name = {"served_model_name": "model", "wan_cross_traffic": "cross_traffic"}.get(str(loc[-1]), str(loc[-1]))
    return "--" + name.replace("_", "-")


def _field_range(model, name: str) -> tuple[Any, Any]:
    """The ``(ge, le)`` bounds of a pydantic field (None where it has none)."""
    lo = hi = None
    for m in model.model_fields[name].metadata:
        lo, hi = getattr(m, "ge", lo), getattr(m, "le", hi)
    return lo, hi


def check_numbers(ap: argparse.ArgumentParser, checks: Iterable[tuple[str, Any, float, bool]]) -> None:
    """``(flag, value, lo, strict)``: refuse a value not ``> lo`` (strict) or ``>= lo``, naming the flag
    (None: not given, passes; NaN fails)."""
    for flag, v, lo, strict in checks:
        if v is not None and not (v > lo if strict else v >= lo):  # NaN fails both
            ap.error(f"{flag}: must be {'>' if strict else '>='} {lo}, got {v}")
        if v is not None and v == float("inf"):  # 'inf' / 1e400 parse as floats
            ap.error(f"{flag}: must be a finite number, got {v}")


def check_workload_args(ap: argparse.ArgumentParser, args) -> None:
    """The workload flags ``pdd bench`` and ``pdd demo`` share (--rate, --requests, --start, the
    Scale knobs): refused naming the flag (argparse ``error``: exit status 2). --rate must be at
    least :data:`pdd.load_profile.MIN_RATE_RPS`."""
    from pdd.load_profile import slow_rate_problem

    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate: must be > 0 req/s, got {args.rate}")
    if args.rate == float("inf"):  # every arrival at t=0, and a sweep that doubles it forever
        ap.error(f"--rate: must be a finite number of req/s, got {args.rate}")
    bad = args.rate is not None and slow_rate_problem(args.rate)
    if bad:  # 1e-9 passed "> 0", and the run's arrivals spanned centuries
        ap.error(f"--rate: {bad}")
    if args.requests is not None and args.requests < 1:
        ap.error(f"--requests: must be >= 1, got {args.requests}")
    if args.start is not None and args.start < 0:
        ap.error(f"--start: must be >= 0, got {args.start}")
    if args.seed < 0:  # the token-id seed feeds numpy's default_rng, which takes no negative seed
        ap.error(f"--seed: must be >= 0, got {args.seed}")
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
    lo, hi = _field_range(LinkConfig, "wan_connections")
    if args.wan_connections is not None and not lo <= args.wan_connections <= hi:
        ap.error(f"--wan-connections: must be {lo}..{hi} (connections P's bulk KV lane to each MD is striped "
                 f"over), got {args.wan_connections}")
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
    dup = sorted({m for m in labels if labels.count(m) > 1})
    if dup:  # as pdd demo: a mode runs once (it was dropped silently, one row where two were asked)
        ap.error(f"--modes: {', '.join(dup)} given more than once")
    wan = [_given_flag(args, k) for k in WAN_OVERRIDES if getattr(args, k) is not None]
    if wan and not args.url and not any(parse_mode_label(m)[0] in WAN_MODES for m in labels):
        # nothing would cross the WAN: the flag would change nothing yet be recorded as if it applied
        ap.error(f"{', '.join(wan)}: no listed mode uses the WAN (--modes {args.modes}); the modes that cross "
                 f"it are {' and '.join(WAN_MODES)}, with any +labels")
    relay = [_given_flag(args, k) for k in PDD_ONLY_OVERRIDES if getattr(args, k) is not None]
    if relay and not args.url and not any(parse_mode_label(m)[0] == "pdd" for m in labels):
        # no relay tier nor pipeline choice in any listed mode: the flag would change nothing yet be recorded
        ap.error(f"{', '.join(relay)}: no listed mode is pdd (--modes {args.modes}); these flags set pdd's pipeline "
                 f"choice and relay tier, which colocated, same_dc_pd and cross_dc_pd do not have")
    if vllm_mode.VLLM_MODE in labels and not args.url:
        try:
            vllm_venv.check_vllm_importable(vllm_venv.vllm_python(args.vllm_python))
        except vllm_venv.VllmMissing as ex:  # before a model, a reference run or a topology is made
            ap.error(f"--modes: {ex}")
    if Path(args.trace).is_dir():
        ap.error(f"--trace: {args.trace} is a directory, not a trace file")
    if not Path(args.trace).exists():  # a device or FIFO exists: load_trace names it as no regular file
        ap.error(f"--trace: no such file: {args.trace}")
    from pdd.workload.replay import load_trace

    try:  # ~0.1 s for the shared trace; a bad line is refused before a model or topology is made
        records = load_trace(args.trace)
    except (OSError, ValueError) as ex:  # names the file and line
        ap.error(f"--trace: {ex}")
    if not records:
        ap.error(f"--trace: {args.trace} holds no trace records")
    if args.config is not None and (Path(args.config).is_dir() or not Path(args.config).exists()):  # (a device:
        # ClusterConfig.load names it)
        ap.error(f"--config {args.config}: "
                 + ("is a directory, not a config file (YAML or JSON)" if Path(args.config).is_dir() else "no such file"))
    if args.url:
        from pdd.cli_args import gateway_root, openai_endpoint

        if openai_endpoint(args.url):  # it was asked for .../v1/completions/v1/models, then blamed --model
            ap.error(f"--url {args.url}: names the endpoint {openai_endpoint(args.url)}; give the server's root "
                     f"(http://host:port) or its /v1 base URL: pdd bench requests the endpoints itself")
        args.url = gateway_root(args.url)  # the ".../v1" pdd serve prints, an OpenAI base_url: its root
        # the server at --url runs its own config: a topology flag would be recorded in the report
        # as if it had applied (found by a new user: --min-step-ms 20 against a server without it)
        shaping = [_given_flag(args, k) for k in TOPOLOGY_OVERRIDES if getattr(args, k) is not None]
        if shaping:
            ap.error(f"{', '.join(shaping)}: with --url the server runs its own config; these flags shape "
                     f"the topologies pdd bench starts (set them in the server's config instead)")
        try:
            models = httpx.get(f"{args.url.rstrip('/')}/v1/models", timeout=10, trust_env=False)
        except httpx.HTTPError as ex:
            ap.error(f"--url: cannot reach {args.url}: {type(ex).__name__}: {ex}")
        # a wrong name ran the whole benchmark, every request a 404, then exit 1; without --model the
        # requests carry the config's served_model_name, checked the same way
        model, named, hint = args.model, f"--model {args.model!r}", ""
        if model is None:
            model = _config_model_name(args.config)
            where = f"--config {args.config}" if args.config else "the default config"
            named = f"served_model_name {model!r} of {where}"
            hint = "; give the name to request with --model"
        if model is not None:
            names = served_models(models)
            if names is None:
                ap.error(f"--url {args.url}: GET /v1/models answered HTTP {models.status_code}, not an OpenAI model "
                         f"list, so {named} cannot be checked{hint}")
            if model not in names:
                ap.error(f"{named}: the server at {args.url} serves "
                         f"{', '.join(map(repr, names)) or 'no model'} (GET /v1/models){hint}")
        if modes_given:  # --url benchmarks the server's one mode: an explicit --modes must be that mode
            server = RemoteTopology(args.url, timeout_s=10).reported_mode()
            if server is None:
                ap.error(f"--modes {args.modes}: the server at {args.url} does not report its mode (GET /pdd/stats "
                         f"or /health), so it cannot be checked; with --url leave --modes out (the one mode "
                         f"benchmarked is the server's)")
            if labels != [server]:
                ap.error(f"--modes {args.modes}: the server at {args.url} runs mode {server}; with --url the one "
                         f"mode benchmarked is the server's (give --modes {server} or leave --modes out)")


def _config_model_name(path: str | None) -> str | None:
    """``served_model_name`` of the config at ``path`` (the defaults' without one), the name
    ``pdd bench --url`` requests when ``--model`` is not given; None when the config cannot be
    loaded (``pdd bench`` refuses it right after the checks, naming the file and field). Raises
    nothing."""
    import pydantic

    from pdd.config import ClusterConfig

    try:
        return ClusterConfig.load(path).served_model_name
    except (pydantic.ValidationError, OSError, ValueError):
        return None


def served_models(resp: httpx.Response) -> list[str] | None:
    """The model ids of a ``GET /v1/models`` answer (OpenAI's ``{"data": [{"id": ...}, ...]}``),
    None when it is no such list (not HTTP 200, not JSON, another shape). Raises nothing."""
    if resp.status_code != 200:
        return None
    try:
        return [str(m["id"]) for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return None


def load_schedule(args) -> tuple | None:
    """The rate schedule of ``--load-profile ramp`` (with ``--peak-rate``, ``--low-rate``,
    ``--phase-seconds``) or ``--rate-schedule`` (:func:`pdd.load_profile.schedule_from_flags`),
    None without either. ValueError naming the flag when a value is bad or the flags conflict."""
    from pdd.load_profile import schedule_from_flags

    return schedule_from_flags(args.load_profile, args.rate_schedule, args.peak_rate, args.low_rate,
                               args.phase_seconds, args.rate, getattr(args, "ramp", None))


def bench_exit_status(report: Mapping, run_order: Sequence[str] | None = None, prog: str = "pdd bench") -> int:
    """0 when every benchmarked mode completed at least one request (failed requests are measured
    results: the report has them); 1 when a mode completed none (a server that refuses everything,
    a mode whose topology failed; a --model the server at --url does not list is refused before), said on stderr; the report is written first.
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
