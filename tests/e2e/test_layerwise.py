"""Layer-wise KV streaming end to end (``policy.kv_stream: layerwise``, docs/LINK.md).

P hands each layer's KV to its streams as the prefill computes it, so the wire carries (request,
layer range, page range) units. The bytes must be exactly those of whole mode (only the pages MD
lacks cross the WAN, the partial last page as its filled slots), greedy outputs equal a single
engine's (the receivers assembled every layer of every page), and every page is free afterwards.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import make_cfg, run_checking_wan_bytes, warm_then_cold_prompts

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: 4 layers x (K, V) x 2 KV heads x 32 dims x fp32 bytes per token


@pytest.mark.parametrize("mode,group", [("cross_dc_pd", 1), ("pdd", 3)])
def test_layerwise_bytes_outputs_and_pages(small_model, topology_factory, mode, group):
    # prefill chunks of 64 tokens: the 200-token prompt's layers arrive over four chunks. No
    # cut-off: in pdd mode RLD may finish a request's 8 tokens before its KV has crossed (a busy
    # machine), and the cut-off would then cancel the rest, so MD would not hold the first
    # prompt's pages for the second; without it the KV always lands and MD keeps the prompt's.
    # Liveness 30 s: a peer silent for the default 5 s on a busy machine is declared lost, and its
    # cache (and the gateway's index of it) with it, so the second prompt would cross whole.
    cfg = make_cfg(small_model, mode, engine={"device": "cpu", "page_size": 16, "prefill_chunk_tokens": 64},
                   policy={"kv_stream": "layerwise", "kv_stream_layer_group": group, "cutoff": False},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0,
                   liveness={"dead_after_s": 30.0})
    topo = topology_factory(cfg)
    prompts = warm_then_cold_prompts(5, 100, 200)
    want = [100 * SLOT, 7 * SLOT, 200 * SLOT]  # MD's 6 cached pages of the first prompt never cross again
    _, st = run_checking_wan_bytes(topo, prompts, want, 8)
    p0 = st["instances"]["p0"]
    assert p0["wan_bytes_sent"] == sum(want)
    # every transfer went layer by layer: MD's three, and in pdd RLD's three
    assert p0["counters"]["layerwise_transfers"] == (3 if mode == "cross_dc_pd" else 6), p0["counters"]


def test_layerwise_disconnect_mid_prefill_cuts_the_streams_and_frees_every_page_once(tmp_path_factory, small_model):
    """A 2,400-token prompt prefilled in 32-token chunks held to 40 ms each (~3 s): its layer
    groups stream to RLD and MD while it runs. The client leaves once P has run two chunks (the
    first chunk's layers are then on their way, between layer groups of the prefill): the prefill
    stops within one chunk, the streams are cancelled (kv_cancel), the gateway's WAN balance holds
    (planned = sent + cancelled) and every instance frees every page."""
    from pdd.launch import Topology
    from tests.e2e.test_prefill_cancel import CHUNK, LONG, STEP_MS, RawClient, _cancelled_total, _one_live, \
        _p, _prompt, _settled, _until

    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "min_step_ms": STEP_MS, "prefill_chunk_tokens": CHUNK,
                                               "max_batch_tokens": CHUNK},
                   link={"wan_gbps": 0.05, "wan_rtt_ms": 20.0, "wan_jitter_ms": 0.0},
                   policy={"kv_stream": "layerwise"}, request_timeout_s=60.0)
    topo = Topology(cfg, log_dir=tmp_path_factory.mktemp("lw-cancel-logs"))
    topo.start()
    try:
        before = _cancelled_total(topo)
        client = RawClient(topo, {"prompt": _prompt(11), "max_tokens": 8, "temperature": 0, "stream": True})
        try:
            rid, view = _until(lambda: _one_live(topo), "the request to reach the gateway")
            trid = view["trid"]
            _until(lambda: (_p(topo)["prefill_live"].get(trid) or {}).get("chunks", 0) >= 2, "P to run two chunks")
        finally:
            client.close()
        entry = _until(lambda: next((c for c in _p(topo)["prefill_cancels"] if c["rid"] == trid), None),
                       "P to report the request's prefill cancelled")
        assert entry["chunks_after_cancel"] <= 1, entry
        assert entry["prefilled_tokens"] < entry["prompt_tokens"] == LONG, entry
        p = _p(topo)
        assert p["counters"]["layerwise_transfers"] >= 1, p["counters"]  # RLD's stream had started
        assert p["counters"].get("kv_bytes_before_first_token", 0) == 0  # no first token: never sealed
        _settled(topo, before)
    finally:
        topo.stop()
