"""The live half of ``pdd sim validate``: the workload on a fresh topology through the bench client.

The simulator's half, the comparison and the report are :mod:`pdd.sim.validate`; this module
runs the live topology (``pdd.launch.Topology``: one warm-up request, caches flushed, then
:func:`pdd.bench.live.measured_replay`) and owns the ``pdd sim validate`` sub-command, which
``pdd.cli`` hands to the simulator's parser (``pdd.sim.cli.add_sim_parser``), so that the
simulator does not import the benchmark.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["live_run", "run_validate", "calibrate_same_day", "add_validate_parser", "cmd_validate",
           "CALIBRATION_ARGS"]


def live_run(cfg, requests, out: Path, seed: int, console) -> tuple[list[dict], dict]:
    """Replay ``requests`` (``pdd.workload.replay.ReplayRequest``) open-loop on a fresh topology of
    ``cfg`` (logs in ``out/logs``) after one warm-up request (seeded by ``seed``) and a cache flush.
    Writes ``out/requests.jsonl`` and ``out/server_stats.json``; returns (per-request record dicts,
    the gateway's stats before and after the replay as one dict)."""
    from pdd.bench.client import run_one_sync
    from pdd.bench.live import measured_replay
    from pdd.bench.report import write_jsonl
    from pdd.launch import Topology
    from pdd.workload.replay import TokenSpace, block_token_ids

    tokens = TokenSpace.from_model(cfg.model_path)
    with Topology(cfg, log_dir=out / "logs") as topo:
        warm = block_token_ids((1 << 65) + seed, 2 * cfg.engine.page_size + 3, tokens, seed)
        run_one_sync(topo.url, warm, 4, model=cfg.served_model_name, timeout_s=120.0)
        topo.flush()
        records, entry = measured_replay(topo, requests, model=cfg.served_model_name, mode="pdd",
                                         timeout_s=cfg.request_timeout_s, progress=False, console=console)
    live = [r.to_dict() for r in records]
    write_jsonl(out / "requests.jsonl", live)
    (out / "server_stats.json").write_text(json.dumps(entry, indent=1, default=str))
    return live, entry


def run_validate(out: str | Path, config=None, *, budget_ms: float = 250.0, console=None, **kw) -> dict:
    """``pdd sim validate``: :func:`pdd.sim.validate.run_validate` with :func:`live_run` (``kw``:
    its workload, profile and ``live_from`` arguments), making the model if missing once it has
    read and checked a ``live_from`` run and the profiles (a bad one fails before a model is
    written into the working directory). Returns and writes what it does
    (``out/validate.json``)."""
    from rich.console import Console

    from pdd.bench.live import ensure_model
    from pdd.sim import validate as V

    console = console or Console(stderr=True)
    def before_model(cfg) -> None:
        try:
            ensure_model(cfg, console)
        except ValueError as e:  # a model_path with no checkpoint: one line naming it (pdd sim validate: error:)
            from pdd.sim.cli import UsageError

            raise UsageError(str(e)) from None

    return V.run_validate(out, config, budget_ms=budget_ms, live_run=live_run, console=console,
                          before_model=before_model, **kw)


# `pdd sim validate`'s workload flags (argument names) and their defaults
WORKLOAD_DEFAULTS = {"requests": 220, "rate": 2.0, "block_tokens": 64, "session_sample": 50, "session_seed": 0,
                     "max_output_tokens": None, "budget_ms": 250.0}
# the committed calibration run's workload and budget (data/validation/cal-a; docs/SIM.md "Measure
# this machine and validate the simulator", step 2): what `pdd sim validate --calibrate` runs live
# first and fits on. Its rate and output cap keep requests decoding while others prefill, which
# the prefill-interference fit needs (tests/sim/test_validate_calibrate.py pins it to cal-a's).
CALIBRATION_ARGS = {"requests": 150, "rate": 1.0, "block_tokens": 64, "session_sample": 50, "session_seed": 1,
                    "max_output_tokens": 64, "budget_ms": 40.0}


def calibration_config(cfg):
    """The topology the calibration run uses: ``cfg`` (None: the embedded one) with every tier on
    the top-level engine (its ``tiers`` blocks dropped), as the committed calibration run was
    recorded for the heterogeneous held-out runs: the fit's per-role terms are over the bare
    profile of that engine, and a heterogeneous MD is then simulated on ``--profile-b``."""
    return None if cfg is None else cfg.model_copy(update={"tiers": {}})


def calibrate_same_day(out: Path, cfg, profile, console) -> Path:
    """``pdd sim validate --calibrate``: run the calibration workload (:data:`CALIBRATION_ARGS`)
    live on :func:`calibration_config` into ``out/calibration`` (simulated on ``profile``; None:
    the bare engine is measured there first, ``out/calibration/profile.json``), fit the live-run
    terms on it (:func:`pdd.sim.calibrate.calibrate_roles`) into ``out/fit.json``, and
    re-simulate the calibration run with that fit (so ``pdd sim validate-report`` reads it beside
    the held-out run). Returns the fitted profile's path. A fit is only good for runs of its own
    day on its own machine (docs/SIM.md "Fit on one day, judged on another"): this is what a
    held-out run recorded today is judged with. Raises what :func:`run_validate` and
    ``calibrate_roles`` raise (:class:`pdd.sim.recorded.RecordedRunError` for a profile it cannot
    read)."""
    from pdd.sim.calibrate import calibrate_roles

    cal, ccfg = out / "calibration", calibration_config(cfg)
    w = dict(CALIBRATION_ARGS)
    args = dict(n_requests=w.pop("requests"), rate=w.pop("rate"), budget_ms=w.pop("budget_ms"), **w)
    console.print(f"calibration run: {args['n_requests']} requests at {args['rate']} req/s, session seed "
                  f"{args['session_seed']}, outputs up to {args['max_output_tokens']} tokens -> {cal}")
    run_validate(cal, ccfg, profile=profile, console=console, **args)
    base = Path(profile) if profile is not None else cal / "profile.json"
    fit = out / "fit.json"
    calibrate_roles(cal, base, fit, ccfg)
    run_validate(cal, ccfg, profile=fit, live_from=cal, console=console, **args)
    console.print(f"fitted on the calibration run: {fit}")
    return fit


# the most of a held-out workload's requests that may also be the calibration run's: the chance
# overlap of another session seed (about 1 / session_sample, 2% at 50), not a slice of its own
HELD_OUT_MAX_SHARED = 0.1


def calibration_overlap(cfg, w: dict) -> int:
    """How many of the trace records the workload ``w`` (``pdd sim validate``'s argument names, as
    :data:`CALIBRATION_ARGS`) replays the calibration run replays too (``ReplayRequest.idx``). The
    records are chosen by ``--session-seed`` / ``--session-sample`` and ``--requests``, not by the
    rate, output cap or budget, so only those can make a workload held out. Two session seeds keep
    a conversation each with probability 1 / ``session_sample``, independently, so another seed
    shares about that share of its requests by chance (seeds 0-11 at 100 requests: 0-4; seed 5:
    2); :data:`HELD_OUT_MAX_SHARED` bounds it."""
    from pdd.sim.validate import build_workload, validate_config
    from pdd.workload.replay import TokenSpace

    def records(cfg, a: dict) -> set[int]:
        reqs, _ = build_workload(cfg, n_requests=a["requests"], rate=a["rate"], block_tokens=a["block_tokens"],
                                 session_sample=a["session_sample"], session_seed=a["session_seed"],
                                 max_output_tokens=a["max_output_tokens"], tokens=TokenSpace())
        return {r.idx for r in reqs}

    vc = validate_config(cfg, w["budget_ms"])
    return len(records(vc, w) & records(calibration_config(vc), CALIBRATION_ARGS))


def flag_error(e, run_flag: str):
    """The :class:`pdd.sim.cli.UsageError` for a :class:`pdd.sim.recorded.RecordedRunError` ``e``,
    its message after the flag it came from: ``--profile`` / ``--profile-b`` by ``e.source``,
    else ``run_flag`` (the recorded or calibration run's flag)."""
    from pdd.sim.cli import UsageError

    flag = {"profile": "--profile", "profile_b": "--profile-b"}.get(e.source, run_flag)
    return UsageError(f"{flag}: {e}")


def cmd_validate(a) -> int:
    """``pdd sim validate``: :func:`_cmd_validate`, stopped by Ctrl-C or SIGTERM with one line and
    the signal's status once the live topology's instances have exited (as ``pdd bench``)."""
    from pdd.cli_args import stop_on_sigterm, stopped_status

    if a.live_from is None:  # a live run: SIGTERM stops its instances and waits for them first
        stop_on_sigterm()
    try:
        return _cmd_validate(a)
    except KeyboardInterrupt as ex:  # the topology was stopped on the way out (``with Topology``)
        return stopped_status("pdd sim validate", ex)


def _cmd_validate(a) -> int:
    from pdd.cli_args import config_or_exit
    from pdd.sim.validate import format_validate

    import math

    from pdd.sim.cli import check_out_dir
    from pdd.sim.recorded import RecordedRunError, WorkloadMismatch, recorded_run_args

    cfg = None
    if a.config or a.port is not None or a.base_port is not None:  # else the embedded topology on free ports
        cfg = config_or_exit(a, gateway_port=a.port, base_port=a.base_port)  # pdd serve's checks and messages
    # a flag not given: the reused run's own value (--live-from), else the default
    rec = recorded_run_args(a.live_from) if a.live_from else {}
    w = {k: getattr(a, k) if getattr(a, k) is not None else rec.get(k, d) for k, d in WORKLOAD_DEFAULTS.items()}
    from pdd.sim.cli import UsageError

    for k in ("requests", "block_tokens", "session_sample", "max_output_tokens"):  # counts (a recorded run's too)
        x = w[k]  # (a recorded run's 220.0 is 220)
        if x is not None and not (not isinstance(x, bool) and math.isfinite(x) and x >= 1 and x == int(x)):
            raise UsageError(f"--{k.replace('_', '-')} must be an integer >= 1, got {w[k]}")
    if w["rate"] is not None and not (math.isfinite(w["rate"]) and w["rate"] > 0):  # nan gave arrival times of nan
        raise UsageError(f"--rate must be a finite number > 0, got {w['rate']}")
    from pdd.load_profile import slow_rate_problem

    slow = w["rate"] is not None and slow_rate_problem(w["rate"])
    if slow:  # 1e-9 passed "> 0": the live run's arrivals spanned centuries
        raise UsageError(f"--rate {slow}")
    if not (math.isfinite(w["budget_ms"]) and w["budget_ms"] >= 0):  # the live topology's pipeline budget
        raise UsageError(f"--budget-ms must be a finite number >= 0, got {w['budget_ms']}")
    if a.calibrate and a.live_from:
        raise UsageError("--calibrate runs a calibration workload live before this one; --live-from re-simulates a "
                         "recorded run: give one of them")
    if a.noise_floor and not a.calibrate:
        raise UsageError("--noise-floor judges two runs of the workload against a calibration run of the same day: "
                         "give it with --calibrate (or record them and use `pdd sim validate-report --noise`)")
    if a.calibrate:
        shared = calibration_overlap(cfg, w)
        if shared > HELD_OUT_MAX_SHARED * w["requests"]:  # the fit would have been made on its requests
            raise UsageError(f"--calibrate: {shared} of this workload's {w['requests']} requests are the calibration "
                             f"run's own (its conversations: --session-seed {CALIBRATION_ARGS['session_seed']}, "
                             f"--session-sample {CALIBRATION_ARGS['session_sample']}): not held out; give another "
                             f"--session-seed (the rate, output cap and budget do not change which requests run)")
        from pdd.sim.recorded import load_profile_checked

        for flag, path in (("--profile", a.profile), ("--profile-b", a.profile_b)):
            try:  # read before the calibration run (and before --out is made), not after it
                if path is not None:
                    load_profile_checked(path)
            except RecordedRunError as e:
                raise UsageError(f"{flag}: {e}") from None
    if cfg is not None and a.live_from is None:  # the live run's ports, as pdd serve, demo and bench refuse them
        from pdd.cli_args import usage_error
        from pdd.topology import ports_taken_refusal

        taken = ports_taken_refusal([cfg], "pdd sim validate")
        if taken:
            usage_error(a, taken)
    check_out_dir(a.out)  # a file or an unwritable place: one line, before any work
    profile = a.profile
    if a.calibrate:
        from rich.console import Console

        try:
            profile = calibrate_same_day(Path(a.out), cfg, a.profile, Console(stderr=True))
        except RecordedRunError as e:  # a --profile it cannot read (before anything runs), a run it cannot fit
            raise flag_error(e, "--calibrate") from None

    def one(out) -> None:
        try:
            res = run_validate(out, cfg, n_requests=w["requests"], rate=w["rate"], block_tokens=w["block_tokens"],
                               budget_ms=w["budget_ms"], session_sample=w["session_sample"],
                               session_seed=w["session_seed"], max_output_tokens=w["max_output_tokens"],
                               seed=rec.get("seed", 0), profile=profile, live_from=a.live_from, profile_b=a.profile_b)
        except RecordedRunError as e:  # a missing / malformed --live-from directory or --profile, another workload
            raise flag_error(e, f"--live-from {a.live_from}" if isinstance(e, WorkloadMismatch) else "--live-from") \
                from None
        print(format_validate(res))
        print(f"wrote {out}/validate.json")

    one(a.out)
    repeat = Path(a.out) / "repeat"
    if a.noise_floor:  # the same workload live again: a second held-out run, and the first's noise floor
        print(f"\nthe same workload run live again (--noise-floor) -> {repeat}")
        one(repeat)
    if a.calibrate:  # the goals, judged as `pdd sim validate-report` judges a held-out run
        from pdd.sim.heldout import format_report, held_out_report

        try:
            rep = held_out_report(Path(a.out) / "calibration", [a.out] + ([repeat] if a.noise_floor else []),
                                  (a.out, repeat) if a.noise_floor else None)
        except ValueError as e:  # e.g. the live run lost an instance: printed above with a WARNING
            print(f"not judged against the goals: {e}")
            return 0
        (Path(a.out) / "report.json").write_text(json.dumps(rep, indent=1, default=str))
        print(format_report(rep))
        print(f"wrote {a.out}/report.json (calibration run and fit: {a.out}/calibration, {profile})")
    return 0


def add_validate_parser(sim_subparsers) -> argparse.ArgumentParser:
    """Add ``validate`` to the ``pdd sim`` sub-commands (``sim_subparsers``)."""
    v = sim_subparsers.add_parser(
        "validate", help="one workload through the live topology and the simulator "
                         "(measured profile): TTFT/TPOT errors and decision match",
        description="Replay a Mooncake-trace slice through a live pdd topology (or reuse a recorded one with "
                    "--live-from) and through the simulator mirroring its config, then compare them request by "
                    "request. The simulator replays the requests at the times the live client sent them, and "
                    "applies the live-run fit a --profile written by `pdd sim calibrate-roles` carries (role step "
                    "scale and overheads, decode and prefill interference, P's dispatch delay and reply lag, WAN "
                    "send buffer, client delay, gateway RTT, fast path). docs/SIM.md \"Measure this machine and "
                    "validate the simulator\".")
    v.add_argument("--out", required=True, help="directory for validate.json, and for a live run its "
                                                "requests.jsonl and server_stats.json (made if missing)")
    v.add_argument("--config", default=None, help="cluster config (YAML/JSON); default: the embedded topology")
    v.add_argument("--port", type=int, default=None,
                   help="the live topology's gateway port (default: the config's, 8000; with neither --config nor "
                        "--base-port, a free block's)")
    v.add_argument("--base-port", type=int, default=None,
                   help="the live topology's instances use base_port .. base_port+99 (default: the config's, 18000; "
                        "with neither --config nor --port, a free block)")
    same = "; with --live-from, default: the run's own"
    v.add_argument("--requests", type=int, default=None, help="(220)" + same)
    v.add_argument("--rate", type=float, default=None, help="req/s, >= 0.001 (2.0)" + same)
    v.add_argument("--block-tokens", type=int, default=None, help="tokens per 512-token trace block (64)" + same)
    v.add_argument("--session-sample", type=int, default=None, help="keep 1 in N conversations of the trace (50)"
                   + same)
    v.add_argument("--session-seed", type=int, default=None, help="which conversations are kept (0)" + same)
    v.add_argument("--max-output-tokens", type=int, default=None, help="cap on output lengths (320)" + same)
    v.add_argument("--budget-ms", type=float, default=None, help="pipeline TTFT budget (P->MD if it fits; 250)"
                   + same)
    v.add_argument("--profile", default=None, help="a `pdd profile` JSON (default: measure now)")
    v.add_argument("--profile-b", default=None,
                   help="MD's step profile for the simulator when MD's tier runs other engine settings than "
                        "--profile measured (e.g. bf16): `pdd profile --config` with that tier's engine; the live "
                        "run does not read it (default: --profile)")
    v.add_argument("--calibrate", action="store_true",
                   help="first run the committed calibration workload live (150 requests at 1 req/s, session seed "
                        "1, outputs up to 64, budget 40 ms) into OUT/calibration, fit the live-run terms on it "
                        "(`pdd sim calibrate-roles`, over --profile or a bare profile measured now) into "
                        "OUT/fit.json, then run this workload judged with that fit: a same-day fit (about 3 "
                        "minutes more)")
    v.add_argument("--noise-floor", action="store_true",
                   help="with --calibrate: run this workload live a second time into OUT/repeat, judge both runs, "
                        "and compare the second with the first as the noise floor (about 2 minutes more for the "
                        "100-request runs)")
    v.add_argument("--live-from", default=None, help="reuse this validate output's live run and only re-simulate "
                                                    "(its workload arguments unless given; a flag given must match)")
    v.set_defaults(func=cmd_validate, parser=v)
    return v
