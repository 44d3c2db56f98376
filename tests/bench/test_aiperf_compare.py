"""The aiperf comparison's parts that need no aiperf: the workload conversion (pdd bench's own
requests, verbatim), aiperf's command line, parsing aiperf 0.13's output files (a trimmed real
export in tests/bench/data/aiperf-0.13), and the side-by-side table."""

import json
from pathlib import Path

import pytest

from bench_fakes import FakeTopology
from pdd.bench import aiperf as A
from pdd.bench import bench as bench_mod
from pdd.bench.client import completion_body
from pdd.bench.report import read_jsonl
from pdd.config import ClusterConfig
from pdd.topology import free_port_block
from test_bench_demo import fake_model

DATA = Path(__file__).parent / "data" / "aiperf-0.13"


def _trace(path: Path, n: int = 8) -> Path:
    """Records of 2-4 hash ids, each with the 512-token blocks its ids name (its last one short)."""
    hids = [[0, 100 + i // 2] + list(range(200 + 10 * i, 200 + 10 * i + i % 3)) for i in range(n)]
    recs = [{"timestamp": 1000 * i, "input_length": 512 * (len(h) - 1) + 40 + 4 * i, "output_length": 300 + 50 * i,
             "hash_ids": h} for i, h in enumerate(hids)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_requests_are_pdd_benchs_and_replay_verbatim(tmp_path, server_url, monkeypatch):
    """bench_requests(ARGS) builds exactly the requests `pdd bench ARGS` replays (same ids, prompt
    lengths, output lengths, send times), and each aiperf record carries pdd bench's request body."""
    cfg_path = tmp_path / "cfg.json"
    base = free_port_block()  # not the config's default ports: a pdd serve or make demo may hold them
    cfg_path.write_text(ClusterConfig(model_path=str(fake_model(tmp_path / "model")), base_port=base,
                                      gateway_port=base + 99).model_dump_json())
    args = ["--trace", str(_trace(tmp_path / "t.jsonl")), "--requests", "6", "--rate", "40", "--session-sample", "1",
            "--block-tokens", "4", "--output-scale", "0.01", "--min-output", "3", "--max-output", "6",
            "--config", str(cfg_path), "--seed", "3"]
    monkeypatch.setattr(bench_mod, "_default_topology", lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    rc = bench_mod.main([*args, "--modes", "pdd", "--slo", "ttft:20000", "tpot:10000", "--sweep-rate", "none",
                         "--no-progress", "--out", str(tmp_path / "bench")])
    assert rc == 0
    replayed = sorted((r["idx"], r["prompt_tokens"], r["max_tokens"], r["arrival_s"])
                      for r in read_jsonl(tmp_path / "bench" / "requests.jsonl"))
    requests, scale, config = A.bench_requests(args)
    assert sorted((r.idx, r.input_tokens, r.max_tokens, r.arrival_s) for r in requests) == replayed
    assert len(replayed) == 6 and scale.block_tokens == 4
    recs = A.aiperf_trace(requests, config.served_model_name)
    for req, rec in zip(requests, recs):
        assert rec["payload"] == completion_body(req.prompt_ids, req.max_tokens, "pdd-small")
        assert rec["payload"]["prompt"] == list(req.prompt_ids) and rec["payload"]["ignore_eos"]
        assert rec["timestamp"] == pytest.approx(req.arrival_s * 1000.0, abs=1e-3)
        assert rec["output_length"] == req.max_tokens and "input_length" not in rec and "hash_ids" not in rec
    A.write_jsonl(tmp_path / "in.jsonl", recs)
    assert [json.loads(x) for x in (tmp_path / "in.jsonl").read_text().splitlines()] == recs


def test_ramp_is_refused():
    with pytest.raises(ValueError, match="--ramp"):
        A.bench_requests(["--ramp", "1:2"])


def test_aiperf_command():
    cmd = A.aiperf_command("aiperf", "http://h:1", "m", "in.jsonl", "out", "tok", {"ttft_ms": 2000.0, "tpot_ms": 50.0},
                           300.0)
    s = " ".join(cmd)
    for part in ("profile --model m --url http://h:1 --endpoint-type completions --streaming",
                 "--input-file in.jsonl --custom-dataset-type mooncake_trace --fixed-schedule",
                 "--tokenizer tok --use-server-token-count", "--export-level records",
                 "--request-timeout-seconds 300", "--workers-max 1 --record-processors 1"):
        assert part in s
    assert cmd[cmd.index("--goodput") + 1] == "time_to_first_token:2000 inter_token_latency:50"
    assert "--goodput" not in A.aiperf_command("aiperf", "u", "m", "i", "o", "t")


def test_read_aiperf_summary_and_records():
    s = A.read_aiperf_summary(DATA)
    assert s["aiperf_version"] == "0.13.0" and s["completed"] == 12 and s["errors"] == 0
    assert s["time_to_first_token"]["p50"] == pytest.approx(1191.856331)
    assert s["time_to_first_token"]["p90"] == pytest.approx(4022.7868968)
    assert s["inter_token_latency"]["count"] == 12 and s["inter_chunk_latency"]["p50"] is not None
    assert s["good_requests"] == 7 and s["goodput_rps"] > 0 and s["duration_s"] == pytest.approx(20.188925184)
    assert s["client"]["send_lag_p50_ms"] == pytest.approx(1.056896) and s["client"]["connect_avg_ms"] > 0
    rows = A.read_aiperf_records(DATA)
    assert [r["start_ns"] for r in rows] == sorted(r["start_ns"] for r in rows) and len(rows) == 3
    first = rows[0]
    assert first["ttft_ms"] == pytest.approx(132.030997) and first["tokens"] == 125
    assert len(first["chunk_gaps_ms"]) == 121 and first["error"] is None
    # 125 + 81 + 46 tokens, 121 + 78 + 44 gaps: 252 - 3 first tokens - 243 = 6 chunks without text
    assert A.contentless_tokens(rows) == {"tokens": 252, "untimed": 6}


def _report(ttft, tpot, itl, e2e, **kw):
    m = {"median_ttft_ms": ttft[0], "p90_ttft_ms": ttft[1], "mean_ttft_ms": ttft[0],
         "median_tpot_ms": tpot[0], "p90_tpot_ms": tpot[1], "median_itl_ms": itl[0], "p90_itl_ms": itl[1],
         "median_e2el_ms": e2e[0], "p90_e2el_ms": e2e[1], "completed": 10, "failed": 0, "request_goodput": 0.5,
         "slo_met": 9, "duration_s": 18.0, **kw}
    return {"modes": {"pdd": m}}


def test_table_ratios_and_noise():
    p1 = A.pdd_summary(_report((100, 400), (20, 30), (10, 40), (1000, 3000)))
    p2 = A.pdd_summary(_report((110, 380), (20, 33), (10, 40), (1100, 3000)))
    ai = {"time_to_first_token": {"p50": 105.0, "p90": 420.0}, "inter_token_latency": {"p50": 21.0, "p90": 30.0},
          "inter_chunk_latency": {"p50": 10.5, "p90": None}, "request_latency": {"p50": 1000.0, "p90": 3000.0}}
    rows = A.comparison_rows(p1, ai, p2)
    by = {r["metric"]: r for r in rows}
    assert [r["metric"] for r in rows] == ["TTFT P50", "TTFT P90", "TPOT P50", "TPOT P90", "ITL P50", "ITL P90",
                                           "E2E P50", "E2E P90"]
    assert by["TTFT P50"]["ratio"] == pytest.approx(1.05) and by["TTFT P50"]["noise"] == pytest.approx(1.1)
    assert by["TTFT P90"]["ratio"] == pytest.approx(1.05) and by["ITL P90"]["ratio"] is None
    assert A.within(rows, 0.10) and not A.within(rows, 0.04)
    table = A.format_table(rows)
    assert by["TTFT P50"]["ratio_aba"] == pytest.approx(1.0)
    assert table.splitlines()[0].count("|") == 8 and "| TTFT P50 | 100.00 | 105.00 | 1.050 | 110.00 | 1.100 | 1.000 |" in table
    assert "| ITL P90 | 40.00 | - | - |" in table
    assert "run 2" not in A.format_table(A.comparison_rows(p1, ai))
    assert p1["goodput_rps"] == 0.5 and p1["good_requests"] == 9 and p1["completed"] == 10


def test_per_request_pairing_and_send_lag():
    recs = [{"idx": 1, "arrival_s": 1.0, "send_s": 1.002, "ok": True, "token_times_s": [1.102, 1.2, 1.3]},
            {"idx": 0, "arrival_s": 0.0, "send_s": 0.001, "ok": True, "token_times_s": [0.201, 0.3]},
            {"idx": 2, "arrival_s": 2.0, "send_s": 2.004, "ok": False, "token_times_s": [], "error": "x"}]
    rows = A.pdd_per_request(recs)
    assert [r["idx"] for r in rows] == [0, 1, 2]
    assert rows[0]["ttft_ms"] == pytest.approx(200.0) and rows[1]["tpot_ms"] == pytest.approx(99.0)
    assert rows[2]["ttft_ms"] is None
    other = [{"ttft_ms": 220.0}, {"ttft_ms": 90.0}, {"ttft_ms": 5.0}]
    p = A.paired_ttft(rows, other)
    assert p["n"] == 2 and p["median_rel"] == pytest.approx((0.1 - 0.1) / 2)
    assert p["median_abs_ms"] == pytest.approx(15.0)
    lag = A.pdd_send_lag(recs)
    assert lag["send_lag_p50_ms"] == pytest.approx(2.0)
    assert A.paired_ttft([], []) is None


# ---- the script's model check (scripts/aiperf_compare.py), before anything starts


def _script():
    import importlib.util

    path = Path(__file__).parents[2] / "scripts" / "aiperf_compare.py"
    spec = importlib.util.spec_from_file_location("aiperf_compare", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def models_gateway():
    """A gateway whose GET /v1/models lists ``served`` (its completions are never reached)."""
    from fastapi import FastAPI

    from bench_fakes import serve_in_thread

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "served", "object": "model"}]}

    url, stop = serve_in_thread(app)
    yield url
    stop()


@pytest.fixture
def compare(monkeypatch, tmp_path):
    """The script's main with an aiperf executable in place and nothing allowed to start."""
    mod = _script()
    aiperf = tmp_path / "aiperf"
    aiperf.write_text("")

    def started(*a, **k):
        raise AssertionError("a server or client was started")

    monkeypatch.setattr(mod.subprocess, "Popen", started)
    monkeypatch.setattr(mod.subprocess, "run", started)
    monkeypatch.setattr(A, "bench_requests", started)
    return lambda argv: mod.main(["--aiperf", str(aiperf), "--out", str(tmp_path / "out"), *argv])


@pytest.mark.parametrize("argv,message", [
    (["--url", "URL", "--", "--model", "wrong"],
     "--model 'wrong': the server at URL serves 'served' (GET /v1/models); give that name with --model after `--`"),
    (["--url", "URL"], "served_model_name 'pdd-small' of the default config: the server at URL serves 'served' "
                       "(GET /v1/models); give that name with --model after `--`"),
    (["--", "--model", "other"], "--model 'other': the pdd serve this comparison starts serves served_model_name "
                                 "'pdd-small' of the default config; leave --model out, or give --url for a server "
                                 "that serves 'other'"),
    (["--", "--config", "MISSING"], "--config MISSING: "),
    # the script's own numbers: a traceback once the server had started / once --out was made
    (["--serve-timeout", "nan"], "--serve-timeout: must be a finite number of s > 0, got nan"),
    (["--min-step-ms", "-1"], "--min-step-ms -1.0: Input should be greater than or equal to 0"),
])
def test_bad_input_is_refused_before_anything_starts(capsys, tmp_path, models_gateway, compare, argv, message):
    """A model name the server does not serve was found only after `pdd serve` had started and pdd
    bench's whole run of 404s had ended (`RuntimeError: pdd bench exited 1`, a traceback)."""
    sub = {"URL": models_gateway, "MISSING": str(tmp_path / "missing.yaml")}
    argv = [sub.get(x, x) for x in argv]
    message = message.replace("URL", models_gateway).replace("MISSING", sub["MISSING"])
    assert compare(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiperf_compare.py: error: {message}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_empty_model_is_refused_naming_the_flag(capsys, tmp_path, compare):
    with pytest.raises(SystemExit) as ex:
        compare(["--", "--model", " "])
    assert ex.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("pdd bench: error: argument --model: served_model_name must "
                                                        "be the name clients send as \"model\", not empty nor only "
                                                        "whitespace; got ' '")
    assert not (tmp_path / "out").exists()


def test_a_too_slow_rate_is_refused_before_anything_starts(capsys, tmp_path, compare):
    """`-- --rate 1e-9` started pdd serve, then a pdd bench replay that never ended."""
    with pytest.raises(SystemExit) as ex:
        compare(["--", "--rate", "1e-9"])
    assert ex.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "pdd bench: error: --rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"
    assert not (tmp_path / "out").exists()


def test_check_model_accepts_the_served_name(models_gateway, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"served_model_name": "served"}))
    assert A.check_model(["--model", "served"], models_gateway) == "served"
    assert A.check_model(["--config", str(cfg)], models_gateway) == "served"
    assert A.check_model(["--config", str(cfg)]) == "served" == A.check_model(["--config", str(cfg), "--model", "served"])
    assert A.check_model([]) == "pdd-small"


@pytest.mark.parametrize("out", ["", "missing", "file"])
def test_report_only_without_a_run_directory_is_one_line(capsys, tmp_path, out):
    """--report-only with an --out that is no directory was a FileNotFoundError /
    NotADirectoryError traceback (exit 1); now one line naming --out, exit 2."""
    mod = _script()
    if out == "file":
        (tmp_path / "file").write_text("")
    arg = str(tmp_path / out) if out else ""
    assert mod.main(["--out", arg, "--report-only"]) == 2
    err = capsys.readouterr().err
    assert err == (f"aiperf_compare.py: error: --out {arg!r}: not a directory of an earlier run (--report-only "
                   "rebuilds the comparison from its files)\n")


def test_report_only_in_a_directory_without_a_run_names_the_missing_file(capsys, tmp_path):
    mod = _script()
    assert mod.main(["--out", str(tmp_path), "--report-only"]) == 2
    assert capsys.readouterr().err == (f"aiperf_compare.py: error: --out {str(tmp_path)!r}: aiperf_input.jsonl "
                                       "missing: not a directory of an earlier run (--report-only rebuilds the "
                                       "comparison from its files)\n")
