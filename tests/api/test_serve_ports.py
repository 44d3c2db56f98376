"""`pdd serve` refuses at once, naming the ports and the options, when its ports are taken (a
second topology beside a running one used to die in the link process with a traceback)."""

import socket

import pytest

from pdd.cli import main
from pdd.config import ClusterConfig
from pdd.topology import free_port_block, layout, ports_in_use
from tests.cli_usage import usage_error


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


def test_serve_names_colliding_ports_without_an_empty_location(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway_port: 18012\nbase_port: 18002\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(cfg)])
    assert str(e.value) == ("pdd: invalid config: ports collide: 18012: p0, gateway (move gateway_port or "
                            "base_port, or use fewer instances)")


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
