"""A relayed request finished by its first token (max_tokens 1, EOS, a stop id): P never starts
its WAN stream to MD, so the gateway must cut MD's leg (drop MD's reservation) whichever way the
relay was planned. Planned on MD's reservation reply (the budget's path), it was not: MD held the
request's place and the gateway awaited a kv_ready that never came, until the request timeout
(live: 64 prompts x n 2 at max_tokens 1 held 114 of MD's 128 places for 300 s, later requests
got 429). Fake connections, no processes."""

from __future__ import annotations

import asyncio

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.topology import layout
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer

PAGE, SLOT = 16, 2048  # the small preset's KV bytes per token
PREFIX = list(range(100, 420))  # 320 tokens the gateway's index says MD holds


class MD(FakePeer):
    """MD's reservation reply: nothing of the prompt cached (its index was wrong)."""

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") != "reserve":
            return {"t": "ok"}, b""
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": 0, "md_cached_pages": 0,
                "n_pages": -(-len(h["prompt_ids"]) // PAGE), "prompt_tokens": len(h["prompt_ids"]),
                "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


class P(FakePeer):
    """P's prefill reply: the first token finished the request (or not)."""

    def __init__(self, fin):
        super().__init__()
        self.fin = fin

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") == "prefill":
            return {"t": "prefill_ok", "first_token": 7, "fin": self.fin, "p_cached_tokens": 0}, b""
        return {"t": "ok"}, b""


@pytest.mark.parametrize("fin", ["length", None], ids=["first_token_ends_it", "it_goes_on"])
async def test_a_relay_planned_on_mds_reply_cuts_md_when_the_first_token_ends_it(fin):
    # budget 50 ms on the default line (0.05 Gbit/s, 20 ms RTT): with 320 of 370 tokens in MD's
    # index the plan waits for MD's reply; the reply says MD holds none (141 ms): relayed
    cfg = ClusterConfig.model_validate({"mode": "pdd", "engine": {"page_size": PAGE},
                                        "policy": {"pipeline_ttft_budget_ms": 50}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(fin), "rld0": FakePeer(), "md0": MD()}
    o.page_bytes, o.kv_bytes_per_token = PAGE * SLOT, SLOT
    o.prefix_index["md0"].insert(PREFIX)
    prompt = PREFIX + list(range(7, 57))
    st = ReqState("r1", len(prompt), SamplingParams(max_tokens=1 if fin else 16), trid="r1", prompt_ids=prompt)
    o.reqs[st.trid] = st
    st.to(Phase.PREFILL, "attempt 0 starts")  # as start_request does
    await o._launch(st, prompt)
    prefill = next(h for h in o.peers["p0"].sent if h["t"] == "prefill")
    assert all(t.get("deferred") for t in prefill["targets"])  # planned on MD's reply ...
    assert st.pipeline == Pipeline.P_RLD_MD  # ... which made it a relay
    for _ in range(100):  # the leg's tidy-up messages go out on the loop
        await asyncio.sleep(0)
    drops = [h for h in o.peers["md0"].sent if h["t"] == "drop"]
    if fin:
        assert st.recovery.md_lost and not st.recovery.degraded
        assert st.trid not in o.awaiting_kv
        assert len(drops) == 1 and o.totals["cut_offs"] == 1
    else:  # a request that goes on keeps MD's leg
        assert not st.recovery.md_lost and drops == [] and o.totals["cut_offs"] == 0
