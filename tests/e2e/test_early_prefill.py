"""P's prefill never waits for MD's reservation (a WAN round trip).

With a long WAN round trip (400 ms), P must have sampled the first token before MD's
reservation reply arrives, in every mode whose plan needs MD's cache state: ``cross_dc_pd`` and
``pdd`` with a positive TTFT budget. Both plans are exercised in ``pdd``: a budget every request
fits (P->MD, planned when MD says what it holds) and one no request fits (relayed at once on the
gateway's prefix index of MD, so P starts at once). The outputs equal a single engine's greedy outputs and
every page is free afterwards. An ordering check with a 400 ms margin, not a timed bound.
"""

from __future__ import annotations

import random

import pytest

from pdd.faults import StreamClient
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

RTT_MS = 400.0


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


@pytest.mark.parametrize("mode,budget_ms,pipeline", [
    ("cross_dc_pd", 0.0, "p_md"),
    ("pdd", 1e6, "p_md"),
    ("pdd", 1.0, "p_rld_md"),
])
def test_prefill_overlaps_md_reservation(small_model, topology_factory, mode, budget_ms, pipeline):
    cfg = make_cfg(small_model, mode, engine={"device": "cpu", "page_size": 16},
                   policy={"pipeline_ttft_budget_ms": budget_ms, "handoff_mode": "one_shot"},
                   link={"wan_gbps": 1.0, "wan_rtt_ms": RTT_MS, "wan_jitter_ms": 0.0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompt = _prompt(7, 100)
    c = StreamClient(topo.url, {"model": cfg.served_model_name, "prompt": prompt, "max_tokens": 12,
                                "temperature": 0, "ignore_eos": True}).start()
    assert c.wait(60) and c.error is None, c.error
    ev = c.summary["events_ms"]
    assert c.summary["pipeline"] == pipeline
    # P replied with its first token while MD's reservation was still on its way back (a relay,
    # planned at once on the gateway's index, may even finish on RLD before that reply)
    assert ev["p_first_token"] < ev.get("md_reserved", float("inf")), ev
    outs, _ = greedy_oracle(small_model, [prompt], 12)
    assert c.tokens == outs[0]
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
