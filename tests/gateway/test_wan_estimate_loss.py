"""The gateway's live WAN estimate knows the configured loss: it starts at one TCP connection's
loss-limited rate (not the line's) and MD's samples above it read as it; without loss it is as
before (None until MD's first sample)."""
import asyncio

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.policy.tcp_model import mathis_gbps
from pdd.topology import layout
from pdd.transfer.messages import WanSample


def _orch(**link):
    cfg = ClusterConfig.model_validate({"mode": "pdd", "link": link})
    return Orchestrator(cfg, layout(cfg))


def test_estimate_starts_at_the_loss_limited_rate():
    o = _orch(wan_gbps=0.05, wan_rtt_ms=20.0, wan_loss_rate=1e-3)
    m = mathis_gbps(1460, 20.0, 1e-3)
    assert o.wan_gbps_live == pytest.approx(m, rel=1e-12)
    asyncio.run(o.on_wan_sample(None, WanSample(0.05).wire(), b""))
    assert o.wan_gbps_live == pytest.approx(m, rel=1e-12)
    asyncio.run(o.on_wan_sample(None, WanSample(0.01).wire(), b""))
    asyncio.run(o.on_wan_sample(None, WanSample(0.01).wire(), b""))
    assert o.wan_gbps_live == 0.01


def test_without_loss_the_estimate_waits_for_md():
    o = _orch(wan_gbps=0.05, wan_rtt_ms=20.0)
    assert o.wan_gbps_live is None
    asyncio.run(o.on_wan_sample(None, WanSample(0.03).wire(), b""))
    assert o.wan_gbps_live == 0.03
