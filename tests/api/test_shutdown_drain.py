"""The gateway's drain (``pdd.gateway.shutdown``) over an in-process engine: once it began, a new
generation request gets 503 ``shutting_down`` and ``/health`` 503; when the shutdown timeout runs
out a stream still running ends with the gateway's mid-stream error event and ``[DONE]``, a
non-streamed request with a 503, each aborted as failed with every KV page freed. The app is
called as ASGI directly, in the test's event loop; the timeout runs out at a token the test
picks (``on_token``), never on a clock."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.openai_schemas import error_body
from pdd.gateway.shutdown import expired_message, refusal_body
from tests.api.conftest import EngineOrch


class HookedOrch(EngineOrch):
    """EngineOrch that calls ``on_token(n)`` before it hands on the n-th token (1-based) of any request."""

    on_token = None

    async def stream(self, st):
        n = 0
        async for t in super().stream(st):
            n += 1
            if self.on_token is not None:
                self.on_token(n)
            yield t


@pytest.fixture
def gateway(tiny_model):
    """(app, orch, engine) on the tiny checkpoint, shutdown_timeout_s 0."""
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app

    eng = Engine.from_pretrained(tiny_model, num_pages=256, page_size=8)
    orch = HookedOrch(eng)
    cfg = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "shutdown_timeout_s": 0,
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    return app, orch, eng


async def call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    """One HTTP request to the ASGI ``app`` from a client that stays connected: (status, headers, body)."""
    raw = json.dumps(body).encode() if body is not None else b""
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    connected = asyncio.Event()  # never set: the client does not go away
    sent: list[dict] = []

    async def receive():
        if pending:
            return pending.pop()
        await connected.wait()

    async def send(msg):
        sent.append(msg)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": headers if body is not None else [],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "scheme": "http", "root_path": ""}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    hdrs = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], hdrs, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _expire_at(app, orch, n: int) -> None:
    """The shutdown timeout runs out when the ``n``-th token is handed on (the drain began then)."""
    def hook(k: int) -> None:
        if k == n:
            app.state.drain.begin()
            app.state.drain.expire(orch)
    orch.on_token = hook


def _leaked(eng) -> int:
    """Pages neither free nor in the prefix cache (flushed first)."""
    eng.flush_cache()
    return eng.pool.num_pages - eng.pool.num_free


async def _settled(orch) -> None:
    """Wait for the aborts the request's end spawned (fire-and-forget tasks) to run."""
    from pdd.gateway import openai_run

    while openai_run._BACKGROUND:
        await asyncio.gather(*list(openai_run._BACKGROUND), return_exceptions=True)


async def test_a_new_request_during_the_drain_is_refused_with_503(gateway):
    app, orch, _ = gateway
    app.state.drain.begin()
    body = {"prompt": [5, 6, 7], "max_tokens": 4}
    for path, req in (("/v1/completions", body), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                        "content": "hi"}]}),
                      ("/v1/responses", {"input": "hi"})):
        status, headers, raw = await call(app, "POST", path, req)
        assert (status, headers["connection"], json.loads(raw)) == (503, "close", refusal_body())
    assert refusal_body() == {"error": {"message": "the server is shutting down and takes no new requests; send "
                                                   "this request to another server", "type": "server_error",
                                        "param": None, "code": "shutting_down"}}
    status, _, raw = await call(app, "GET", "/health")
    assert (status, json.loads(raw)["status"]) == (503, "shutting_down")
    status, _, raw = await call(app, "GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "pdd-tiny"
    assert orch.started == [] and app.state.drain.in_flight == 0


async def test_a_stream_running_at_the_shutdown_timeout_ends_with_the_error_event_and_done(gateway):
    app, orch, eng = gateway
    _expire_at(app, orch, 4)
    status, _, raw = await call(app, "POST", "/v1/completions",
                                {"prompt": [5, 6, 7, 8, 9], "max_tokens": 100, "ignore_eos": True, "stream": True})
    events = [ln[len("data: "):] for ln in raw.decode().split("\n\n") if ln]
    assert status == 200
    pos = [json.loads(e)["pdd"]["pos"] for e in events[:-2]]  # tokens sent before (those queued are dropped)
    assert pos == list(range(len(pos))) and 1 <= len(pos) <= 3
    assert json.loads(events[-2]) == error_body(expired_message(0), etype="server_error")
    assert events[-1] == "[DONE]"
    assert expired_message(0) == ("the server is shutting down and this request did not finish within its shutdown "
                                  "timeout (shutdown_timeout_s 0 s): it was aborted")
    await _settled(orch)
    assert orch.abort_reasons == ["failed"] and app.state.drain.ended == 1 and app.state.drain.in_flight == 0
    assert orch.seqs == {} and _leaked(eng) == 0


async def test_a_non_streamed_request_running_at_the_shutdown_timeout_gets_503(gateway):
    app, orch, eng = gateway
    _expire_at(app, orch, 2)
    status, _, raw = await call(app, "POST", "/v1/completions",
                                {"prompt": [5, 6, 7, 8, 9], "max_tokens": 100, "ignore_eos": True, "n": 2})
    assert (status, json.loads(raw)) == (503, error_body(expired_message(0), etype="server_error"))
    await _settled(orch)
    assert orch.abort_reasons == ["failed", "failed"] and app.state.drain.ended == 1
    assert orch.seqs == {} and _leaked(eng) == 0


async def test_the_drain_waits_for_nothing_when_nothing_runs(gateway):
    app, orch, _ = gateway
    rep = await app.state.drain.run(orch)
    assert (rep["ended"], rep["left"], app.state.drain.draining, app.state.drain.expired) == (0, [], True, False)


async def test_a_batch_ended_by_the_shutdown_timeout_counts_as_one_request(gateway):
    """Found by a new user: the gateway's log said "waiting ... for 4 requests in flight", then
    "7 requests ended with an error": each prompt of a batch was counted as a request."""
    app, orch, eng = gateway
    _expire_at(app, orch, 2)
    status, _, raw = await call(app, "POST", "/v1/completions",
                                {"prompt": [[5, 6, 7], [8, 9, 10], [11, 12]], "max_tokens": 100, "ignore_eos": True})
    assert (status, json.loads(raw)) == (503, error_body(expired_message(0), etype="server_error"))
    await _settled(orch)
    assert orch.abort_reasons == ["failed", "failed", "failed"] and app.state.drain.ended == 1
    assert orch.seqs == {} and _leaked(eng) == 0


class _Running:
    """A Generation still running when the timeout runs out (``shut_down`` says so)."""

    def shut_down(self, message: str) -> bool:
        return True


def test_a_request_freed_before_another_is_made_is_not_counted_as_that_one():
    """``Drain`` keyed a request by ``id(request)``: a request object freed (its stream ended, its
    Generation still aborting) and the next one made at the same address were one request to
    :meth:`Drain.expire`. Here they have the same id; each still counts, a batch's prompts once."""
    from starlette.requests import Request

    from pdd.gateway.shutdown import Drain

    def request():
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []})

    drain, gens = Drain(0), [_Running() for _ in range(4)]
    for _ in range(100):  # CPython gives a new object the memory of one just freed, almost always at once
        first = request()
        drain.track(gens[0], first)
        drain.track(gens[1], first)  # a batch: two prompts of one request
        freed_at = id(first)
        del first
        second = request()
        if id(second) == freed_at:
            break
        drain, gens = Drain(0), [_Running() for _ in range(4)]
    else:
        pytest.skip("no request object was made at a freed one's address")
    drain.track(gens[2], second)
    drain.track(gens[3], None)  # (no request: a request of its own)
    assert drain.expire(object()) == 3 and drain.ended == 3
