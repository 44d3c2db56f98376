"""pdd bench: bad arguments are argparse `error: ...` naming the flag (exit 2) before anything runs,
--modes with --url must be the server's mode, and a mode that completes no request exits 1.
Found by a new user. No topology is started: the --url cases use a tiny in-process gateway."""

import json
import socket

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from bench_fakes import serve_in_thread

from pdd.bench import bench as bench_mod
from pdd.bench.bench import RemoteTopology, bench_exit_status, main
from pdd.topology import free_port_block
from tests.cli_usage import usage_error


@pytest.fixture
def no_run(monkeypatch):
    """Any argument that gets past the checks would start a benchmark: fail loudly instead."""
    def run_bench(*a, **k):
        raise AssertionError("run_bench was reached")

    monkeypatch.setattr(bench_mod, "run_bench", run_bench)


def _refused(capsys, argv, *names):
    err = usage_error(capsys, main, argv)
    assert "pdd bench: error:" in err, err
    for n in names:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("args,names", [
    (["--max-input", "0"], ["--max-input: must be >= 1"]),
    (["--block-tokens", "0"], ["--block-tokens: must be >= 1"]),
    (["--min-output", "0"], ["--min-output: must be >= 1"]),
    (["--min-output", "8", "--max-output", "4"], ["--max-output: must be >= --min-output (8)"]),
    (["--output-scale", "0"], ["--output-scale: must be > 0"]),
    (["--session-sample", "0"], ["--session-sample: must be >= 1"]),
    (["--request-timeout", "0"], ["--request-timeout: must be > 0"]),
    (["--request-timeout", "nan"], ["--request-timeout: must be > 0"]),
    (["--sweep-timeout", "-1"], ["--sweep-timeout: must be > 0"]),
    (["--sweep-points", "0"], ["--sweep-points: must be >= 1"]),
    (["--ref-requests", "-1"], ["--ref-requests: must be >= 0"]),
    (["--wan-gbps", "0"], ["--wan-gbps:", "greater than 0"]),
    (["--wan-gbps", "1e-312"], ["pdd bench: error: --wan-gbps: must be >= 1e-06 Gbit/s (1 kbit/s: a 64 KiB chunk then takes 524 s; below it a chunk's time overflows), got 1e-312"]),  # a chunk's time overflowed
    (["--min-step-ms", "-5"], ["--min-step-ms:", "greater than or equal to 0"]),
    (["--gateway-port", "99999"], ["--gateway-port:", "65535"]),
    (["--port", "99999"], ["--gateway-port:", "65535"]),  # --port as serve and demo name it ("unrecognized")
    # 'inf' and 1e400 parse as floats: these reached the run (all arrivals at t=0, a sweep at inf req/s)
    (["--rate", "inf"], ["--rate: must be a finite number of req/s, got inf"]),
    (["--rate", "1e400"], ["--rate: must be a finite number of req/s, got inf"]),
    (["--output-scale", "inf"], ["--output-scale: must be a finite number, got inf"]),
    (["--request-timeout", "inf"], ["--request-timeout: must be a finite number, got inf"]),
    (["--sweep-seconds", "inf"], ["--sweep-seconds: must be a finite number, got inf"]),
    (["--sweep-rate", "inf"], ["--sweep-rate: rates must be finite and > 0 req/s, got inf in 'inf'"]),
    (["--sweep-rate", "1,nan"], ["--sweep-rate: rates must be finite and > 0 req/s, got nan in '1,nan'"]),
    (["--sweep-rate=0,2"], ["--sweep-rate: rates must be finite and > 0 req/s, got 0.0 in '0,2'"]),
    (["--ramp", "1:inf"], ["--ramp: rates must be finite and > 0, got '1:inf'"]),
    # passed "> 0", then a run whose arrivals spanned centuries (pdd.load_profile.MIN_RATE_RPS)
    (["--rate", "1e-9"], ["--rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"]),
    (["--ramp", "1e-9:4"], ["--ramp: each rate must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09 in '1e-9:4'"]),
    (["--ramp", "4:1e-9"], ["--ramp: each rate must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09 in '4:1e-9'"]),
    (["--sweep-rate", "1,1e-9"], ["--sweep-rate: each rate must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09 in '1,1e-9'"]),
    (["--seed", "-1"], ["--seed: must be >= 0, got -1"]),  # numpy's default_rng: a ValueError traceback
    (["--sweep-rate", ","], ["--sweep-rate: expected 'auto', 'none' or comma-separated rates, got ','"]),
    # "bad SLO term 'ttft:nan'" named no flag; 1e400 was an infinite bound nothing misses; 'ttft:-5' was a
    # "bad term" naming neither the metric nor the range
    (["--slo", "ttft:nan"], ["pdd bench: error: --slo: the ttft bound must be a positive, finite number of ms, got 'ttft:nan'"]),
    (["--slo", "ttft:0"], ["pdd bench: error: --slo: the ttft bound must be a positive, finite number of ms, got 'ttft:0'"]),
    (["--slo", "tpot:1e400"], ["pdd bench: error: --slo: the tpot bound must be a positive, finite number of ms, got 'tpot:1e400'"]),
    (["--slo", "ttft:-5"], ["pdd bench: error: --slo: the ttft bound must be a positive, finite number of ms, got 'ttft:-5'"]),
    (["--slo", "ttft:500", "tpot:-0.5ms"], ["pdd bench: error: --slo: the tpot bound must be a positive, finite number of ms, got 'tpot:-0.5ms'"]),
    (["--slo", "ttft:abc"], ["pdd bench: error: --slo: bad term 'ttft:abc': expected ttft:MS or tpot:MS"]),
])
def test_refuses_bad_numbers_naming_the_flag(capsys, tmp_path, no_run, args, names):
    _refused(capsys, args + ["--out", str(tmp_path / "b")], *names)
    assert not (tmp_path / "b").exists()  # nothing ran


@pytest.mark.parametrize("args,message", [
    (["--rate", "-1"], "--rate: must be > 0 req/s, got -1.0"),  # check_args
    (["--requests", "x"], "argument --requests: invalid int value: 'x'"),  # argparse
    (["--bogus"], "unrecognized arguments: --bogus"),  # argparse
    # pydantic's "Input should be greater than or equal to 1, got 0" named neither the range nor its meaning
    (["--wan-connections", "0"], "--wan-connections: must be 1..16 (connections P's bulk KV lane to each MD is "
                                 "striped over), got 0"),
    (["--wan-connections", "17"], "--wan-connections: must be 1..16 (connections P's bulk KV lane to each MD is "
                                  "striped over), got 17"),
    # an empty or blank served model name started a whole run whose every request was refused (404)
    (["--model", ""], "argument --model: served_model_name must be the name clients send as \"model\", not empty "
                      "nor only whitespace; got ''"),
    (["--model", " \t"], "argument --model: served_model_name must be the name clients send as \"model\", not empty "
                         "nor only whitespace; got ' \\t'"),
    (["--modes", "colocated", "--wan-loss-rate", "0.001"],
     "--wan-loss-rate: no listed mode uses the WAN (--modes colocated); the modes that cross it are cross_dc_pd "
     "and pdd, with any +labels"),
])
def test_a_usage_error_is_one_usage_line_and_the_message(capsys, tmp_path, no_run, args, message):
    """argparse printed all 24 lines of pdd bench's usage before the message naming the flag."""
    with pytest.raises(SystemExit) as ex:
        main(args + ["--out", str(tmp_path / "b")])
    assert ex.value.code == 2
    assert capsys.readouterr().err == ("usage: pdd bench [-h] [options]  (see pdd bench --help)\n"
                                       f"pdd bench: error: {message}\n")


def test_names_the_file_and_line_of_a_bad_trace(capsys, tmp_path, no_run):
    readme = tmp_path / "README.md"
    readme.write_text("# pdd\n")
    _refused(capsys, ["--trace", str(readme), "--out", str(tmp_path / "b")], f"--trace: {readme}, line 1",
             "not a JSON record")
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]})
                 + "\n\n" + json.dumps({"timestamp": 5}) + "\n")
    _refused(capsys, ["--trace", str(t), "--out", str(tmp_path / "b")], f"{t}, line 3", "lacks 'input_length'")
    assert not (tmp_path / "b").exists()


def test_refuses_an_empty_output_dir(capsys, tmp_path, monkeypatch, no_run):
    """`--out ''` wrote the run's files into the current directory."""
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, ["--out", ""])
    assert err.splitlines()[-1] == "pdd bench: error: --out '': empty; give the output directory"


@pytest.mark.parametrize("out,names", [
    ("/proc/pdd-bench-test/x", ["cannot create the output directory"]),
    ("FILE/x", ["cannot create the output directory: FILE is a file, not a directory"]),
    ("FILE", ["cannot create the output directory: a file of that name exists"]),
])
def test_refuses_an_output_dir_it_cannot_create(capsys, tmp_path, no_run, out, names):
    (tmp_path / "FILE").write_text("x")
    out = out.replace("FILE", str(tmp_path / "FILE"))
    _refused(capsys, ["--out", out], f"--out {out}", *[n.replace("FILE", str(tmp_path / "FILE")) for n in names])


def test_the_output_dir_check_makes_nothing(tmp_path):
    from pdd.cli_args import out_dir_problem

    assert out_dir_problem(tmp_path / "a" / "b" / "c", keep=False) is None
    assert out_dir_problem(str(tmp_path / "x" / ".." / "y"), keep=False) is None
    (tmp_path / "kept").mkdir()
    assert out_dir_problem(tmp_path / "kept" / "new", keep=False) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_one_output_dir_check_for_every_command(tmp_path):
    """pdd make-model / certs, pdd sim ... and pdd bench / demo each had their own --out check with
    its own wording; one function now, keep=True leaving the directory made."""
    from pdd.cli_args import out_dir_problem

    assert out_dir_problem(tmp_path / "a" / "b", keep=True) is None
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    for keep in (True, False):
        assert out_dir_problem(tmp_path / "f", keep) == (
            f"--out {tmp_path / 'f'}: cannot create the output directory: a file of that name exists")
        assert out_dir_problem(tmp_path / "f" / "x", keep, flag="--dir") == (
            f"--dir {tmp_path / 'f' / 'x'}: cannot create the output directory: {tmp_path / 'f'} is a file, "
                "not a directory")
        assert out_dir_problem("", keep) == "--out '': empty; give the output directory"
        assert out_dir_problem(" ", keep) == "--out ' ': empty; give the output directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "f"]


# ---------------------------------------------------------------- against a fake gateway (--url)


def _gateway(mode: str | None, completions_status: int = 404) -> FastAPI:
    """A gateway that reports ``mode`` (/pdd/stats and /health; None: neither endpoint exists)
    and refuses every completion with ``completions_status`` (a wrong --model)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "served", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions():
        return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error"}},
                            status_code=completions_status)

    if mode is not None:
        @app.get("/pdd/stats")
        async def stats():
            return {"mode": mode, "instances": {}}

        @app.get("/health")
        async def health():
            return {"status": "ok", "mode": mode, "down": []}

    return app


@pytest.fixture
def gateway():
    stops = []

    def start(mode, completions_status=404):
        url, stop = serve_in_thread(_gateway(mode, completions_status))
        stops.append(stop)
        return url

    yield start
    for stop in stops:
        stop()


def test_url_refuses_modes_other_than_the_servers(capsys, tmp_path, gateway, no_run):
    url = gateway("same_dc_pd")
    assert RemoteTopology(url).mode() == "same_dc_pd"
    _refused(capsys, ["--url", url, "--model", "served", "--modes", "pdd", "--out", str(tmp_path / "b")],
             "--modes pdd", f"the server at {url} runs mode same_dc_pd", "--modes same_dc_pd or leave --modes out")
    _refused(capsys, ["--url", url, "--model", "served", "--modes", "same_dc_pd,pdd", "--out", str(tmp_path / "b")],
             "runs mode same_dc_pd")
    _refused(capsys, ["--url", url, "--model", "served", "--modes", "same_dc_pd+routing=round_robin",
                      "--out", str(tmp_path / "b")],
             "runs mode same_dc_pd")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flags", [["--min-step-ms", "20"], ["--wan-gbps", "0.2", "--handoff-mode", "one_shot"]])
def test_url_refuses_topology_flags(capsys, tmp_path, no_run, flags):
    """The server at --url runs its own config: a topology flag used to be recorded in report.json as
    if applied (a new user's --min-step-ms 20 against a server without it)."""
    _refused(capsys, ["--url", "http://127.0.0.1:1", *flags, "--out", str(tmp_path / "b")],
             flags[0], "with --url the server runs its own config")
    assert not (tmp_path / "b").exists()


def test_url_refuses_modes_when_the_server_reports_none(capsys, tmp_path, gateway, no_run):
    url = gateway(None)
    assert RemoteTopology(url).reported_mode() is None and RemoteTopology(url).mode() == "external"
    _refused(capsys, ["--url", url, "--model", "served", "--modes", "pdd", "--out", str(tmp_path / "b")],
             "does not report its mode", "leave --modes out")


def _small_trace(tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 600, "output_length": 40,
                                     "hash_ids": [1, 2 + i]}) + "\n" for i in range(3)))
    return t


def _url_argv(tmp_path, url, *extra, served="served"):
    """``served``: the config's served_model_name, the name requested without --model (the fake
    gateway serves 'served')."""
    cfg = tmp_path / "cfg.json"  # no checkpoint at model_path: the token space needs none with --url
    cfg.write_text(json.dumps({"model_path": str(tmp_path / "no-model"), "served_model_name": served}))
    return ["--url", url, "--config", str(cfg), "--trace", str(_small_trace(tmp_path)), "--requests", "3",
            "--rate", "50", "--session-sample", "1", "--sweep-rate", "none", "--slo", "ttft:1000", "tpot:1000", "--no-warmup",
            "--no-progress", "--request-timeout", "5", "--out", str(tmp_path / "out"), *extra]


def test_every_request_failing_exits_1_after_writing_the_report(capsys, tmp_path, gateway):
    url = gateway("pdd", completions_status=404)
    assert main(_url_argv(tmp_path, url, "--modes", "pdd", "--model", "served")) == 1  # --modes = the server's
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["bench"]["run_order"] == ["pdd"] and rep["modes"]["pdd"]["completed"] == 0
    assert "no request completed in pdd" in capsys.readouterr().err


@pytest.mark.parametrize("tail", ["/v1", "/v1/"])
def test_url_takes_the_v1_url_pdd_serve_prints_as_the_gateways_root(capsys, tmp_path, gateway, tail):
    """Found by a new user: ``--url http://127.0.0.1:9100/v1``, exactly what pdd serve prints
    ("serving at .../v1", the OpenAI base_url form), failed: "GET /v1/models answered HTTP 404,
    not an OpenAI model list" (it asked /v1/v1/models). Its root is benchmarked."""
    url = gateway("pdd")  # it refuses every completion: exit 1 once the run is over and its report written
    assert main(_url_argv(tmp_path, url + tail, "--modes", "pdd", "--model", "served")) == 1
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["bench"]["run_order"] == ["pdd"] and rep["modes"]["pdd"]["completed"] == 0
    out = capsys.readouterr().out
    assert f"external gateway {url}: mode pdd" in out
    # found by a user: a server with a smaller vocabulary refused every request; said up front
    assert " ".join(out.split()).count("no checkpoint at") == 1 and "prompt token ids are drawn from [0, 32000)" \
        in " ".join(out.split())


@pytest.mark.parametrize("tail", ["/v1/completions", "/v1/chat/completions/", "/pdd/v1/models"])
def test_an_endpoint_url_is_refused_naming_it(capsys, tmp_path, tail, no_run):
    """Found by a new user: ``--url http://host:port/v1/completions`` (an endpoint, not the base
    URL) was asked ``.../v1/completions/v1/models`` and refused with advice about ``--model``. It
    is refused before anything is requested, naming the endpoint."""
    url = "http://127.0.0.1:9"  # nothing listens: the refusal comes before any request
    err = usage_error(capsys, main, _url_argv(tmp_path, url + tail, "--model", "served"))
    assert err.splitlines()[-1] == (f"pdd bench: error: --url {url + tail}: names the endpoint "
                                    f"{tail[tail.index('/v1/'):]}; give the server's root (http://host:port) or its "
                                    f"/v1 base URL: pdd bench requests the endpoints itself")
    assert not (tmp_path / "out").exists()


def test_a_model_the_server_does_not_serve_is_refused_before_the_run(capsys, tmp_path, gateway, no_run):
    """Found by a new user: ``--url URL --model WRONG`` ran the whole benchmark, every request a
    404, and exited 1 with a report of failures."""
    url = gateway("pdd")
    err = usage_error(capsys, main, _url_argv(tmp_path, url, "--model", "wrong"))
    assert err.splitlines()[-1] == f"pdd bench: error: --model 'wrong': the server at {url} serves 'served' (GET /v1/models)"
    assert not (tmp_path / "out").exists()


def test_the_configs_model_name_is_checked_without_model(capsys, tmp_path, gateway, no_run):
    """Found in user testing: without --model, ``--url`` requested the config's served_model_name
    unchecked (a server serving another name: every request a 404, as --model WRONG was)."""
    url = gateway("pdd")
    err = usage_error(capsys, main, _url_argv(tmp_path, url, served="pdd-small"))
    assert err.splitlines()[-1] == (f"pdd bench: error: served_model_name 'pdd-small' of --config {tmp_path / 'cfg.json'}: "
                                    f"the server at {url} serves 'served' (GET /v1/models); give the name to "
                                    f"request with --model")
    assert not (tmp_path / "out").exists()
    app = FastAPI()  # no /v1/models: 404
    url, stop = serve_in_thread(app)
    try:
        err = usage_error(capsys, main, _url_argv(tmp_path, url, served="pdd-small"))
    finally:
        stop()
    assert err.splitlines()[-1] == (f"pdd bench: error: --url {url}: GET /v1/models answered HTTP 404, not an OpenAI "
                                    f"model list, so served_model_name 'pdd-small' of --config {tmp_path / 'cfg.json'} "
                                    f"cannot be checked; give the name to request with --model")


def test_a_model_cannot_be_checked_without_the_servers_model_list(capsys, tmp_path, no_run):
    app = FastAPI()  # no /v1/models: 404
    url, stop = serve_in_thread(app)
    try:
        err = usage_error(capsys, main, _url_argv(tmp_path, url, "--model", "m"))
    finally:
        stop()
    assert err.splitlines()[-1] == (f"pdd bench: error: --url {url}: GET /v1/models answered HTTP 404, not an OpenAI "
                                    f"model list, so --model 'm' cannot be checked")
    err = usage_error(capsys, main, _url_argv(tmp_path, "http://127.0.0.1:1", "--model", "m"))
    assert err.splitlines()[-1].startswith("pdd bench: error: --url: cannot reach http://127.0.0.1:1: ConnectError")


def test_exit_status_counts_modes_without_a_completed_request():
    def rep(modes, errors=None):
        return {"bench": {"run_order": list(modes)}, "modes": {m: {"completed": c} for m, c in modes.items()
                                                               if c is not None}, "mode_errors": errors or {}}

    assert bench_exit_status(rep({"pdd": 3, "colocated": 1})) == 0  # some failures are measured results
    assert bench_exit_status(rep({"pdd": 3, "colocated": 0})) == 1
    assert bench_exit_status(rep({"pdd": 3, "colocated": None}, {"colocated": "LaunchError: x"})) == 1


@pytest.mark.parametrize("rec,names", [
    ({"timestamp": "x"}, ["'timestamp' must be a number of ms, got 'x'"]),
    ({"timestamp": True}, ["'timestamp' must be a number of ms, got True"]),
    ({"timestamp": float("nan")}, ["'timestamp' must be a number of ms, got nan"]),
    ({"timestamp": float("-inf")}, ["'timestamp' must be a number of ms, got -inf"]),
    ({"timestamp": -5}, ["'timestamp' must be >= 0 (ms since the trace's start), got -5"]),
    ({"timestamp": -0.5}, ["'timestamp' must be >= 0 (ms since the trace's start), got -0.5"]),
    ({"input_length": 0}, ["'input_length' must be an integer 1..1,000,000,000, got 0"]),
    ({"input_length": "600"}, ["'input_length' must be an integer 1..1,000,000,000, got '600'"]),
    ({"output_length": -1}, ["'output_length' must be an integer 0..1,000,000,000, got -1"]),
    # past float's range the scaling raised OverflowError (a traceback) or math.isfinite did
    ({"input_length": 10 ** 400}, ["'input_length' must be an integer 1..1,000,000,000, got 1000"]),
    ({"output_length": 10 ** 400}, ["'output_length' must be an integer 0..1,000,000,000, got 1000"]),
    ({"timestamp": 10 ** 400}, ["'timestamp' must be a number of ms, got 1000"]),
    ({"hash_ids": "1,2"}, ["'hash_ids' must be a list of integers"]),
    ({"hash_ids": [1, None]}, ["'hash_ids' must be a list of integers"]),
    # numpy seeds a block's tokens from its id: a negative one ended the run with numpy's own
    # "expected non-negative integer" (a new user's trace; `pdd sim run` took it)
    ({"hash_ids": [1, -5]}, ["'hash_ids' must be a list of integers >= 0, got [1, -5]"]),
    # one id per 512-token block: extra ids made replay's prompt longer than input_length (each id
    # gets at least one token of its block: 5 ids on 100 tokens replayed 65 tokens, not 3)
    ({"input_length": 100, "hash_ids": [1, 2, 3, 4, 5]},
     ["'hash_ids' has 5 ids, more than the 1 512-token block(s) of its 'input_length' 100 (one id per block)"]),
    ({"input_length": 1024, "hash_ids": [1, 2, 3]},
     ["'hash_ids' has 3 ids, more than the 2 512-token block(s) of its 'input_length' 1024 (one id per block)"]),
])
def test_names_the_file_line_and_field_of_a_bad_trace_value(capsys, tmp_path, no_run, rec, names):
    """A record with all four fields but an unusable value was accepted by the checks and failed
    inside the run as `error: could not convert string to float: 'x'` (no file, line or field)."""
    t = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 40, "hash_ids": [1, 2]}
    t.write_text(json.dumps(good) + "\n" + json.dumps({**good, **rec}) + "\n")
    _refused(capsys, ["--trace", str(t), "--out", str(tmp_path / "b")], f"--trace: {t}, line 2", *names)


def test_a_trace_the_default_session_sample_empties_names_the_flag(capsys, tmp_path, gateway):
    """`pdd workload agentic --n 30 --out t.jsonl` then `pdd bench --trace t.jsonl`: the default
    --session-sample 50 (sized for the shared Mooncake trace) kept none of its conversations and
    the run stopped with `no requests in t.jsonl (start=0 count=200)`, naming nothing to change."""
    url = gateway("pdd")
    argv = _url_argv(tmp_path, url)
    i = argv.index("--session-sample")
    del argv[i:i + 2]  # the default
    err = _refused(capsys, argv, "no requests in", "--session-sample 50", "give --session-sample 1")
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # the refused run made --out and three empty .jsonl files there


def test_an_empty_trace_is_named_as_such(capsys, tmp_path, no_run):
    """An empty trace file was blamed on --session-sample ("kept none of this trace's"
    conversations) though it held no records at all."""
    t = tmp_path / "empty.jsonl"
    t.write_text("\n")
    err = _refused(capsys, ["--trace", str(t), "--out", str(tmp_path / "b")], f"--trace: {t} holds no trace records")
    assert "kept none" not in err


def test_a_trace_directory_is_named_as_such(capsys, tmp_path, no_run):
    """``--trace DIR`` said 'no such file' though the path exists."""
    _refused(capsys, ["--trace", str(tmp_path), "--out", str(tmp_path / "b")],
             f"--trace: {tmp_path} is a directory, not a trace file")


@pytest.mark.parametrize("modes", ["colocated", "colocated,same_dc_pd+routing=round_robin", " same_dc_pd "])
@pytest.mark.parametrize("flags", [["--wan-loss-rate", "0.001"], ["--wan-connections", "4"], ["--wan-gbps", "0.1"],
                                   ["--wan-rtt-ms", "5"], ["--wan-order", "srf"], ["--cross-traffic", "0:0.01"],
                                   ["--cross-traffic-gbps", "0.01"]])
def test_wan_flags_without_a_mode_crossing_the_wan_are_refused(capsys, tmp_path, no_run, modes, flags):
    """`--modes colocated --wan-loss-rate 0.001` ran, and report.json recorded a loss rate nothing
    could see: no instance of colocated or same_dc_pd is across the WAN."""
    _refused(capsys, ["--modes", modes, *flags, "--out", str(tmp_path / "b")],
             f"error: {flags[0]}: no listed mode uses the WAN", "cross_dc_pd and pdd")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("modes", ["colocated,pdd+allow_p_rld", "cross_dc_pd+wan_connections=2", "same_dc_pd,pdd"])
def test_wan_flags_with_a_mode_crossing_the_wan_pass_the_checks(tmp_path, modes):
    from pdd.bench.args import build_parser, check_args

    ap = build_parser()
    args = ap.parse_args(["--modes", modes, "--wan-connections", "4", "--cross-traffic", "0:0.01",
                          "--trace", str(_small_trace(tmp_path))])
    check_args(ap, args)  # no SystemExit
    assert args.wan_connections == 4 and args.wan_cross_traffic == [(0.0, 0.01)]


@pytest.mark.parametrize("modes", ["colocated", "cross_dc_pd,same_dc_pd+cutoff=true"])
@pytest.mark.parametrize("flags", [["--pipeline-ttft-budget-ms", "100"], ["--allow-p-rld"],
                                   ["--handoff-mode", "auto"]])
def test_pdd_only_flags_without_a_pdd_mode_are_refused(capsys, tmp_path, no_run, modes, flags):
    """`--modes colocated --pipeline-ttft-budget-ms 100` ran, and report.json recorded a budget no
    mode has: only pdd chooses a pipeline and has a relay tier."""
    _refused(capsys, ["--modes", modes, *flags, "--out", str(tmp_path / "b")],
             f"error: {flags[0]}: no listed mode is pdd (--modes {modes})")
    assert not (tmp_path / "b").exists()


def test_pdd_only_flags_with_a_pdd_mode_pass_the_checks(tmp_path):
    from pdd.bench.args import build_parser, check_args

    ap = build_parser()
    args = ap.parse_args(["--modes", "colocated,pdd+routing=round_robin", "--pipeline-ttft-budget-ms", "100",
                          "--handoff-mode", "auto", "--trace", str(_small_trace(tmp_path))])
    check_args(ap, args)  # no SystemExit
    assert (args.pipeline_ttft_budget_ms, args.handoff_mode) == (100.0, "auto")


def test_wan_modes_are_the_topologies_with_a_link():
    """WAN_MODES (the modes the WAN flags and link labels need) = the layouts with datacenter B."""
    from pdd.bench.modes import WAN_MODES
    from pdd.config import MODES, ClusterConfig
    from pdd.topology import layout

    assert [m for m in MODES if layout(ClusterConfig(mode=m)).link_control_port is not None] == list(WAN_MODES)


def test_a_rate_schedule_with_an_infinite_time_names_the_flag(capsys, tmp_path, no_run):
    """`0:1,inf:2` was refused as `rates must be finite and >= 0 req/s, got 2 at t=inf` (the rate was fine)."""
    trace = str(_small_trace(tmp_path))
    for sched, msg in (("0:1,inf:2", "--rate-schedule: times must be finite seconds, got inf\n"),
                       ("0:1,nan:2", "--rate-schedule: times must be finite seconds, got nan\n"),
                       ("0:nan,5:1", "--rate-schedule: rates must be finite req/s, got nan at t=0\n"),
                       ("", "--rate-schedule: empty; expected T:RATE points")):
        _refused(capsys, ["--trace", trace, "--rate-schedule", sched, "--out", str(tmp_path / "b")],
                 f"pdd bench: error: {msg}")


def test_mode_label_errors_list_every_suffix(capsys, tmp_path, no_run):
    """An unknown or empty setting in a label listed policy, link, engine and vllm settings but not
    +autoscale or +standby=none; a link setting on a mode with no WAN was accepted and did nothing."""
    from pdd.bench.modes import parse_mode_label

    err = _refused(capsys, ["--modes", "pdd+autoscal", "--out", str(tmp_path / "b")],
                   "--modes: mode 'pdd+autoscal': 'autoscal' is neither autoscale[=true|false], standby=none, "
                   "a policy setting (")
    assert "a link setting (wan_connections), engine.<setting> (" in err
    with pytest.raises(ValueError) as ex:
        parse_mode_label("pdd+")
    assert str(ex.value) == ("mode 'pdd+': an empty setting after '+'; a label is MODE+SETTING[=VALUE]+...; SETTING "
                             "is autoscale[=true|false], standby=none, a policy setting, wan_connections (link), "
                             "engine.<setting> or vllm.<setting>")
    for label in ("colocated+wan_connections=4", "same_dc_pd+link.wan_connections=2"):
        with pytest.raises(ValueError) as ex:
            parse_mode_label(label)
        assert str(ex.value) == (f"mode {label!r}: wan_connections is a WAN setting and no instance of "
                                 f"{label.split('+')[0]} crosses the WAN (modes that do: cross_dc_pd, pdd)")
    assert parse_mode_label("pdd+wan_connections=4") == ("pdd", {"link.wan_connections": "4"})
    assert parse_mode_label("cross_dc_pd+link.wan_connections=2") == ("cross_dc_pd", {"link.wan_connections": "2"})


def test_a_flag_that_makes_the_configs_cross_traffic_too_high_names_both(capsys, tmp_path, no_run):
    """--wan-gbps below the config file's link.wan_cross_traffic was refused as '--cross-traffic:
    ...', a flag not given."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("link: {wan_cross_traffic: [[0, 0.02]]}\n")
    with pytest.raises(SystemExit) as ex:
        main(["--wan-gbps", "0.01", "--config", str(cfg), "--out", str(tmp_path / "b")])
    assert ex.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pdd bench: error: --wan-gbps: with link.wan_cross_traffic of --config {cfg}: 0.02 Gbit/s at 0 s must be "
        "below the line's 0.01 Gbit/s")


# ---------------------------------------------------------------- ports taken before the run


@pytest.fixture
def nothing_starts(monkeypatch):
    """A check that lets the run go on would make the model or start a topology: fail loudly instead."""
    def started(*a, **k):
        raise AssertionError("a model or topology was started")

    monkeypatch.setattr(bench_mod, "ensure_model", started)
    monkeypatch.setattr(bench_mod, "_default_topology", started)


def _ports_refusal(port_text: str, gateway: int, base: int) -> str:
    return (f"pdd bench: error: {port_text} already in use (another pdd serve, make demo or pdd bench?): pdd bench "
            f"needs the gateway port {gateway} and base_port {base}..{base + 99}; choose others with --gateway-port "
            f"and --base-port (or gateway_port / base_port in the config)\n")


def test_a_busy_gateway_port_is_refused_before_anything_starts(capsys, tmp_path, nothing_starts):
    """pdd serve refuses a taken port at once; pdd bench made the model, ran its reference and died in
    each mode with a LaunchError after starting the instances."""
    base = free_port_block()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = usage_error(capsys, main, ["--gateway-port", str(port), "--base-port", str(base), "--modes", "colocated",
                                         "--out", str(tmp_path / "b" / "run")])
    assert err == _ports_refusal(f"port {port} (gateway: gateway_port)", port, base)
    assert list(tmp_path.iterdir()) == []  # --out and its parent were made before the refusal, and left behind


@pytest.mark.parametrize("modes,slo,offset,who", [
    ("colocated", [], 70, "d0: base_port + 70"),  # the same_dc_pd reference run's decoder
    ("colocated,pdd", ["--slo", "ttft:500", "tpot:50"], 70, "md0: base_port + 70"),  # no reference run
    ("colocated,pdd", ["--slo", "ttft:500", "tpot:50"], 1, "md0 wan: base_port + 1"),
    ("same_dc_pd,pdd", [], 80, "d0 metrics, md0 metrics: base_port + 80"),
])
def test_a_busy_instance_port_names_what_uses_it(capsys, tmp_path, nothing_starts, modes, slo, offset, who):
    base = free_port_block()
    gateway = base + 99
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + offset))
        s.listen()
        err = usage_error(capsys, main, ["--gateway-port", str(gateway), "--base-port", str(base), "--modes", modes,
                                         *slo, "--out", str(tmp_path / "b")])
    assert err == _ports_refusal(f"port {base + offset} ({who})", gateway, base)


def test_only_the_ports_of_the_topologies_run_are_checked():
    """colocated with both SLO bounds given runs no same_dc_pd reference: its decoder's port is not needed."""
    from pdd.bench.modes import check_ports_free
    from pdd.config import ClusterConfig

    base = free_port_block()
    cfg = ClusterConfig(base_port=base, gateway_port=base + 99)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 70))
        s.listen()
        check_ports_free(cfg, ["colocated", "vllm_colocated"], reference=False)  # no error
        with pytest.raises(ValueError, match=rf"^port {base + 70} \(d0: base_port \+ 70\) already in use"):
            check_ports_free(cfg, ["colocated"], reference=True)


def test_a_fault_that_applies_to_no_mode_is_refused_before_anything_starts(capsys, tmp_path, monkeypatch):
    """``--fault kill:zzz@prefill`` (a typo of an instance name) ran a whole benchmark with the
    fault only listed as not applicable in each mode (found by a new user); one that applies to
    some of the modes still runs (the others record it as not applicable)."""
    def no_topology(*a, **k):
        raise AssertionError("a topology was started")

    monkeypatch.setattr(bench_mod, "_default_topology", no_topology)
    err = _refused(capsys, ["--fault", "kill:zzz@prefill", "--modes", "pdd,cross_dc_pd", "--out", str(tmp_path / "b")],
                   "--fault kill:zzz@prefill: applies to none of the modes benchmarked (pdd: mode pdd has no "
                   "instance 'zzz'; cross_dc_pd: mode cross_dc_pd has no instance 'zzz')")
    assert err.count("\n") == 2 and not (tmp_path / "b").exists()
    from pdd.bench.faults import parse_bench_fault
    from pdd.config import ClusterConfig

    # kill:rld0 applies to pdd (which has an RLD) though not to cross_dc_pd: no refusal
    bench_mod._check_faults_apply([parse_bench_fault("kill:rld0@rld_decode")], ClusterConfig(), ["pdd", "cross_dc_pd"])


# ---------------------------------------------------------------- a model_path with no checkpoint


def test_a_model_path_with_no_checkpoint_is_refused_as_pdd_serve_does(capsys, tmp_path, monkeypatch):
    """Found by a new user: ``model_path: /nonexistent/model`` printed "making model 'small' (seed 0) in
    /nonexistent/model ...", made the directory and benchmarked random weights (exit 0), where
    pdd serve refuses the same config. Only the default models/<preset> is made."""
    def started(*a, **k):
        raise AssertionError("a topology was started")

    monkeypatch.setattr(bench_mod, "_default_topology", started)
    monkeypatch.setattr(bench_mod, "check_ports_free", lambda *a, **k: None)  # other topologies may hold them
    model = tmp_path / "no" / "model"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"model_path": str(model)}))
    err = usage_error(capsys, main, ["--config", str(cfg), "--modes", "colocated", "--out", str(tmp_path / "out")])
    assert err.splitlines()[-1] == (f"pdd bench: error: model_path {model}: no checkpoint there (config.json missing); "
                                    f"make one with: pdd make-model --out {model}")
    assert not (tmp_path / "no").exists() and not (tmp_path / "out").exists()


def test_the_default_model_path_is_still_made(tmp_path, monkeypatch):
    """``make demo`` and ``pdd bench`` without --config rely on the default checkpoint being written."""
    from pdd.bench.live import ensure_model
    from pdd.config import ClusterConfig

    monkeypatch.chdir(tmp_path)
    path = ensure_model(ClusterConfig(model_path="models/tiny", model_preset="tiny"))
    assert str(path) == "models/tiny" and (tmp_path / "models" / "tiny" / "config.json").is_file()


@pytest.mark.parametrize("modes,dup", [("pdd,pdd", "pdd"), ("same_dc_pd, pdd+cutoff=false,pdd+cutoff=false", "pdd+cutoff=false")])
def test_a_mode_given_twice_is_refused(capsys, tmp_path, no_run, modes, dup):
    """`--modes pdd,pdd` ran pdd once and reported one row where two were asked (pdd demo refused it)."""
    _refused(capsys, ["--modes", modes, "--out", str(tmp_path / "b")], f"error: --modes: {dup} given more than once")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("sample,why", [
    ("1", "which has 3 requests (give --start below 3)"),
    ("2", "which has 3 requests, 2 of them kept by --session-sample 2 (--start counts kept requests; "
          "give --start below 2)"),
])
def test_a_start_past_the_trace_names_start_and_the_trace_s_count(capsys, tmp_path, gateway, sample, why):
    """``--start 99999999`` was blamed on --session-sample ("kept none of this trace's")."""
    url = gateway("pdd")
    argv = _url_argv(tmp_path, url, "--start", "99999999")
    argv[argv.index("--session-sample") + 1] = sample
    err = _refused(capsys, argv)
    assert err.splitlines()[-1] == f"pdd bench: error: --start 99999999: past the end of {tmp_path / 't.jsonl'}, {why}"
    assert "kept none" not in err


@pytest.mark.parametrize("spec,requests,why", [
    ("kill:md@prefill#4", "3", "--fault 'kill:md@prefill#4': #4 is past the run's 3 requests (--requests): "
                               "it would never fire"),
    ("kill:md@prefill#99999999999999999999", "3",
     "--fault 'kill:md@prefill#99999999999999999999': #N must be at most 1,000,000 (the most requests a run "
     "counts to), got 99999999999999999999"),
    # said "fault 'bogus': ..." without naming --fault (found by a new user)
    ("bogus", "3", "--fault 'bogus': expected KIND[:ARG]@PHASE, e.g. wan_outage:3@transfer"),
    ("nope@prefill", "3", "--fault 'nope@prefill': kind must be one of "
                          "('wan_outage', 'wan_slowdown', 'cross_traffic', 'kill', 'client_disconnect')"),
])
def test_a_fault_count_past_the_run_is_refused(capsys, tmp_path, no_run, spec, requests, why):
    """``--fault kill:md@prefill#99999999999999999999`` passed the checks: the fault could never fire."""
    err = _refused(capsys, ["--fault", spec, "--requests", requests, "--modes", "pdd", "--out", str(tmp_path / "b")])
    assert err.splitlines()[-1] == f"pdd bench: error: {why}"
    assert not (tmp_path / "b").exists()
