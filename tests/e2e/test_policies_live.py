"""Load-dependent policies proven on a running pdd topology (issue #22 item 3): the pipeline
choice (``policy.pipeline_ttft_budget_ms``) and the ``allow_p_rld`` ablation, end to end.

The choice is made from byte counts and configured rates only (``policy.wan_estimate: config``
pins the WAN estimate to ``link.wan_gbps`` / ``link.wan_rtt_ms``), with wide gaps, so the outcome
does not depend on machine speed (``policy.pipeline.expected_wan_seconds``):

- SHORT, a cold 20-token prompt: 20 x 2,048 B at 5 Mbit/s = 65.5 ms + 20 ms RTT = 86 ms, far
  below the 500 ms budget: P->MD;
- LONG, a cold 400-token prompt: 400 x 2,048 B at 5 Mbit/s = 1,311 ms + 20 ms = 1,331 ms, far
  above it: relayed P->RLD->MD by default, finished on RLD alone (P->RLD, no KV over the WAN)
  with ``allow_p_rld``.

Every output equals a single engine's greedy output, the gateway's pipeline counters move as the
policy says, WAN bytes sent equal the bytes expected, and no page leaks.
"""

from __future__ import annotations

import random

import pytest

from pdd.faults import StreamClient
from pdd.policy.pipeline import PipelineInputs, choose_pipeline
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: KV bytes per token
GBPS = 0.005
RTT_MS = 20.0
BUDGET_MS = 500.0
SHORT, LONG = 20, 400
MAX_TOKENS = 8


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _wan_ms(tokens: int) -> float:
    return RTT_MS + tokens * SLOT * 8 / (GBPS * 1e9) * 1000


def test_margins_are_wide():
    assert _wan_ms(SHORT) < BUDGET_MS / 4 and _wan_ms(LONG) > BUDGET_MS * 2


def _complete(url: str, model: str, prompt: list[int]) -> tuple[list[int], dict]:
    """Streamed, for the token ids; its last chunk carries the same ``pdd`` block as a
    non-streaming response's top level."""
    c = StreamClient(url, {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}).start()
    assert c.wait(120) and c.error is None, c.error
    return c.tokens, c.summary


@pytest.mark.parametrize("allow_p_rld", [False, True], ids=["default", "allow_p_rld"])
def test_pipeline_choice_live(small_model, topology_factory, allow_p_rld):
    short, long_ = _ids(1, SHORT), _ids(2, LONG)
    (want_short, want_long), _ = greedy_oracle(small_model, [short, long_], MAX_TOKENS)
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu"},
                   policy={"pipeline_ttft_budget_ms": BUDGET_MS, "wan_estimate": "config", "cutoff": False,
                           "allow_p_rld": allow_p_rld},
                   link={"wan_gbps": GBPS, "wan_rtt_ms": RTT_MS, "wan_jitter_ms": 0.0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    long_pipeline = "p_rld" if allow_p_rld else "p_rld_md"

    def planned(p: dict, want: str, tokens: int) -> dict:
        d = [x for x in p["decisions"] if x["policy"] == "pipeline"][-1]
        inp = d["inputs"]
        # the inputs the gateway planned with are the configured ones, and the policy's rule on
        # them gives what was served
        assert inp["wan_gbps_estimate"] == GBPS and inp["wan_rtt_ms"] == RTT_MS, inp
        assert inp["prompt_tokens"] == tokens and inp["md_cached_tokens"] == 0, inp
        assert inp["kv_bytes_per_token"] == SLOT and inp["allow_p_rld"] is allow_p_rld, inp
        assert choose_pipeline(PipelineInputs(**inp)).value == d["result"] == p["pipeline"] == want, p
        return p

    # P->MD: the short prompt's missing KV fits the budget (whatever allow_p_rld says)
    before = topo.stats()
    got_short, ps = _complete(topo.url, cfg.served_model_name, short)
    ps = planned(ps, "p_md", SHORT)
    assert ps["wan_bytes_expected"] == SHORT * SLOT, ps  # MD gets the whole prompt's KV across the WAN
    assert topo.wait_idle(timeout_s=60), topo.last_busy
    mid = topo.stats()
    assert mid["pipelines"].get("p_md", 0) == before["pipelines"].get("p_md", 0) + 1, mid["pipelines"]
    assert mid["wan_bytes"] == mid["wan_bytes_expected"] == before["wan_bytes"] + ps["wan_bytes_expected"], mid

    # the long prompt's does not: relayed (default) or finished on RLD alone (allow_p_rld)
    got_long, pl = _complete(topo.url, cfg.served_model_name, long_)
    pl = planned(pl, long_pipeline, LONG)
    if allow_p_rld:
        assert pl["wan_bytes"] == pl["wan_bytes_expected"] == 0, pl  # MD never gets its KV
        assert pl["handoff_pos"] is None, pl
    else:
        assert pl["wan_bytes_expected"] == LONG * SLOT, pl
    assert topo.wait_idle(timeout_s=60), topo.last_busy
    after = topo.stats()
    assert after["pipelines"].get(long_pipeline, 0) == mid["pipelines"].get(long_pipeline, 0) + 1, after["pipelines"]
    assert after["pipelines"].get("p_md", 0) == mid["pipelines"].get("p_md", 0), after["pipelines"]
    assert after["pipelines"].get("p_rld", 0) == (1 if allow_p_rld else 0), after["pipelines"]
    assert after["wan_bytes"] == after["wan_bytes_expected"] == mid["wan_bytes"] + pl["wan_bytes_expected"], after
    assert after["totals"]["completed"] == mid["totals"]["completed"] + 1 and after["totals"]["failed"] == 0, after

    # served correctly: a single engine's greedy outputs
    assert got_short == want_short and got_long == want_long, (got_short, want_short, got_long, want_long)
    assert topo.flush()["leaked_pages"] == 0


def test_default_budget_sends_short_and_cached_prompts_direct(small_model, topology_factory):
    """The default budget (``PolicyConfig().pipeline_ttft_budget_ms``, 50 ms) on the default line
    (0.05 Gbit/s, 20 ms RTT): the cold SHORT prompt (26.6 ms) goes P->MD; the cold LONG one
    (151 ms) is relayed, planned at once on the gateway's index; LONG again with 10 more tokens,
    whose 400-token prefix MD now holds (23.3 ms), goes P->MD and ships only the 10 missing
    tokens' KV."""
    from pdd.config import PolicyConfig

    budget = PolicyConfig().pipeline_ttft_budget_ms
    short, long_ = _ids(1, SHORT), _ids(2, LONG)
    again = long_ + _ids(3, 10)
    assert RTT_MS + SHORT * SLOT * 8 / 0.05e9 * 1000 < budget / 1.5
    assert RTT_MS + LONG * SLOT * 8 / 0.05e9 * 1000 > budget * 2
    assert RTT_MS + 10 * SLOT * 8 / 0.05e9 * 1000 < budget / 1.5
    want, _ = greedy_oracle(small_model, [short, long_, again], MAX_TOKENS)
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu"},
                   policy={"pipeline_ttft_budget_ms": budget, "wan_estimate": "config", "cutoff": False},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    assert (cfg.link.wan_gbps, cfg.link.wan_rtt_ms) == (0.05, RTT_MS)
    topo = topology_factory(cfg)
    got, summaries = [], []
    for prompt in (short, long_, again):
        toks, s = _complete(topo.url, cfg.served_model_name, prompt)
        got.append(toks)
        summaries.append(s)
        assert topo.wait_idle(timeout_s=60), topo.last_busy  # the relayed prompt's KV is in MD's cache before the next
    assert [s["pipeline"] for s in summaries] == ["p_md", "p_rld_md", "p_md"], summaries
    relayed = [d for d in summaries[1]["decisions"] if d["policy"] == "pipeline"]
    assert [(d["inputs"]["md_cached_tokens"], d["result"]) for d in relayed] == [(0, "p_rld_md")]
    assert summaries[2]["md_cached_tokens"] == LONG, summaries[2]
    assert [s["wan_bytes_expected"] for s in summaries] == [SHORT * SLOT, LONG * SLOT, 10 * SLOT], summaries
    st = topo.stats()
    assert st["wan_bytes"] == st["wan_bytes_expected"] == (SHORT + LONG + 10) * SLOT, st
    assert st["totals"]["failed"] == 0
    assert got == want
