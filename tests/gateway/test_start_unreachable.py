"""The gateway started before (or without) its instances, or against another topology's: it
says which instance it waits for, and fails in one line naming it and its address (it was
silent for about 6.5 minutes, then a ConnectionError traceback; a refused handshake was a
HandshakeError traceback at once)."""

from __future__ import annotations

import json
import logging

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator, TierUnreachable
from pdd.topology import free_port_block, layout
from pdd.transfer.server import Server


def _orch(base: int) -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "colocated", "base_port": base, "gateway_port": base + 95,
                                        "security": {"tls": False, "fast_path": "plain"}})
    return Orchestrator(cfg, layout(cfg))


async def test_no_instance_answering_is_named_after_a_line_saying_it_waits(caplog):
    base = free_port_block()
    orch = _orch(base)
    with caplog.at_level(logging.WARNING, logger="pdd.gateway.orchestrator"):
        with pytest.raises(TierUnreachable) as e:
            await orch.start(retries=1)
    assert str(e.value) == (f"c0 at 127.0.0.1:{base + 10} did not answer: [Errno 111] Connect call failed "
                            f"('127.0.0.1', {base + 10})")
    assert [r.getMessage() for r in caplog.records] == [
        f"gateway: waiting for c0 at 127.0.0.1:{base + 10} (start the topology's instances first)"]


async def test_an_instance_refusing_the_handshake_is_named_at_once(caplog):
    caplog.set_level(logging.WARNING)
    base = free_port_block()
    srv = await Server("127.0.0.1", base + 10, {}, role="colocated", instance="c0", mac_key=b"k" * 32).start()
    try:
        with pytest.raises(TierUnreachable) as e:
            await _orch(base).start(retries=0)
    finally:
        await srv.close()
    assert str(e.value) == (f"c0 at 127.0.0.1:{base + 10} refused the gateway's connection: peer refused "
                            f"connection: unauthenticated connection refused: mutual TLS or a fast-path MAC is "
                            f"required (an instance of another topology, or one with other security settings?)")
    # no wait: a refusal is not retried
    assert [r for r in caplog.records if r.name == "pdd.gateway.orchestrator"] == []


def test_pdd_launch_gateway_fails_in_one_line(capsys, monkeypatch, tmp_path, tiny_model):
    from pdd import launch
    from pdd.cli import main

    def run_instance(cfg, name):
        raise TierUnreachable("c0 at 127.0.0.1:18010 did not answer: cannot connect")

    monkeypatch.setattr(launch, "run_instance", run_instance)
    cfg = tmp_path / "c.json"
    model = tiny_model  # launch checks the checkpoint first: the default models/small is not in a fresh clone
    base = free_port_block()  # the default ports may be another process's: launch refuses taken ports first
    cfg.write_text(json.dumps({"mode": "colocated", "base_port": base, "gateway_port": base + 95,
                               "model_path": str(model), "security": {"tls": False, "fast_path": "plain"}}))
    with pytest.raises(SystemExit) as ex:
        main(["launch", "--role", "gateway", "--config", str(cfg)])
    assert ex.value.code == "pdd launch: gateway: c0 at 127.0.0.1:18010 did not answer: cannot connect"
    assert "Traceback" not in capsys.readouterr().err
