"""`pdd serve` refuses at once, naming the ports and the options, when its ports are taken (a
second topology beside a running one used to die in the link process with a traceback)."""

import socket

import pytest

from pdd.cli import main
from pdd.config import ClusterConfig
from pdd.topology import free_port_block, layout, ports_in_use
from tests.cli_usage import usage_error
from tests.net import ipv6_loopback


def test_ports_in_use_names_the_taken_ones():
    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": base, "gateway_port": base + 95})
    lay = layout(cfg)
    assert ports_in_use(lay) == []
    with socket.socket() as s:
        s.bind((cfg.host, base + 10))  # P's RPC port
        s.listen()
        assert ports_in_use(lay) == [base + 10]


def _ports_refusal(prog: str, port_text: str, gateway: int, base: int, port_flag: str = "--port") -> str:
    return (f"{prog}: error: {port_text} already in use (another pdd serve, make demo or pdd bench?): {prog} needs "
            f"the gateway port {gateway} and base_port {base}..{base + 99}; choose others with {port_flag} and "
            f"--base-port (or gateway_port / base_port in the config)\n")


def test_serve_refuses_a_taken_block_with_a_clear_message(capsys):
    base = free_port_block()
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 70))  # MD's RPC port
        s.listen()
        err = usage_error(capsys, main, ["serve", "--base-port", str(base), "--port", str(base + 95)])
    assert err == _ports_refusal("pdd serve", f"port {base + 70} (md0: base_port + 70)", base + 95, base)


@pytest.mark.parametrize("cmd,port_flag", [("serve", "--port"), ("demo", "--port"), ("bench", "--gateway-port")])
def test_serve_demo_and_bench_refuse_taken_ports_alike(capsys, monkeypatch, tmp_path, cmd, port_flag):
    """The three commands that start a topology refused a taken port three ways: serve exit 1 with
    no user named, demo argparse's usage block, bench exit 2 naming users after a usage line. Now
    one line naming the ports and their users, exit 2."""
    from pdd.bench import bench as bench_mod, demo as demo_mod

    def started(*a, **k):
        raise AssertionError("a model, run or topology was started")

    monkeypatch.setattr(demo_mod, "run_demo", started)
    monkeypatch.setattr(bench_mod, "ensure_model", started)
    monkeypatch.setattr(bench_mod, "_default_topology", started)
    base = free_port_block()
    with socket.socket() as gw, socket.socket() as s:
        gw.bind(("127.0.0.1", 0))
        gw.listen()
        gateway = gw.getsockname()[1]
        s.bind(("127.0.0.1", base + 10))  # P's RPC port (pdd's p0, same_dc_pd's p0 in bench's reference run)
        s.listen()
        extra = [] if cmd == "serve" else ["--out", str(tmp_path / "out"), "--modes", "pdd"]
        err = usage_error(capsys, main, [cmd, port_flag, str(gateway), "--base-port", str(base), *extra])
    named = {base + 10: f"{base + 10} (p0: base_port + 10)", gateway: f"{gateway} (gateway: gateway_port)"}
    assert err == _ports_refusal(f"pdd {cmd}", "ports " + ", ".join(named[p] for p in sorted(named)), gateway, base,
                                 port_flag)
    assert not (tmp_path / "out").exists()  # pdd bench made it before the refusal


@pytest.mark.parametrize("over,clash", [
    ({"gateway_port": 18012, "base_port": 18002}, "18012: p0, gateway"),
    ({"instances": {"main_decode": 10}}, "18010: p0, md9 wan"),
])
def test_config_refuses_colliding_ports_naming_them(over, clash):
    """Found by a new user: a gateway port inside the instances' block passed validation and died
    at start with "address already in use"; ten MDs put md9's WAN port on p0's."""
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="ports collide") as e:
        ClusterConfig.model_validate({"mode": "pdd", **over})
    assert clash in str(e.value)
    ClusterConfig.model_validate({"mode": "pdd", "instances": {"main_decode": 9}})


def test_config_refuses_an_unsupported_device():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        ClusterConfig.model_validate({"engine": {"device": "tpu"}})
    for ok in ("cpu", "cuda", "cuda:1"):
        assert ClusterConfig.model_validate({"engine": {"device": ok}}).engine.device == ok


def test_serve_names_colliding_ports_without_an_empty_location(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway_port: 18012\nbase_port: 18002\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(cfg)])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"pdd serve: error: --config {cfg}: invalid config: ports collide: 18012: p0, "
                                       "gateway (move gateway_port or base_port, or use fewer instances)\n")


@pytest.mark.parametrize("argv,flags,clash", [
    (["--port", "18012", "--base-port", "18002"], "--port / --base-port", "18012: p0, gateway"),
    (["--base-port", "7990"], "--base-port", "8000: p0, gateway"),
])
def test_serve_refuses_flags_whose_ports_collide_as_demo_and_bench_do(capsys, argv, flags, clash):
    """`pdd serve --port 9100 --base-port 9050` (the gateway inside the instances' block) exited 1
    like a bad config file, where pdd demo and pdd bench refuse the same flags as a usage error:
    the config is valid without the flags, so their values are bad CLI input, exit 2, named."""
    err = usage_error(capsys, main, ["serve", *argv])
    assert err == (f"pdd serve: error: {flags}: invalid config: ports collide: {clash} (move gateway_port or "
                   "base_port, or use fewer instances)\n")


@pytest.mark.parametrize("cmd,flag,value,message", [
    ("serve", "--port", "70000", "invalid config: gateway_port (--port): Input should be less than or equal to 65535"),
    ("serve", "--port", "0", "invalid config: gateway_port (--port): Input should be greater than or equal to 1"),
    ("serve", "--port", "-1", "invalid config: gateway_port (--port): Input should be greater than or equal to 1"),
    ("serve", "--base-port", "70000",
     "invalid config: base_port (--base-port): Input should be less than or equal to 65400"),
    ("demo", "--port", "70000", "--port: invalid config: gateway_port: Input should be less than or equal to 65535"),
    ("demo", "--port", "-1", "--port: invalid config: gateway_port: Input should be greater than or equal to 1"),
    ("demo", "--base-port", "70000", "--base-port: invalid config: base_port: Input should be less than or equal to "
                                     "65400"),
    ("bench", "--gateway-port", "70000", "--gateway-port: Input should be less than or equal to 65535, got 70000"),
    ("bench", "--gateway-port", "0", "--gateway-port: Input should be greater than or equal to 1, got 0"),
])
def test_a_port_out_of_range_is_refused_naming_its_flag(capsys, monkeypatch, tmp_path, cmd, flag, value, message):
    """Every command with a port flag refuses a port outside 1..65535 before anything starts, one
    line naming the flag (pdd demo named "--config / --port / --base-port / --nice")."""
    from pdd.bench import bench as bench_mod, demo as demo_mod

    def started(*a, **k):
        raise AssertionError("a model, run or topology was started")

    monkeypatch.setattr(demo_mod, "run_demo", started)
    monkeypatch.setattr(bench_mod, "ensure_model", started)
    monkeypatch.setattr(bench_mod, "_default_topology", started)
    err = usage_error(capsys, main, [cmd, f"{flag}={value}"])
    assert err.splitlines()[-1] == f"pdd {cmd}: error: {message}"


def test_a_port_the_user_may_not_bind_is_named_as_such_not_as_in_use(capsys, monkeypatch):
    """``pdd serve --port 80`` as a user: the bind is refused with EACCES, which the check called
    "already in use"."""
    import errno

    base = free_port_block()
    real = socket.socket

    class NoLowPorts(real):
        def bind(self, addr):
            if addr[1] < 1024:
                raise PermissionError(errno.EACCES, "Permission denied")
            return super().bind(addr)

    monkeypatch.setattr(socket, "socket", NoLowPorts)
    err = usage_error(capsys, main, ["serve", "--port", "80", "--base-port", str(base)])
    assert err == (f"pdd serve: error: port 80 (gateway: gateway_port): permission denied (a port below 1024 needs "
                   f"root or CAP_NET_BIND_SERVICE): pdd serve needs the gateway port 80 and base_port "
                   f"{base}..{base + 99}; choose others with --port and --base-port (or gateway_port / base_port in "
                   f"the config)\n")


@pytest.mark.parametrize("log,said", [
    ("INFO: loading\nERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address "
     "already in use\nTraceback (most recent call last):\n  File \"x\"\nSystemExit: 3\n",
     "[Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use"),
    ("Traceback (most recent call last):\n  File \"x\"\nOSError: [Errno 13] error while attempting to bind "
     "on address ('127.0.0.1', 80): permission denied\n",
     "[Errno 13] error while attempting to bind on address ('127.0.0.1', 80): permission denied"),
])
def test_a_bind_failure_at_start_is_one_line_naming_the_port_settings(tmp_path, log, said):
    """A port taken between the check and the bind: the gateway's log (uvicorn) ends with
    ``SystemExit: 3``, which was all ``pdd serve`` said of it."""
    from pdd.spawn import BIND_FIELDS, start_failure_cause

    path = tmp_path / "gateway.log"
    path.write_text(log)
    assert start_failure_cause(path) == f"{BIND_FIELDS}: {said} (whole log: {path})"
    assert BIND_FIELDS == "cannot listen on its port (gateway_port / base_port; pdd serve --port / --base-port)"


HOST_ADVICE = ("every process of the topology listens on it; set host in the config to an address of this machine "
               "(127.0.0.1, 0.0.0.0, ::1) or a name that resolves to one")


@pytest.mark.parametrize("cmd", ["serve", "launch"])
def test_a_host_not_of_this_machine_is_named_not_every_port_in_use(capsys, monkeypatch, tmp_path, cmd):
    """Found by a new user: `host: 192.0.2.1` (an address of another machine, or a name that does
    not resolve) was refused as "ports 18000 (link: ...), ... and 4 more already in use (another
    pdd serve ...?)": the bind failed for want of the address, not of the ports."""
    import json

    from pdd import launch

    monkeypatch.setattr(launch, "run_instance", lambda *a: pytest.fail("an instance was started"))
    base = free_port_block()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"mode": "pdd", "host": "192.0.2.1", "base_port": base, "gateway_port": base + 95,
                               "model_path": str(model), "security": {"cert_dir": str(tmp_path)}}))
    argv = ["serve", "--config", str(cfg)] if cmd == "serve" else ["launch", "--role", "prefill", "--config", str(cfg)]
    err = usage_error(capsys, main, argv)
    assert err == (f"pdd {cmd}: error: host 192.0.2.1: cannot listen there (Cannot assign requested address): "
                   f"{HOST_ADVICE}\n")


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_host_the_config_accepts_is_checked_in_its_own_family():
    """`host: "::1"` (an address the config names as valid) was refused as every port "already in
    use": the check bound an IPv4 socket to it. The gateway's URL puts it in brackets."""
    from pdd.launch import Topology
    from pdd.topology import ports_taken_refusal

    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "host": "::1", "base_port": base, "gateway_port": base + 95})
    assert ports_taken_refusal([cfg], "pdd serve") is None
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", base + 10))
        s.listen()
        assert ports_in_use(layout(cfg)) == [base + 10]
    assert Topology(cfg).url == f"http://[::1]:{base + 95}"
