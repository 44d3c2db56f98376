"""The gateway's count of the places it holds in each instance's bounded queue
(``Orchestrator.holding``, ``pdd.gateway.routing``): taken when routing chooses the instance, P's
freed when its prefill returns, the rest when the attempt ends or is aborted; routing sends a
choice to an instance whose queue that count fills only when every instance is full. Fake
connections, no processes."""

from __future__ import annotations

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import ABORT_REJECTED, Orchestrator
from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, layout
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PROMPT = list(range(100, 140))  # 40 tokens, 2 whole pages of 16


class CachingP(FakePeer):
    """A P whose cache holds ``PROMPT``'s whole pages (``peek``)."""

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return ({"t": "peek_ok", "hit_tokens": 32}, b"") if h.get("t") == "peek" else ({"t": "ok"}, b"")


def _orch(**over) -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "cross_dc_pd", "engine": {"max_running": 1, "page_size": 16},
                                        "limits": {"tier_max_waiting": 1}, **over})
    orch = Orchestrator(cfg, layout(cfg))
    orch.peers = {s.name: FakePeer() for s in orch.layout.engines}
    return orch


def _req(rid: str, **names) -> ReqState:
    st = ReqState(rid, len(PROMPT), SamplingParams(), trid=rid, prompt_ids=list(PROMPT))
    st.names = dict(names)
    return st


async def test_a_place_is_held_from_routing_until_p_returns_or_the_attempt_ends():
    """P's sequence ends with its prefill (the first token), a decoder's with the attempt: the
    gateway's count of the places it holds follows (the in-flight counts stay the attempt's)."""
    orch = _orch()
    st = _req("r1", **{ROLE_PREFILL: "p0", ROLE_MAIN: "md0"})
    orch._assign(st, ROLE_PREFILL)
    orch._assign(st, ROLE_MAIN)
    assert (orch.holding, orch.inflight) == ({"p0": 1, "md0": 1}, {"p0": 1, "md0": 1})
    assert orch.queue_places("p0") == 2 and not orch.queue_full("p0")
    st.to(Phase.PREFILL, "attempt 0 starts")
    orch._prefilled(st)
    assert (orch.holding, orch.inflight) == ({"p0": 0, "md0": 1}, {"p0": 1, "md0": 1})
    orch._unassign(st)
    assert (orch.holding, orch.inflight, st.holds, st.assigned) == ({"p0": 0, "md0": 0}, {"p0": 0, "md0": 0},
                                                                    set(), set())


async def test_an_abort_ends_the_counts_at_once():
    """A choice of a refused request is aborted, and its stream may never start (its pump
    cancelled unstarted), so the abort itself ends its counts; they were left for good."""
    orch = _orch()
    st = _req("r1", **{ROLE_PREFILL: "p0", ROLE_MAIN: "md0"})
    orch.reqs[st.trid] = st
    orch._assign(st, ROLE_PREFILL, ROLE_MAIN)
    await orch.abort(st, ABORT_REJECTED)
    assert (orch.holding, orch.inflight) == ({"p0": 0, "md0": 0}, {"p0": 0, "md0": 0})


async def test_routing_leaves_the_cached_p_once_its_queue_is_full():
    """Two Ps of 2 places, p0 holding the prompt: the choices go to p0 (cache-aware, within the
    load slack) until the places held there fill its queue, then to p1; with both full the
    policy decides as before (p0)."""
    orch = _orch(instances={"prefill": 2})
    orch.peers["p0"] = CachingP()
    got = []
    for i in range(5):
        st = _req(f"r{i}")
        st.names[ROLE_PREFILL] = await orch._route(ROLE_PREFILL, PROMPT)
        orch._assign(st, ROLE_PREFILL)
        got.append(st.names[ROLE_PREFILL])
    assert got == ["p0", "p0", "p1", "p1", "p0"]
    assert orch.holding == {"p0": 3, "p1": 2}
