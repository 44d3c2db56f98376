"""`pdd sim ...` and `pdd plan ...` sub-commands (wired into the main CLI by pdd.cli).

    pdd sim run --mode pdd --trace data/traces/mooncake_conversation_trace.jsonl --n-p 30 --n-rld 13 --n-md 32
    pdd sim run --mode cross_dc_pd --agentic 3000 --rate 2
    pdd sim experiment ttft --out runs/sim/ttft [--quick]
    pdd sim agentic --n 5000 --rate 2 --out agentic.jsonl      (prints the seven-bin hit histogram)
    pdd plan --workload agentic --rate 3 --slo-ttft 2 --slo-tpot 0.05 --wan 10:5,25:9,100:15
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import sys
import time

from pdd.cli_args import ShortUsageParser, config_or_exit  # a bad config: one line naming the field, not a traceback


class UsageError(Exception):
    """Bad input found after parsing (a trace's content, a --set key, a configuration the
    simulator refuses): the entry point prints it as the sub-command's ``error: ...`` (exit 2)."""


def _wan_options(spec: str) -> list:
    """``pdd plan --wan``: comma-separated GBPS:USD_PER_HOUR, each rate > 0 and price >= 0;
    UsageError naming the bad item otherwise (it was an IndexError / ZeroDivisionError)."""
    from pdd.sim.plan import WanOption

    out = []
    for item in spec.split(","):
        parts = item.split(":")
        try:
            gbps, usd = (float(parts[0]), float(parts[1])) if len(parts) == 2 else (None, None)
        except ValueError:
            gbps = usd = None
        if gbps is None or not _positive(gbps) or not _nonneg(usd):
            raise UsageError(f"--wan {spec!r}: bad line option {item!r} (expected GBPS:USD_PER_HOUR with "
                             "GBPS > 0 and USD_PER_HOUR >= 0, comma-separated, e.g. 10:5,25:9)")
        out.append(WanOption(gbps, usd))
    return out


def _rld_counts(spec: str) -> list[int]:
    """``pdd plan --rld``: comma-separated RLD counts >= 1; UsageError otherwise."""
    try:
        out = [int(x) for x in spec.split(",")]
    except ValueError:
        out = []
    from pdd.sim.sim_config import MAX_INSTANCES

    if not out or min(out) < 1:
        raise UsageError(f"--rld {spec!r}: expected comma-separated RLD counts >= 1, e.g. 1,2,4")
    if max(out) > MAX_INSTANCES:
        raise UsageError(f"--rld {spec!r}: at most {MAX_INSTANCES:,} (instances of one tier)")
    return out


def _number(conv, what: str, ok):
    """An argparse ``type=``: ``conv`` of the string, refused unless ``ok(value)`` (message: ``what``).
    A float must also be finite: NaN, inf and -inf are refused as any value out of range is, with
    ``must be a finite number WHAT, got TEXT`` (an integer's: ``must be WHAT, got TEXT``)."""
    def parse(text: str):
        try:
            v = conv(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if conv is int else 'a number'}: {text!r}") from None
        if conv is float and not math.isfinite(v) or not ok(v):  # NaN passes no comparison
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if conv is float else ''}{what}, got {text}")
        return v

    parse.__name__ = conv.__name__  # argparse names the type in its own messages
    return parse


def _positive(v: float) -> bool:
    """A finite number > 0 (NaN is not)."""
    return 0 < v < float("inf")


def _nonneg(v: float) -> bool:
    """A finite number >= 0 (NaN is not)."""
    return 0 <= v < float("inf")


POS_INT = _number(int, ">= 1", lambda v: v >= 1)
NONNEG_INT = _number(int, ">= 0", lambda v: v >= 0)
# generated requests (`--agentic`, `pdd plan --requests`, `pdd sim agentic --n`): a million take about
# 1 GB of records; more is a typo that would fill the memory before anything is simulated
MAX_GENERATED = 1_000_000
MAX_PROMPT_TOKENS = 10_000_000  # `pdd plan --input-len`: 76x the largest model context in models.json


def _int_in(lo: int, hi: int, what: str):
    """An argparse ``type=``: an integer >= ``lo`` (refused as NONNEG_INT / POS_INT refuse) and at
    most ``hi`` (message: ``what`` it counts)."""
    low = _number(int, f">= {lo}", lambda v: v >= lo)

    def parse(text: str) -> int:
        v = low(text)
        if v > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi:,} ({what}), got {text}")
        return v

    parse.__name__ = "int"
    return parse


def _instances(lo: int):
    from pdd.sim.sim_config import MAX_INSTANCES

    return _int_in(lo, MAX_INSTANCES, "instances of one tier")


INSTANCES = _instances(0)
GENERATED = _int_in(1, MAX_GENERATED, "requests of a generated workload")
POS_FLOAT = _number(float, "> 0", _positive)
NONNEG_FLOAT = _number(float, ">= 0", _nonneg)
FRACTION = _number(float, "in [0, 1]", lambda v: 0 <= v <= 1)
LOSS_RATE = _number(float, "in [0, 1)", lambda v: 0 <= v < 1)  # a packet loss probability (tcp_model.check_loss_rate)
# a negative number as a flag's value, not an option: argparse's own pattern takes -1 and -.5
# but read -1e3, -inf and -nan as unknown options ("expected one argument"), before the flag's
# type could refuse them by name
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def _numbers_as_values(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``p``, reading any negative number (``-1e3``, ``-inf``) after a flag as its value (none of
    the simulator's flags looks like a number)."""
    p._negative_number_matcher = _NEGATIVE_NUMBER
    return p


def _rate(factor: bool):
    """An argparse ``type=`` for a request rate (req/s; ``factor``: a replay speed-up): as
    POS_FLOAT, and refused below :data:`pdd.load_profile.MIN_RATE_RPS` (a run that would not end)."""
    def parse(text: str) -> float:
        from pdd.load_profile import slow_rate_problem

        v = POS_FLOAT(text)
        bad = slow_rate_problem(v, factor=factor)
        if bad:
            raise argparse.ArgumentTypeError(bad)
        return v

    parse.__name__ = "float"
    return parse


RATE = _rate(False)
SCALE_RATE = _rate(True)


def _sim_default(name: str):
    """SimConfig's default of field ``name``: the runtime's, for the fields that mirror its config
    (``pdd.sim.sim_config.RUNTIME_MIRRORS``)."""
    from dataclasses import fields

    from pdd.sim.sim_config import SimConfig

    return {f.name: f.default for f in fields(SimConfig)}[name]


def _known(kind: str, load):
    """An argparse ``type=`` accepting the names ``load()`` knows (a dict), listing them otherwise."""
    def parse(text: str) -> str:
        names = sorted(load())
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {kind} {text!r}; known: {', '.join(names)}")
        return text

    parse.__name__ = kind
    return parse


def _model_names():
    from pdd.sim.models import load_models

    return load_models()


def _chip_names():
    from pdd.sim.hardware import load_chips

    return load_chips()


def _existing_file(text: str) -> str:
    """An input file flag's type (``--trace``, ``--op-profile``): a regular file that exists.
    ``/dev/zero`` was "no such file" (it exists; read, it never ends)."""
    from pathlib import Path

    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a regular file (a device, FIFO or socket)")
    return text


def _cfg_args(p: argparse.ArgumentParser) -> None:
    from pdd.sim.sim_config import WAN_ORDERS

    g = p.add_argument_group("cluster")
    g.add_argument("--mode", default="pdd", choices=["colocated", "same_dc_pd", "cross_dc_pd", "pdd"])
    g.add_argument("--model", default="llama-3.1-8b", type=_known("model", _model_names),
                   help="a profile in data/hardware/models.json")
    g.add_argument("--kv-bytes-per-token", type=POS_INT, default=None)
    g.add_argument("--chip-a", default="H100-SXM5-80GB", type=_known("chip", _chip_names),
                   help="a chip in data/hardware/chips.json")
    g.add_argument("--chip-b", default="H200-SXM-141GB", type=_known("chip", _chip_names))
    g.add_argument("--price-a", type=NONNEG_FLOAT, default=None, help="USD per GPU-hour (default: chip profile)")
    g.add_argument("--price-b", type=NONNEG_FLOAT, default=None)
    g.add_argument("--profile", default=None,
                   help="one measured profile for both chips (as `pdd sim validate --profile`); "
                   "--profile-a / --profile-b override it per chip")
    g.add_argument("--profile-a", default=None, help="chip A's measured profile (`pdd profile`) or roofline "
                   "calibration file (format of data/calibration)")
    g.add_argument("--profile-b", default=None)
    g.add_argument("--no-live-fit", action="store_true",
                   help="ignore the live-run fit `pdd sim calibrate-roles` wrote into --profile / --profile-a "
                   "(role step scale and overheads, WAN send buffer, client delay, gateway RTT, fast path): "
                   "the bare engine's step times alone")
    for n, d in (("p", 4), ("rld", 2), ("md", 4), ("d", 4), ("c", 8)):
        g.add_argument(f"--n-{n}", type=INSTANCES, default=d)
    g.add_argument("--wan-gbps", type=POS_FLOAT, default=25.0)
    g.add_argument("--wan-rtt-ms", type=NONNEG_FLOAT, default=30.0)
    g.add_argument("--wan-order", default=_sim_default("wan_order"), choices=list(WAN_ORDERS),
                   help="the WAN send order (default: the runtime's policy.wan_order, %(default)s); ps is processor "
                   "sharing, an idealisation no runtime mode implements")
    g.add_argument("--wan-express-lane-bdp", type=NONNEG_FLOAT, default=_sim_default("wan_express_lane_bdp"),
                   help="WAN transfers of at most this many bandwidth-delay products take a connection of their own "
                   "(policy.wan_express_lane_bdp, default %(default)s; 0: one connection per target)")
    g.add_argument("--wan-usd-per-hour", type=NONNEG_FLOAT, default=0.0)
    g.add_argument("--wan-loss-rate", type=LOSS_RATE, default=_sim_default("wan_loss_rate"),
                   help="packet loss p in [0, 1): each WAN transfer at most TCP's Mathis rate (pdd.policy.tcp_model)")
    g.add_argument("--wan-mss-bytes", type=POS_INT, default=_sim_default("wan_mss_bytes"), help="TCP segment of that formula, bytes")
    g.add_argument("--cross-traffic", default=None, metavar="T:GBPS,...",
                   help="cross traffic on the WAN line from T seconds of simulated time, e.g. 0:5,60:10")
    g.add_argument("--kv-stream", default=_sim_default("kv_stream"), choices=["whole", "layerwise"],
                   help="P sends a request's KV after its prefill, or layer group by layer group during it")
    g.add_argument("--kv-stream-layer-group", type=POS_INT, default=_sim_default("kv_stream_layer_group"), help="layers per group (layerwise)")
    g.add_argument("--config", default=None,
                   help="a runtime cluster config (YAML/JSON): its link.wan_* (rate, RTT, loss, MSS, cross "
                   "traffic), policy.wan_order / kv_stream / kv_stream_layer_group / cutoff / cutoff_min_remaining_s "
                   "/ cutoff_max_sent_fraction and the engine settings its "
                   "engine and tiers blocks set (batch limits, step floor, KV page and pool, profile) replace "
                   "those flags")
    g.add_argument("--budget-ms", type=NONNEG_FLOAT, default=_sim_default("ttft_budget_ms"),
                   help="pipeline TTFT budget (P->MD if the WAN fits; policy.pipeline_ttft_budget_ms, default "
                   "%(default)s)")
    g.add_argument("--handoff", default=_sim_default("handoff_mode"), choices=["one_shot", "catch_up", "auto"])
    g.add_argument("--catchup-threshold", type=NONNEG_INT, default=_sim_default("catchup_threshold"))
    g.add_argument("--allow-p-rld", action="store_true")
    g.add_argument("--no-cutoff", action="store_true")
    g.add_argument("--cutoff-min-remaining-s", type=NONNEG_FLOAT, default=_sim_default("cutoff_min_remaining_s"),
                   help="cut a relayed request's WAN transfer off only when its rest takes at least this long "
                   "(policy.cutoff_min_remaining_s)")
    g.add_argument("--cutoff-max-sent-fraction", type=FRACTION, default=_sim_default("cutoff_max_sent_fraction"),
                   help="let a transfer finish once MD has reported this share of its bytes "
                   "(policy.cutoff_max_sent_fraction; 1: the remaining time alone)")
    g.add_argument("--no-md-predicted-send", action="store_true",
                   help="a request relayed at once (--budget-ms 0) sends MD's KV after MD's reservation round trip, "
                   "not when P's prefill is done (policy.md_predicted_send: false)")
    g.add_argument("--no-md-wait-claims", action="store_true",
                   help="MD's reservation matches only the KV that landed: a prefix still on its way to MD (another "
                   "request's claim) is sent again instead of waited for (policy.md_wait_claims: false)")
    g.add_argument("--md-load-cap", type=NONNEG_INT, default=_sim_default("md_load_cap"),
                   help="an MD with this many requests is routed to only when every MD has as many; 0: no cap "
                   "(policy.md_load_cap)")
    g.add_argument("--no-early-handoff", action="store_true",
                   help="a relayed request's handoff waits for MD's kv_ready to cross back instead of starting "
                   "when MD's KV has left P (policy.early_handoff: false)")
    g.add_argument("--no-drc", action="store_true")
    g.add_argument("--routing", default=_sim_default("routing"), choices=["cache_aware", "load", "round_robin"])
    g.add_argument("--max-batch-tokens", type=POS_INT, default=8192)
    g.add_argument("--prefill-chunk-tokens", type=POS_INT, default=8192)
    g.add_argument("--max-running-seqs", type=POS_INT, default=256)
    g.add_argument("--slo-ttft", type=POS_FLOAT, default=2.0, help="seconds")
    g.add_argument("--slo-tpot", type=POS_FLOAT, default=0.05, help="seconds")


DEFAULT_RATE = 2.0  # --rate when none is typed (req/s)


def _workload_defaults(a) -> None:
    """Fill in --rate, --seed and --scale-rate left untyped (None) once the flags were checked."""
    a.rate = DEFAULT_RATE if a.rate is None else a.rate
    a.seed = 0 if a.seed is None else a.seed
    a.scale_rate = 1.0 if a.scale_rate is None else a.scale_rate


def _workload_args(p: argparse.ArgumentParser, max_input: bool = False) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=None, type=_existing_file,
                   help="Mooncake JSONL (default: the bundled conversation trace)")
    g.add_argument("--limit", type=POS_INT, default=None, help="the trace's first N requests (default: all)")
    if max_input:
        g.add_argument("--max-input", type=POS_INT, default=None,
                       help="prompt cap in tokens, as pdd bench --max-input: whole trailing 512-token blocks "
                            "are dropped until a prompt fits (no request is dropped; default: none)")
    # None: not typed (typed where its workload does not read it, it is refused: _sim_run_workload_flags,
    # _plan_workload_flags)
    g.add_argument("--scale-rate", type=SCALE_RATE, default=None,
                   help="replay the trace this many times faster (>= 0.001: at most 1000 times slower; default 1)")
    g.add_argument("--agentic", type=GENERATED, default=None,
                   help="generate N (1 to 1,000,000) agentic requests instead of a trace")
    g.add_argument("--rate", type=RATE, default=None,
                   help=f"req/s for generated workloads (>= 0.001: one request per 1000 s on average; default "
                        f"{DEFAULT_RATE:g})")
    g.add_argument("--seed", type=NONNEG_INT, default=None,
                   help="workload seed (>= 0: numpy's generators take no negative seed; default 0)")


def _profiles(a) -> tuple[str | None, str | None]:
    """Chip A's and chip B's measured profile: ``--profile-a`` / ``--profile-b``, each defaulting to
    ``--profile`` (one profile for both chips, as ``pdd sim validate --profile``)."""
    return a.profile_a or a.profile, a.profile_b or a.profile


def _read_profiles(a) -> list[tuple[str, dict]]:
    """(path, JSON) of each profile given as --profile(-a/-b), chip A's first. A measured profile
    (``pdd-profile/1``) is checked as ``pdd sim validate`` checks one
    (``recorded.load_profile_checked``: its live-run fit's fields and ranges); any other JSON
    object is a roofline calibration file (``data/calibration``) and may not carry a live-run
    fit. UsageError naming the flag and file otherwise."""
    from pathlib import Path

    from pdd.files import InputFileError, read_text
    from pdd.sim.recorded import RecordedRunError, check_step_rows, load_profile_checked
    from pdd.sim.sim_config import live_fit_of

    flags = {a.profile: "--profile", a.profile_a: "--profile-a", a.profile_b: "--profile-b"}
    out = []
    for p in dict.fromkeys(x for x in _profiles(a) if x):
        flag = flags.get(p, "--profile")
        try:
            prof = json.loads(read_text(p, what="give a JSON profile (pdd profile) or a roofline calibration file"))
        except InputFileError as e:  # a device, FIFO or socket (/dev/zero was read until memory ran out)
            raise UsageError(f"{flag} {e}") from None
        except (OSError, ValueError) as e:
            raise UsageError(f"{flag} {p}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if not isinstance(prof, dict):
            raise UsageError(f"{flag} {p}: not a profile (a JSON {type(prof).__name__}, not an object)")
        if prof.get("format") == "pdd-profile/1":
            try:
                prof = load_profile_checked(p)
            except RecordedRunError as e:
                raise UsageError(f"{flag} {e}") from None
        elif "format" in prof:  # a roofline calibration file (data/calibration) has none
            raise UsageError(f"{flag} {p}: unsupported profile format {prof['format']!r} (expected pdd-profile/1, "
                             "or a roofline calibration file of data/calibration)")
        elif live_fit_of(prof):
            raise UsageError(f"{flag} {p}: carries a live-run fit ({', '.join(live_fit_of(prof))}) but is not a "
                             f"pdd-profile/1 profile (format {prof.get('format')!r})")
        else:  # a roofline calibration file: the same measured tables, no model
            try:
                check_step_rows(prof, Path(p), need_model=False)
            except RecordedRunError as e:
                raise UsageError(f"{flag} {e}") from None
        out.append((p, prof))
    return out


def _measured_model(profiles: list[tuple[str, dict]]) -> dict | None:
    """The model shape of a `pdd profile` file among ``profiles`` (its step times and KV pool
    belong to that model), else None."""
    for _, prof in profiles:
        if prof.get("format") == "pdd-profile/1":
            return prof["model"]
    return None


def _live_fit(a, profiles: list[tuple[str, dict]], cfg):
    """``cfg`` with the live-run fit (``pdd.sim.sim_config.with_live_fit``) of chip A's profile
    (--profile, else --profile-a; the fit is of one whole live run, so one profile carries it),
    unless --no-live-fit; says on stderr what it applied. Chip B's own fit, when it has another,
    is named as not applied."""
    from pdd.sim.sim_config import live_fit_of, with_live_fit

    if a.no_live_fit or not profiles:
        return cfg
    path_a, prof_a = profiles[0]
    if a.profile_a is None and a.profile is None:  # only --profile-b: chip A is a table chip
        path_a, prof_a = None, {}
    fields = live_fit_of(prof_a)
    for path, prof in profiles:
        if path != path_a and live_fit_of(prof):
            print(f"pdd sim: the live-run fit in {path} is not applied (the one of --profile / --profile-a is)",
                  file=sys.stderr)
    if not fields:
        return cfg
    run = (prof_a.get("role_overhead_from") or {}).get("run")
    shared = [f for f in fields if f in ("decode_interference", "prefill_interference")]
    note = f" ({', '.join(shared)} only on a shared host, which `pdd sim run` does not simulate)" \
        if shared and cfg.host_cores <= 0 else ""
    print(f"pdd sim: applying the live-run fit in {path_a}" + (f" (calibrated on {run})" if run else "")
          + f": {', '.join(fields)}{note}; --no-live-fit ignores it", file=sys.stderr)
    return with_live_fit(cfg, prof_a)


def _make_cfg(a):
    from pdd.sim.cluster import SimConfig

    profiles = _read_profiles(a)
    spec = _measured_model(profiles)
    profile_a, profile_b = _profiles(a)
    kw = dict(
        mode=a.mode, model="measured" if spec else a.model, model_spec=spec, kv_bytes_per_token=a.kv_bytes_per_token, chip_a=a.chip_a, chip_b=a.chip_b,
        price_a=a.price_a, price_b=a.price_b, profile_a=profile_a, profile_b=profile_b, n_p=a.n_p,
        n_rld=a.n_rld, n_md=a.n_md, n_d=a.n_d, n_c=a.n_c, wan_gbps=a.wan_gbps, wan_rtt_ms=a.wan_rtt_ms,
        wan_order=a.wan_order, wan_express_lane_bdp=a.wan_express_lane_bdp, wan_usd_per_hour=a.wan_usd_per_hour, ttft_budget_ms=a.budget_ms,
        handoff_mode=a.handoff, catchup_threshold=a.catchup_threshold, allow_p_rld=a.allow_p_rld,
        cutoff=not a.no_cutoff, cutoff_min_remaining_s=a.cutoff_min_remaining_s,
        cutoff_max_sent_fraction=a.cutoff_max_sent_fraction, md_predicted_send=not a.no_md_predicted_send, md_wait_claims=not a.no_md_wait_claims,
        md_load_cap=a.md_load_cap,
        early_handoff=not a.no_early_handoff, drc=not a.no_drc, routing=a.routing,
        max_batch_tokens=a.max_batch_tokens,
        prefill_chunk_tokens=a.prefill_chunk_tokens, max_running_seqs=a.max_running_seqs,
        slo_ttft_s=a.slo_ttft, slo_tpot_s=a.slo_tpot)
    # --config's WAN line replaces --wan-gbps / --wan-rtt-ms / --wan-order too, its engine blocks
    # the scheduler flags (--max-batch-tokens, --prefill-chunk-tokens, --max-running-seqs)
    kw.update(_wan_kv_engine_cutoff_fields(a))
    cfg = SimConfig(**kw)
    for role, (n, _) in cfg.tiers().items():  # the flag named (the simulator said "MD needs at least one instance")
        if n < 1:
            raise UsageError(f"--n-{role.lower()} {n}: {cfg.mode} mode needs at least one {role} instance")
    return _live_fit(a, profiles, cfg)


# a runtime config's blocks `pdd sim run` / `plan` do not read from --config
NOT_SIMULATED_FROM_CONFIG = frozenset({"instances", "model_path", "model_preset", "mode"})


def _wan_kv_engine_cutoff_fields(a) -> dict:
    """The WAN line's loss / cross traffic and the KV streaming fields from the flags, or from
    ``--config``'s runtime keys (``pdd.sim.sim_config.runtime_wan_fields``) with its engine
    blocks' (``pdd.sim.runtime_engines.runtime_engine_fields``: ``engine`` and ``tiers``, as
    simulated in ``--mode``) and its cut-off policy (``cutoff``, ``cutoff_min_remaining_s``,
    ``cutoff_max_sent_fraction``, replacing ``--no-cutoff`` / ``--cutoff-*``). UsageError naming
    the flag for a bad value."""
    from pdd.policy.tcp_model import check_loss_rate, check_schedule, parse_cross_traffic
    from pdd.sim.runtime_engines import runtime_engine_fields
    from pdd.sim.sim_config import SimConfig, runtime_wan_fields

    if getattr(a, "config", None):
        cfg = config_or_exit(a)
        engines, unread_engine = runtime_engine_fields(cfg, a.mode, SimConfig.block_tokens)
        unread = sorted(cfg.model_fields_set & NOT_SIMULATED_FROM_CONFIG) + unread_engine
        if unread:  # a config's instance counts or bf16 MD simulated otherwise, silently
            print(f"pdd sim: --config {a.config}: not simulated here: {', '.join(unread)} (instance counts: --n-p / "
                  "--n-rld / --n-md; the mode: --mode; the KV size: --model / --kv-bytes-per-token; the chips: "
                  "--chip-a / --chip-b; a live run's tiers with their dtypes: pdd sim validate --config with "
                  "--profile-b)", file=sys.stderr)
        pol = cfg.policy  # its cut-off replaces --no-cutoff / --cutoff-* (it was read nowhere, silently)
        return {**runtime_wan_fields(cfg), **engines, "cutoff": pol.cutoff,
                "cutoff_min_remaining_s": pol.cutoff_min_remaining_s,
                "cutoff_max_sent_fraction": pol.cutoff_max_sent_fraction}
    try:
        # "" is refused (no point in it), not taken as no cross traffic
        cross = parse_cross_traffic(a.cross_traffic, "--cross-traffic") if a.cross_traffic is not None else ()
        check_schedule(cross, "--cross-traffic", a.wan_gbps)
        loss = check_loss_rate(a.wan_loss_rate, "--wan-loss-rate")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return dict(wan_loss_rate=loss, wan_mss_bytes=a.wan_mss_bytes, wan_cross_traffic=cross,
                kv_stream=a.kv_stream, kv_stream_layer_group=a.kv_stream_layer_group)


def _trace_or_agentic(a) -> None:
    """UsageError naming both flags when --trace and --agentic are given (the trace was never read)."""
    if a.agentic and a.trace:
        raise UsageError("--trace and --agentic exclude each other: --agentic N generates the requests, "
                         "--trace FILE replays a file")


def _sim_run_workload_flags(a) -> None:
    """UsageError naming a workload flag of ``pdd sim run`` that its workload would not read
    (it ran without it): --limit / --scale-rate with --agentic, --scale-rate with a rate
    schedule, --rate with a trace or with --agentic and a schedule (unless it is --load-profile
    ramp's default peak), --seed with
    a trace and no schedule. Untyped flags are None here (:func:`_workload_defaults` fills them)."""
    schedule = "--rate-schedule" if a.rate_schedule is not None else "--load-profile" if a.load_profile else None
    if a.agentic:
        if a.limit is not None:
            raise UsageError("--limit and --agentic exclude each other: --limit N takes a trace's first N records; "
                             "--agentic N generates N requests")
        if a.scale_rate is not None:
            raise UsageError("--scale-rate and --agentic exclude each other: --scale-rate replays a trace faster; "
                             "generated requests arrive at --rate")
    if schedule and a.scale_rate is not None:
        raise UsageError(f"--scale-rate and {schedule} exclude each other: the schedule sets every arrival time")
    ramp_peak = a.load_profile == "ramp" and a.peak_rate is None  # schedule_from_flags' default peak
    if a.agentic:
        if schedule and a.rate is not None and not ramp_peak:
            raise UsageError(f"--rate: {schedule} sets every arrival time of the generated requests; --rate is "
                             "read only as --load-profile ramp's peak when --peak-rate is not given")
        return
    if a.rate is not None and not ramp_peak:
        raise UsageError("--rate: a trace replays at its own timestamps (faster or slower: --scale-rate); --rate is "
                         "a generated workload's (--agentic N) or --load-profile ramp's default peak")
    if a.seed is not None and not schedule:
        raise UsageError("--seed: a trace replays as recorded; --seed draws a generated workload (--agentic N) or "
                         "a load profile's arrivals")


def _records(a, rate=None):
    from pdd.workload import records as W

    cap = getattr(a, "max_input", None)  # pdd sim run and pdd plan
    _trace_or_agentic(a)
    if a.agentic:
        recs = W.generate_agentic(a.agentic, seed=a.seed, rate=rate or a.rate)
        return W.cap_input(recs, cap) if cap else recs
    path = a.trace or W.MOONCAKE_TRACE
    try:
        recs = W.load_trace(path, limit=a.limit)
    except (OSError, ValueError) as e:  # unreadable, or a line that is not a trace record (file and line named)
        raise UsageError(f"--trace: {e}") from None
    if not recs:  # as pdd bench and pdd plan refuse it: "simulated 0 requests" measures nothing
        raise UsageError(f"--trace: {path} holds no trace records")
    recs = W.from_earliest(recs)  # as pdd bench: epoch-ms timestamps simulated 1.7e9 idle seconds first
    if cap:
        recs = W.cap_input(recs, cap)
    if rate is not None:
        return W.retime(recs, rate, a.seed)
    return W.scale_rate(recs, a.scale_rate) if a.scale_rate != 1.0 else recs


def _autoscale_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load profile and autoscaling (docs/SIM.md \"Autoscaling\")")
    g.add_argument("--load-profile", choices=("ramp",),
                   help="'ramp': Poisson arrivals at --low-rate, rising to --peak-rate, held, falling back "
                        "(--phase-seconds), drawn with --seed, on the workload's requests in order")
    g.add_argument("--peak-rate", type=POS_FLOAT, default=None, help="ramp: peak req/s (default: --rate)")
    g.add_argument("--low-rate", type=NONNEG_FLOAT, default=None, help="ramp: low req/s (default: peak / 4)")
    g.add_argument("--phase-seconds", default=None, metavar="LOW:RISE:HOLD:FALL", help="ramp phases (default 10:20:10:20)")
    g.add_argument("--rate-schedule", default=None, metavar="T:RATE,...", help="rate points seconds:req/s, linear between")
    g.add_argument("--autoscale", default=None, nargs="+", metavar="ROLE=MAX",
                   help="run the gateway's autoscaling loop (pdd serve --autoscale) with these most active "
                        "instances per role (p, rld, md or prefill, relay_decode, main_decode; e.g. md=3 rld=2 "
                        "or md=3,rld=2; a role once); the --n-* counts are the initial ones")
    g.add_argument("--autoscale-min", default=None, nargs="+", metavar="ROLE=MIN",
                   help="fewest active per role (default 1)")
    # None when not typed (AUTOSCALE_DEFAULTS fills them): typed without --autoscale they are refused
    g.add_argument("--autoscale-interval", type=POS_FLOAT, default=None, help="seconds between decisions (5)")
    g.add_argument("--autoscale-sample", type=POS_FLOAT, default=None, help="seconds between load samples (0.25)")
    g.add_argument("--autoscale-cooldown", type=NONNEG_FLOAT, default=None, help="no change within this many s (30)")
    g.add_argument("--autoscale-up-at", type=POS_FLOAT, default=None, help="scale up at this mean utilisation (0.75)")
    g.add_argument("--autoscale-down-at", type=NONNEG_FLOAT, default=None, help="scale down at or below this (0.25)")
    g.add_argument("--autoscale-start-s", type=NONNEG_FLOAT, default=None,
                   help="seconds from an add decision to the new instance serving (0)")


# the autoscaling loop's settings when --autoscale is given and the flag is not
AUTOSCALE_DEFAULTS = {"autoscale_interval": 5.0, "autoscale_sample": 0.25, "autoscale_cooldown": 30.0,
                      "autoscale_up_at": 0.75, "autoscale_down_at": 0.25, "autoscale_start_s": 0.0}


def _autoscale_flags(a) -> None:
    """UsageError naming the --autoscale-* flags typed without --autoscale (they tune a loop that
    does not run); else each one not typed gets its :data:`AUTOSCALE_DEFAULTS` value."""
    typed = ["--" + k.replace("_", "-") for k in ("autoscale_min", *AUTOSCALE_DEFAULTS) if getattr(a, k) is not None]
    if a.autoscale is None and typed:
        raise UsageError(f"{', '.join(typed)}: only with --autoscale (the autoscaling loop's settings; without "
                         "--autoscale no loop runs)")
    for k, v in AUTOSCALE_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def _apply_load_profile(a, recs):
    """The records retimed by --load-profile ramp / --rate-schedule (pdd.load_profile), else as given."""
    from pdd.load_profile import schedule_arrivals, schedule_from_flags
    from pdd.sim.autoscale import retime

    try:
        sched = schedule_from_flags(a.load_profile, a.rate_schedule, a.peak_rate, a.low_rate, a.phase_seconds, a.rate)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sched is None:
        return recs, None
    return retime(recs, schedule_arrivals(sched, len(recs), a.seed)), sched


def _joined(items) -> str:
    """``--autoscale md=3 rld=2`` (nargs="+") as ``"md=3,rld=2"``; a single string as it is."""
    return items if isinstance(items, str) else ",".join(items)


# AutoscaleConfig's fields -> the `pdd sim run` flag that sets each
AUTOSCALE_FIELD_FLAGS = {"interval_s": "--autoscale-interval", "sample_s": "--autoscale-sample",
                         "cooldown_s": "--autoscale-cooldown", "up_at": "--autoscale-up-at",
                         "down_at": "--autoscale-down-at", "min": "--autoscale-min", "max": "--autoscale"}


def _autoscale_error(e) -> str:
    """The message of an :class:`~pdd.config.AutoscaleConfig` ValidationError built from the
    flags, each error naming the flag that set its field (``--autoscale-down-at: 0.5 must be <
    --autoscale-up-at / 2 = 0.375 ...``), not the config field; ``;``-joined."""
    import re

    def flags(text: str) -> str:
        return re.sub(r"\b(" + "|".join(k for k in AUTOSCALE_FIELD_FLAGS if k not in ("min", "max")) + r")\b",
                      lambda m: AUTOSCALE_FIELD_FLAGS[m.group(1)], text)

    out = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else re.match(r"[a-z_]*", msg).group(0)
        flag = AUTOSCALE_FIELD_FLAGS.get(field, "--autoscale")
        if not err["loc"] and msg.startswith(field + ":"):
            msg = msg[len(field) + 1:].lstrip()
        elif err["loc"]:
            msg = ".".join(str(x) for x in err["loc"][1:]) + (": " if len(err["loc"]) > 1 else "") + msg
        out.append(f"{flag}: {flags(msg)}")
    return "; ".join(out)


def _autoscale_config(a):
    """The autoscaling loop's :class:`~pdd.config.AutoscaleConfig` from ``--autoscale`` and the
    ``--autoscale-*`` values :func:`_autoscale_flags` filled; UsageError naming the flag or the
    setting that is wrong."""
    from pydantic import ValidationError

    from pdd.config import AutoscaleConfig
    from pdd.sim.autoscale import parse_role_counts

    try:
        mx = parse_role_counts(_joined(a.autoscale))
        mn = parse_role_counts(_joined(a.autoscale_min), "--autoscale-min") if a.autoscale_min is not None else {}
        return AutoscaleConfig(enabled=True, interval_s=a.autoscale_interval, sample_s=a.autoscale_sample,
                               cooldown_s=a.autoscale_cooldown, min=mn, max=mx, up_at=a.autoscale_up_at,
                               down_at=a.autoscale_down_at)
    except ValidationError as e:  # a field of the loop's config: named as the flag that set it
        raise UsageError(_autoscale_error(e)) from None
    except ValueError as e:  # parse_role_counts names its flag
        raise UsageError(str(e)) from None


def cmd_run(a) -> int:
    from pdd.load_profile import describe
    from pdd.sim.autoscale import autoscaled_sim, fixed_summary
    from pdd.sim.cluster import ClusterSim, RequestTooLarge
    from pdd.sim.report import print_summary, summarize, write_json

    _autoscale_flags(a)
    _trace_or_agentic(a)
    _sim_run_workload_flags(a)
    _workload_defaults(a)
    acfg = _autoscale_config(a) if a.autoscale is not None else None  # refused before the workload is read
    if a.json is not None:
        check_out_file(a.json, "--json")  # before the simulation, not after it
    recs, sched = _apply_load_profile(a, _records(a))
    cfg = _make_cfg(a)
    t0 = time.time()
    try:
        sim = (autoscaled_sim(cfg, acfg, a.autoscale_start_s) if acfg is not None else ClusterSim(cfg)).run(recs)
    except RequestTooLarge as e:  # e.g. the shared trace's 87k-token prompts on a CPU profile's pool
        if e.max_prompt < 1:
            raise UsageError(f"{e}; no prompt cap helps: the longest output alone does not fit") from None
        given = f" (--max-input {a.max_input} is above that)" if a.max_input else ""
        raise UsageError(f"{e}; cap the prompts with --max-input {e.max_prompt} or less{given}") from None
    except ValueError as e:  # a deployment the simulator refuses (no instance of a role, no KV room, ...)
        raise UsageError(str(e)) from None
    wall = time.time() - t0
    s = summarize(sim)
    s["wall_s"] = wall
    s["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_summary(s)
    if sched is not None:
        s["rate_schedule"] = [list(p) for p in sched]
    auto = sim.autoscaler.summary(s["duration_s"]) if sim.autoscaler is not None else fixed_summary(sim, s["duration_s"])
    s["autoscale"] = auto
    for d in auto.get("decisions", ()):
        if d["applied"]:
            x = d["inputs"]
            print(f"autoscale t={d['time']:.1f} s: " + ", ".join(
                f"{r['role']} {r['active']} active, utilisation {r['utilisation']:.2f}" for r in x["roles"])
                + f", arrivals {x['arrival_rps']:.2f} req/s -> " + ", ".join(
                f"{o['op']} {o.get('instance') or o.get('error')}" for o in d["applied"]))
    print(f"instance-seconds {auto['instance_seconds']:.1f} over {auto['window_s']:.1f} s (mean "
          f"{auto['mean_instances']} instances; " + ", ".join(f"{r} {v:.1f}" for r, v in
                                                            auto["instance_seconds_by_role"].items())
          + f"); autoscale " + (f"{auto['scale_ups']} up, {auto['scale_downs']} down" if sim.autoscaler is not None
                                else "off"))
    at = f" at rate schedule {describe(sched)} req/s" if sched is not None else ""  # not just the rates measured
    print(f"simulated {len(recs)} requests ({s['duration_s']:.0f} s of traffic{at}) in {wall:.1f} s wall, "
          f"peak RSS {s['peak_rss_mb']:.0f} MB")
    if sim.stalled:  # requests left unfinished: the figures above are of the others
        s["stalled"] = sim.stalled
        print(f"pdd sim run: warning: {sim.stalled}", file=sys.stderr)
    if a.json:
        # what it ran with (docs/SIM.md "Run one deployment"): the deployment as simulated, the
        # autoscaling loop's settings and the command's flags (the workload's among them)
        from pdd.sim.sim_config import settings_of

        s["settings"] = settings_of(cfg)
        if acfg is not None:
            s["settings"]["autoscale"] = {**acfg.model_dump(mode="json"), "start_s": a.autoscale_start_s}
        s["arguments"] = {k: v for k, v in vars(a).items() if k not in ("func", "parser")}
        write_json(s, a.json)
    return 0


def experiment_params(name: str, sets) -> dict:
    """``--set KEY=VALUE`` pairs as keyword arguments of experiment ``name``: KEY (``-`` read as
    ``_``) must be one of its parameters, VALUE is converted by the parameter's type (a float or
    int parameter refuses a non-number; ``none`` gives None where that is the default; an
    untyped one takes a number if it reads as one, else the text). UsageError otherwise."""
    import inspect

    from pdd.sim.experiments import EXPERIMENTS

    params = {p.name: p for p in list(inspect.signature(EXPERIMENTS[name]).parameters.values())
              if p.name not in ("out", "quick") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    valid = f"valid keys: {', '.join(params)}" if params else f"experiment {name} takes no --set keys"
    kw = {}
    for kv in sets:
        if "=" not in kv:
            raise UsageError(f"--set {kv!r}: expected KEY=VALUE ({valid})")
        k, v = kv.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in params:
            raise UsageError(f"--set {kv!r}: unknown key {k!r} for experiment {name}; {valid}")
        p = params[k]
        ann = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        if p.default is None and v.strip().lower() == "none":
            kw[k] = None
            continue
        conv = float if "float" in ann else int if "int" in ann else None
        if conv is None and p.annotation is p.empty and isinstance(p.default, (int, float)):
            conv = type(p.default)
        if conv is not None:
            try:
                kw[k] = conv(v)
            except ValueError:
                raise UsageError(f"--set {kv!r}: {k} takes {'an integer' if conv is int else 'a number'}, "
                                 f"got {v!r}") from None
        elif "str" in ann:
            kw[k] = v
        else:  # untyped (e.g. a comma list): a number if it reads as one
            try:
                kw[k] = float(v) if "." in v or "e" in v.lower() else int(v)
            except ValueError:
                kw[k] = v
        bad = _set_value_problem(k, kw[k])
        if bad:
            raise UsageError(f"--set {kv!r}: {k} {bad}")
    return kw


_SET_POSITIVE = ("rate", "wan_gbps", "inp", "chunk", "slo_ttft_s", "slo_tpot_s", "tpot_ms", "kv_bytes")
_SET_NONNEG = ("price_a", "wan_usd_per_hour")


def _set_value_problem(key: str, value) -> str | None:
    """Why ``--set key=value`` cannot run (to follow ``KEY ``), or None. Each experiment used the
    value as given: ``rate=0`` or ``wan_gbps=0`` was a ZeroDivisionError traceback, ``chunk=0``
    never ended, ``model=nosuch`` a KeyError, ``hit=2`` a table of negative costs. None (a
    parameter's ``none``) is its default and passes."""
    from pathlib import Path

    if value is None:
        return None
    if key in ("tpot_ms", "kv_bytes") and isinstance(value, str):  # comma lists
        for item in value.split(","):
            try:
                x = float(item)
            except ValueError:
                return f"takes comma-separated numbers > 0, got {item!r}"
            if not _positive(x):
                return f"takes comma-separated numbers > 0, got {item!r}"
        return None
    if key in _SET_POSITIVE or key in _SET_NONNEG or key in ("premium", "hit"):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"takes a number, got {value!r}"
    if key in _SET_POSITIVE and not _positive(value):
        return f"must be a finite number > 0, got {value:g}"
    if key == "rate":
        from pdd.load_profile import slow_rate_problem

        return slow_rate_problem(value)
    if key in _SET_NONNEG and not _nonneg(value):
        return f"must be a finite number >= 0, got {value:g}"
    if key == "premium" and not -1 < value < float("inf"):
        return f"must be a finite number > -1 (GPU-B's price is GPU-A's x (1 + premium)), got {value:g}"
    if key == "hit" and not 0 <= value <= 1:
        return f"must be in [0, 1], got {value:g}"
    if key == "model" and value not in _model_names():
        return f"{value!r} is not a known model; known: {', '.join(sorted(_model_names()))}"
    if key in ("chip_a", "chip_b") and value not in _chip_names():
        return f"{value!r} is not a known chip; known: {', '.join(sorted(_chip_names()))}"
    if key == "pairs":
        for pair in str(value).split(","):
            chips = pair.split("/")
            if len(chips) != 2 or any(c not in _chip_names() for c in chips):
                return (f"takes comma-separated CHIP_A/CHIP_B pairs of known chips, got {pair!r}; known: "
                        f"{', '.join(sorted(_chip_names()))}")
    if key == "profile" and not Path(str(value)).is_file():
        return f"is not a file: {value}"
    return None


def cmd_experiment(a) -> int:
    from pdd.sim.experiments import run_experiment

    t0 = time.time()
    kw = experiment_params(a.name, a.set or [])
    check_out_dir(a.out)  # a file or an unwritable path: one line naming --out, not the experiment's traceback
    res = run_experiment(a.name, a.out, quick=a.quick, **kw)
    print(res.get("table", ""))
    for k in ("wan_sensitivity_table", "bounds_table"):
        if k in res:
            print(res[k])
    if "checks" in res:
        print("checks:", json.dumps(res["checks"]))
    print(f"wrote {a.out}/result.json and {a.out}/{a.name}.png in {time.time() - t0:.0f} s")
    return 0


def _print_report(a, compute, fmt) -> int:
    """``compute()`` (a ValueError, e.g. a missing or malformed input, becomes a UsageError naming
    it), printed by ``fmt``, and written as JSON to ``a.json`` when given (checked first)."""
    import json
    from pathlib import Path

    if a.json is not None:  # --json '' is refused, not read as "no --json" (the report went unwritten)
        check_out_file(a.json, "--json")
    try:
        res = compute()
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(fmt(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0


def cmd_validate_report(a) -> int:
    from pdd.sim.heldout import format_report, held_out_report

    # a missing / malformed run directory, or a run that is not held out: a usage error
    return _print_report(a, lambda: held_out_report(a.calibration, a.held_out, tuple(a.noise) if a.noise else None),
                         format_report)


def cmd_compare_profiles(a) -> int:
    from pdd.sim.compare import compare_profiles, format_compare

    # a malformed input: one line naming the file and field
    return _print_report(a, lambda: compare_profiles(a.op_profile, a.calibration), format_compare)


def cmd_calibrate_roles(a) -> int:
    from pathlib import Path

    from pdd.sim.calibrate import PREFILL_QUIET_BELOW, calibrate_roles
    from pdd.sim.live_measures import DECODE_GAPS_MIN
    from pdd.sim.recorded import RecordedRunError

    cfg = config_or_exit(a) if a.config else None

    def before_model(run_cfg) -> None:  # the run and the profile are read: a bad one was named first
        model = run_cfg.model_path  # the run is re-simulated on this model's shapes
        if not (Path(model) / "config.json").exists():
            raise UsageError(f"no checkpoint at {model} (the run's model); make one with: pdd make-model --out "
                             f"{model}, or give the run's --config")
        check_out_file(a.out or a.profile, "--out" if a.out else "--profile")

    try:
        prof = calibrate_roles(a.run, a.profile, a.out, cfg, before_model=before_model)
    except RecordedRunError as e:  # a missing / malformed run directory or profile: one line naming it
        raise UsageError(f"{'--profile' if e.source == 'profile' else '--run'}: {e}") from None
    sc = (prof["role_overhead_from"].get("step_scale_fit") or {}).get("P")
    if sc:
        print(f"P    step shape x{sc['scale']:.3f} over the profile + {sc['overhead_s'] * 1e3:.2f} ms, reply lag "
              f"{sc['lag_s_per_token'] * 1e6:.1f} us a token of its largest step ({sc['samples']} isolated prefills "
              f"decoded beside for under {PREFILL_QUIET_BELOW:.0%} of their time, fit |error| "
              f"{sc['mean_abs_rel_err']:.1%})")
        if sc["level"] != 1.0:
            print(f"P    level x{sc['level']:.3f} (no prefill interference in [1, 5] gives P's mean live step; the "
                  f"level does): step x{prof['role_step_scale']['P']:.3f} + "
                  f"{prof['role_step_overhead_s']['P'] * 1e3:.2f} ms")
        else:
            print(f"P    step while other requests decode: x{sc['prefill_interference']:.3f} (where the simulated mean "
                  f"P step equals the live one)")
    else:
        print("P    step shape: too few isolated prefills in the run to fit a scale (x1); its per-step overhead "
              "is fitted below")
    dp = prof["role_overhead_from"].get("p_dispatch_fit")
    if dp:
        md = dp.get("median_diff_s", dp["dispatch_s"])
        print(f"P    dispatch {prof.get('p_dispatch_s', 0.0) * 1e3:.2f} ms a request (the median, over {dp['samples']} "
              f"isolated prefills, of the live P interval less the simulated one: {md * 1e3:.2f} ms"
              + (", below 0: none" if md < 0 else "") + ")")
    ds = prof["role_overhead_from"].get("decode_scale_fit")
    if ds:
        for t, g in ds["tiers"].items():
            print(f"{t.upper():4s} step shape x{g['factor']:.3f} over the profile (median token gap over the bare step, "
                  f"{g['samples']} gaps of a request decoding alone: {g['median_gap_s'] * 1e3:.2f} ms against "
                  f"{g['median_bare_s'] * 1e3:.2f} ms)")
    else:
        print(f"RLD  step shape: no factor fitted (x1): fewer than {DECODE_GAPS_MIN} token gaps of a request decoding "
              "alone; its per-step overhead is fitted below")
    di = prof["role_overhead_from"].get("decode_interference_fit")
    if di:
        per = "; ".join(f"{t}: {g['busy_median_s'] * 1e3:.1f} ms over {g['quiet_median_s'] * 1e3:.1f} ms, "
                        f"{g['busy_samples']} gaps with P busy, {g['quiet_samples']} with P quiet"
                        for t, g in di["tiers"].items())
        fs = ", ".join(f"{r} x{f:.2f}" for r, f in di["factors"].items())
        print(f"decode step while P prefills: {fs} (median token gap, P busy over P quiet: {per})")
    else:
        print(f"decode step while P prefills: no slow-down fitted (x1): no tier has {DECODE_GAPS_MIN} token gaps "
              "both with P busy and with P quiet")
    it = prof["role_overhead_from"]["iterations"][-1]
    for t, o in prof["role_step_overhead_s"].items():
        if t == "P" and sc:
            continue  # fitted above
        print(f"{t:4s} overhead {o * 1e3:7.2f} ms/step  (live mean step {it[t]['live_mean_step_s'] * 1e3:7.2f} ms, "
              f"simulated {it[t]['sim_mean_step_s'] * 1e3:7.2f} ms, the fit's last round)")
    f = prof["role_overhead_from"]
    print(f"WAN committed bytes a cut-off cannot recall: {prof['wan_send_buffer_bytes'] / 2 ** 20:.2f} MiB (sim carries "
          f"{f['sim_wan_bytes'] / 1e6:.1f} MB, live {f['live_wan_payload_bytes'] / 1e6:.1f} MB)")
    wl = f.get("wan_written_lead_fit")
    if wl:
        print(f"WAN bytes still to go when P has written MD's KV: {wl['lead_bytes'] / 2 ** 10:.0f} KiB (where the "
              f"simulated xfer_done falls on the live one: median {wl['median_diff_s'] * 1e3:+.1f} ms over "
              f"{wl['samples']} relayed requests)")
    else:
        print("WAN bytes still to go when P has written MD's KV: not fitted (too few relayed requests with an "
              "xfer_done); the committed bytes above")
    print(f"client delay (gateway first token -> client): {prof['client_delay_s'] * 1e3:.1f} ms")
    if prof.get("gateway_rtt_ms"):
        print(f"WAN RTT the gateway's decisions read (median): {prof['gateway_rtt_ms']:.2f} ms")
    print(f"wrote {a.out or a.profile}")
    return 0


def cmd_profile(a) -> int:
    import json
    from pathlib import Path

    from pdd.sim.profile import measure_profile

    from pdd.sim.sim_config import live_fit_of

    cfg = config_or_exit(a)
    if not (Path(cfg.model_path) / "config.json").exists():
        from pdd.cli_args import no_checkpoint_message

        raise UsageError(no_checkpoint_message(cfg.model_path))  # exit 2, as pdd serve and pdd launch say it
    out = Path(a.out)
    if not out.parent.exists():  # made now, so the check below (and the write after minutes) can pass
        from pdd.cli_args import file_in_the_way

        if file_in_the_way(a.out) is not None:
            check_out_file(a.out)  # names the file in the way, as every out-path check does
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {a.out}: cannot make its directory ({e.strerror or e})") from None
    check_out_file(a.out)  # before a minute of measuring, not after
    if out.is_file() and not a.force:
        try:
            old = json.loads(out.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and live_fit_of(old):
            raise UsageError(f"--out {a.out}: holds a live-run fit (pdd sim calibrate-roles: "
                             f"{', '.join(live_fit_of(old))}) that a new profile would drop; give another --out, "
                             "or --force")
    prof = measure_profile(cfg, reps=a.reps)
    out.write_text(json.dumps(prof, indent=1))
    f = prof["fit"]
    print(f"step-time fit over {len(prof['prefill']) + len(prof['decode']) + len(prof['extend'])} rows: mean |rel "
          f"err| {f['mean_abs_rel_err']:.1%}, max {f['max_abs_rel_err']:.1%}; wrote {a.out}")
    return 0


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure the live engine's prefill / decode / extend step times "
                                              "and write a hardware profile for `pdd sim --profile-a`")
    p.add_argument("--out", default="runs/profile.json",
                   help="the profile to write (default runs/profile.json); an existing profile that carries a "
                   "live-run fit (e.g. data/profiles/this-machine.json) is kept unless --force")
    p.add_argument("--force", action="store_true", help="overwrite --out even when it holds a live-run fit")
    p.add_argument("--config", default=None, help="cluster config (YAML/JSON) whose engine settings to use")
    p.add_argument("--reps", type=POS_INT, default=5, help="repetitions per point (median; >= 1)")
    p.set_defaults(func=cmd_profile, parser=p)
    return p


def check_out_dir(path: str, flag: str = "--out") -> None:
    """Make the output directory ``path`` now (parents too) so that a bad one is a UsageError
    naming ``flag`` before the work, not a traceback after it (:func:`pdd.cli_args.out_dir_problem`)."""
    from pdd.cli_args import out_dir_problem

    bad = out_dir_problem(path, keep=True, flag=flag)
    if bad:
        raise UsageError(bad)


def check_out_file(path: str, flag: str = "--out") -> None:
    """UsageError naming ``flag`` unless ``path`` can be written as a file (checked before the work):
    opened for appending (nothing written; a file this call made is removed again), since
    ``os.access`` says yes to root for a directory no file can be made in (``/proc``)."""
    import os
    from pathlib import Path

    if not str(path).strip():
        raise UsageError(f"{flag} {path!r}: empty; give a file path")
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file path")
    parent = p.parent
    if not parent.is_dir():
        from pdd.cli_args import file_in_the_way

        if (f := file_in_the_way(path)) is not None:  # /etc/passwd/x.json: not "no such directory: /etc/passwd"
            raise UsageError(f"{flag} {path}: {f} is a file, not a directory")
        raise UsageError(f"{flag} {path}: no such directory: {parent}")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as ex:  # root in /proc or /sys: the simulation ran, then write_text was a traceback
        raise UsageError(f"{flag} {path}: cannot write it: {ex.strerror or ex}") from None
    if not existed:
        p.unlink(missing_ok=True)


def cmd_agentic(a) -> int:
    from pdd.workload.records import generate_agentic, print_hit_histogram, write_trace

    if a.out is not None:
        check_out_file(a.out)
    recs = generate_agentic(a.n, seed=a.seed, rate=a.rate)
    print_hit_histogram(recs)
    if a.out:
        try:
            write_trace(recs, a.out)
        except OSError as ex:  # what the check above cannot see (a full disk)
            raise UsageError(f"--out {a.out}: cannot write it: {ex.strerror or ex}") from None
        print(f"wrote {len(recs)} records to {a.out}")
    return 0


def add_sim_parser(subparsers, add_validate=None) -> argparse.ArgumentParser:
    """Add ``pdd sim`` and its sub-commands to ``subparsers``. ``add_validate(sim_subparsers)`` adds
    ``validate`` (``pdd.bench.live_validate.add_validate_parser``: its live run drives the bench
    client, which the simulator does not import); without it there is no ``pdd sim validate``."""
    p = subparsers.add_parser("sim", help="discrete-event simulator of a two-datacenter cluster")
    sp = p.add_subparsers(dest="sim_cmd", required=True)
    r = _numbers_as_values(sp.add_parser("run", help="simulate one deployment on a workload"))
    _cfg_args(r)
    _workload_args(r, max_input=True)
    _autoscale_args(r)
    r.add_argument("--json", default=None, help="write the summary here")
    r.set_defaults(func=cmd_run, parser=r)
    from pdd.sim.experiments import EXPERIMENTS

    e = sp.add_parser("experiment", help="run a named experiment")
    e.add_argument("name", choices=sorted(EXPERIMENTS))
    e.add_argument("--out", required=True, help="directory for result.json and the experiment's plot")
    e.add_argument("--quick", action="store_true", help="fewer points and requests")
    e.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="experiment parameter (a keyword of the experiment's function in pdd.sim.experiments; an "
                        "unknown key is refused, listing the valid ones), e.g. --set chip_b=MI300X --set premium=0.3")
    e.set_defaults(func=cmd_experiment, parser=e)
    if add_validate is not None:  # pdd.bench.live_validate: the live run is the benchmark's
        add_validate(sp)
    c = sp.add_parser("calibrate-roles", help="fit each live role's step over the bare engine's (P's factor from "
                                             "isolated prefills, each role's per-step overhead) on one validate run "
                                             "and write it into the profile")
    c.add_argument("--run", required=True, help="a `pdd sim validate --out` directory (the calibration run)")
    c.add_argument("--profile", required=True, help="the bare engine's step profile (`pdd profile`) the fits are "
                                                    "made over; its earlier fits are replaced")
    c.add_argument("--out", default=None, help="profile to write (default: --profile in place)")
    c.add_argument("--config", default=None, help="the cluster config (YAML/JSON) the run was made with "
                                                  "(default: the embedded topology)")
    c.set_defaults(func=cmd_calibrate_roles, parser=c)
    vr = sp.add_parser("validate-report", help="judge recorded `pdd sim validate` runs held out from the calibration "
                                               "run, beside the noise floor of one workload run live twice")
    vr.add_argument("--calibration", required=True, help="the validate directory the profile was fitted on")
    vr.add_argument("--held-out", required=True, nargs="+", metavar="DIR",
                    help="validate directories of other workloads (same profile, nothing refitted)")
    vr.add_argument("--noise", nargs=2, metavar="DIR", default=None,
                    help="two validate directories of one workload run live twice (the noise floor): the "
                         "live runs themselves (holding requests.jsonl), not `--live-from` re-simulations of them")
    vr.add_argument("--json", default=None, help="write the report here")
    vr.set_defaults(func=cmd_validate_report, parser=vr)
    from pdd.sim.compare import DEFAULT_CALIBRATION, DEFAULT_OP_PROFILE

    cp = sp.add_parser("compare-profiles", help="the step model's prefill / decode step times against Vidur's "
                                                "published operator profiles and the H200 calibration")
    cp.add_argument("--op-profile", type=_existing_file, default=str(DEFAULT_OP_PROFILE),
                    help="a pdd-op-profile/1 JSON (default: data/hardware/vidur/linear-ops.json)")
    cp.add_argument("--calibration", type=_existing_file, default=str(DEFAULT_CALIBRATION),
                    help="a measured step profile (default: the H200 calibration)")
    cp.add_argument("--json", default=None, help="write every row and the summary here")
    cp.set_defaults(func=cmd_compare_profiles, parser=cp)
    g = _numbers_as_values(sp.add_parser("agentic", help="generate an agentic Mooncake-format workload"))
    g.add_argument("--n", type=GENERATED, default=5000)
    g.add_argument("--rate", type=RATE, default=2.0, help="mean arrivals, req/s (>= 0.001)")
    g.add_argument("--seed", type=NONNEG_INT, default=0)
    g.add_argument("--out", default=None, help="Mooncake-format JSONL file to write (default: only the hit histogram is printed)")
    g.set_defaults(func=cmd_agentic)
    return p


PLAN_REQUESTS = 1500  # `pdd plan`'s generated requests when neither --requests nor --agentic gives a count


PLAN_INPUT_LEN, PLAN_OUTPUT_LEN, PLAN_HIT = 63 * 1024, 1024, 0.9  # the fixed workload's defaults


def _plan_workload_flags(a) -> None:
    """UsageError naming a workload flag of ``pdd plan`` that its workload (``a.workload``, set)
    would not read: --scale-rate (every workload runs at --rate), --limit with a generated
    workload, --input-len / --output-len / --hit with any but the fixed one, --max-input with the
    fixed one. Untyped flags are None here."""
    if a.scale_rate is not None:
        raise UsageError("--scale-rate: pdd plan runs its workload at --rate (and at each rate its goodput search "
                         "tries), a trace retimed to it: a scale factor would not be read (give --rate)")
    if a.limit is not None and a.workload != "trace":
        raise UsageError("--limit: only with a trace workload (--trace FILE or --workload trace): it takes the "
                         f"trace's first N records; the {a.workload} workload is generated (its count: --requests N)")
    fixed = [f for f, v in (("--input-len", a.input_len), ("--output-len", a.output_len), ("--hit", a.hit))
             if v is not None]
    if fixed and a.workload != "fixed":
        raise UsageError(f"{', '.join(fixed)}: only with --workload fixed (the fixed workload's prompt tokens, "
                         f"output tokens and prefix hit rate); the {a.workload} workload's requests are its own")
    if a.max_input is not None and a.workload == "fixed":
        raise UsageError("--max-input and --workload fixed exclude each other: --max-input caps the agentic or "
                         "trace workload's prompts; the fixed workload's prompt is --input-len")


def cmd_plan(a) -> int:
    from pdd.sim.cluster import RequestTooLarge
    from pdd.sim.plan import WanOption, best_with_goodput, format_plan, search
    from pdd.workload.records import generate_fixed

    if a.trace and a.workload not in (None, "trace"):  # it ran that workload and never read the file
        raise UsageError(f"--trace and --workload {a.workload} exclude each other: --trace FILE replays a trace "
                         "(--workload trace, which --trace alone implies)")
    if a.agentic:  # --agentic N is the agentic workload's count; it was overwritten by --requests' (default)
        _trace_or_agentic(a)
        if a.workload not in (None, "agentic"):
            raise UsageError(f"--agentic and --workload {a.workload} exclude each other: --agentic N generates N "
                             "agentic requests (--workload agentic, which --agentic alone implies)")
        if a.requests is not None and a.requests != a.agentic:
            raise UsageError(f"--agentic {a.agentic} and --requests {a.requests} disagree: both give the agentic "
                             "workload's request count (give one)")
    a.workload = a.workload or ("trace" if a.trace else "agentic")
    if a.workload == "trace" and a.requests is not None:  # the whole trace was replayed, silently
        raise UsageError("--requests and --workload trace exclude each other: --requests N sizes a generated "
                         "workload (agentic or fixed); a trace's first N records: --limit N")
    _plan_workload_flags(a)
    _workload_defaults(a)
    a.input_len = PLAN_INPUT_LEN if a.input_len is None else a.input_len
    a.output_len = PLAN_OUTPUT_LEN if a.output_len is None else a.output_len
    a.hit = PLAN_HIT if a.hit is None else a.hit
    requests = a.agentic or a.requests or PLAN_REQUESTS
    if a.workload == "fixed":
        def make(rate):
            return generate_fixed(requests, rate, a.input_len, a.output_len, a.hit, n_prefixes=48, seed=a.seed,
                                  warm_s=40.0)
    else:
        a.agentic = requests if a.workload == "agentic" else None

        def make(rate):
            return _records(a, rate)

    from pdd.sim.sim_config import MAX_INSTANCES

    if a.md_step < 1 or a.md_min < 1 or a.md_max < a.md_min:
        raise UsageError(f"--md-min {a.md_min} / --md-max {a.md_max} / --md-step {a.md_step}: the MD counts searched "
                         "are empty (need 1 <= --md-min <= --md-max and --md-step >= 1)")
    if a.md_max > MAX_INSTANCES:
        raise UsageError(f"--md-max {a.md_max}: at most {MAX_INSTANCES:,} (instances of one tier)")
    if a.json is not None:
        check_out_file(a.json, "--json")  # before the search (minutes), not after it
    base = _make_cfg(a)
    wans = _wan_options(a.wan)
    rlds = _rld_counts(a.rld)
    recs = make(a.rate)
    bar = PlanProgress(enabled=not a.no_progress and sys.stderr.isatty())
    try:
        with bar:
            found = search(recs, base, md_counts=range(a.md_min, a.md_max + 1, a.md_step),
                           rld_counts=rlds, wans=wans, p_max=a.p_max,
                           d_counts=range(a.md_min, a.md_max + 1, a.md_step),
                           log=lambda r: bar.say(f"  feasible: {r['config']} WAN {r['wan_gbps']} "
                                                 f"${r['cost_per_hour']:.1f}/h"),
                           progress=bar.candidates)
            rows = best_with_goodput(found, make, a.rate, a.top, progress=bar.goodput) if found else []
        if not found:
            print("no configuration in the search space meets the SLO at this rate")
            return 1
    except RequestTooLarge as e:  # e.g. the agentic workload's 57k-token prompts on a CPU profile's pool
        cap = ("lower --input-len" if a.workload == "fixed" else
               f"cap the prompts with --max-input {e.max_prompt} or less") if e.max_prompt >= 1 else \
            "no prompt cap helps: the longest output alone does not fit"
        raise UsageError(f"{e}; {cap}") from None
    print(format_plan(rows))
    if a.json:
        from pdd.sim.report import write_json

        write_json({"rows": rows, "all_feasible": [{k: v for k, v in r.items() if k != "_cfg"} for r in found]},
                   a.json)
    return 0


class PlanProgress:
    """``pdd plan``'s progress on stderr: a rich bar of the candidates evaluated (each a P
    bisection of simulator runs), then of the cheapest configurations' SLA goodput searches; the
    search ran 100 s and more without a line. Off (``enabled`` False) when stderr is not a
    terminal or with ``--no-progress``; stdout is never written to. ``say(line)``: a line on
    stderr, above the bar while it shows. A context manager: the bar is removed on exit."""

    def __init__(self, enabled: bool):
        self.prog = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                                 redirect_stdout=False, redirect_stderr=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.prog is not None:
            self.prog.start()
        return self

    def __exit__(self, *exc):
        if self.prog is not None:
            self.prog.stop()
        return False

    def _update(self, what: str, done: int, total: int) -> None:
        if self.prog is None:
            return
        if what not in self.tasks:
            self.tasks[what] = self.prog.add_task(what, total=total)
        self.prog.update(self.tasks[what], completed=done, total=total)

    def candidates(self, done: int, total: int) -> None:
        self._update("candidates evaluated", done, total)

    def goodput(self, done: int, total: int) -> None:
        self._update("SLA goodput of the cheapest", done, total)

    def say(self, line: str) -> None:
        if self.prog is not None:
            self.prog.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = _numbers_as_values(subparsers.add_parser("plan", help="size P / RLD / MD counts and the WAN line for a "
                                                              "workload and SLO"))
    _cfg_args(p)
    _workload_args(p, max_input=True)
    p.add_argument("--workload", default=None, choices=["agentic", "trace", "fixed"],
                   help="agentic: --requests generated agentic requests; trace: --trace FILE (default: the bundled "
                        "conversation trace); fixed: --input-len / --output-len / --hit (default: trace when "
                        "--trace is given, else agentic)")
    p.add_argument("--requests", type=GENERATED, default=None,
                   help=f"requests of a generated workload (agentic or fixed; default {PLAN_REQUESTS}); "
                        "--agentic N is the same count for the agentic workload")
    p.add_argument("--input-len", type=_int_in(1, MAX_PROMPT_TOKENS, "prompt tokens"), default=None,
                   help=f"prompt tokens of the fixed workload (default {PLAN_INPUT_LEN})")
    p.add_argument("--output-len", type=NONNEG_INT, default=None,
                   help=f"output tokens of the fixed workload (default {PLAN_OUTPUT_LEN})")
    p.add_argument("--hit", type=FRACTION, default=None,
                   help=f"prefix hit rate of the fixed workload, in [0, 1] (default {PLAN_HIT})")
    p.add_argument("--wan", default="10:5,25:9,100:15", help="line options GBPS:USD_PER_HOUR, comma-separated")
    p.add_argument("--md-min", type=int, default=2)
    p.add_argument("--md-max", type=int, default=16)
    p.add_argument("--md-step", type=int, default=2)
    p.add_argument("--rld", default="1,2,4")
    p.add_argument("--p-max", type=_instances(1), default=32)
    p.add_argument("--top", type=POS_INT, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar of the candidates evaluated on stderr (it shows only when stderr is a "
                        "terminal)")
    p.set_defaults(func=cmd_plan, parser=p)
    return p


def main(argv=None) -> int:
    """Stand-alone entry (``python -m pdd.sim.cli sim ...`` / ``... plan ...``); ``sim validate``
    is ``pdd``'s only (its live run is the benchmark's)."""
    ap = ShortUsageParser(prog="pdd")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_sim_parser(sub)
    add_plan_parser(sub)
    a = ap.parse_args(argv)
    return run_command(a, ap)


def run_command(a, ap: argparse.ArgumentParser) -> int:
    """Run the parsed sub-command; its UsageError becomes one ``PROG: error: ...`` line on
    stderr (exit 2), without the usage block argparse prints for a malformed command line (a
    refusal of a value names its flag; the usage of 40 flags above it buried it)."""
    try:
        return a.func(a)
    except UsageError as e:
        sys.stderr.write(f"{(getattr(a, 'parser', None) or ap).prog}: error: {e}\n")
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
