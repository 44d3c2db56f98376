"""A client that goes away while its request is still starting (P prefilling, nothing written yet)
has it aborted on every tier at once (``pdd.gateway.disconnect``), counted cancelled once; a
prompt of a batch that a tier refuses while starting stops the others still starting, counted
rejected. The real ``Orchestrator.start_request`` / ``abort`` behind the real HTTP app on a real
uvicorn server; ``_launch`` stands in for P's prefill: it holds until the request is aborted
(or the test lets it go), as P's prefill call fails once P has the abort."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import ABORT_CLIENT, ABORT_REJECTED, OUTCOMES, Orchestrator, TokenOut
from pdd.topology import layout
from pdd.transfer.peer import RemoteError
from tests.api.live_app import served
from tests.gateway.fake_peer import FakePeer

PROMPT_LONG = list(range(10, 60))  # held in "prefill" until aborted
PROMPT_REFUSED = list(range(100, 120))  # refused at once by a tier (its KV pool short of pages)


class HeldOrch(Orchestrator):
    """The real orchestrator over fake peers; ``_launch`` holds each start in its "prefill" until
    the request is aborted (then fails as P's refused prefill does) or ``go`` is set (then the
    request streams ``max_tokens`` tokens, the last with fin "length")."""

    def __init__(self, cfg: ClusterConfig):
        super().__init__(cfg, layout(cfg))
        self.peers = {s.name: FakePeer() for s in self.layout.engines}
        self.prefilling = asyncio.Event()  # a start reached its prefill
        self.go = asyncio.Event()
        self.aborted = asyncio.Event()
        self.abort_reasons: list[tuple[str, str]] = []  # (rid, reason)
        self.stops: dict[str, asyncio.Event] = {}  # rid -> set when that request is aborted
        self.refuse_sibling = False  # n > 1: the first sibling choice to start is refused
        self.refused_one = False

    async def _launch(self, st, prompt, sp=None, force_relay=False):
        if list(prompt) == PROMPT_REFUSED or (self.refuse_sibling and st.sibling_of is not None
                                              and not self.refused_one):
            self.refused_one = st.sibling_of is not None
            raise RemoteError("OutOfPages: out of KV pages: need 57, 52 free", {})
        if self.refuse_sibling and st.sibling_of is None:
            self.go.set()  # choice 0 starts; of its siblings one is refused, the other held
        elif self.refuse_sibling:
            self.go.clear()
        self.prefilling.set()
        stop = asyncio.ensure_future(self.stops.setdefault(st.rid, asyncio.Event()).wait())
        go = asyncio.ensure_future(self.go.wait())
        await asyncio.wait((stop, go), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        go.cancel()
        if st.end.aborted:
            raise RemoteError(f"request {st.trid} aborted", {})
        for pos in range(st.sampling.max_tokens):
            st.queue.put_nowait(TokenOut(pos, 7, "c", "length" if pos == st.sampling.max_tokens - 1 else None))

    async def abort(self, st, reason):
        self.abort_reasons.append((st.rid, reason))
        await super().abort(st, reason)
        self.stops.setdefault(st.rid, asyncio.Event()).set()
        self.aborted.set()


@pytest.fixture
async def held(tiny_model):
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    orch = HeldOrch(cfg)
    app = create_app(cfg, orch, tok)
    async with served(app) as port:
        yield orch, app, port


async def _post(port: int, body: dict):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    return reader, writer


async def _until(pred, what: str, timeout_s: float = 10.0) -> None:
    async def poll():
        while not pred():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_while_prefilling_aborts_it_on_every_tier(held, stream):
    orch, app, port = held
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 8, "stream": stream})
    await asyncio.wait_for(orch.prefilling.wait(), 10)
    assert not reader.at_eof() and len(orch.reqs) == 1
    (rid,) = [st.rid for st in orch.reqs.values()]
    writer.close()  # before any byte of the response
    await writer.wait_closed()
    await asyncio.wait_for(orch.aborted.wait(), 10)  # without go: only the disconnect can end it
    await _until(lambda: not orch.reqs and app.state.admission.inflight == 0, "the request to end")
    assert orch.abort_reasons[0] == (rid, ABORT_CLIENT)
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 1, "rejected": 0}
    # every tier was told to drop it
    for name, peer in orch.peers.items():
        assert {"t": "abort", "rid": rid} in [{k: m[k] for k in ("t", "rid") if k in m} for m in peer.sent], name
    assert app.state.admission.queued_tokens == 0 and not orch.go.is_set()


async def test_a_client_gone_while_starting_is_not_logged_as_a_server_failure(held, caplog):
    """Its start ends because its client left: logged at INFO, not as a WARNING saying the client
    gets a 503 (nobody gets anything; the request is counted cancelled)."""
    import logging

    orch, app, port = held
    caplog.set_level(logging.INFO, logger="pdd")
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 8})
    await asyncio.wait_for(orch.prefilling.wait(), 10)
    writer.close()
    await writer.wait_closed()
    await _until(lambda: not orch.reqs and app.state.admission.inflight == 0, "the request to end")
    await _until(lambda: any("its client disconnected while it started" in r.getMessage() for r in caplog.records),
                 "the start's end to be logged")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "503" in r.getMessage()] == []
    assert orch.totals["cancelled"] == 1


async def test_the_other_prompts_of_a_batch_stop_when_one_is_refused_while_starting(held):
    """A batch of two prompts: one is refused by a tier at once (429), the other is still
    prefilling; it is aborted then (counted rejected), not prefilled to its end first."""
    orch, app, port = held
    reader, writer = await _post(port, {"prompt": [PROMPT_LONG, PROMPT_REFUSED], "max_tokens": 4})
    status = (await asyncio.wait_for(reader.readline(), 10)).decode()
    assert status.startswith("HTTP/1.1 429"), status
    writer.close()
    await _until(lambda: not orch.reqs and app.state.admission.inflight == 0, "the batch to end")
    assert not orch.go.is_set()  # the held prompt ended by its abort
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 2}
    first: dict = {}
    for rid, why in orch.abort_reasons:  # the first abort's reason is the one counted
        first.setdefault(rid, why)
    assert sorted(first.values()) == [ABORT_REJECTED] * 2


async def test_a_request_that_starts_normally_is_not_touched_by_the_watch(held):
    orch, app, port = held
    orch.go.set()
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 3})
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    n = int([ln for ln in head.decode().split("\r\n") if ln.lower().startswith("content-length")][0].split(":")[1])
    body = json.loads(await reader.readexactly(n))
    assert body["choices"][0]["finish_reason"] == "length"
    writer.close()
    await _until(lambda: not orch.reqs, "the request to end")
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 1, "failed": 0, "cancelled": 0, "rejected": 0}
    assert orch.abort_reasons == []


async def test_a_choice_refused_while_starting_stops_its_sibling_still_prefilling(held):
    """n=3: choice 0 starts, choice 1 is refused by a tier (429), choice 2 is still prefilling:
    it is aborted then (rejected), as choice 0 is, instead of prefilled to its end first."""
    orch, app, port = held
    orch.refuse_sibling = True
    reader, writer = await _post(port, {"prompt": PROMPT_LONG, "max_tokens": 4, "n": 3})
    status = (await asyncio.wait_for(reader.readline(), 10)).decode()
    assert status.startswith("HTTP/1.1 429"), status
    writer.close()
    await _until(lambda: not orch.reqs and app.state.admission.inflight == 0, "the request to end")
    assert orch.refused_one and not orch.go.is_set()  # the held choice ended by its abort
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 3}
