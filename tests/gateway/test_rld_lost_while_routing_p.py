"""The only RLD lost while the gateway routes a new request's P (a cache-aware peek of each P is
a round trip): with an MD reachable the request is planned P->MD, as one arriving after the loss
is (docs/FAULTS.md "No RLD reachable ... but an MD"). Before, the check that no RLD is reachable
ran before P's routing, and the RLD routing after it raised NoInstance: a 503 "no relay_decode
instance is reachable" for a request that did no work. Fake connections, no processes."""

from __future__ import annotations

import asyncio

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.topology import layout
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer

PAGE, SLOT = 16, 2048  # the small preset's KV bytes per token


class P(FakePeer):
    """A prefill instance whose ``peek`` answers once ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.peeked = asyncio.Event()
        self.release = asyncio.Event()

    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        if h.get("t") == "peek":
            self.peeked.set()
            await self.release.wait()
            return {"t": "ok", "hit_tokens": 0}, b""
        if h.get("t") == "prefill":
            return {"t": "prefill_ok", "first_token": 7, "fin": None, "p_cached_tokens": 0}, b""
        return {"t": "ok"}, b""


class MD(FakePeer):
    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        if h.get("t") != "reserve":
            return {"t": "ok"}, b""
        n = len(h["prompt_ids"])
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": 0, "md_cached_pages": 0,
                "n_pages": -(-n // PAGE), "prompt_tokens": n, "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


async def test_the_only_rld_lost_while_p_is_routed_plans_p_md():
    cfg = ClusterConfig.model_validate({"mode": "pdd", "engine": {"page_size": PAGE},
                                        "instances": {"prefill": 2, "relay_decode": 1, "main_decode": 1},
                                        "policy": {"pipeline_ttft_budget_ms": 0}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "p1": P(), "rld0": FakePeer(), "md0": MD()}
    o.page_bytes, o.kv_bytes_per_token = PAGE * SLOT, SLOT
    prompt = list(range(100, 400))
    st = ReqState("r1", len(prompt), SamplingParams(max_tokens=16), trid="r1", prompt_ids=prompt)
    o.reqs[st.trid] = st
    st.to(Phase.PREFILL, "attempt 0 starts")
    launch = asyncio.get_running_loop().create_task(o._launch(st, prompt))
    await o.peers["p0"].peeked.wait()  # RLD was reachable when the request began; P's peek is out
    o.peers["rld0"].closed = True  # kill -9 of the only RLD now
    o._peer_closed("rld0")
    for name in ("p0", "p1"):
        o.peers[name].release.set()
    await launch
    assert st.pipeline == Pipeline.P_MD
    assert "relay_decode" not in st.names and st.names["main_decode"] == "md0"
    assert o.peers["rld0"].of("expect") == []
