import math

import pytest

from pdd.policy.pipeline import (PipelineInputs, choose_pipeline, expected_wan_seconds, missing_tokens,
                                 relays_every_request)
from pdd.types import Pipeline


def inp(**kw):
    base = dict(mode="pdd", prompt_tokens=10_000, md_cached_tokens=9_000, kv_bytes_per_token=100_000,
                wan_gbps_estimate=8.0, wan_rtt_ms=20.0, ttft_budget_ms=200.0)
    base.update(kw)
    return PipelineInputs(**base)


def test_missing_tokens_clamped():
    assert missing_tokens(inp()) == 1000
    assert missing_tokens(inp(md_cached_tokens=20_000)) == 0
    assert missing_tokens(inp(md_cached_tokens=-5)) == 10_000


def test_expected_wan_seconds_exact():
    # 1000 tok * 100 kB = 1e8 B = 8e8 bit at 8 Gbps = 0.1 s, + 20 ms RTT
    assert expected_wan_seconds(inp()) == pytest.approx(0.12)
    assert expected_wan_seconds(inp(md_cached_tokens=10_000)) == pytest.approx(0.02)
    assert math.isinf(expected_wan_seconds(inp(wan_gbps_estimate=0.0)))


def test_pdd_high_hit_goes_p_md():
    assert choose_pipeline(inp()) is Pipeline.P_MD  # 120 ms <= 200 ms


def test_pdd_low_hit_relays():
    assert choose_pipeline(inp(md_cached_tokens=0)) is Pipeline.P_RLD_MD  # 1.02 s > 200 ms


def test_budget_boundary_inclusive():
    assert choose_pipeline(inp(ttft_budget_ms=120.0)) is Pipeline.P_MD
    assert choose_pipeline(inp(ttft_budget_ms=119.9)) is Pipeline.P_RLD_MD


def test_zero_budget_always_relays():
    assert choose_pipeline(inp(ttft_budget_ms=0.0, md_cached_tokens=10_000, wan_rtt_ms=0.0)) is Pipeline.P_RLD_MD


def test_p_rld_never_planned_without_ablation():
    for cached in (0, 5_000, 9_999, 10_000):
        for budget in (0.0, 50.0, 1e6):
            assert choose_pipeline(inp(md_cached_tokens=cached, ttft_budget_ms=budget)) is not Pipeline.P_RLD


def test_allow_p_rld_ablation_low_hit_finishes_on_rld():
    assert choose_pipeline(inp(md_cached_tokens=0, allow_p_rld=True)) is Pipeline.P_RLD
    assert choose_pipeline(inp(allow_p_rld=True)) is Pipeline.P_MD  # high hit still ends at MD


def test_degraded_without_md():
    assert choose_pipeline(inp(md_available=False)) is Pipeline.P_RLD


def test_baseline_modes():
    assert choose_pipeline(inp(mode="colocated")) is Pipeline.COLOCATED
    assert choose_pipeline(inp(mode="same_dc_pd")) is Pipeline.P_D
    assert choose_pipeline(inp(mode="cross_dc_pd", md_cached_tokens=0)) is Pipeline.P_MD
    with pytest.raises(ValueError):
        choose_pipeline(inp(mode="bogus"))


def test_live_estimate_changes_decision():
    assert choose_pipeline(inp(wan_gbps_estimate=2.0)) is Pipeline.P_RLD_MD  # 0.42 s


@pytest.mark.parametrize("mode,budget,allow,expected", [
    ("pdd", 0.0, False, True), ("pdd", 50.0, False, False), ("pdd", 0.0, True, False),
    ("cross_dc_pd", 0.0, False, False), ("same_dc_pd", 0.0, False, False),
])
def test_relays_every_request_exactly_when_choose_pipeline_cannot_do_otherwise(mode, budget, allow, expected):
    assert relays_every_request(mode, budget, allow) is expected
    if expected:  # whatever MD holds, choose_pipeline relays
        for cached in (0, 500, 999):
            inp = PipelineInputs(mode=mode, prompt_tokens=1000, md_cached_tokens=cached, ttft_budget_ms=budget,
                                 allow_p_rld=allow)
            assert choose_pipeline(inp) == Pipeline.P_RLD_MD


def test_cross_traffic_halving_the_line_flips_a_request_to_the_relay():
    """The gateway's live estimate (MD's receive rates) falls when cross traffic takes half the
    line, and a request whose missing KV fitted the budget at the full rate now relays."""
    from pdd.policy.tcp_model import available_gbps
    from pdd.policy.wan_estimate import WanEstimate

    line, kvpt, budget = 0.05, 2048, 150.0
    # 300 missing tokens = 614,400 B: 98.3 ms at 0.05 Gbit/s (+20 ms RTT fits 150 ms), 196.6 ms at 0.025
    req = dict(mode="pdd", prompt_tokens=400, md_cached_tokens=100, kv_bytes_per_token=kvpt,
               wan_rtt_ms=20.0, ttft_budget_ms=budget)
    est = WanEstimate.for_line(line, 20.0)
    decisions = []
    for sample in [line] * 5 + [available_gbps(line, line / 2)] * 7:
        est.add(sample)
        decisions.append(choose_pipeline(PipelineInputs(wan_gbps_estimate=est.gbps, **req)))
    # the median (window 9) turns once most of the window is from the halved line: the 10th sample
    assert decisions == [Pipeline.P_MD] * 9 + [Pipeline.P_RLD_MD] * 3
    assert est.gbps == 0.025
    assert expected_wan_seconds(PipelineInputs(wan_gbps_estimate=0.025, **req)) == pytest.approx(
        0.02 + 614_400 * 8 / 0.025e9, rel=1e-12)
    # a high-hit request keeps P->MD at the halved rate: 20 missing tokens = 13 ms
    hi = dict(req, md_cached_tokens=380)
    assert choose_pipeline(PipelineInputs(wan_gbps_estimate=est.gbps, **hi)) is Pipeline.P_MD


def test_md_in_datacenter_a_is_p_d_and_not_relayed_at_once():
    from pdd.policy.pipeline import PipelineInputs, choose_pipeline, relays_every_request
    from pdd.types import Pipeline

    inp = PipelineInputs(mode="pdd", prompt_tokens=4096, md_cached_tokens=0, ttft_budget_ms=0.0,
                         md_crosses_wan=False)
    assert choose_pipeline(inp) == Pipeline.P_D  # a re-roled RLD: the KV takes the fast path
    assert choose_pipeline(PipelineInputs(mode="pdd", prompt_tokens=4096, md_available=False,
                                          md_crosses_wan=False)) == Pipeline.P_RLD
    assert relays_every_request("pdd", 0.0, False) is True
    assert relays_every_request("pdd", 0.0, False, md_in_a=True) is False


@pytest.mark.parametrize("mode,budget,allow,peek,expected", [
    ("pdd", 50.0, False, False, True), ("pdd", 0.0, False, False, False), ("pdd", 50.0, True, False, False),
    ("pdd", 50.0, False, True, False), ("cross_dc_pd", 50.0, False, False, False),
])
def test_plans_from_index_only_for_a_positive_budget_without_ablations(mode, budget, allow, peek, expected):
    from pdd.policy.pipeline import plans_from_index

    assert plans_from_index(mode, budget, allow, peek) is expected
    # never both: a zero budget relays every request at once whatever the index says
    assert not (plans_from_index(mode, budget, allow, peek) and relays_every_request(mode, budget, allow))
