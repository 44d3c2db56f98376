"""The gateway probes MDs whose goodput estimate is stale (``policy.wan_probe_interval_s``): which
ones, what a probe sends, how its timings enter the MD's estimate, its counters. Fake
connections, no processes; the clock is passed in."""
import asyncio

import pytest
from prometheus_client import generate_latest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator, ReqState
from pdd.policy.cutoff import should_cut_off
from pdd.topology import ROLE_MAIN, layout
from pdd.transfer.messages import WanSample
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer


class PayloadPeer(FakePeer):
    def __init__(self):
        super().__init__()
        self.payloads: list[int] = []

    async def call(self, h, payload=b"", timeout=None):
        self.payloads.append(len(payload))
        return await super().call(h, payload, timeout)


def _orch(**policy):
    cfg = ClusterConfig.model_validate({"mode": "pdd", "instances": {"prefill": 1, "relay_decode": 1, "main_decode": 2},
                                        "policy": {"pipeline_ttft_budget_ms": 150, "wan_probe_interval_s": 5,
                                                   **policy}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {s.name: PayloadPeer() for s in o.layout.engines}
    o.kv_bytes_per_token = 2048
    return o


def test_only_stale_mds_are_probed_once_per_interval():
    o = _orch()
    assert o._probes_due(100.0) == ["md0", "md1"]  # never sampled
    assert o._probes_due(102.0) == []  # probed at 100
    o.wan_last_sample["md0"] = 104.0  # md0 received KV
    assert o._probes_due(105.5) == ["md1"]
    assert o._probes_due(109.5) == ["md0"]
    assert _orch(wan_probe_interval_s=0)._probes_due(1e9) == []  # off


def test_a_probe_sends_an_empty_and_a_sized_call_and_counts():
    o = _orch(wan_probe_bytes=65536)
    asyncio.run(o._probe("md1"))
    assert [h["t"] for h in o.peers["md1"].sent] == ["wan_probe", "wan_probe"]
    assert o.peers["md1"].payloads == [0, 65536]
    assert o.wan_probes["probes"] == 1 and o.wan_probes["bytes"] == 65536
    assert o.wan_peers.view()["md1"]["rtt_samples"] == 1


def test_probe_timings_move_an_idle_mds_estimate_and_the_plan():
    """md0 read 0.025 Gbit/s (a 300-token request relays: 216.6 ms > 150 ms). Probes of md0,
    empty 20 ms and 125,000 bytes 40 ms, read 0.05 Gbit/s each: once 5 of its 9 samples do, the
    median is back and the request fits (118.3 ms) again."""
    o = _orch()
    for _ in range(4):
        o.wan_peers.add_goodput("md0", 0.025)
    st = ReqState("r", 300, SamplingParams(max_tokens=4), trid="r")
    st.names = {ROLE_MAIN: "md0"}
    assert o._plan(st, 300, 0) == Pipeline.P_RLD_MD
    for _ in range(5):
        o._probe_result("md0", 0.020, 0.040, 125_000)
    assert o.wan_peers.gbps("md0") == pytest.approx(0.05, rel=1e-12)
    assert o.wan_peers.rtt_ms_of("md0") == pytest.approx(20.0)
    assert o._plan(st, 300, 0) == Pipeline.P_MD
    assert o.wan_probes == {"probes": 5, "failures": 0, "bytes": 625_000, "goodput_samples": 5}
    text = generate_latest(o.metrics.registry).decode()
    assert 'pdd_gateway_wan_probes_total{outcome="ok"} 5.0' in text


def test_a_failed_probe_is_counted_and_changes_nothing():
    o = _orch()

    async def boom(h, payload=b"", timeout=None):
        raise ConnectionError("gone")

    o.peers["md0"].call = boom
    asyncio.run(o._probe("md0"))
    assert o.wan_probes["failures"] == 1 and o.wan_probes["probes"] == 0
    assert o.wan_peers.view() == {}


def test_probes_bring_back_the_overall_estimate_the_cut_off_reads():
    """The line was slow: md0's 9 KV receive rates read 0.01 Gbit/s, so did the overall
    estimate (``wan_gbps_live``: /pdd/stats, ``pdd_wan_goodput_bytes_per_second``, the cut-off's
    remaining time). Back at 0.05 Gbit/s, md0 idle: 5 probes at 0.05 bring both medians back, so a
    600-token transfer (1,228,800 bytes) just begun has 196.608 ms left, under the 0.5 s
    ``cutoff_min_remaining_s``: it is not cut off (at the stale 0.01 it read 983 ms and was; live,
    the overall estimate stayed at 0.0093 Gbit/s while md0's read 0.041 after the restore)."""
    o = _orch()
    for _ in range(9):
        asyncio.run(o.on_wan_sample(o.peers["md0"], WanSample(0.01).wire(), b""))
    st = ReqState("r", 600, SamplingParams(max_tokens=4), trid="r")
    st.names = {ROLE_MAIN: "md0"}
    st.wan.expected = 600 * 2048
    assert o.wan_gbps_live == pytest.approx(0.01) and o._remaining_wan_s(st) == pytest.approx(0.98304)
    for _ in range(5):
        o._probe_result("md0", 0.020, 0.040, 125_000)
    assert o.wan_peers.gbps("md0") == pytest.approx(0.05, rel=1e-12)
    assert o.wan_gbps_live == pytest.approx(0.05, rel=1e-12)
    assert o._remaining_wan_s(st) == pytest.approx(0.196608, rel=1e-12)
    assert not should_cut_off(True, False, o._remaining_wan_s(st), o.cfg.policy.cutoff_min_remaining_s)
    text = generate_latest(o.metrics.registry).decode()
    assert "pdd_wan_goodput_bytes_per_second 6.25e+06" in text
