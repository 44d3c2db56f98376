"""Per-peer live WAN estimates (``policy.wan_estimate.PeerWanEstimates``) and the decisions that
read them: the pipeline choice (``policy.pipeline``) and MD routing (``policy.routing``), with
exact values. Pure: no clock, no I/O."""

import pytest

from pdd.policy.pipeline import PipelineInputs, choose_pipeline, expected_wan_seconds
from pdd.policy.routing import InstanceLoad, choose_instance
from pdd.policy.wan_estimate import PeerWanEstimates, RttEstimate, transfer_seconds
from pdd.types import Pipeline

KV = 2048  # bytes per token of the demo model (docs/LINK.md)


def test_rtt_is_the_windowed_minimum():
    r = RttEstimate(window=3)
    assert r.ms is None
    assert r.add(25.0) == 25.0 and r.add(21.0) == 21.0 and r.add(40.0) == 21.0
    assert r.add(30.0) == 21.0 and r.add(35.0) == 30.0  # 21 left the window
    assert r.add(float("inf")) == 30.0 and r.add(-1.0) == 30.0
    with pytest.raises(ValueError, match="window"):
        RttEstimate(window=0)


def test_transfer_seconds_is_rtt_plus_bytes_over_goodput():
    assert transfer_seconds(614_400, 0.05, 20.0) == pytest.approx(0.02 + 0.098304, abs=1e-12)
    assert transfer_seconds(0, 0.05, 20.0) == 0.02
    assert transfer_seconds(1, 0.0, 20.0) == float("inf")
    # the pipeline policy's formula is the same one
    inp = PipelineInputs(mode="pdd", prompt_tokens=300, kv_bytes_per_token=KV, wan_gbps_estimate=0.05, wan_rtt_ms=20.0)
    assert expected_wan_seconds(inp) == transfer_seconds(300 * KV, 0.05, 20.0)


def test_each_peer_has_its_own_estimate_with_the_configured_line_as_fallback():
    est = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    assert est.gbps("md0") == 0.05 and est.rtt_ms_of("md0") == 20.0  # nothing measured yet
    for g in (0.025, 0.026, 0.024):
        est.add_goodput("md0", g)
    est.add_rtt("md0", 31.0)
    est.add_rtt("md0", 27.0)
    assert est.gbps("md0") == 0.025 and est.rtt_ms_of("md0") == 27.0
    assert est.gbps("md1") == 0.05 and est.rtt_ms_of("md1") == 20.0  # md1 untouched
    assert est.transfer_s("md0", 614_400) == pytest.approx(0.027 + 0.196608, abs=1e-12)
    assert est.transfer_s("md1", 614_400) == pytest.approx(0.020 + 0.098304, abs=1e-12)
    v = est.view()
    assert v["md0"] == {"gbps": 0.025, "rtt_ms": 27.0, "gbps_measured": 0.025, "rtt_ms_measured": 27.0,
                        "goodput_samples": 3, "rtt_samples": 2}
    # policy.wan_estimate: config -- every peer reads the configured figures, samples still shown
    cfg = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0, source="config")
    cfg.add_goodput("md0", 0.025)
    cfg.add_rtt("md0", 27.0)
    assert cfg.gbps("md0") == 0.05 and cfg.rtt_ms_of("md0") == 20.0
    assert cfg.view()["md0"]["gbps_measured"] == 0.025
    with pytest.raises(ValueError, match="source"):
        PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0, source="guess")


def test_configured_loss_caps_a_peer_before_and_after_samples():
    from pdd.policy.tcp_model import mathis_gbps

    m = mathis_gbps(1460, 20.0, 1e-3)  # 0.0226 Gbit/s < the 0.05 line
    est = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0, loss_rate=1e-3)
    assert est.gbps("md0") == pytest.approx(m, rel=1e-12)
    est.add_goodput("md0", 0.04)
    assert est.gbps("md0") == pytest.approx(m, rel=1e-12)


def _plan(est: PeerWanEstimates, md: str, missing_tokens: int = 300, budget_ms: float = 150.0) -> Pipeline:
    return choose_pipeline(PipelineInputs(mode="pdd", prompt_tokens=missing_tokens, md_cached_tokens=0,
                                          kv_bytes_per_token=KV, wan_gbps_estimate=est.gbps(md),
                                          wan_rtt_ms=est.rtt_ms_of(md), ttft_budget_ms=budget_ms))


def test_a_request_flips_to_the_relay_as_its_mds_estimate_drops():
    """300 missing tokens = 614,400 bytes: 20 + 98.3 = 118.3 ms at the configured 0.05 Gbit/s fits a
    150 ms budget (P->MD); once md0's window reads 0.025 Gbit/s (cross traffic took half the
    line) it is 20 + 196.6 = 216.6 ms: relayed. md1's path is unchanged, so the same request
    planned to md1 still goes P->MD; with the configured figure it never flips."""
    live = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    conf = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0, source="config")
    assert _plan(live, "md0") == Pipeline.P_MD
    for g in (0.05, 0.05):
        live.add_goodput("md0", g), conf.add_goodput("md0", g)
    assert _plan(live, "md0") == Pipeline.P_MD
    for g in (0.025, 0.025, 0.025):  # the median turns with the third sample of the halved line
        live.add_goodput("md0", g), conf.add_goodput("md0", g)
    assert live.gbps("md0") == 0.025
    assert _plan(live, "md0") == Pipeline.P_RLD_MD
    assert _plan(live, "md1") == Pipeline.P_MD
    assert _plan(conf, "md0") == Pipeline.P_MD
    # a longer round trip alone flips it too: 118.3 ms + 40 ms more > 150 ms
    rtt = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    rtt.add_rtt("md0", 60.0)
    assert _plan(rtt, "md0") == Pipeline.P_RLD_MD


def _mds(est: PeerWanEstimates, hits: dict, prompt: int = 400, loads: dict | None = None) -> list[InstanceLoad]:
    loads = loads or {}
    return [InstanceLoad(n, running=loads.get(n, 0), prefix_hit_tokens=h,
                         transfer_s=est.transfer_s(n, (prompt - h) * KV)) for n, h in hits.items()]


def test_an_md_whose_estimate_dropped_loses_the_routing_choice():
    """md0 holds 320 of the prompt's 400 tokens, md1 240: 80 vs 160 missing tokens. At the
    configured 0.05 Gbit/s md0's transfer is 20 + 26.2 = 46.2 ms against md1's 20 + 52.4 = 72.4 ms,
    so md0 wins (the longest hit, as without estimates). When md0's goodput reads 0.0125 Gbit/s
    (a quarter) its 80 tokens take 20 + 104.9 = 124.9 ms: md1 wins."""
    est = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    hits = {"md0": 320, "md1": 240}
    c = _mds(est, hits)
    assert [x.transfer_s for x in c] == pytest.approx([0.0462144, 0.0724288], abs=1e-12)
    assert choose_instance(c, "cache_aware", load_slack=4, prompt_tokens=400, min_hit_frac=0.5) == 0
    for _ in range(3):
        est.add_goodput("md0", 0.0125)
    c = _mds(est, hits)
    assert c[0].transfer_s == pytest.approx(0.1248576, abs=1e-12)
    assert choose_instance(c, "cache_aware", load_slack=4, prompt_tokens=400, min_hit_frac=0.5) == 1
    # without estimates (transfer_s None) the hit decides, whatever the line does
    plain = [InstanceLoad(x.name, prefix_hit_tokens=x.prefix_hit_tokens) for x in c]
    assert choose_instance(plain, "cache_aware", load_slack=4, prompt_tokens=400, min_hit_frac=0.5) == 0


def test_routing_weighs_transfer_time_with_load_and_the_slack():
    est = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    # cold prompt, equal paths: equal transfer times, the least loaded wins
    c = _mds(est, {"md0": 0, "md1": 0}, loads={"md0": 2, "md1": 1})
    assert choose_instance(c, "cache_aware", load_slack=4, load_cost_s=0.01) == 1
    # md0's path is at half rate: a cold 400-token prompt costs 20 + 262.1 ms there against
    # 20 + 131.1 ms on md1, which wins even when 3 busier (3 x 10 ms < 131 ms) ...
    for _ in range(3):
        est.add_goodput("md1", 0.05)
        est.add_goodput("md0", 0.025)
    c = _mds(est, {"md0": 0, "md1": 0}, loads={"md0": 0, "md1": 3})
    assert choose_instance(c, "cache_aware", load_slack=4, load_cost_s=0.01) == 1
    # ... but not beyond the load slack
    c = _mds(est, {"md0": 0, "md1": 0}, loads={"md0": 0, "md1": 5})
    assert choose_instance(c, "cache_aware", load_slack=4, load_cost_s=0.01) == 0
    # a tiny shared prefix does not outweigh a request in flight: 16 tokens = 5.2 ms < 10 ms
    est2 = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    c = _mds(est2, {"md0": 16, "md1": 0}, loads={"md0": 1, "md1": 0})
    assert choose_instance(c, "cache_aware", load_slack=4, load_cost_s=0.01) == 1
    assert choose_instance(c, "cache_aware", load_slack=4, load_cost_s=0.0) == 0
