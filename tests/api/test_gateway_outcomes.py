"""Every request is counted exactly once as completed, failed, cancelled or rejected, in the orchestrator's
``totals`` and in /metrics ``pdd_gateway_outcomes``: the real ``Orchestrator.stream`` /
``abort`` behind the real HTTP app and a real uvicorn server (in this event loop), over scripted
tiers (tokens fed in process, no engine processes). A client that disconnects mid-stream is
cancelled (as vLLM's finish reason "abort"); a choice a stop string ended at the gateway, which
is aborted on the tiers too, stays completed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.gateway.phase import Phase
from pdd.gateway.orchestrator import (ABORT_CLIENT, ABORT_FAILED, ABORT_REJECTED, ABORT_STOP, OUTCOMES, Orchestrator,
                                      ReqState, RequestFailed, TokenOut)
from pdd.topology import layout
from pdd.types import Pipeline, SamplingParams
from tests.api.live_app import served
from tests.gateway.fake_peer import FakePeer

TICK_S = 0.01  # seconds between two scripted tokens


class ScriptedOrch(Orchestrator):
    """The real orchestrator, but ``start_request`` makes a colocated request whose tokens a task
    feeds (``script`` cycled, one per TICK_S, the last with fin "length"); ``fail_at``: the tier
    fails the request at that output position instead (as the request's own failure, with
    ``fail_as_client`` its why, when set); ``hold_at``: the tier stops feeding at that
    position until the request is aborted (a generation that cannot end on its own). Phases move
    as the real one's: prefill at the start, decode at the first token."""

    def __init__(self, cfg: ClusterConfig, script: list[int]):
        super().__init__(cfg, layout(cfg))
        self.peers = {s.name: FakePeer() for s in self.layout.engines}
        self.script = script
        self.fail_at: int | None = None
        self.fail_as_client: str | None = None  # fail_at's failure is the request's own, this its why
        self.hold_at: int | None = None
        self.fed: dict[str, int] = {}  # rid -> tokens fed
        self.abort_reasons: list[str] = []

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        rid = rid or f"r{next(self._ids)}"
        st = ReqState(rid, len(prompt_ids), sp, pipeline=Pipeline.COLOCATED, trid=rid, prompt_ids=list(prompt_ids))
        self.reqs[rid] = st
        self.totals["requests"] += 1
        st.to(Phase.PREFILL, "attempt 0 starts")
        self._spawn(self._feed(st, self.fail_at))
        return st

    async def _feed(self, st: ReqState, fail_at: int | None) -> None:
        n = st.sampling.max_tokens
        for pos in range(n):
            if st.end.aborted:
                return
            if pos == self.hold_at:
                while not st.end.aborted:
                    await asyncio.sleep(TICK_S)
                return
            if pos == fail_at:
                st.recovery.error = "injected tier failure"
                if self.fail_as_client is not None:  # the request's own failure, as a tier's req_error gives it
                    st.recovery.error = f"c0: {self.fail_as_client}"
                    st.recovery.client_error, st.recovery.client_reason = True, self.fail_as_client
                st.queue.put_nowait(None)
                return
            if pos == 0:
                st.to(Phase.DECODE, "first token sampled")
            st.queue.put_nowait(TokenOut(pos, self.script[pos % len(self.script)], "c",
                                         "length" if pos == n - 1 else None))
            self.fed[st.rid] = pos + 1
            await asyncio.sleep(TICK_S)

    async def abort(self, st: ReqState, reason: str) -> None:
        self.abort_reasons.append(reason)
        await super().abort(st, reason)


@pytest.fixture
async def gateway(tiny_model):
    """(httpx.AsyncClient on a live uvicorn server, ScriptedOrch, tokenizer)."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    script = tok.encode("the quick brown fox jumps over the lazy dog and runs far away ",
                        add_special_tokens=False).ids
    orch = ScriptedOrch(cfg, script)
    app = create_app(cfg, orch, tok)
    async with served(app) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client, orch, tok


async def _settled(orch: ScriptedOrch, want: int) -> dict:
    """The outcome counts once ``want`` requests are counted, none is live and the gateway's
    background work (aborts) has run (60 s at most)."""
    for _ in range(6000):
        if sum(orch.totals[k] for k in OUTCOMES) >= want and not orch.reqs:
            break
        await asyncio.sleep(0.01)
    await _background_done(orch)
    return {k: orch.totals[k] for k in OUTCOMES}


async def _background_done(orch: ScriptedOrch) -> None:
    """Wait for the fire-and-forget tasks of the gateway (aborts spawned by the orchestrator and
    by ``openai_run``) to end: whatever they count is counted after this."""
    from pdd.gateway import openai_run

    while True:
        tasks = [t for t in (*orch._tasks, *openai_run._BACKGROUND) if not t.done()]
        if not tasks:
            return
        await asyncio.wait(tasks, timeout=60)


async def _metrics(client) -> dict:
    text = (await client.get("/metrics")).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^pdd_gateway_outcomes_total\{outcome="(\w+)"\} (\S+)$',
                                                   text, re.M)}


BODY = {"prompt": "hello there", "max_tokens": 400, "ignore_eos": True, "stream": True}


async def leave_mid_stream(client, body: dict, chunks: int = 6) -> None:
    """Stream ``body`` from /v1/completions and go away after ``chunks`` data chunks (leaving the
    block closes the connection mid-stream)."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        got = 0
        async for line in r.aiter_lines():
            got += line.startswith("data: {")
            if got >= chunks:
                break


async def test_client_disconnect_mid_stream_counts_cancelled_once(gateway):
    client, orch, _ = gateway
    await leave_mid_stream(client, {**BODY, "n": 3})
    assert await _settled(orch, 3) == {"completed": 0, "failed": 0, "cancelled": 3, "rejected": 0}
    assert orch.totals["requests"] == 3
    assert orch.abort_reasons and set(orch.abort_reasons) == {ABORT_CLIENT}  # the tiers were told
    assert await _metrics(client) == {"completed": 0.0, "failed": 0.0, "cancelled": 3.0, "rejected": 0.0}


async def test_stop_string_stays_completed_and_every_outcome_once(gateway):
    client, orch, tok = gateway
    # a stop string that completes mid-stream: the gateway aborts the tiers, counted completed
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "stop": ["lazy dog"]})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == "lazy dog"
    assert await _settled(orch, 1) == {"completed": 1, "failed": 0, "cancelled": 0, "rejected": 0}
    assert orch.abort_reasons == [ABORT_STOP]
    # streamed, n=2: both choices stop on it
    r = await client.post("/v1/completions", json={**BODY, "n": 2, "stop": "fox"})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert sorted(c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]) == ["stop"] * 2
    assert await _settled(orch, 3) == {"completed": 3, "failed": 0, "cancelled": 0, "rejected": 0}
    # run to max_tokens
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 5})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert await _settled(orch, 4) == {"completed": 4, "failed": 0, "cancelled": 0, "rejected": 0}
    # a tier fails the request mid-stream: failed (not cancelled, though its stream is aborted)
    orch.fail_at = 3
    r = await client.post("/v1/completions", json={**BODY, "stream": False})
    assert r.status_code == 503
    assert await _settled(orch, 5) == {"completed": 4, "failed": 1, "cancelled": 0, "rejected": 0}
    assert ABORT_FAILED in orch.abort_reasons and ABORT_CLIENT not in orch.abort_reasons
    orch.fail_at = None
    assert orch.totals["requests"] == sum(orch.totals[k] for k in OUTCOMES) == 5
    assert await _metrics(client) == {"completed": 4.0, "failed": 1.0, "cancelled": 0.0, "rejected": 0.0}


async def test_abort_counts_once_with_its_first_reason():
    cfg = ClusterConfig.model_validate({"mode": "colocated"})
    orch = ScriptedOrch(cfg, [1, 2, 3])
    sp = SamplingParams(max_tokens=100)
    st = await orch.start_request([5] * 8, sp)
    with pytest.raises(ValueError):
        await orch.abort(st, "bored")
    assert not st.finished and st.end.outcome is None  # an unknown reason changes nothing
    await orch.abort(st, ABORT_CLIENT)
    await orch.abort(st, ABORT_FAILED)  # a later abort keeps the first count and reason
    assert (st.end.abort_reason, st.end.outcome) == (ABORT_CLIENT, "cancelled")
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 1, "rejected": 0}
    assert [t async for t in orch.stream(st)] == []  # its stream ends at once, counted already
    assert orch.totals["cancelled"] == 1 and orch.totals["completed"] == 0
    # a consumer that closes the stream mid-way (no abort by the HTTP layer first): cancelled
    st2 = await orch.start_request([5] * 8, sp)
    s = orch.stream(st2)
    assert (await s.__anext__()).pos == 0
    await s.aclose()
    await _background_done(orch)
    assert (st2.end.abort_reason, st2.end.outcome) == (ABORT_CLIENT, "cancelled") and orch.totals["cancelled"] == 2


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello there"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}),
    ("/v1/responses", {"input": "hello there"}),
])
async def test_client_disconnect_non_streamed_counts_cancelled(gateway, path, body):
    """Starlette does not cancel a non-streaming endpoint whose client went away: the gateway
    watches for ``http.disconnect`` itself and aborts the generation (ABORT_CLIENT), so it is
    counted cancelled, not decoded on to max_tokens and counted completed."""
    client, orch, _ = gateway
    if path.endswith("chat/completions"):
        r = await client.post(path, json={**body, "max_tokens": 1})
        if r.status_code == 400 and "chat template" in r.text:
            pytest.skip("the tiny model has no chat template")
        await _settled(orch, 1)
    before = {k: orch.totals[k] for k in OUTCOMES}
    n_reqs = orch.totals["requests"]
    payload = json.dumps({**body, "max_tokens": 400, "ignore_eos": True, "stream": False}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    orch.hold_at = 10  # the tier feeds 10 tokens, then only an abort ends the generation
    for _ in range(6000):  # generating: its 10 tokens fed
        if orch.totals["requests"] > n_reqs and orch.reqs and 10 in orch.fed.values():
            break
        await asyncio.sleep(0.01)
    assert orch.reqs, "the request did not start"
    writer.close()  # the client goes away mid-generation
    await writer.wait_closed()
    got = await _settled(orch, sum(before.values()) + 1)
    assert {k: got[k] - before[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 1, "rejected": 0}
    assert orch.abort_reasons and orch.abort_reasons[-1] == ABORT_CLIENT  # every tier was told
    assert not orch.reqs  # freed


class RefusingOrch(Orchestrator):
    """The real ``start_request``, whose every start finds a tier refusing new work for now: P's
    KV pool short of pages (``OutOfPages``, as the RPC layer reports a remote one)."""

    def __init__(self, cfg: ClusterConfig):
        super().__init__(cfg, layout(cfg))
        self.peers = {s.name: FakePeer() for s in self.layout.engines}

    async def _launch(self, st, prompt, sp=None, force_relay=False):
        raise RuntimeError("OutOfPages: out of KV pages: need 57, 52 free (seq r1)")


async def test_a_tier_refusing_a_starting_request_counts_it_rejected_not_failed(tiny_model):
    """A request a tier refuses while it starts (its KV pool short of pages now, or its queue
    full) gets a 429 to retry later, so it is counted "rejected", not "failed" (a new user saw
    44 "failed" for 11 such 429s of n=4 requests), each choice that started once, in totals and
    /metrics."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    orch = RefusingOrch(cfg)
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/completions", json={**BODY, "stream": False})
        assert r.status_code == 429, r.text
        assert "Retry-After" in r.headers
        assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 1}
        assert await _metrics(client) == {"completed": 0.0, "failed": 0.0, "cancelled": 0.0, "rejected": 1.0}
        # n choices: each one started is counted rejected (none failed)
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 4, "n": 4})
        assert r.status_code == 429, r.text
        assert orch.totals["failed"] == 0 and orch.totals["rejected"] == orch.totals["requests"] >= 2


@contextlib.asynccontextmanager
async def colocated_client(tiny_model, orch_cls, **config):
    """``(orch, client)``: an httpx client of a colocated gateway (in process) whose orchestrator
    is ``orch_cls`` (a fake, given the ids of the prompt "a b c"); ``config``: more top-level
    config fields (e.g. ``limits``)."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}, **config})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    orch = orch_cls(cfg, tok.encode("a b c", add_special_tokens=False).ids)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(cfg, orch, tok)),
                                 base_url="http://t") as client:
        yield orch, client


async def _three_choices(tiny_model, orch_cls):
    """(the fake orchestrator, the response) of one non-streamed n=3 completion on a colocated
    gateway (in process) whose orchestrator is ``orch_cls``."""
    async with colocated_client(tiny_model, orch_cls) as (orch, client):
        return orch, await client.post("/v1/completions", json={**BODY, "stream": False, "n": 3})


class SiblingRefusingOrch(ScriptedOrch):
    """Choice 0 starts (scripted tokens); every other choice is refused by a tier while starting,
    counted as the real ``start_request`` counts it."""

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        if sibling_of is None:
            return await super().start_request(prompt_ids, sp, rid)
        st = ReqState(f"r{next(self._ids)}", len(prompt_ids), sp, trid="x", prompt_ids=list(prompt_ids))
        self.totals["requests"] += 1
        await self.abort(st, ABORT_REJECTED)
        raise RequestFailed("request failed while starting") from RuntimeError("OutOfPages: out of KV pages: need 45, 38 free")


async def test_the_started_choices_of_a_refused_request_are_rejected_too(tiny_model):
    """n=3 where choices 1 and 2 are refused for now (429): choice 0, already started, is stopped
    and counted rejected as well, not failed (a new user saw one "failed" per such 429)."""
    orch, r = await _three_choices(tiny_model, SiblingRefusingOrch)
    assert r.status_code == 429, r.text
    assert await _settled(orch, 3) == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 3}
    assert orch.totals["requests"] == 3


class AbortedBeforeRefusalOrch(ScriptedOrch):
    """Choice 0 starts; choice 1 is still starting when choice 2 is refused for now, and ends
    only as aborted because of that refusal (as P reports it: "request ... aborted"): it waits
    for the refusal (an event, not a delay), so it always fails second."""

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        if sibling_of is None:
            return await super().start_request(prompt_ids, sp, rid)
        st = ReqState(f"r{next(self._ids)}", len(prompt_ids), sp, trid="x", prompt_ids=list(prompt_ids))
        self.totals["requests"] += 1
        self._starts = getattr(self, "_starts", 0) + 1
        if self._starts == 1:  # still starting when its sibling is refused; aborted because of it
            self.refused = getattr(self, "refused", None) or asyncio.Event()
            await self.refused.wait()
            await self.abort(st, ABORT_REJECTED)
            raise RequestFailed(f"request {st.rid} failed while starting: RuntimeError: request {st.rid} aborted")
        await self.abort(st, ABORT_REJECTED)
        self.refused = getattr(self, "refused", None) or asyncio.Event()
        self.refused.set()  # choice 1 goes on only after this choice's refusal is raised (same step)
        raise RequestFailed("request failed while starting") from RuntimeError("TierBusy: queue full: 128 sequences "
                                                                            "need compute, the limit is 128")


async def test_a_refused_choice_is_answered_429_not_its_aborted_sibling(tiny_model):
    """n=3: choice 2 is refused for now (429) while choice 1 is still starting; choice 1 then fails
    only as aborted. The answer is the refusal's 429, not a 503 "request ... aborted" (a new user
    saw a 9-prompt x n=16 batch answered either way at random)."""
    orch, r = await _three_choices(tiny_model, AbortedBeforeRefusalOrch)
    assert r.status_code == 429, r.text
    assert await _settled(orch, 3) == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 3}


class FinishedBeforeRefusalOrch(ScriptedOrch):
    """A request refused partway: its first choice (or, in a batch, its first prompt's choice) runs
    to its last token; only then are the other choices refused for now (``OutOfPages`` while
    starting, as the real ``start_request`` counts it), or failed (``ending`` "failed"), or started
    after all (``ending`` "completed"). The others wait for that last token to be handed to the
    gateway (an event, not a delay)."""

    ending = "rejected"

    def __init__(self, cfg: ClusterConfig, script: list[int]):
        super().__init__(cfg, script)
        self.first_done = asyncio.Event()
        self.first: str | None = None

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        if self.first is None:
            st = await super().start_request(prompt_ids, sp, rid)
            self.first = st.rid
            return st
        await self.first_done.wait()
        if self.ending == "completed":
            return await super().start_request(prompt_ids, sp, rid)
        st = ReqState(f"r{next(self._ids)}", len(prompt_ids), sp, trid="x", prompt_ids=list(prompt_ids))
        self.totals["requests"] += 1
        if self.ending == "failed":
            await self.abort(st, ABORT_FAILED)
            raise RequestFailed(f"request {st.rid} failed while starting: RuntimeError: injected")
        await self.abort(st, ABORT_REJECTED)
        raise RequestFailed("request failed while starting") from RuntimeError("OutOfPages: out of KV pages: need 45, "
                                                                            "38 free")

    async def stream(self, st: ReqState):
        async for t in super().stream(st):
            if t.fin is not None and st.rid == self.first:
                self.first_done.set()
            yield t


@pytest.mark.parametrize("ending,status", [("rejected", 429), ("failed", 503), ("completed", 200)])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", [{"prompt": "hello there", "n": 3}, {"prompt": ["a b", "c d", "e f"]}])
async def test_choices_finished_before_a_sibling_is_refused_count_as_the_request_ended(tiny_model, body, stream,
                                                                                        ending, status):
    """Found by a new user: a request refused partway (429: one choice had already run to its last
    token when a sibling choice, or another prompt of its batch, was refused) counted that
    finished choice "completed", though the client got nothing but the refusal. Every choice of it
    is "rejected" (or "failed", when the sibling failed: 503), in totals and /metrics; the
    admission counts one refused request. Had the siblings started, all three are completed."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    orch = FinishedBeforeRefusalOrch(cfg, tok.encode("a b c", add_special_tokens=False).ids)
    orch.ending = ending
    app = create_app(cfg, orch, tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/completions", json={**body, "max_tokens": 2, "ignore_eos": True, "stream": stream})
        assert r.status_code == status, r.text
        want = {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 0, ending: 3}
        assert await _settled(orch, 3) == want
        assert orch.totals["requests"] == 3 and orch.fed[orch.first] == 2  # the first choice did finish
        assert await _metrics(client) == {k: float(v) for k, v in want.items()}
        adm = app.state.admission
        assert adm.inflight == 0 and adm.admitted == 1
        assert adm.rejected == ({"out_of_pages": 1} if ending == "rejected" else {})
        if ending == "completed":
            if stream:
                fins = [json.loads(x[6:])["choices"][0] for x in r.text.splitlines() if x.startswith("data: {")]
                assert sorted(c["index"] for c in fins if c["finish_reason"] == "length") == [0, 1, 2]
            else:
                assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 3
