"""Heterogeneous tiers: MD on another page size (and dtype) than P and RLD (``cfg.tiers``).

fp32 everywhere, P and RLD with 16-token pages, MD with 32: the KV is re-chunked to MD's pages
on its way, MD's cache matches whole pages of its own (a 100-token prompt leaves 3 pages of 32 =
96 tokens cached), and greedy output across the handoff equals one engine's. The WAN carries
exactly the tokens MD lacks (``wan_bytes == wan_bytes_expected``, both exact here).

MD in bfloat16 with 8-token pages (narrower than P): P casts before sending, so the WAN carries
half the bytes; the first token is P's (computed in fp32: equal to the fp32 engine's), the rest
are MD's, decoded in bfloat16 (the output contract of mixed dtypes, docs/ARCHITECTURE.md: their
agreement with an engine in MD's dtype is measured, not promised).
Every page is free afterwards. Both also run with layer-wise streaming (``policy.kv_stream:
layerwise``, a layer group of 3 of the 4 layers: uneven groups): each group is re-chunked and cast
on its own, and the bytes are the same.
"""

from __future__ import annotations

import random

import pytest

from pdd.faults import StreamClient
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: 4 layers x (K, V) x 2 KV heads x 32 dims x fp32 bytes per token
FAST_WAN = {"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0}


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    first = [rng.randrange(5, 4000) for _ in range(100)]
    return [first, first + [7, 8, 9], [rng.randrange(5, 4000) for _ in range(200)]]


def _run(topo, cfg, prompts, max_tokens):
    got = []
    for prompt in prompts:
        c = StreamClient(topo.url, {"model": cfg.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True}).start()
        assert c.wait(90) and c.error is None, c.error
        assert topo.wait_idle(timeout_s=30), topo.last_busy
        got.append(c)
    return got


STREAMS = [{}, {"kv_stream": "layerwise", "kv_stream_layer_group": 3}]


@pytest.mark.parametrize("stream", STREAMS, ids=["whole", "layerwise"])
def test_mixed_page_sizes_greedy_equals_one_engine(small_model, topology_factory, stream):
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "page_size": 16}, link=FAST_WAN,
                   tiers={"main_decode": {"engine": {"page_size": 32, "num_pages": 1024}}},
                   policy={"handoff_min_tokens": 4, **stream},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompts = _prompts()
    outs, _ = greedy_oracle(small_model, prompts, 12)
    got = _run(topo, cfg, prompts, 12)
    for c, out in zip(got, outs):
        assert c.tokens == out
        k = c.tiers.count("rld")  # handed over after >= 4 relayed tokens: MD decoded the rest
        assert k >= 4 and c.tiers == ["rld"] * k + ["md"] * (12 - k), c.tiers
    assert [c.summary["wan_bytes_expected"] for c in got] == [100 * SLOT, 7 * SLOT, 200 * SLOT]
    # 3 of MD's 32-token pages: the plan above was made on them (7 tokens' bytes); MD's own count
    # comes with its reservation reply, which a request RLD finished first on a busy machine can
    # end without (a layer-wise send starts before it, from the gateway's index)
    s1 = got[1].summary
    if "md_reserved" in s1["events_ms"] or "md" in got[1].tiers:
        assert "md_reserved" in s1["events_ms"] and s1["md_cached_tokens"] == 96, s1
    else:
        assert s1["rld_finished_first"] and s1["md_cached_tokens"] == 0, s1
    st = topo.stats()
    assert st["wan_bytes"] == st["wan_bytes_expected"] == 307 * SLOT
    hw = {n: (st["instances"][n]["hardware"]["page_size"], st["instances"][n]["hardware"]["dtype"])
          for n in ("p0", "rld0", "md0")}
    assert hw == {"p0": (16, "float32"), "rld0": (16, "float32"), "md0": (32, "float32")}
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl


@pytest.mark.parametrize("stream", STREAMS, ids=["whole", "layerwise"])
def test_narrower_receiver_gets_the_cast_kv(small_model, topology_factory, stream):
    cfg = make_cfg(small_model, "cross_dc_pd", engine={"device": "cpu", "page_size": 16},
                   tiers={"main_decode": {"engine": {"page_size": 8, "dtype": "bfloat16", "num_pages": 4096}}},
                   policy=stream,
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompts = _prompts()
    outs, _ = greedy_oracle(small_model, prompts, 8)
    got = _run(topo, cfg, prompts, 8)
    half = SLOT // 2  # bfloat16 on the wire
    assert [c.summary["wan_bytes_expected"] for c in got] == [100 * half, 7 * half, 200 * half]
    assert got[1].summary["md_cached_tokens"] == 96  # 12 of MD's 8-token pages
    for c, out in zip(got, outs):
        assert c.tokens[0] == out[0] and len(c.tokens) == 8  # P's token, computed in fp32
    st = topo.stats()
    assert st["wan_bytes"] == st["wan_bytes_expected"] == 307 * half
    assert st["instances"]["md0"]["hardware"]["dtype"] == "bfloat16"
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
