"""The gateway's per-MD WAN estimates (``Orchestrator.wan_peers``) decide the pipeline and the MD:
fed by MD's ``wan_sample`` (per connection) and the reservation round trips, exported in
/pdd/stats ``wan_peers`` and on /metrics per instance. Fake connections, no processes."""
import asyncio

from prometheus_client import generate_latest

from pdd.gateway.orchestrator import ReqState
from pdd.topology import ROLE_MAIN
from pdd.transfer.messages import WanSample
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import fake_orchestrator


def _orch(**policy):
    o = fake_orchestrator(instances={"prefill": 1, "relay_decode": 1, "main_decode": 2},
                          policy={"pipeline_ttft_budget_ms": 150, **policy})
    o.kv_bytes_per_token = 2048
    return o


def _samples(o, md, gbps, n=3):
    for _ in range(n):
        asyncio.run(o.on_wan_sample(o.peers[md], WanSample(gbps).wire(), b""))


def _plan(o, md, tokens=300):
    st = ReqState("r", tokens, SamplingParams(max_tokens=4), trid="r")
    st.names = {ROLE_MAIN: md}
    return o._plan(st, tokens, 0)


def test_the_plan_reads_its_mds_own_estimate():
    """300 missing tokens (614,400 bytes) fit the 150 ms budget at 0.05 Gbit/s (118.3 ms), not at
    md0's measured 0.025 (216.6 ms); md1's path was not measured: still P->MD there."""
    o = _orch()
    assert _plan(o, "md0") == Pipeline.P_MD
    _samples(o, "md0", 0.025)
    assert o.wan_peers.gbps("md0") == 0.025 and o.wan_gbps_live == 0.025
    assert _plan(o, "md0") == Pipeline.P_RLD_MD
    assert _plan(o, "md1") == Pipeline.P_MD
    conf = _orch(wan_estimate="config")  # the baseline: the configured figure whatever was measured
    _samples(conf, "md0", 0.025)
    assert _plan(conf, "md0") == Pipeline.P_MD
    # the reservation's round trip is md0's RTT estimate (the windowed minimum)
    o2 = _orch()
    o2._wan_rtt_sample("md0", 0.070)
    o2._wan_rtt_sample("md0", 0.060)
    assert o2.wan_peers.rtt_ms_of("md0") == 60.0 and _plan(o2, "md0") == Pipeline.P_RLD_MD


def test_md_routing_moves_off_an_md_whose_estimate_dropped_and_is_exported():
    o = _orch()
    session = list(range(100, 500))  # 400 tokens, 25 pages of 16
    o.prefix_index["md0"].insert(session[:320])
    o.prefix_index["md1"].insert(session[:240])
    assert asyncio.run(o._route(ROLE_MAIN, session)) == "md0"  # 80 missing tokens vs 160
    assert o.totals["md_routes_by_wan"] == 0
    _samples(o, "md0", 0.0125)  # md0's path at a quarter: its 80 tokens take 124.9 ms, md1's 160 72.4 ms
    o.prefix_index["md0"].clear()
    o.prefix_index["md0"].insert(session[:320])
    assert asyncio.run(o._route(ROLE_MAIN, session)) == "md1"
    assert o.totals["md_routes_by_wan"] == 1 and o.md_routes == {"md0": 1, "md1": 1}
    text = generate_latest(o.metrics.registry).decode()
    assert 'pdd_wan_peer_goodput_bytes_per_second{instance="md0"} 1.5625e+06' in text
    assert 'pdd_wan_peer_rtt_seconds{instance="md0"} 0.02' in text
    assert 'pdd_gateway_md_routes_total{instance="md1"} 1.0' in text
    assert "pdd_gateway_md_routes_by_wan_total 1.0" in text
    # the configured figure: the hit decides (the previous rule), nothing counted
    c = _orch(wan_estimate="config")
    c.prefix_index["md0"].insert(session[:320])
    c.prefix_index["md1"].insert(session[:240])
    _samples(c, "md0", 0.0125)
    assert asyncio.run(c._route(ROLE_MAIN, session)) == "md0" and c.totals["md_routes_by_wan"] == 0
    assert c.wan_peers.view()["md0"]["gbps_measured"] == 0.0125 and c.wan_peers.view()["md0"]["gbps"] == 0.05


def test_a_fresh_gateway_reports_every_fault_total_as_zero():
    """/pdd/stats' totals name recovered and degraded (docs/FAULTS.md) from the start, 0 until a
    request is recovered or ends degraded, like every other outcome."""
    t = _orch().totals
    assert t["recovered"] == 0 and t["degraded"] == 0
