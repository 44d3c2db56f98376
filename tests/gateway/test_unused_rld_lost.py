"""A request planned P->MD on MD's reservation reply does not use the RLD routed beside its P
(RLD's slot is cancelled on P and its reservation freed): that RLD's loss leaves the request
alone. Before, the RLD stayed in the attempt's instances and its loss re-prefilled the request
(a recovery: FAULTS "RLD, otherwise: recover") though it never needed it. A loss while MD's reply
is still out (the plan may yet relay) still recovers it. Fake connections, no processes."""

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
PREFIX = list(range(100, 420))  # 320 tokens MD holds (its index and its reply agree)


class MD(FakePeer):
    """MD's reservation reply: the prompt's first 320 tokens cached; ``release`` holds it back."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()
        self.asked = asyncio.Event()

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") != "reserve":
            return {"t": "ok"}, b""
        self.asked.set()
        await self.release.wait()
        n = len(h["prompt_ids"])
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": 320, "md_cached_pages": 20,
                "n_pages": -(-n // PAGE), "prompt_tokens": n, "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


class P(FakePeer):
    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") == "prefill":
            return {"t": "prefill_ok", "first_token": 7, "fin": None, "p_cached_tokens": 0}, b""
        return {"t": "ok"}, b""


def _orch() -> Orchestrator:
    # budget 50 ms on the default line: 320 of 370 tokens in MD's index, so the plan waits for
    # MD's reply, which says MD holds them: the 50 left cross in time, P->MD
    cfg = ClusterConfig.model_validate({"mode": "pdd", "engine": {"page_size": PAGE},
                                        "policy": {"pipeline_ttft_budget_ms": 50}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "rld0": FakePeer(), "md0": MD()}
    o.page_bytes, o.kv_bytes_per_token = PAGE * SLOT, SLOT
    o.prefix_index["md0"].insert(PREFIX)
    return o


def _request(o: Orchestrator, rid: str) -> ReqState:
    prompt = PREFIX + list(range(7, 57))
    st = ReqState(rid, len(prompt), SamplingParams(max_tokens=16), trid=rid, prompt_ids=prompt)
    o.reqs[st.trid] = st
    st.to(Phase.PREFILL, "attempt 0 starts")  # as start_request does
    return st


async def test_rld_lost_after_a_p_md_plan_leaves_the_request_alone():
    o = _orch()
    st = _request(o, "r1")
    o.peers["md0"].release.set()
    await o._launch(st, st.prompt_ids)
    assert st.pipeline == Pipeline.P_MD
    assert {"t": "target", "rid": "r1", "slot": "rld", "cancelled": True} in o.peers["p0"].sent
    o.peers["rld0"].closed = True
    o._peer_closed("rld0")
    assert not st.recovery.lost and st.recovery.error is None and st.queue.empty()


async def test_rld_lost_while_md_s_reply_is_out_still_recovers():
    o = _orch()
    st = _request(o, "r1")
    launch = asyncio.get_running_loop().create_task(o._launch(st, st.prompt_ids))
    await o.peers["md0"].asked.wait()  # P prefills, RLD expects it, MD's reply not in: no plan yet
    o.peers["rld0"].closed = True
    o._peer_closed("rld0")
    assert st.recovery.lost  # the plan may still relay through that RLD
    o.peers["md0"].release.set()
    await launch


async def test_a_p_md_plan_leaves_the_unused_rld_s_load_at_once():
    # the RLD routed beside P counted the request in its inflight (routing's least-loaded
    # choice, /pdd/stats, the autoscaler) until the request ended though the plan never used it
    o = _orch()
    st = _request(o, "r1")
    o.peers["md0"].release.set()
    await o._launch(st, st.prompt_ids)
    assert st.pipeline == Pipeline.P_MD and not st.finished
    assert o.inflight == {"p0": 1, "rld0": 0, "md0": 1}
    assert o.routed.get("rld0") == 1  # it was routed there
    assert "rld0" not in st.assigned and "rld0" not in st.holds
    o._unassign(st)  # the request ends: nothing counted twice
    assert o.inflight == {"p0": 0, "rld0": 0, "md0": 0}
