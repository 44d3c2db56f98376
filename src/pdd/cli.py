"""``pdd`` command line: make-model | serve | launch | certs | demo | bench | sim | plan."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pdd.cli_args import ShortUsageParser, config_or_exit as _config, usage_error as _usage


def ensure_model(cfg, prog: str = "pdd serve") -> None:
    """Write the configured random-weight checkpoint if the model directory has none and the
    path is the embedded default (``models/<preset>``); any other missing path, or a checkpoint
    the engine cannot use (:func:`pdd.engine.checkpoint.checkpoint_problem`), is a usage error
    naming ``model_path`` (exit 2, :func:`pdd.cli_args.missing_model_problem`)."""
    from pathlib import Path

    from pdd.cli_args import missing_model_problem, refuse

    if (Path(cfg.model_path) / "config.json").exists():
        from pdd.engine.checkpoint import checkpoint_problem

        # a config.json the engine cannot compute, a corrupted weights file, no tokenizer: refused
        # here, naming the file and field, before any instance starts
        bad = checkpoint_problem(cfg.model_path)
        if bad:
            refuse(prog, f"model_path {cfg.model_path}: {bad}")
        return
    missing = missing_model_problem(cfg)
    if missing:
        refuse(prog, missing)
    from pdd.modelgen import make_model

    print(f"pdd: writing a {cfg.model_preset} random-weight checkpoint to {cfg.model_path} (seed {cfg.model_seed})")
    make_model(cfg.model_path, preset=cfg.model_preset, seed=cfg.model_seed)


def vllm_md_refusal(cfg) -> str | None:
    """Why ``cfg``'s main-decode instances cannot run on vLLM (``vllm.main_decode``): its venv is
    missing or has no ``vllm`` package (:func:`pdd.vllm_tier.venv.vllm_python`,
    :func:`~pdd.vllm_tier.venv.check_vllm_importable`), as one line naming ``make vllm`` and
    ``vllm.python``; None when MD does not run on vLLM here (off, or a mode without MD) or the
    venv is there. Starts nothing but the interpreter's probe."""
    from pdd.topology import ROLE_MAIN, layout
    from pdd.vllm_tier.venv import VllmMissing, check_vllm_importable, vllm_python

    if not cfg.vllm.main_decode or not any(s.role == ROLE_MAIN for s in layout(cfg).instances):
        return None
    who = "vllm.main_decode (MD on vLLM)"
    try:
        check_vllm_importable(vllm_python(cfg.vllm.python, who=who, flag=None), who=who, knob="vllm.python")
    except VllmMissing as e:
        return str(e)
    return None


def _check_out_dir(args) -> None:
    """A usage error naming --out unless it is (or can be made, and is now) a writable directory,
    checked before the work (:func:`pdd.cli_args.out_dir_problem`)."""
    from pdd.cli_args import out_dir_problem

    bad = out_dir_problem(args.out, keep=True)
    if bad:
        _usage(args, bad)


_LIKE_SCALE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                     "max_positions", "original_max_positions", "sliding_window", "rope_scaling")


def _rmdir_made(path: str, existed: bool) -> None:
    """Remove ``path`` if this run made it (``existed`` False) and it is empty: a refused or failed
    ``pdd make-model`` leaves nothing behind, not even the empty --out directory."""
    if not existed:
        try:
            os.rmdir(path)
        except OSError:
            pass


def _write_failed(args, e: Exception, existed: bool) -> int:
    """Writing the checkpoint failed midway (:func:`pdd.modelgen.make_like` has removed the
    files it wrote): one line naming --out and the cause, exit status 1."""
    from pdd.cli_args import say

    _rmdir_made(args.out, existed)
    cause = e.strerror if isinstance(e, OSError) and e.strerror else (str(e) or type(e).__name__)
    say(f"{args.parser.prog}: error: --out {args.out}: writing the checkpoint failed: {cause}; "
        "the files this run wrote were removed")
    return 1


def cmd_make_model(args) -> int:
    from pdd.modelgen import make_like, make_model

    given = [f for f in _LIKE_SCALE_FLAGS if getattr(args, f) is not None]
    if args.like is None:
        if given:
            _usage(args, f"--{given[0].replace('_', '-')} shapes a --like checkpoint; give --like NAME")
        existed = os.path.exists(args.out)
        _check_out_dir(args)
        preset, family = args.preset or "small", args.family or "llama"
        try:
            make_model(args.out, preset=preset, seed=args.seed, family=family, tie_word_embeddings=args.tie_embeddings)
        except Exception as e:  # noqa: BLE001 - a full disk, ...: one line, not a traceback
            return _write_failed(args, e, existed)
        print(f"wrote {preset} {family} checkpoint to {args.out}")
        return 0
    for flag, val in (("--preset", args.preset), ("--family", args.family)):
        if val is not None:
            _usage(args, f"{flag} and --like exclude each other (--like takes the published config's family)")
    if args.tie_embeddings:
        _usage(args, "--tie-embeddings and --like exclude each other (--like keeps the published tie_word_embeddings)")
    scale = {f: getattr(args, f) for f in given if f != "vocab"}
    for f, v in scale.items():
        if f != "rope_scaling" and v < 1:
            _usage(args, f"--{f.replace('_', '-')} {v}: must be >= 1")
    if "rope_scaling" in scale:
        try:
            scale["rope_scaling"] = json.loads(scale["rope_scaling"])
        except json.JSONDecodeError as e:
            _usage(args, f"--rope-scaling: not JSON ({e.msg}); e.g. '{{\"rope_type\": \"yarn\", \"factor\": 4.0}}'")
        if scale["rope_scaling"] is not None and not isinstance(scale["rope_scaling"], dict):
            _usage(args, "--rope-scaling: expected a JSON object or null")
    existed = os.path.exists(args.out)
    _check_out_dir(args)
    try:
        make_like(args.out, args.like, seed=args.seed, vocab=1024 if args.vocab is None else args.vocab, **scale)
        from pdd.engine.config import ModelConfig

        cfg = ModelConfig.from_pretrained(args.out)
    except (ValueError, NotImplementedError) as e:
        _rmdir_made(args.out, existed)
        _usage(args, str(e))
    except Exception as e:  # noqa: BLE001 - a full disk, ...: one line, not a traceback
        return _write_failed(args, e, existed)
    print(f"wrote a {args.like}-shaped checkpoint ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, random weights) to {args.out}")
    return 0


def cmd_launch(args) -> int:
    from pdd.launch import run_instance

    from pathlib import Path

    from pdd.security import CERT_DIR_UNSET, SecurityError, needs_material
    from pdd.topology import ROLE_LINK, instance_ports_refusal, layout

    if getattr(args, "join", None) is not None:  # before anything starts: a typo is a usage error, not a late JOIN FAILED
        from pdd.cli_args import gateway_root
        from pdd.gateway.join import gateway_url_problem

        args.join = gateway_root(args.join)  # the ".../v1" pdd serve prints: the gateway's root
        bad = gateway_url_problem(args.join)
        if bad:
            _usage(args, f"--join: {bad}")
    cfg = _config(args)
    lay = layout(cfg)
    name = args.name  # main() gives the role's first instance by default (p0, rld0, ...)
    if name not in {s.name for s in lay.instances}:
        _usage(args, f"--name {name}: no instance of that name in the {cfg.mode} topology of the config; its "
                     f"instances: {', '.join(s.name for s in lay.instances)}")
    if lay.get(name).role != args.role:
        _usage(args, f"--name {name} is a {lay.get(name).role} instance, not {args.role} (--role)")
    if needs_material(cfg.security) and not cfg.security.cert_dir:
        _usage(args, CERT_DIR_UNSET)
    if lay.get(name).role != ROLE_LINK and not (Path(cfg.model_path) / "config.json").is_file():
        from pdd.cli_args import no_checkpoint_message

        _usage(args, no_checkpoint_message(cfg.model_path))
    taken = instance_ports_refusal(cfg, name)
    if taken:  # the bind failed later with a traceback (OSError: address already in use)
        _usage(args, taken)
    if lay.get(name).role != ROLE_LINK:
        from pdd.engine.checkpoint import checkpoint_problem

        bad = checkpoint_problem(cfg.model_path)
        if bad:  # was the instance's traceback (SafetensorError, the gateway's tokenizer, int('four'))
            _usage(args, f"model_path {cfg.model_path}: {bad}")
    if getattr(args, "join", None):
        if lay.get(name).role in (ROLE_LINK, "gateway"):
            _usage(args, "--join: only an engine instance (prefill, relay_decode, main_decode, colocated) joins")
        from pdd.gateway.join import join_when_ready

        join_when_ready(cfg, lay.get(name), args.join)  # in the background, once the instance listens
    from pdd.gateway.orchestrator import TierUnreachable

    try:
        stopped_by = run_instance(cfg, name)
    except SecurityError as e:  # a cert file missing or bad in security.cert_dir
        _usage(args, str(e))
    except TierUnreachable as e:  # the gateway launched alone: an instance of its layout never answered
        raise SystemExit(f"pdd launch: gateway: {e}")
    import signal

    # stopped cleanly by SIGHUP (its terminal closed): the shell's status for it, as pdd serve's
    return 128 + signal.SIGHUP if stopped_by == signal.SIGHUP else 0


def cmd_serve(args) -> int:
    from pdd.launch import Topology

    from pdd.cli_args import say, seconds_flag, stop_on_sigterm, stopped_status, stopping_message, with_cors_flags
    from pdd.launch import LaunchError
    from pdd.security import SecurityError
    from pdd.topology import ports_taken_refusal

    cfg = _config(args, gateway_port=args.port, mode=args.mode, base_port=args.base_port,
                  shutdown_timeout_s=seconds_flag(args, "--shutdown-timeout", args.shutdown_timeout),
                  tool_call_parser=args.tool_call_parser)
    cfg = with_cors_flags(args, cfg)  # browser access (CORS), vLLM's flags over the config's cors block
    unused = cfg.unused_settings()
    if unused:  # served all the same (a config may be shared by modes), but the user is told
        print(f"pdd: note: mode {cfg.mode} has no relay tier nor pipeline choice; it does not use {', '.join(unused)} "
              f"(pdd mode only)", file=sys.stderr)
    unused = cfg.unused_sections()
    if unused:  # tiers.prefill in colocated mode was ignored silently
        from pdd.config import instance_tier
        from pdd.topology import layout

        runs = [f"{s.name} (tier {instance_tier(s.name)})" for s in layout(cfg).instances if instance_tier(s.name)]
        print(f"pdd: note: mode {cfg.mode} runs {', '.join(runs)}; no instance of it uses {', '.join(unused)}",
              file=sys.stderr)
    if getattr(args, "autoscale", False):  # the planner in the loop (docs/SERVE.md "Autoscaling")
        from pydantic import ValidationError

        from pdd.config import ClusterConfig, validation_summary

        try:
            cfg = ClusterConfig.model_validate({**cfg.model_dump(), "autoscale": {**cfg.autoscale.model_dump(),
                                                                                  "enabled": True}})
        except ValidationError as e:
            _usage(args, f"--autoscale: invalid config: {validation_summary(e)}")
    taken = ports_taken_refusal([cfg], "pdd serve")
    if taken:  # one line naming the ports and their users, exit 2, as pdd demo and pdd bench refuse
        _usage(args, taken)
    missing = vllm_md_refusal(cfg)
    if missing:  # md0 refused it only after P and RLD had started; pdd bench checks up front too
        _usage(args, missing)
    ensure_model(cfg)

    stop_on_sigterm()  # SIGTERM (systemd, docker, k8s) or SIGHUP (its terminal closed): shut down like Ctrl-C
    try:
        topo = Topology(cfg, log_dir=args.log_dir)
    except SecurityError as e:
        _usage(args, str(e))
    try:  # the log dir first: the one path serve creates, so an OSError here is about it
        topo.log_dir.mkdir(parents=True, exist_ok=True)
        (topo.log_dir / ".write-test").touch()
        (topo.log_dir / ".write-test").unlink()
    except OSError as e:
        _usage(args, f"--log-dir {topo.log_dir}: cannot create or write the log directory: {e.strerror or e}")
    try:
        topo.start()
    except LaunchError as e:
        raise SystemExit(f"pdd: could not start the topology: {e}")
    except SecurityError as e:  # security.cert_dir lacks what it needs (no CA key to issue a certificate)
        _usage(args, str(e))
    except KeyboardInterrupt as ex:  # Ctrl-C or SIGTERM while starting: start() stopped what it started
        return stopped_status("pdd serve", ex)
    try:
        print(f"pdd ({cfg.mode}) serving at {topo.url}/v1  (logs in {topo.log_dir}); Ctrl-C stops")
        return _supervise(topo)
    except KeyboardInterrupt as ex:  # Ctrl-C, SIGTERM or SIGHUP: 130 / 143 / 129, one line once the instances exited
        say(stopping_message("pdd serve", ex, cfg.shutdown_timeout_s))
        try:
            topo.stop()  # the gateway drains first, then the instances stop
        except KeyboardInterrupt as again:  # a second Ctrl-C / SIGTERM: everything was killed at once
            ex = again
        return stopped_status("pdd serve", ex)
    finally:
        topo.stop()  # (a no-op after the one above)


SUPERVISE_MAX_RESTARTS = 5  # restarts of one instance within SUPERVISE_WINDOW_S before giving up
SUPERVISE_WINDOW_S = 60.0


def _supervise(topo, poll_s: float = 0.5) -> int:
    """Keep ``pdd serve``'s topology up: an instance that exits (crash, OOM kill, SIGKILL) is
    started again alone, and the others keep serving meanwhile (the gateway recovers or degrades
    its in-flight requests and routes around it until it rejoins: docs/FAULTS.md). An instance
    that exits more than ``SUPERVISE_MAX_RESTARTS`` times within ``SUPERVISE_WINDOW_S`` seconds
    is crash-looping: the whole topology stops and 1 is returned. A restart that dies before it
    is ready counts as one more exit (a new user killed md0 again while it restarted, and the
    whole topology went down with a traceback)."""
    from pathlib import Path

    from pdd.launch import LaunchError
    from pdd.spawn import note_stop

    restarts: dict[str, list[float]] = {}
    while True:
        time.sleep(poll_s)
        for name, proc in list(topo.procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            now = time.monotonic()
            recent = [t for t in restarts.get(name, []) if now - t < SUPERVISE_WINDOW_S] + [now]
            restarts[name] = recent
            if len(recent) > SUPERVISE_MAX_RESTARTS:
                print(f"pdd: {name} exited {len(recent)} times in {SUPERVISE_WINDOW_S:.0f} s (last exit code "
                      f"{rc}); stopping (logs in {topo.log_dir})", file=sys.stderr)
                note_stop(Path(topo.log_dir) / f"{name}.log", len(recent), SUPERVISE_WINDOW_S, rc)
                return 1
            print(f"pdd: {name} exited (code {rc}); restarting it, the rest keep serving (its log: "
                  f"{Path(topo.log_dir) / f'{name}.log'})", file=sys.stderr)
            try:
                topo.restart(name)
            except LaunchError as e:  # it died again before it was ready: one more exit, seen at the next poll
                print(f"pdd: {name} did not come back ({str(e).splitlines()[0]}); trying again", file=sys.stderr)


def cmd_certs(args) -> int:
    from pdd.security import SecurityError, ensure_topology_certs

    cfg = _config(args, mode=args.mode)
    _check_out_dir(args)
    try:
        rep = ensure_topology_certs(cfg, args.out, force=args.force)
    except SecurityError as e:  # --out holds a CA certificate without its key: bad input, as every refusal
        _usage(args, f"--out {e}")
    except OSError as e:  # what the check cannot see (a full disk)
        _usage(args, f"--out {args.out}: cannot write the certificates: {e.strerror or e}")
    print(f"certificates for the {cfg.mode} topology in {rep['dir']}: CA {rep['ca']}, "
          f"issued {', '.join(rep['issued']) or 'none'}, kept {', '.join(rep['kept']) or 'none'}, "
          f"fast-path key {rep['fast_path_key']}")
    print(f"use them with security.cert_dir: {rep['dir']}")
    return 0


def cmd_demo(args) -> int:
    from pdd.bench.demo import main as demo_main

    return demo_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = ShortUsageParser(prog="pdd", description="Cross-datacenter Prefill / RelayDecode / MainDecode serving")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-model", help="write a deterministic random-weight HF-format checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--preset", choices=["tiny", "small"], default=None, help="size without --like (default small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=["llama", "qwen2", "qwen3"], default=None,
                   help="architecture without --like: llama (default), qwen2 (q/k/v biases) or qwen3 (q/k norms)")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="tie the LM head to the input embeddings (no lm_head.weight in the checkpoint)")
    from pdd.families import LIKE_NAMES

    g = p.add_argument_group("--like: the published config.json of a real model, sizes scaled down "
                             "(family features kept: rope scaling, q/k norms, biases, tied embeddings, window)")
    g.add_argument("--like", choices=LIKE_NAMES, default=None)
    g.add_argument("--layers", type=int, help="num_hidden_layers (default 2)")
    g.add_argument("--hidden", type=int, help="hidden_size (default 128)")
    g.add_argument("--heads", type=int, help="num_attention_heads (default 4)")
    g.add_argument("--kv-heads", type=int, help="num_key_value_heads (default 2 under GQA)")
    g.add_argument("--head-dim", type=int, help="head_dim (default keeps the published head_dim*heads/hidden)")
    g.add_argument("--intermediate", type=int, help="intermediate_size (default keeps the published ratio)")
    g.add_argument("--vocab", type=int, help="synthetic BPE entries, before the family's special tokens (default 1024)")
    g.add_argument("--max-positions", type=int, help="max_position_embeddings (default: published)")
    g.add_argument("--original-max-positions", type=int,
                   help="rope_scaling.original_max_position_embeddings (default: published)")
    g.add_argument("--sliding-window", type=int, help="sliding_window (Mistral; default: published)")
    g.add_argument("--rope-scaling", help="rope_scaling as JSON, replacing the published one ('null' removes it)")
    p.set_defaults(fn=cmd_make_model, parser=p)

    p = sub.add_parser("launch", help="start one instance of a topology",
                       description="Start one instance (P, RLD, MD, colocated engine, gateway or WAN link) of the "
                                   "topology described by --config; it prints READY <name> when it serves.")
    p.add_argument("--role", required=True,
                   choices=["prefill", "relay_decode", "main_decode", "colocated", "gateway", "link"])
    p.add_argument("--name", help="instance name in the topology (default: the role's first, p0, rld0, md0, c0, "
                   "gateway or link)")
    p.add_argument("--config", help="cluster config (YAML or JSON)")
    p.add_argument("--join", metavar="GATEWAY_URL",
                   help="once this instance listens, add it to the running gateway at GATEWAY_URL "
                        "(http://host:port, a trailing /v1 dropped; POST /pdd/instances; the API key: "
                        "PDD_API_KEY or the config's first; docs/SERVE.md)")
    _add_log_level(p)
    p.set_defaults(fn=cmd_launch, parser=p)

    p = sub.add_parser("serve", help="start the whole two-datacenter topology and keep the gateway up")
    p.add_argument("--config", help="cluster config (YAML or JSON; default: the embedded topology, docs/SERVE.md)")
    p.add_argument("--port", type=int, default=None, help="gateway HTTP port (default 8000)")
    p.add_argument("--base-port", type=int, default=None,
                   help="the instances use base_port .. base_port+99 (default 18000); another for a second topology")
    p.add_argument("--mode", choices=["colocated", "same_dc_pd", "cross_dc_pd", "pdd"], default=None,
                   help="the topology to serve (default: the config's mode, pdd)")
    p.add_argument("--log-dir", default=None,
                   help="logs and TLS material (default: a new /tmp/pdd-<mode>-* directory, kept after exit)")
    p.add_argument("--shutdown-timeout", metavar="SECONDS", default=None,
                   help="on Ctrl-C / SIGTERM, seconds requests in flight may still finish (new ones get 503) "
                        "before they end with an error; 0 ends them at once (default: the config's "
                        "shutdown_timeout_s, 30); a second Ctrl-C stops at once")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json", "mistral", "none"], default=None,
                   help="how chat parses tool calls (tools with tool_choice auto) out of the text, as vLLM's flag: "
                        "hermes (Qwen2.5 / Qwen3), llama3_json (Llama 3.1+), mistral, none (refused); auto: the "
                        "checkpoint family's (default: the config's tool_call_parser, auto)")
    g = p.add_argument_group("browser access (CORS; the config's cors block, vLLM's flags and defaults)")
    g.add_argument("--allowed-origins", metavar="JSON", default=None,
                   help="origins whose pages may call the gateway, a JSON list: '[\"https://app.example.com\"]', "
                        "'[\"*\"]' for any (default: none)")
    g.add_argument("--allow-credentials", action="store_true", help="let those pages send cookies / HTTP auth")
    g.add_argument("--allowed-methods", metavar="JSON", default=None, help="methods they may use (default '[\"*\"]')")
    g.add_argument("--allowed-headers", metavar="JSON", default=None, help="headers they may send (default '[\"*\"]')")
    p.add_argument("--autoscale", action="store_true",
                   help="run the autoscaling loop in the gateway: the config's autoscale block (interval_s, "
                        "cooldown_s, min, max per role) over its standby slots; GET /pdd/autoscale logs each decision")
    _add_log_level(p)
    p.set_defaults(fn=cmd_serve, parser=p)

    p = sub.add_parser("certs", help="make a CA, per-instance TLS certificates and the fast-path MAC key for a topology",
                       description="Make (or complete) a cert dir for the topology of --config: ca.pem/ca.key, "
                                   "<instance>.pem/.key for every engine and the gateway, fastpath.key. Existing "
                                   "files are kept unless --force. Point security.cert_dir at it.")
    p.add_argument("--config", help="cluster config (YAML or JSON)")
    p.add_argument("--mode", choices=["colocated", "same_dc_pd", "cross_dc_pd", "pdd"], default=None)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--force", action="store_true", help="make a new CA and everything anew")
    p.set_defaults(fn=cmd_certs, parser=p)

    p = sub.add_parser("demo", help="replay the Mooncake trace through every mode and compare (pdd demo --help)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_demo)
    sub.add_parser("bench", help="benchmark modes side by side on a trace, SLO goodput, rate sweep (pdd bench --help)",
                   add_help=False)

    try:
        from pdd.sim.cli import add_plan_parser, add_profile_parser, add_sim_parser

        try:  # `pdd sim validate` runs the live topology through the bench client
            from pdd.bench.live_validate import add_validate_parser
        except ImportError:
            add_validate_parser = None
        add_sim_parser(sub, add_validate=add_validate_parser)
        add_profile_parser(sub)
        add_plan_parser(sub)
        # `pdd workload agentic` (issue wording) is the simulator's generator under its own name
        w = sub.add_parser("workload", help="generate workloads (Mooncake-format JSONL)")
        wsub = w.add_subparsers(dest="workload_cmd", required=True)
        from pdd.sim.cli import GENERATED, NONNEG_INT, RATE, cmd_agentic

        g = wsub.add_parser("agentic", help="agentic multi-turn workload calibrated to the PDD report; prints the "
                                            "seven-bin prefix-hit histogram")
        g.add_argument("--n", "--requests", dest="n", type=GENERATED, default=5000)
        g.add_argument("--rate", type=RATE, default=2.0,
                       help="mean arrivals, requests/s (>= 0.001: one request per 1000 s on average)")
        g.add_argument("--seed", type=NONNEG_INT, default=0)
        g.add_argument("--out", default=None)
        g.set_defaults(func=cmd_agentic, parser=g)
    except ImportError:
        pass
    return ap


def _deepest_parser(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The sub-command parser ``argv`` reaches from ``ap`` (``pdd sim run ...``: sim run's)."""
    for tok in argv:
        subs = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and tok in subs[0].choices:
            ap = subs[0].choices[tok]
    return ap


def _log_level_flag(value: str) -> str:
    """``--log-level``'s type: a log level in any case, upper-cased (argparse names the flag in
    its refusal)."""
    from pdd.logs import level_problem

    bad = level_problem(value)
    if bad:
        raise argparse.ArgumentTypeError(bad)
    from pdd.logs import level_name

    return level_name(value)


def _add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", type=_log_level_flag, default=None, metavar="LEVEL",
                   help="pdd's log lines shown, in this process and the ones it starts: DEBUG, INFO, WARNING, "
                        "ERROR or CRITICAL (default: $PDD_LOG_LEVEL, else INFO)")


def _configure_logging(level: str | None = None) -> None:
    """pdd's log format and level for this process (:func:`pdd.logs.configure_logging`); a
    ``level`` given (``--log-level``) is also put in ``PDD_LOG_LEVEL`` for the processes it starts
    (``pdd serve --log-level DEBUG`` reaches its instances). Raises ValueError naming
    ``PDD_LOG_LEVEL`` when that holds no log level."""
    import os

    from pdd.logs import LEVEL_ENV, configure_logging

    set_level = configure_logging(level)
    if level is not None:
        os.environ[LEVEL_ENV] = set_level


def main(argv: list[str] | None = None) -> int:
    """``pdd``'s entry: run the subcommand ``argv`` names (default ``sys.argv[1:]``) and return
    its exit status. A Ctrl-C (KeyboardInterrupt) or a :class:`pdd.cli_args.Stopped` that the
    subcommand did not handle itself (``pdd plan``, ``pdd sim run``, ``pdd profile`` ...) is one
    line on stderr, ``pdd plan: interrupted`` (``stopped by SIGTERM`` for a Stopped), and the
    shell's status 128 + signal (130 for SIGINT), not a traceback of wherever it landed.
    ``pdd serve`` and ``pdd bench`` stop their topologies and return their own status first."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt as ex:
        return _interrupted(argv, ex)


def _interrupted(argv: list[str], ex: KeyboardInterrupt) -> int:
    """One line naming the subcommand ``argv`` reaches and how it was stopped; 128 + signal."""
    import signal

    from pdd.cli_args import say

    try:
        prog = _deepest_parser(build_parser(), argv).prog
    except Exception:  # noqa: BLE001 - the line must still be printed
        prog = "pdd"
    signum = getattr(ex, "signum", signal.SIGINT)
    say(f"{prog}: interrupted" if signum == signal.SIGINT else f"{prog}: stopped by {signal.Signals(signum).name}")
    return 128 + signum


def _main(argv: list[str]) -> int:
    try:
        _configure_logging()  # from PDD_LOG_LEVEL; --log-level below overrides it
        env_problem = None
    except ValueError as e:  # a bad PDD_LOG_LEVEL: refused below unless --log-level replaces it (or --help)
        from pdd.logs import configure_logging

        env_problem = f"pdd: {e}"
        configure_logging("INFO")  # meanwhile (the variable left as it is: not passed on as INFO)
    if env_problem and argv and argv[0] in ("demo", "bench") and not {"-h", "--help"} & set(argv):
        print(env_problem, file=sys.stderr)  # they take no --log-level: one line, exit 2 as a bad flag's value
        return 2
    if argv and argv[0] == "demo":  # the demo owns its flags (pdd demo --help)
        from pdd.bench.demo import main as demo_main

        return int(demo_main(argv[1:]) or 0)
    if argv and argv[0] == "bench":  # so does the benchmark (pdd bench --help)
        try:
            from pdd.bench.bench import main as bench_main
        except ImportError as e:
            raise SystemExit(f"pdd bench is not available: {e}")
        return int(bench_main(argv[1:]) or 0)
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # refused by the sub-command's parser, which names itself (pdd sim run), not pdd's
        _deepest_parser(ap, argv).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "launch" and not args.name:
        from pdd.topology import ROLE_LINK

        names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0", "colocated": "c0", "gateway": "gateway",
                 ROLE_LINK: "link"}
        args.name = names[args.role]
    if getattr(args, "log_level", None):
        _configure_logging(args.log_level)
    elif env_problem:
        print(env_problem, file=sys.stderr)
        return 2
    if getattr(args, "fn", None) is None:  # the simulator's parsers use func (and UsageError: exit 2)
        from pdd.sim.cli import run_command

        return int(run_command(args, ap) or 0)
    return int(args.fn(args) or 0)


def exit_now(code: int) -> None:
    """End this process with ``code`` once its output is flushed, skipping the interpreter's
    teardown (``os._exit``): an engine instance or gateway that has stopped cleanly spent about
    a second more tearing down torch's and pdd's modules (no syscalls: pure CPU), which every
    topology stop (``pdd serve``'s Ctrl-C, a test's teardown) waited for. Only for processes a
    topology starts (``python -m pdd.cli launch``, ``pdd.spawn``): pdd registers no atexit work."""
    import logging
    import os

    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed or hung-up stream: nothing more to write
            pass
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if len(sys.argv) > 1 and sys.argv[1] == "launch":
        exit_now(status)
    sys.exit(status)
