"""P's load as routing reads it (``pdd.gateway.routing``): the prefills it runs (``holding``: from
routing until P's prefill returns), not the requests routed there until they end: a P whose
earlier requests decode on RLD / MD is not busy, as the simulator counts P
(``ClusterSim._route``). Fake connections, no processes."""

from __future__ import annotations

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY, layout
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PROMPT = list(range(100, 164))  # 64 tokens, 4 whole pages of 16


class CachingP(FakePeer):
    """A P whose cache holds ``PROMPT``'s whole pages (``peek``)."""

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return ({"t": "peek_ok", "hit_tokens": 64}, b"") if h.get("t") == "peek" else ({"t": "ok"}, b"")


def _orch(routing: str = "cache_aware", load_slack: int = 1) -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "pdd", "engine": {"page_size": 16}, "instances": {"prefill": 2},
                                        "policy": {"routing": routing, "load_slack": load_slack}})
    orch = Orchestrator(cfg, layout(cfg))
    orch.peers = {s.name: FakePeer() for s in orch.layout.engines}
    return orch


def _started(orch: Orchestrator, rid: str, p: str) -> ReqState:
    """A request routed to P ``p`` (and RLD, MD), its attempt counted there."""
    st = ReqState(rid, len(PROMPT), SamplingParams(), trid=rid, prompt_ids=list(PROMPT))
    st.names = {ROLE_PREFILL: p, ROLE_RELAY: "rld0", ROLE_MAIN: "md0"}
    orch.reqs[rid] = st
    orch._assign(st, ROLE_PREFILL, ROLE_RELAY, ROLE_MAIN)
    st.to(Phase.PREFILL, "attempt 0 starts")
    return st


def _decoding_elsewhere(orch: Orchestrator, rid: str, p: str) -> ReqState:
    """A request whose prefill on ``p`` returned: it decodes on RLD / MD (in flight at the
    gateway), P's prefill is over."""
    st = _started(orch, rid, p)
    orch._prefilled(st)
    return st


async def test_cache_aware_routes_to_the_cached_p_whose_requests_decode_elsewhere():
    """p0 holds the prompt and two earlier requests that now decode on RLD / MD; p1 is idle.
    Neither runs a prefill, so the prefix wins (load slack 1); the requests' in-flight count (2
    on p0) had sent it to p1."""
    orch = _orch()
    orch.peers["p0"] = CachingP()
    for rid in ("a", "b"):
        _decoding_elsewhere(orch, rid, "p0")
    assert (orch.inflight["p0"], orch.holding["p0"]) == (2, 0)
    assert await orch._route(ROLE_PREFILL, PROMPT) == "p0"


async def test_load_routes_by_the_prefills_p_runs():
    """Load policy: p0's two requests decode elsewhere, p1 prefills one: p0 (0) is less loaded
    than p1 (1); by requests in flight (2 against 1) it had been p1. Once p1's prefill returns
    and p0 takes two more prefills, p1 is the less loaded."""
    orch = _orch("load")
    for rid in ("a", "b"):
        _decoding_elsewhere(orch, rid, "p0")
    c = _started(orch, "c", "p1")
    assert (orch.holding["p0"], orch.holding["p1"]) == (0, 1)
    assert await orch._route(ROLE_PREFILL, PROMPT) == "p0"
    orch._prefilled(c)
    for rid in ("d", "e"):
        _started(orch, rid, "p0")
    assert (orch.holding["p0"], orch.holding["p1"]) == (2, 0)
    assert await orch._route(ROLE_PREFILL, PROMPT) == "p1"
