"""`pdd sim validate --port / --base-port`: the live topology's ports, as `pdd serve`, `pdd bench`
and `pdd demo` take them (it had neither: a second validate beside a served topology needed a
config file). Bad values are refused in pdd serve's one line before anything runs; the ports
given reach the live topology's config (the live run is replaced by a recorder: nothing starts)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main
from pdd.topology import free_port_block
from tests.cli_usage import usage_error

PROFILE = Path(__file__).resolve().parents[2] / "data" / "profiles" / "this-machine.json"
# a free block of this run's (fixed ports failed beside a topology on them): base_port .. +109
# (the configs below move it by 10) and the gateway's kept apart from it, at +120
BASE = free_port_block(121)
GATEWAY = BASE + 120


@pytest.mark.parametrize("flags,message", [
    (["--port", "70000"], "invalid config: gateway_port (--port): Input should be less than or equal to 65535"),
    (["--port", "0"], "invalid config: gateway_port (--port): Input should be greater than or equal to 1"),
    (["--base-port", "70000"], "invalid config: base_port (--base-port): Input should be less than or equal to 65400"),
    (["--port", "0", "--base-port", "70000"],
     "invalid config: base_port (--base-port): Input should be less than or equal to 65400; gateway_port (--port): "
     "Input should be greater than or equal to 1"),
    (["--port", "18012", "--base-port", "18002"], "--port / --base-port: invalid config: ports collide: 18012: p0, "
                                                   "gateway (move gateway_port or base_port, or use fewer instances)"),
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
])
def test_bad_port_flags_are_refused_as_pdd_serve_refuses_them(capsys, tmp_path, monkeypatch, flags, message):
    import pdd.bench.live_validate as lv

    monkeypatch.setattr(lv, "run_validate", lambda *a, **k: pytest.fail("the validation ran"))
    err = usage_error(capsys, pdd_main, ["sim", "validate", "--out", str(tmp_path / "v"), *flags])
    assert err.splitlines()[-1] == f"pdd sim validate: error: {message}"
    serve = usage_error(capsys, pdd_main, ["serve", *flags])
    assert serve.splitlines()[-1] == f"pdd serve: error: {message}"
    assert not (tmp_path / "v").exists()


def test_a_port_in_use_is_refused_naming_the_flags(capsys, tmp_path, monkeypatch):
    import pdd.bench.live_validate as lv

    monkeypatch.setattr(lv, "run_validate", lambda *a, **k: pytest.fail("the validation ran"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", GATEWAY))
        s.listen()
        err = usage_error(capsys, pdd_main, ["sim", "validate", "--out", str(tmp_path / "v"), "--port", str(GATEWAY),
                                             "--base-port", str(BASE)])
    assert err == (f"pdd sim validate: error: port {GATEWAY} (gateway: gateway_port) already in use (another pdd "
                   f"serve, make demo or pdd bench?): pdd sim validate needs the gateway port {GATEWAY} and base_port "
                   f"{BASE}..{BASE + 99}; choose others with --port and --base-port (or gateway_port / base_port in "
                   "the config)\n")
    assert not (tmp_path / "v").exists()


class _Started(Exception):
    pass


@pytest.mark.parametrize("config,flags,ports", [
    (None, ["--port", str(GATEWAY), "--base-port", str(BASE)], (GATEWAY, BASE)),
    # a flag replaces the config's field; the other is the config's
    ({"gateway_port": GATEWAY - 5, "base_port": BASE + 10}, ["--port", str(GATEWAY)], (GATEWAY, BASE + 10)),
    ({"gateway_port": GATEWAY - 5, "base_port": BASE + 10}, ["--base-port", str(BASE)], (GATEWAY - 5, BASE)),
])
def test_the_ports_reach_the_live_topology(tmp_path, monkeypatch, tiny_model, config, flags, ports):
    import json

    import pdd.bench.live_validate as lv

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "small").symlink_to(tiny_model)  # its tokenizer builds the workload; no engine runs
    monkeypatch.chdir(tmp_path)
    seen = []

    def live_run(cfg, requests, out, seed, console):
        seen.append(cfg)
        raise _Started

    monkeypatch.setattr(lv, "live_run", live_run)
    argv = ["sim", "validate", "--out", str(tmp_path / "v"), "--profile", str(PROFILE), "--requests", "3", *flags]
    if config is not None:
        (tmp_path / "c.json").write_text(json.dumps(config))
        argv += ["--config", str(tmp_path / "c.json")]
    with pytest.raises(_Started):
        pdd_main(argv)
    assert [(c.gateway_port, c.base_port, c.mode) for c in seen] == [(*ports, "pdd")]
