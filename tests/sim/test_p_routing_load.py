"""P's load as the simulator's routing reads it (``ClusterSim._route``): its sequences, queued
admissions and requests on their way, as the gateway's (its prefills: ``holding``;
tests/gateway/test_p_routing_load.py): a P whose earlier requests decode on RLD / MD is not busy,
nor is one whose prefill ended while it still sends that prompt's KV (the send shares the line,
not P's compute)."""

from __future__ import annotations

from pdd.sim.cluster import SimConfig
from tests.sim.test_sim_invariants import run_checked


def _recs(*arrivals_ms: int) -> list[dict]:
    """One 8-token prompt (one hash block) arriving at each time, 200 tokens out."""
    return [{"timestamp": t, "input_length": 8, "output_length": 200, "hash_ids": [7]} for t in arrivals_ms]


def test_the_cached_p_whose_requests_decode_elsewhere_is_chosen():
    """Two Ps, load slack 1: the first two requests' prefills ended on P0 and they decode on RLD /
    MD; the third goes to P0 too (its cache holds the prompt, its load is 0), as the gateway
    routes the same scenario. Counting them until they end (2 against 0) sends it to P1."""
    cfg = SimConfig(mode="pdd", n_p=2, load_slack=1, block_tokens=8, page_tokens=8, cutoff=False, warmup_frac=0.0)
    sim = run_checked(cfg, _recs(0, 200, 400))
    assert [r.p.name for r in sim.reqs] == ["P0", "P0", "P0"]
    assert all(r.t_first < 0.4 < r.t_last for r in sim.reqs[:2])  # decoding elsewhere when the third came


def test_a_p_still_sending_a_prompts_kv_is_not_busy():
    """Two Ps, load slack 0, a 0.02 Gbit/s WAN: the second request comes while P0 still sends the
    first one's KV to MD, its prefill over: P0 holds the prompt and runs no prefill (0 against
    0), so it takes the second too."""
    cfg = SimConfig(mode="pdd", n_p=2, load_slack=0, wan_gbps=0.02, block_tokens=8, page_tokens=8, cutoff=False,
                    warmup_frac=0.0)
    sim = run_checked(cfg, _recs(0, 100))
    first = sim.reqs[0]
    assert first.t_prefill_done < 0.1 < first.wan_flow.t_end  # P0's send of it still ran
    assert [r.p.name for r in sim.reqs] == ["P0", "P0"]
