"""What a client gets, and how the gateway counts it, when a request cannot start because no
instance of a tier is up: the real orchestrator's start loop and the real HTTP app (called
through ``httpx.ASGITransport``, no socket), over a stand-in ``_launch`` (no engine process).

- no P reachable on its first try: 503 with ``Retry-After``, counted ``rejected`` (it never ran
  on any tier, as a tier's 429 refusal), not ``failed``;
- a start that lost its P and waits for it to come back when SIGTERM's drain begins: the same
  503 ``shutting_down`` body as a request arriving during the drain, at once, so the drain is not
  held for ``RECOVERY_WAIT_S`` (30 s); counted ``failed`` (a lost P ended it)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import OUTCOMES, Orchestrator
from pdd.gateway.shutdown import refusal_body
from pdd.gateway.state import NoInstance
from pdd.topology import layout
from tests.gateway.fake_peer import FakePeer

BOUND_S = 10.0  # what a step may take at most before the test fails (it takes milliseconds)
BODY = {"prompt": "hello there", "max_tokens": 4, "stream": True}


class NoPOrch(Orchestrator):
    """The real orchestrator whose ``_launch`` loses its P on try ``lost_at`` (ConnectionError)
    and finds none reachable on every other try (NoInstance: restarting); ``tried`` is set once
    it has been tried ``waiting_after`` times."""

    def __init__(self, cfg: ClusterConfig, lost_at: int | None = None, waiting_after: int = 1):
        super().__init__(cfg, layout(cfg))
        self.peers = {s.name: FakePeer() for s in self.layout.engines}
        self.lost_at, self.waiting_after = lost_at, waiting_after
        self.tries: list[str] = []
        self.tried = asyncio.Event()

    async def _launch(self, st, prompt, sp=None, force_relay=False):
        self.tries.append(st.trid)
        if len(self.tries) >= self.waiting_after:
            self.tried.set()
        if len(self.tries) == self.lost_at:
            raise ConnectionError("instance p0 is unreachable")
        raise NoInstance("no prefill instance is reachable")


@pytest.fixture
def make_app(tiny_model):
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    def make(**kw):
        cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                            "shutdown_timeout_s": 60,
                                            "engine": {"max_model_len": 512, "max_input_len": 400}})
        orch = NoPOrch(cfg, **kw)
        return create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json")), orch

    return make


def _outcomes(orch) -> dict:
    return {k: orch.totals[k] for k in OUTCOMES}


async def test_a_request_that_finds_no_p_is_refused_503_and_counted_rejected(make_app):
    app, orch = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/completions", json=BODY)
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    (rid,) = orch.tries  # tried once: the request id
    assert r.json()["error"]["message"] == f"request {rid} failed while starting: no prefill instance is reachable"
    assert _outcomes(orch) == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 1}


async def test_a_start_waiting_for_its_restarting_p_gets_the_shutdown_503_when_the_drain_begins(make_app):
    app, orch = make_app(lost_at=1, waiting_after=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        req = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
        await asyncio.wait_for(orch.tried.wait(), BOUND_S)  # P lost, then none up: the start waits
        rep = await asyncio.wait_for(app.state.drain.run(orch), BOUND_S)
        r = await asyncio.wait_for(req, BOUND_S)
    assert (r.status_code, r.headers["connection"], r.json()) == (503, "close", refusal_body())
    assert (rep["ended"], rep["left"]) == (0, []) and len(orch.tries) == 3 and not orch.reqs
    assert _outcomes(orch) == {"completed": 0, "failed": 1, "cancelled": 0, "rejected": 0}


class GrammarFailsOnP(NoPOrch):
    """P's prefill call fails because the request's own grammar failed on its first token: the
    RemoteError a tier's ``CallFailed(..., client_error=True)`` arrives as."""

    async def _launch(self, st, prompt, sp=None, force_relay=False):
        from pdd.transfer.peer import RemoteError

        self.tries.append(st.trid)
        raise RemoteError("CallFailed: p0: structured output failed at token 0: row limit",
                          {"t": "error", "error": "x", "detail": {"client_error": True}})


@pytest.mark.parametrize("stream", [True, False])
async def test_a_grammar_failing_on_ps_first_token_is_a_400_not_a_503(tiny_model, stream):
    """A structured output whose grammar fails while the request starts (P samples its first
    token) is the request's own failure: 400, as when it fails later (a 503 made the openai
    client send it again, to fail the same way)."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    orch = GrammarFailsOnP(cfg)
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await asyncio.wait_for(client.post("/v1/completions", json={**BODY, "stream": stream}), BOUND_S)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "structured output failed at token 0" in err["message"]
