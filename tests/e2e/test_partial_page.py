"""A prompt's partial last KV page crosses the WAN as its filled token slots only.

``cross_dc_pd`` (every request P->MD): a cold 100-token prompt (6 whole pages of 16 and 4
tokens) sends 100 tokens' KV, not 7 pages; the same prompt plus 3 tokens then hits MD's 6 cached
pages and sends the 7 tokens after them. With the ``kv_whole_pages`` ablation both go page-
granular (7 pages, then 1). Greedy outputs equal a single engine's in both, so the partial page
MD imported is the KV it needed; every page is free afterwards.

Both transfers are small (under 2 BDPs of the line: 250 kB), so P sends them on the WAN's express
lane (pdd.policy.wan_order.wan_lane); a third, cold 200-token prompt (400 kB) takes the bulk lane.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import make_cfg, run_checking_wan_bytes, warm_then_cold_prompts

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: 4 layers x (K, V) x 2 KV heads x 32 dims x fp32 bytes per token
PAGE = 16 * SLOT


@pytest.mark.parametrize("whole", [False, True])
def test_partial_last_page_bytes(small_model, topology_factory, whole):
    cfg = make_cfg(small_model, "cross_dc_pd", engine={"device": "cpu", "page_size": 16},
                   policy={"kv_whole_pages": whole},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompts = warm_then_cold_prompts(3, 100, 200)
    want = [7 * PAGE, 1 * PAGE, 13 * PAGE] if whole else [100 * SLOT, 7 * SLOT, 200 * SLOT]
    summaries, st = run_checking_wan_bytes(topo, prompts, want, 8)
    assert summaries[1]["md_cached_tokens"] == 96
    assert st["instances"]["p0"]["wan_lane_transfers"] == {"express": 2, "bulk": 1}, st["instances"]["p0"]
