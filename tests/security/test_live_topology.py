"""A live ``pdd`` topology (real processes, as ``pdd serve`` starts it) is secured by default:
certificates are made in its log dir, requests work, and a plain, unkeyed or foreign-certified
peer is refused by RLD (fast path + control) and by MD through the WAN emulator."""

from __future__ import annotations

import json

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.launch import Topology
from pdd.security import client_context
from pdd.topology import ROLE_MAIN, ROLE_RELAY, free_port_block
from pdd.transfer.client import connect

pytestmark = pytest.mark.slow


async def test_live_pdd_topology_is_secured_by_default(tiny_model, tmp_path, foreign_certs):
    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "model_preset": "tiny",
                                        "base_port": base, "gateway_port": base + 99,
                                        "engine": {"num_pages": 128}})
    topo = Topology(cfg, log_dir=tmp_path / "logs")
    topo.start()
    try:
        written = json.loads((tmp_path / "logs" / "cluster.json").read_text())["security"]
        assert written["tls"] is True and written["fast_path"] == "mac"
        certs = tmp_path / "logs" / "certs"
        assert written["cert_dir"] == str(certs.resolve()) and (certs / "md0.pem").exists()

        async with httpx.AsyncClient(base_url=topo.url, timeout=60, trust_env=False) as c:
            r = await c.post("/v1/completions", json={"model": cfg.served_model_name, "prompt": "hello secure world",
                                                       "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text

        lay = topo.layout
        rld = lay.by_role(ROLE_RELAY)[0]
        md = lay.by_role(ROLE_MAIN)[0]
        md_host, md_wan_port, crosses = lay.address_from_a(md.name)
        assert crosses
        for port in (rld.port, md_wan_port):
            with pytest.raises(ConnectionError):  # plain, no key, no certificate
                await connect("127.0.0.1", port, instance="gateway", connect_timeout_s=5)
        with pytest.raises(ConnectionError):  # fast path under a wrong key
            await connect("127.0.0.1", rld.port, instance="p0", mac_key=b"x" * 32, connect_timeout_s=5)
        with pytest.raises(ConnectionError):  # a certificate from another CA, through the WAN emulator
            await connect(md_host, md_wan_port, instance="gateway", connect_timeout_s=5,
                          ssl=client_context(foreign_certs, "gateway"), server_hostname=md.name)
        # the topology's own gateway certificate works through the WAN emulator: TLS end to end
        peer = await connect(md_host, md_wan_port, role="gateway", instance="gateway", connect_timeout_s=5,
                             ssl=client_context(certs, "gateway"), server_hostname=md.name)
        h, _ = await peer.call({"t": "stats"})
        assert h["name"] == md.name and peer.auth == "tls"
        await peer.close()
    finally:
        topo.stop()
