"""Live per-MD WAN estimates decide the pipeline end to end (docs/LINK.md "Live estimates that
decide"): the line is slowed through the link emulator's control port (``set_link``), MD's
measured KV receive rates bring md0's goodput estimate down, and the next request whose missing
KV no longer fits the TTFT budget is relayed, as ``policy.pipeline.choose_pipeline`` says for the
inputs the gateway recorded. Waits are on the gateway's counters and estimates, never on sleeps
of a guessed length."""
from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import pytest

from pdd.faults import StreamClient
from pdd.policy.pipeline import PipelineInputs, choose_pipeline
from pdd.transfer.link import set_link
from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: KV bytes per token
BUDGET_MS = 150.0
TOKENS = 250  # a fresh prompt: 512,000 bytes, 20 + 81.9 ms at 0.05 Gbit/s: fits 150 ms (an RTT up to 68 ms too)
# the goodput under which TOKENS no longer fit at a 20 ms RTT: (150 - 20) ms for 512,000 bytes
THRESHOLD_GBPS = TOKENS * SLOT * 8 / ((BUDGET_MS - 20.0) / 1000.0) / 1e9  # 0.0315


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def test_slowed_line_flips_requests_to_the_relay(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu"},
                   policy={"pipeline_ttft_budget_ms": BUDGET_MS, "cutoff": False},
                   link={"wan_gbps": 0.05, "wan_rtt_ms": 20.0, "wan_jitter_ms": 0.0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)

    def run(prompt: list[int]) -> dict:
        c = StreamClient(topo.url, {"model": cfg.served_model_name, "prompt": prompt, "max_tokens": 4,
                                    "temperature": 0, "ignore_eos": True}).start()
        assert c.wait(60) and c.error is None, c.error
        return c.summary

    def md0() -> dict:
        return topo.stats()["wan_peers"].get("md0", {})

    def planned_as_the_policy_says(s: dict) -> str:
        d = [x for x in s["decisions"] if x["policy"] == "pipeline"][-1]
        assert choose_pipeline(PipelineInputs(**d["inputs"])).value == d["result"] == s["pipeline"], s
        return d["inputs"]["wan_gbps_estimate"]

    # nothing measured yet: md0 reads the configured line, the request fits the budget: P->MD
    first = run(_ids(1, TOKENS))
    assert planned_as_the_policy_says(first) == 0.05 and first["pipeline"] == "p_md", first
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    deadline = time.monotonic() + 60  # a bound on the waits below, not a timing assert
    while md0().get("goodput_samples", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # MD's wan_sample for the first transfer (sent after its import)
    before = md0()
    assert before["goodput_samples"] == 1 and before["rtt_samples"] >= 1, before
    assert before["rtt_ms"] >= 20.0, before  # a reservation's round trip crossed the 20 ms line

    # the line at a fifth (cross traffic, a congested path): MD's receive rates fall, md0's
    # median with them; every request meanwhile is planned by the policy on md0's estimate
    asyncio.run(set_link(cfg.host, topo.layout.link_control_port, gbps=0.01))
    seen, seed = [], 10
    try:
        while md0()["gbps"] >= THRESHOLD_GBPS and time.monotonic() < deadline and len(seen) < 8:
            n = md0()["goodput_samples"]
            s = run(_ids(seed, TOKENS))
            seed += 1
            seen.append((planned_as_the_policy_says(s), s["pipeline"]))
            assert topo.wait_idle(timeout_s=30), topo.last_busy
            while md0()["goodput_samples"] == n and time.monotonic() < deadline:
                time.sleep(0.05)  # this transfer's sample reached the gateway
        low = md0()
        assert low["gbps"] < THRESHOLD_GBPS, (low, seen)
        counts = topo.stats()["pipelines"]
        relayed = run(_ids(99, TOKENS))
    finally:
        asyncio.run(set_link(cfg.host, topo.layout.link_control_port, gbps=0.05))
    assert planned_as_the_policy_says(relayed) < THRESHOLD_GBPS and relayed["pipeline"] == "p_rld_md", relayed
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    after = topo.stats()
    assert after["pipelines"].get("p_rld_md", 0) == counts.get("p_rld_md", 0) + 1, (counts, after["pipelines"])
    assert after["pipelines"].get("p_md", 0) == counts.get("p_md", 0), (counts, after["pipelines"])
    assert after["wan_estimate"] == "live" and after["wan_bytes"] == after["wan_bytes_expected"], after
    with urllib.request.urlopen(topo.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'pdd_wan_peer_goodput_bytes_per_second{instance="md0"}' in text and 'pdd_wan_peer_rtt_seconds{instance="md0"}' in text
    assert json.dumps(after["wan_peers"])  # plain data in /pdd/stats
    assert topo.flush()["leaked_pages"] == 0
