"""Demo end to end against a fake topology, plots, scale fitting."""

import json
from pathlib import Path

import pytest
from rich.console import Console

from bench_fakes import FakeTopology
from pdd.bench.demo import run_demo
from pdd.bench.plots import plot_token_timeline, plot_ttft_cdf, timeline_title
from pdd.bench.report import read_jsonl, recompute_report
from pdd.workload.replay import Scale, fit_scale
from pdd.config import ClusterConfig, EngineConfig


def fake_model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": 1024, "bos_token_id": 0, "eos_token_id": 1}))
    tok = {"added_tokens": [{"id": i, "content": f"<{i}>"} for i in range(16)],
           "model": {"vocab": {f"t{i}": i for i in range(1024)}}}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


def test_fit_scale():
    cfg = ClusterConfig(engine=EngineConfig(max_model_len=1000, max_input_len=950))
    s = fit_scale(Scale(max_output_tokens=96), cfg, 12, 3)
    assert (s.max_input_tokens, s.count, s.start) == (904, 12, 3)
    assert fit_scale(Scale(max_input_tokens=100), cfg, None, None).max_input_tokens == 100


def test_run_demo_with_fake_topology(tmp_path, server_url):
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    FakeTopology.started.clear()
    out = tmp_path / "demo"
    scale = Scale(block_tokens=4, output_scale=1 / 100, min_output_tokens=2, max_output_tokens=5, target_rate_rps=50)
    report = run_demo(out, ("cross_dc_pd", "pdd"), 6, scale, cfg, seed=1, request_timeout_s=10, progress=False,
                      console=Console(file=open(tmp_path / "console.txt", "w"), width=160),
                      topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    assert FakeTopology.started == ["cross_dc_pd", "pdd"]
    recs = read_jsonl(out / "requests.jsonl")
    assert len(recs) == 12 and {r["mode"] for r in recs} == {"cross_dc_pd", "pdd"}
    assert all(r["ok"] and len(r["token_times_s"]) == r["max_tokens"] for r in recs)
    saved = json.loads((out / "report.json").read_text())
    assert saved["modes"] == recompute_report(out / "requests.jsonl")
    assert saved == json.loads(json.dumps(report))
    pdd = saved["modes"]["pdd"]
    assert pdd["completed"] == 6 and pdd["failed"] == 0 and pdd["leaked_pages"] == 0
    # stats taken once after warm-up (calls=1) and once after the replay (calls=2)
    assert pdd["wan_line_bytes"] == 1000 and pdd["cpu_seconds"] == pytest.approx(1.25)
    assert saved["workload"]["requests"] == 6 and saved["workload"]["scale"]["block_tokens"] == 4
    assert saved["link"]["wan_gbps"] == cfg.link.wan_gbps and saved["seed"] == 1
    for name in ("ttft_cdf.png", "timeline_pdd.png", "server_stats.json"):
        assert (out / name).stat().st_size > 0
    assert saved["output_agreement"]["modes"]["pdd"] == {"compared": 6, "identical": 6, "diverged": []}
    text = (tmp_path / "console.txt").read_text()
    assert "TTFT P90" in text
    # every file written, not only requests.jsonl, report.json and ttft_cdf.png
    assert (f"wrote {out}/requests.jsonl, {out}/server_stats.json, {out}/report.json, {out}/ttft_cdf.png, "
            f"{out}/timeline_cross_dc_pd.png, {out}/timeline_pdd.png\n") in text


def test_plots(tmp_path):
    recs = [
        {"mode": m, "idx": i, "ok": True, "send_s": 0.1 * i, "end_s": 0.1 * i + 0.5,
         "token_times_s": [0.1 * i + 0.05 * (k + 1) + (0.2 if m == "cross_dc_pd" else 0) for k in range(5)],
         "tiers": ["rld", "rld", "md", "md", "md"] if m == "pdd" else ["md"] * 5}
        for m in ("pdd", "cross_dc_pd") for i in range(8)
    ]
    recs.append({"mode": "pdd", "idx": 99, "ok": False, "send_s": 0.0, "end_s": 1.0, "token_times_s": [], "tiers": []})
    for p in (plot_ttft_cdf(recs, tmp_path / "cdf.png"), plot_token_timeline(recs, tmp_path / "tl.png")):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_cli_refuses_taken_ports_and_bad_configs(capsys, tmp_path):
    """``pdd demo --port/--base-port`` (found by a new user: the demo had only the config's ports)."""
    import socket

    from pdd.bench.demo import main
    from pdd.topology import free_port_block

    base = free_port_block()  # other topologies may run on this machine (CI beside a pdd serve)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    taken = s.getsockname()[1]
    try:
        with pytest.raises(SystemExit) as ex:
            main(["--port", str(taken), "--base-port", str(base), "--out", str(tmp_path / "d")])
        assert ex.value.code == 2 and str(taken) in capsys.readouterr().err
    finally:
        s.close()
    with pytest.raises(SystemExit):
        main(["--port", str(taken), "--base-port", "-3", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert "invalid config: base_port: Input should be greater than or equal to" in err
    assert "errors.pydantic.dev" not in err and "validation error for" not in err
    assert not (tmp_path / "d").exists()


@pytest.fixture
def demo_cli(monkeypatch):
    """``pdd demo``'s main with the port check stubbed (other topologies may hold the config's ports)
    and run_demo failing loudly if an argument got past the checks."""
    from pdd import topology
    from pdd.bench import demo as demo_mod

    monkeypatch.setattr(topology, "ports_in_use", lambda layout: [])

    def run_demo(*a, **k):
        raise AssertionError("run_demo was reached")

    monkeypatch.setattr(demo_mod, "run_demo", run_demo)
    return demo_mod


@pytest.mark.parametrize("args,message", [
    (["--modes", "foo"], "--modes: unknown mode 'foo'; choose from colocated, same_dc_pd, cross_dc_pd, pdd"),
    (["--modes", ","], "--modes: no mode given (','); choose from colocated, same_dc_pd, cross_dc_pd, pdd"),
    (["--modes", "pdd,colocated,pdd"], "--modes: pdd given more than once"),
    (["--requests", "-5"], "--requests: must be >= 1, got -5"),
    (["--requests", "0"], "--requests: must be >= 1, got 0"),
    (["--rate", "0"], "--rate: must be > 0 req/s, got 0.0"),
    (["--rate", "-1"], "--rate: must be > 0 req/s, got -1.0"),
    (["--rate", "1e-9"], "--rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"),  # passed "> 0": a replay spanning centuries
    (["--start", "-1"], "--start: must be >= 0, got -1"),
    (["--block-tokens", "0"], "--block-tokens: must be >= 1, got 0"),
    (["--max-output", "0"], "--max-output: must be >= 1, got 0"),
    (["--session-sample", "0"], "--session-sample: must be >= 1, got 0"),
    (["--output-scale", "-1"], "--output-scale: must be > 0, got -1.0"),
    (["--seed", "-1"], "--seed: must be >= 0, got -1"),  # was numpy's ValueError traceback
])
def test_demo_cli_refuses_bad_modes_and_numbers_naming_the_flag(capsys, tmp_path, demo_cli, args, message):
    """``--modes foo`` ran nothing and exited 0; bad numbers were tracebacks (found by a new user)."""
    with pytest.raises(SystemExit) as ex:
        demo_cli.main(args + ["--out", str(tmp_path / "d")])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"pdd demo: error: {message}\n") and "Traceback" not in err, err
    assert not (tmp_path / "d").exists()


def test_demo_cli_refusals_are_not_buried_under_the_usage(capsys, tmp_path, demo_cli):
    """argparse printed all 20 lines of pdd demo's usage before the line naming the flag (pdd bench
    prints one pointing at --help)."""
    with pytest.raises(SystemExit) as ex:
        demo_cli.main(["--rate", "-1", "--out", str(tmp_path / "d")])
    assert ex.value.code == 2
    assert capsys.readouterr().err == ("usage: pdd demo [-h] [options]  (see pdd demo --help)\n"
                                       "pdd demo: error: --rate: must be > 0 req/s, got -1.0\n")


@pytest.mark.parametrize("path,says", [("/nonexistent.yaml", "no such file"),
                                       ("/", "is a directory, not a config file (YAML or JSON)")])
def test_demo_cli_names_a_config_it_cannot_read_as_pdd_serve_does(capsys, tmp_path, demo_cli, path, says):
    """It said "--config: [Errno 2] No such file or directory: '/nonexistent.yaml'"."""
    with pytest.raises(SystemExit) as ex:
        demo_cli.main(["--config", path, "--out", str(tmp_path / "d")])
    assert ex.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"pdd demo: error: --config {path}: {says}"


def _demo_refusal(capsys, tmp_path, monkeypatch, *argv: str) -> str:
    """``pdd demo --config C ARGV --out tmp/d`` (a fake checkpoint, ports free) exits 2: its stderr."""
    from pdd import topology
    from pdd.bench.demo import main

    monkeypatch.setattr(topology, "ports_in_use", lambda layout: [])
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_path": str(fake_model(tmp_path / "model"))}))
    with pytest.raises(SystemExit) as ex:
        main(["--config", str(cfg), *argv, "--out", str(tmp_path / "d")])
    assert ex.value.code == 2
    return capsys.readouterr().err


def test_demo_cli_refuses_a_start_past_the_trace(capsys, tmp_path, monkeypatch):
    err = _demo_refusal(capsys, tmp_path, monkeypatch, "--start", "100000000")
    from pdd.workload.replay import DEFAULT_TRACE

    assert err.splitlines()[-1] == (
        f"pdd demo: error: --start 100000000: past the end of {DEFAULT_TRACE}, "
        "which has 12031 requests, 147 of them kept by --session-sample 100 (--start counts kept requests; "
        "give --start below 147)") and "Traceback" not in err, err
    assert not (tmp_path / "d").exists()  # run_demo made --out before it found the slice empty


def test_demo_cli_refuses_an_out_it_cannot_create(capsys, tmp_path, demo_cli):
    """``pdd demo --out FILE`` was a FileExistsError traceback from run_demo."""
    (tmp_path / "FILE").write_text("x")
    for out, message in ((tmp_path / "FILE", "a file of that name exists"), (tmp_path / "FILE" / "x", f"{tmp_path / 'FILE'} is a file, not a directory")):
        with pytest.raises(SystemExit) as ex:
            demo_cli.main(["--out", str(out)])
        assert ex.value.code == 2
        err = capsys.readouterr().err
        assert err.endswith(f"pdd demo: error: --out {out}: cannot create the output directory: {message}\n"), err
    with pytest.raises(SystemExit) as ex:  # '' wrote into the current directory
        demo_cli.main(["--out", ""])
    assert ex.value.code == 2
    assert capsys.readouterr().err.endswith("pdd demo: error: --out '': empty; give the output directory\n")


def test_demo_cli_exits_1_when_a_mode_completed_no_request(capsys, tmp_path, demo_cli, monkeypatch):
    """As ``pdd bench``: the report is written, and a mode with no completed request is an exit 1."""
    reports = {"ok": {"modes": {"pdd": {"completed": 3}, "colocated": {"completed": 1}}},
               "empty": {"modes": {"pdd": {"completed": 3}, "colocated": {"completed": 0}}},
               "failed": {"modes": {"pdd": {"completed": 3}}, "mode_errors": {"colocated": "LaunchError: x"}}}
    for name, code in (("ok", 0), ("empty", 1), ("failed", 1)):
        monkeypatch.setattr(demo_cli, "run_demo", lambda *a, _r=reports[name], **k: _r)
        assert demo_cli.main(["--modes", "pdd,colocated", "--out", str(tmp_path / "d")]) == code, name
    err = capsys.readouterr().err
    assert "pdd demo: no request completed in colocated (colocated: LaunchError: x)" in err


def test_run_demo_warns_about_failed_requests(tmp_path):
    """A mode with timed-out requests: a WARNING line naming it, the count and the most common
    error, and the ratios marked as over completed requests only (a new user's demo printed
    headline ratios over the 65 of 100 that completed, with no warning)."""
    from bench_fakes import fake_app, serve_in_thread
    from pdd.bench.args import bench_exit_status

    flaky_url, stop = serve_in_thread(fake_app(hang_every=2))
    ok_url, stop_ok = serve_in_thread(fake_app())
    try:
        cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
        scale = Scale(block_tokens=4, output_scale=1 / 100, min_output_tokens=2, max_output_tokens=5,
                      target_rate_rps=50)
        console_path = tmp_path / "console.txt"
        report = run_demo(tmp_path / "demo", ("same_dc_pd", "pdd"), 6, scale, cfg, seed=1, warmup=False,
                          request_timeout_s=1, progress=False, console=Console(file=open(console_path, "w"), width=100),
                          topology_factory=lambda c, log_dir=None: FakeTopology(
                              flaky_url if c.mode == "same_dc_pd" else ok_url, c, log_dir))
    finally:
        stop()
        stop_ok()
    m = report["modes"]["same_dc_pd"]
    assert (m["completed"], m["failed"]) == (3, 3) and m["errors"] == {"Timeout": 3}
    text = console_path.read_text()
    assert ("WARNING: same_dc_pd: 3 of 6 requests failed (most common error, 3x: Timeout: no end after 1 s "
            "(1 tokens)); its metrics and ratios are over its 3 completed requests only\n") in text
    assert "WARNING: pdd" not in text
    assert "(over completed requests only: same_dc_pd 3/6)" in text
    assert "greedy outputs identical to same_dc_pd: pdd 3/3 (over requests completed in both)" in text
    assert bench_exit_status(report, ["same_dc_pd", "pdd"], prog="pdd demo") == 0  # completed some: a result


def test_demo_request_timeout_flag(monkeypatch, capsys):
    """--request-timeout reaches run_demo; 0 is refused naming the flag (exit status 2)."""
    import pdd.bench.demo as demo

    with pytest.raises(SystemExit) as ex:
        demo.main(["--request-timeout", "0"])
    assert ex.value.code == 2 and "--request-timeout: must be > 0, got 0.0" in capsys.readouterr().err
    seen = {}

    def fake_run_demo(*a, **kw):
        seen.update(kw)
        return {"modes": {m: {"completed": 1} for m in demo.DEFAULT_MODES}}

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    monkeypatch.setattr("pdd.topology.ports_in_use", lambda lay: [])
    assert demo.main(["--request-timeout", "600"]) == 0 and seen["request_timeout_s"] == 600


def test_demo_cli_refuses_a_model_path_with_no_checkpoint_as_pdd_serve_does(capsys, tmp_path, demo_cli):
    """``model_path: /nonexistent/model`` was filled with random weights and benchmarked (exit 0)
    where pdd serve refuses it (found by a new user); only the default models/<preset> is made."""
    model = tmp_path / "no" / "model"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_path: {model}\n")
    with pytest.raises(SystemExit) as ex:
        demo_cli.main(["--config", str(cfg), "--out", str(tmp_path / "d")])
    assert ex.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pdd demo: error: model_path {model}: no checkpoint there (config.json missing); make one with: "
        f"pdd make-model --out {model}")
    assert not (tmp_path / "no").exists() and not (tmp_path / "d").exists()


def test_demo_cli_refuses_blocks_longer_than_the_prompt_cap(capsys, tmp_path, monkeypatch):
    """``pdd demo --block-tokens 1000000000`` drew 8 GB per block, then an ArrayMemoryError traceback."""
    err = _demo_refusal(capsys, tmp_path, monkeypatch, "--block-tokens", "1000000000")
    assert "pdd demo: error: --block-tokens 1000000000 exceeds the prompt cap of 3776 tokens" in err, err
    assert "Traceback" not in err and not (tmp_path / "d").exists()


def test_the_timeline_says_when_it_shows_only_the_first_requests():
    """Found by a new user: the demo's timeline_pdd.png held 64 of its 100 requests, and nothing said so."""
    assert timeline_title("pdd", 64, 100) == "pdd (first 64 of 100 requests)"
    assert timeline_title("pdd", 20, 20) == "pdd"
