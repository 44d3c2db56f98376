"""pdd.sim.ttft_phases: a relayed request's TTFT split at P's reply, live and simulated, by the
prompt tokens P computed; and the median fast-path fit that phase points at."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdd.sim.ttft_phases import bucket_name, format_ttft_phases, ttft_phases
from pdd.types import Pipeline


def live(prompt, cached, p_reply_ms, ttft_s, pipeline="p_rld_md", ok=True, send_s=10.0):
    return {"ok": ok, "prompt_tokens": prompt, "send_s": send_s, "token_times_s": [send_s + ttft_s, send_s + 1.0],
            "pdd": {"pipeline": pipeline, "p_cached_tokens": cached, "events_ms": {"p_first_token": p_reply_ms}}}


def sim_req(p_done_s, first_s, pipeline=Pipeline.P_RLD_MD, arrival=5.0):
    return SimpleNamespace(arrival=arrival, t_prefill_done=None if p_done_s is None else arrival + p_done_s,
                           t_first=None if first_s is None else arrival + first_s, pipeline=pipeline)


def test_phases_split_each_relayed_request_at_p_s_reply_by_the_tokens_p_computed():
    recs = [live(100, 0, 20.0, 0.040), live(200, 100, 30.0, 0.050),  # 100 computed each: bucket 0-127
            live(1000, 0, 150.0, 0.170),  # 512-1023
            live(5000, 1000, 500.0, 0.530),  # 4000 computed: >=1024
            live(128, 0, 60.0, 0.080),  # exactly 128: 128-511
            # left out: P -> MD live, failed live, another pipeline simulated, no simulated prefill end
            live(100, 0, 20.0, 0.040, pipeline="p_md"), live(100, 0, 20.0, 0.040, ok=False),
            live(100, 0, 20.0, 0.040), live(100, 0, 20.0, 0.040)]
    reqs = [sim_req(0.018, 0.042), sim_req(0.026, 0.050), sim_req(0.160, 0.190), sim_req(0.450, 0.490),
            sim_req(0.050, 0.075), sim_req(0.018, 0.042), sim_req(0.018, 0.042),
            sim_req(0.018, 0.042, pipeline=Pipeline.P_MD), sim_req(None, 0.042)]
    got = ttft_phases(recs, SimpleNamespace(reqs=reqs))
    assert [(g["prompt_tokens_computed"], g["requests"]) for g in got] == [("0-127", 2), ("128-511", 1),
                                                                          ("512-1023", 1), (">=1024", 1)]
    short = got[0]
    assert short["to_p_reply_ms"] == {"live": pytest.approx(25.0), "sim": pytest.approx(22.0)}
    # live: TTFT 40 and 50 ms less the reply at 20 and 30; sim: 42-18 and 50-26
    assert short["after_p_reply_ms"] == {"live": pytest.approx(20.0), "sim": pytest.approx(24.0)}
    assert got[3]["to_p_reply_ms"] == {"live": pytest.approx(500.0), "sim": pytest.approx(450.0)}
    assert got[3]["after_p_reply_ms"] == {"live": pytest.approx(30.0), "sim": pytest.approx(40.0)}
    assert ttft_phases(recs[5:7], SimpleNamespace(reqs=reqs[5:7])) == []


def test_bucket_names_and_the_output_line():
    assert bucket_name(0, 128) == "0-127" and bucket_name(1024, None) == ">=1024"
    ph = [{"prompt_tokens_computed": "0-127", "requests": 2, "to_p_reply_ms": {"live": 25.0, "sim": 22.0},
           "after_p_reply_ms": {"live": 20.0, "sim": 24.0}}]
    assert format_ttft_phases(ph) == ("\nTTFT phases, 0-127 prompt tokens computed (2 relayed requests, medians): "
                                      "to P's reply live 25.0 / sim 22.0 ms, then to the first token live 20.0 / "
                                      "sim 24.0 ms")
    assert format_ttft_phases([]) == ""


def test_the_median_fast_path_is_the_typical_trip_the_waits_do_not_pull_up():
    from pdd.sim.live_measures import live_fast_path

    kvb = 2048

    def rec(tokens, extra_ms=0.0):
        # 3 ms + the prompt's KV at 2 Gbit/s from P's reply to the first token (+ extra_ms: it waited)
        dt_ms = 3.0 + tokens * kvb * 8 / 2e9 * 1e3 + extra_ms
        return {"ok": True, "prompt_tokens": tokens,
                "pdd": {"pipeline": "p_rld_md", "events_ms": {"md_reserved": 5.0, "p_first_token": 50.0,
                                                            "first_token": 50.0 + dt_ms}}}

    # 30 requests on the line, 10 of them (spread over the sizes) waited 20-40 ms more
    recs = [rec(100 * k, extra_ms=(20.0 + 2 * k) if k % 3 == 0 else 0.0) for k in range(1, 31)]
    med = live_fast_path(recs, kvb, max_gbps=4.0, fit="median")
    assert med["samples"] == 30
    assert med["latency_s"] == pytest.approx(0.003, rel=1e-4) and med["gbps"] == pytest.approx(2.0, rel=1e-4)
    lsq = live_fast_path(recs, kvb, max_gbps=4.0)
    assert lsq["latency_s"] == pytest.approx(0.006770, rel=1e-3)  # least squares books part of the waits as latency
    assert med["median_s"] == lsq["median_s"]
    with pytest.raises(ValueError, match="fit must be 'least_squares' or 'median', got 'mean'"):
        live_fast_path(recs, kvb, max_gbps=4.0, fit="mean")
