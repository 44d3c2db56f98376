#!/usr/bin/env python3
"""`pdd bench` and NVIDIA's aiperf on the same workload against the same gateway.

    make aiperf                                   # aiperf in .venv-aiperf (once)
    python scripts/aiperf_compare.py --out runs/aiperf --mode pdd -- --requests 40 --rate 1
    python scripts/aiperf_compare.py --out runs/aiperf --url http://127.0.0.1:8000 -- --requests 40

Everything after `--` is `pdd bench` workload flags (`--trace`, `--requests`, `--rate`,
`--session-sample`, `--block-tokens`, `--output-scale`, `--max-output`, `--config`, `--slo`,
...). Steps: start `pdd serve --mode MODE` (unless `--url`); `pdd bench --url` on the workload
(warm-up, flush, the replay, flush); the same requests (`pdd.bench.aiperf.bench_requests`: same
prompt token ids, output lengths and send times) written as an aiperf Mooncake trace with
`payload` records and replayed by `aiperf profile --fixed-schedule` on flushed caches; `pdd bench`
once more (run 2: the run-to-run noise the clients' ratio is read against; `--no-rerun` skips
it). Writes OUT/compare.md and OUT/compare.json (table, both clients' summaries, per-request TTFT
pairing, commands) beside each client's own output (OUT/pdd_bench, OUT/aiperf, OUT/pdd_bench_run2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    import httpx

    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"pdd serve exited with status {proc.returncode} before it was healthy")
        try:
            r = httpx.get(f"{url}/health", timeout=2.0, trust_env=False)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url}/health not ok after {timeout_s:.0f} s")


CPU_S: dict[str, float] = {}  # CPU seconds of each client run (its whole process tree, once it exited)


def _run(cmd: list[str], log: Path, env=None, name: str = "") -> int:
    import resource

    print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S[name or cmd[0]] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="aiperf_compare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/aiperf")
    ap.add_argument("--mode", default="pdd", choices=("colocated", "same_dc_pd", "cross_dc_pd", "pdd"),
                    help="the mode of the `pdd serve` this starts (not with --url)")
    ap.add_argument("--url", default=None, help="a running gateway instead of starting one")
    ap.add_argument("--aiperf", default=str(ROOT / ".venv-aiperf" / "bin" / "aiperf"),
                    help="the aiperf executable (`make aiperf` installs .venv-aiperf)")
    ap.add_argument("--min-step-ms", type=float, default=None,
                    help="the started server's emulated accelerator step (engine.min_step_ms; not with --url)")
    ap.add_argument("--no-rerun", action="store_true", help="skip the second pdd bench run (noise)")
    ap.add_argument("--serve-timeout", type=float, default=300.0)
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild compare.md / compare.json from the files in --out")
    a = ap.parse_args(argv)
    if a.report_only:
        out = Path(a.out).resolve()
        if not a.out.strip() or not out.is_dir():  # a traceback reading its files once
            print(f"{ap.prog}: error: --out {a.out!r}: not a directory of an earlier run (--report-only rebuilds "
                  "the comparison from its files)", file=sys.stderr)
            return 2
        try:
            meta = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {
                "requests": len(_jsonl(out / "aiperf_input.jsonl")), "url": None, "slo": None}
            text = write_comparison(out, meta)
        except FileNotFoundError as e:  # a directory without an earlier run's files
            print(f"{ap.prog}: error: --out {a.out!r}: {Path(e.filename).name} missing: not a directory of an "
                  "earlier run (--report-only rebuilds the comparison from its files)", file=sys.stderr)
            return 2
        print(text)
        return 0

    from pdd.bench import aiperf as A

    if any(x == "--url" or x.startswith("--url=") for x in bench_args):
        ap.error("give --url before `--` (it is this script's, passed on to pdd bench)")
    if not any(x == "--slo" or x.startswith("--slo=") for x in bench_args):
        bench_args += ["--slo", "ttft:2000", "tpot:200"]  # absolute: no reference run, the same SLO for aiperf
    A.check_workload(bench_args)  # --rate 1e-9 started pdd serve, then a replay that never ended
    if not Path(a.aiperf).exists():
        print(f"aiperf not found at {a.aiperf}: run `make aiperf` (or give --aiperf)", file=sys.stderr)
        return 2
    if a.min_step_ms is not None and a.url:
        ap.error("--min-step-ms: the server at --url runs its own config")
    if not 0 < a.serve_timeout < float("inf"):  # NaN too: the wait for /health never ran, then failed
        print(f"{ap.prog}: error: --serve-timeout: must be a finite number of s > 0, got {a.serve_timeout}",
              file=sys.stderr)
        return 2
    serve_cfg = None
    try:  # before anything starts: a wrong name made every request of both clients a 404
        if a.url is not None:
            _wait_health(a.url, None, a.serve_timeout)  # a server still starting is waited for, as before
        A.check_model(bench_args, a.url)
        if a.min_step_ms is not None:  # the started server's config (--config's, checked above) with it
            import pydantic

            from pdd.bench.modes import apply_overrides
            from pdd.config import ClusterConfig

            i = bench_args.index("--config") if "--config" in bench_args else None
            try:
                serve_cfg = apply_overrides(ClusterConfig.load(bench_args[i + 1] if i is not None else None),
                                            min_step_ms=a.min_step_ms)
            except pydantic.ValidationError as ex:  # a traceback once --out was made
                raise ValueError(f"--min-step-ms {a.min_step_ms}: {ex.errors()[0]['msg']}") from None
    except (RuntimeError, ValueError) as ex:
        print(f"{ap.prog}: error: {ex}", file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if serve_cfg is not None:
        (out / "serve_config.json").write_text(serve_cfg.model_dump_json(indent=1))
        if i is not None:
            del bench_args[i:i + 2]
        bench_args += ["--config", str(out / "serve_config.json")]
    env = dict(os.environ)
    py = sys.executable
    server = None
    url = a.url
    cmds: dict[str, str] = {}
    try:
        if url is None:
            from pdd.topology import free_port_block

            port, base = _free_port(), free_port_block(100)
            url = f"http://127.0.0.1:{port}"
            cfg_flag = []
            if "--config" in bench_args:
                cfg_flag = ["--config", bench_args[bench_args.index("--config") + 1]]
            cmd = [py, "-m", "pdd.cli", "serve", "--mode", a.mode, "--port", str(port), "--base-port", str(base),
                   "--log-dir", str(out / "serve-logs"), *cfg_flag]
            cmds["serve"] = shlex.join(cmd)
            print("$ " + cmds["serve"], file=sys.stderr, flush=True)
            server = subprocess.Popen(cmd, stdout=(out / "serve.log").open("w"), stderr=subprocess.STDOUT,
                                      cwd=ROOT, env=env, start_new_session=True)
        _wait_health(url, server, a.serve_timeout)

        requests, scale, config = A.bench_requests([*bench_args, "--url", url])
        model = config.served_model_name
        A.write_jsonl(out / "aiperf_input.jsonl", A.aiperf_trace(requests, model))

        def bench(d: str) -> dict:
            cmd = [py, "-m", "pdd.cli", "bench", "--url", url, "--out", str(out / d), "--sweep-rate", "none",
                   "--no-progress", *bench_args]
            cmds[d] = shlex.join(cmd)
            rc = _run(cmd, out / f"{d}.console.txt", env, d)
            if rc != 0:
                raise RuntimeError(f"pdd bench exited {rc}: see {out / (d + '.console.txt')}")
            return json.loads((out / d / "report.json").read_text())

        report1 = bench("pdd_bench")
        recs1 = [json.loads(x) for x in (out / "pdd_bench" / "requests.jsonl").read_text().splitlines() if x.strip()]
        mine = sorted((r.idx, r.input_tokens, int(r.max_tokens), round(r.arrival_s, 6)) for r in requests)
        theirs = sorted((r["idx"], r["prompt_tokens"], r["max_tokens"], round(r["arrival_s"], 6)) for r in recs1)
        if mine != theirs:
            raise RuntimeError("the aiperf input is not pdd bench's workload (idx, prompt, max_tokens, arrival differ)")

        from pdd.bench.live import RemoteTopology

        with RemoteTopology(url) as remote:
            remote.flush()  # pdd bench flushed after its run; aiperf starts on empty caches too
        slo = report1.get("slo") or {}
        slo_ms = {"ttft_ms": slo.get("ttft_ms"), "tpot_ms": slo.get("tpot_ms")}
        tok = Path(config.model_path)
        cmd = A.aiperf_command(a.aiperf, url, model, out / "aiperf_input.jsonl", out / "aiperf",
                               tok if tok.is_absolute() else ROOT / tok, slo_ms, config.request_timeout_s)
        cmds["aiperf"] = shlex.join(cmd)
        t0 = time.monotonic()
        rc = _run(cmd, out / "aiperf.console.txt", env, "aiperf")
        aiperf_wall = time.monotonic() - t0
        if rc != 0 or not (out / "aiperf" / "profile_export_aiperf.json").exists():
            raise RuntimeError(f"aiperf exited {rc}: see {out / 'aiperf.console.txt'}")
        report2 = None if a.no_rerun else bench("pdd_bench_run2")
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)

    meta = {"url": url, "requests": len(requests), "bench_args": bench_args, "commands": cmds,
            "aiperf_wall_s": aiperf_wall, "slo": slo_ms, "client_cpu_s": dict(CPU_S)}
    (out / "run.json").write_text(json.dumps(meta, indent=1))
    print(write_comparison(out, meta))
    return 0


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def write_comparison(out: Path, meta: dict) -> str:
    """Read the three runs' files in ``out``; write compare.md / compare.json; return the text."""
    from pdd.bench import aiperf as A

    report1 = json.loads((out / "pdd_bench" / "report.json").read_text())
    recs1 = _jsonl(out / "pdd_bench" / "requests.jsonl")
    rerun = out / "pdd_bench_run2" / "report.json"
    report2 = json.loads(rerun.read_text()) if rerun.exists() else None
    url = meta.get("url")
    slo_ms = meta.get("slo") or {k: (report1.get("slo") or {}).get(k) for k in ("ttft_ms", "tpot_ms")}
    p1 = A.pdd_summary(report1)
    p1["client"] = A.pdd_send_lag(recs1)
    ai = A.read_aiperf_summary(out / "aiperf")
    p2 = A.pdd_summary(report2) if report2 else None
    rows = A.comparison_rows(p1, ai, p2)
    per1 = A.pdd_per_request(recs1)
    per_ai = A.read_aiperf_records(out / "aiperf")
    paired = {"aiperf_vs_pdd_bench": A.paired_ttft(per1, per_ai)}
    if report2:
        paired["pdd_bench_run2_vs_run1"] = A.paired_ttft(per1, A.pdd_per_request(_jsonl(out / "pdd_bench_run2" / "requests.jsonl")))
    table = A.format_table(rows)
    mode = next(iter(report1["modes"]))
    head = (f"{meta.get('requests')} requests, mode {mode}, {url}; completed: pdd bench {p1['completed']}, "
            f"aiperf {ai['completed']:.0f} (errors {ai['errors']})"
            + (f", pdd bench run 2 {p2['completed']}" if p2 else "")
            + f"; goodput (SLO {slo_ms}) pdd bench {p1['goodput_rps']}, aiperf {ai['goodput_rps']} req/s")

    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    lines = [head, "", table, "",
             f"send lag against the schedule, P50 / P90 ms: pdd bench {ms(p1['client']['send_lag_p50_ms'])} / "
             f"{ms(p1['client']['send_lag_p90_ms'])}, aiperf {ms(ai['client']['send_lag_p50_ms'])} / "
             f"{ms(ai['client']['send_lag_p90_ms'])} (aiperf: connect avg {ms(ai['client']['connect_avg_ms'])} ms, "
             f"connections reused {ai['client']['connection_reused']})"]
    if meta.get("client_cpu_s"):
        lines.append("client CPU seconds (whole process tree, start-up included): " + ", ".join(
            f"{k} {v:.1f}" for k, v in meta["client_cpu_s"].items()))
    cl = A.contentless_tokens(per_ai)
    lines.append(f"tokens whose chunk aiperf did not time (empty text): {cl['untimed']} of {cl['tokens']}")
    for k, v in paired.items():
        if v:
            lines.append(f"per-request TTFT {k}: n {v['n']}, median {100 * v['median_rel']:+.1f}%, "
                         f"P90 |rel| {100 * v['p90_abs_rel']:.1f}%, median |diff| {v['median_abs_ms']:.1f} ms")
    text = "\n".join(lines)
    (out / "compare.md").write_text(text + "\n")
    res = {"git_commit": report1.get("git_commit"), "aiperf_version": ai.get("aiperf_version"), "url": url,
           "mode": mode, **{k: v for k, v in meta.items() if k not in ("url",)}, "rows": rows,
           "pdd_bench": p1, "aiperf": ai, "pdd_bench_run2": p2, "per_request_ttft": paired, "aiperf_untimed_tokens": cl,
           "within_10pct": A.within(rows)}
    (out / "compare.json").write_text(json.dumps(res, indent=1))
    return text


if __name__ == "__main__":
    sys.exit(main())
