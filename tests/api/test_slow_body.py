"""A request body that stops arriving (``pdd.gateway.slow_body``): the request ends with an
OpenAI-style 408 and ``Connection: close``, and its place among the gateway's HTTP requests at
once is freed. Found by a new user: 1,030 connections that sent a POST's headers and one byte of
its body held the 1,024 places, and every later request got 429 for as long as they stayed open
(40 s and more). Plain ASGI calls, no server; ``idle_s`` 0 makes a body that is not there time
out at once (a client that never sends it), so nothing waits on a clock."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.responses import JSONResponse

from pdd.gateway.admission import Admission, AdmissionLimits
from pdd.gateway.api import ConcurrencyLimit
from pdd.gateway.slow_body import BodyIdleTimeout, timeout_body


def _stalled(first: bytes = b'{"prompt": "hi"'):
    """An ASGI receive: one part of a body, then nothing more, ever."""
    parts = [{"type": "http.request", "body": first, "more_body": True}]
    never = asyncio.Event()

    async def receive():
        if parts:
            return parts.pop()
        await never.wait()

    return receive


async def _whole():
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def _call(app, receive, path="/v1/completions", headers=None):
    sent = []

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": headers if headers is not None else [(b"content-type", b"application/json"),
                                                             (b"content-length", b"100")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), 10)  # (a stalled body without the bound hangs)
    head = next(m for m in sent if m["type"] == "http.response.start")
    return head["status"], {k.decode(): v.decode() for k, v in head["headers"]}, b"".join(
        m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def reader(scope, receive, send):
    """An app that reads the whole body, and answers 499 when the client went away meanwhile."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return await JSONResponse({"gone": True}, status_code=499)(scope, receive, send)
        if not msg.get("more_body", False):
            return await JSONResponse({"ok": True})(scope, receive, send)


def _silent():
    """An ASGI receive: no part of a body, ever."""
    never = asyncio.Event()

    async def receive():
        await never.wait()

    return receive


async def test_a_stalled_body_gets_408_and_frees_its_place():
    adm = Admission(AdmissionLimits(None, None, None))
    bound = BodyIdleTimeout(reader, idle_s=0)
    app = ConcurrencyLimit(bound, admission=adm, limit=1)
    status, headers, body = await _call(app, _silent())
    assert (status, headers["connection"], json.loads(body)) == (408, "close", timeout_body(0))
    assert timeout_body(30) == {"error": {
        "message": "request body incomplete: none of it arrived for 30 s; send the whole body without pausing",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}
    assert app.serving == 0
    bound.idle_s = 30.0  # (0 times out even a body part that is there, on Python 3.11)
    assert (await _call(app, _whole))[0] == 200  # the place is free: not a 429
    assert adm.rejected == {}


@pytest.mark.parametrize("first, message", [
    (b"", "request body incomplete: none of it arrived for 0.001 s; send the whole body without pausing"),
    (b"{", "request body incomplete: no more of it arrived for 0.001 s after 1 byte; send the whole body "
           "without pausing"),
    (b'{"prompt": "hi"', "request body incomplete: no more of it arrived for 0.001 s after 15 bytes; send "
                         "the whole body without pausing"),
])
async def test_the_408_says_whether_part_of_the_body_arrived(first, message):
    """Found by a new user: a body that stopped after 15 of its bytes was answered "none of it
    arrived". (A positive ``idle_s``: its first part is there and is read, the next never comes.)"""
    app = BodyIdleTimeout(reader, idle_s=0.001)
    status, _, body = await _call(app, _stalled(first))
    assert (status, json.loads(body)["error"]["message"]) == (408, message)
    assert json.loads(body) == timeout_body(0.001, len(first))


@pytest.mark.parametrize("headers", [
    [(b"content-type", b"application/json"), (b"content-length", b"100")],  # the route reads it
    [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],  # api.BodyLimit reads it
])
async def test_the_gateway_answers_a_stalled_body_408(tiny_model, monkeypatch, headers):
    from tokenizers import Tokenizer

    import pdd.gateway.slow_body
    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from pdd.gateway.shutdown import DrainGate
    from tests.api.conftest import EngineOrch

    monkeypatch.setattr(pdd.gateway.slow_body, "BODY_IDLE_S", 0.001)  # (its first 15 bytes are read)
    cfg = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=8))
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    status, hdrs, body = await _call(app, _stalled(), headers=headers)
    assert (status, hdrs["connection"], json.loads(body)) == (408, "close", timeout_body(0.001, 15))
    assert orch.started == []
    # inside the bound on requests at once (whose place it frees), outside the body's readers
    assert [m.cls for m in app.user_middleware[4:7]] == [DrainGate, ConcurrencyLimit, BodyIdleTimeout]


async def test_an_answer_before_the_body_was_read_closes_the_connection():
    """``pdd.gateway.api.CloseUnreadBody``: a response that starts while the request's body is
    still unread (a 413 on Content-Length, a 429 of the concurrency limit, ...) carries
    ``Connection: close`` (a client still sending the body would otherwise wait for its own
    timeout); one after the whole body arrived, or of a request with no body, does not."""
    from pdd.gateway.api import CloseUnreadBody

    async def early(scope, receive, send):
        return await JSONResponse({"no": 1}, status_code=413)(scope, receive, send)

    async def late(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        return await JSONResponse({"ok": 1})(scope, receive, send)

    status, headers, _ = await _call(CloseUnreadBody(early), _stalled())
    assert (status, headers.get("connection")) == (413, "close")
    status, headers, _ = await _call(CloseUnreadBody(late), _whole)
    assert (status, headers.get("connection")) == (200, None)
    status, headers, _ = await _call(CloseUnreadBody(early), _whole, headers=[(b"content-length", b"0")])
    assert (status, headers.get("connection")) == (413, None)  # no body: nothing left unread
    status, headers, _ = await _call(CloseUnreadBody(early), _whole, headers=[(b"transfer-encoding", b"chunked")])
    assert (status, headers.get("connection")) == (413, "close")
