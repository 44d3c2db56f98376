"""`pdd serve` refuses at once, naming the ports and the options, when its ports are taken (a
second topology beside a running one used to die in the link process with a traceback)."""

import socket

import pytest

from pdd.cli import main
from pdd.config import ClusterConfig
from pdd.topology import free_port_block, layout, ports_in_use


def test_ports_in_use_names_the_taken_ones():
    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "base_port": base, "gateway_port": base + 95})
    lay = layout(cfg)
    assert ports_in_use(lay) == []
    with socket.socket() as s:
        s.bind((cfg.host, base + 10))  # P's RPC port
        s.listen()
        assert ports_in_use(lay) == [base + 10]


def test_serve_refuses_a_taken_block_with_a_clear_message(capsys):
    base = free_port_block()
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 70))  # MD's RPC port
        s.listen()
        with pytest.raises(SystemExit) as e:
            main(["serve", "--base-port", str(base), "--port", str(base + 95)])
    msg = str(e.value)
    assert f"port {base + 70} already in use" in msg and "--base-port" in msg and "--port" in msg


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
