"""A WAN KV stream striped over several connections end to end (``link.wan_connections``,
docs/LINK.md "Parallel connections"): the same bytes as one connection, request by request,
greedy outputs equal one engine's (MD imported every page in place), and every page freed."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import make_cfg, run_checking_wan_bytes, warm_then_cold_prompts

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: KV bytes per token


@pytest.mark.parametrize("kv_stream", ["whole", "layerwise"])
def test_four_connections_send_the_bytes_of_one_and_free_every_page(small_model, topology_factory, kv_stream):
    cfg = make_cfg(small_model, "cross_dc_pd", engine={"device": "cpu", "page_size": 16, "prefill_chunk_tokens": 64},
                   link={"wan_connections": 4}, policy={"kv_stream": kv_stream, "wan_express_lane_bdp": 0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompts = warm_then_cold_prompts(3, 150, 230)
    want = [150 * SLOT, 9 * SLOT, 230 * SLOT]  # MD's 9 cached pages of the first prompt never cross again
    _, st = run_checking_wan_bytes(topo, prompts, want, 6)
    p0 = st["instances"]["p0"]
    assert p0["wan_bytes_sent"] == sum(want)
    stripes = p0["wan_stripe_bytes"]  # one striped lane (express off: every transfer on it), 4 connections
    assert len(stripes) == 1 and len(next(iter(stripes.values()))) == 4, stripes
    assert sum(next(iter(stripes.values()))) == sum(want)
