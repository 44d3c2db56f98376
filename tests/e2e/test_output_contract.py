"""Output contract: greedy output through pdd equals one monolithic engine's, whatever the
handoff point (right after the first token, mid-stream). fp32, >= 20 prompts.

A prompt may be excused only for a detected near-tie: at the first differing position the
reference engine's top-two logits are within ``TIE_TOL`` (MD recomputes the handed-over
tokens' KV, which is not bit-equal to RLD's). At most 2 of the 20 may be excused.
"""

from __future__ import annotations

import random

import httpx
import pytest

from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

TIE_TOL = 1e-3
N_PROMPTS = 20
MAX_TOKENS = 32


def _prompts() -> list[list[int]]:
    rng = random.Random(1234)
    lengths = [8, 15, 16, 17, 31, 33, 50, 64, 90, 128, 150, 200, 255, 256, 300, 333, 400, 480, 512, 600]
    assert len(lengths) == N_PROMPTS
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(small_model):
    """Greedy outputs and a logits probe from one in-process engine (the single-engine oracle)."""
    return greedy_oracle(small_model, _prompts(), MAX_TOKENS)


# no "never" (RLD decodes all): "mid-stream"'s first 12 tokens are RLD's alone, and the suite must stay
# within CI's 30 minutes
@pytest.mark.parametrize("handoff_min_tokens,label", [(1, "after-first-token"), (12, "mid-stream")])
def test_greedy_equals_single_engine_across_handoff(small_model, reference, topology_factory, handoff_min_tokens,
                                                     label):
    ref_outs, margin = reference
    # a fast WAN so MD's KV is there early and the handoff point is set by handoff_min_tokens;
    # every request relayed (budget 0: the pipeline decision does not read the machine's load);
    # RLD's step held to >= 20 ms, so its 32 tokens take >= 0.64 s, far longer than MD's KV
    # needs on a quiet machine (a busy one may still let RLD finish first: checked below)
    cfg = make_cfg(small_model, "pdd", link={"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0},
                   policy={"handoff_min_tokens": handoff_min_tokens, "pipeline_ttft_budget_ms": 0},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}})
    topo = topology_factory(cfg)
    excused, handoffs = [], []
    for i, p in enumerate(_prompts()):
        r = httpx.post(topo.url + "/v1/completions", timeout=120,
                       json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                             "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        import json

        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        toks = [c["pdd"]["token_id"] for c in chunks if c.get("choices")]
        tiers = [c["pdd"]["tier"] for c in chunks if c.get("choices")]
        summary = chunks[-1]["pdd"]
        handoffs.append(summary["handoff_pos"])
        assert len(toks) == MAX_TOKENS
        if handoff_min_tokens >= MAX_TOKENS:
            assert summary["handoff_pos"] is None and set(tiers) == {"rld"}
        elif summary["handoff_pos"] is None:  # RLD finished before MD's KV was ready
            assert summary["rld_finished_first"] and set(tiers) == {"rld"}, summary
        else:
            hp = summary["handoff_pos"]
            assert hp >= handoff_min_tokens, summary
            assert tiers == ["rld"] * hp + ["md"] * (MAX_TOKENS - hp)  # no gap, no repeat at the switch
        if toks != ref_outs[i]:
            d = next(j for j, (a, b) in enumerate(zip(toks, ref_outs[i])) if a != b)
            m = margin(p, ref_outs[i][:d])
            assert m <= TIE_TOL, f"prompt {i} ({len(p)} tokens) diverged at {d} with top-2 margin {m:.4f}"
            excused.append((i, d, m))
    print(f"[{label}] handoff positions: {handoffs}; excused near-ties: {excused}")
    assert len(excused) <= 2
    if handoff_min_tokens < MAX_TOKENS:  # the handoff this case is about happened
        assert any(h is not None for h in handoffs), handoffs
