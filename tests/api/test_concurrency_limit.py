"""The gateway's bound on HTTP requests served at once (``api.ConcurrencyLimit``): past it a
request gets a 429 in the OpenAI shape with ``Retry-After``, never uvicorn's plain-text 503
"Service Unavailable" (what 701 of 1,500 concurrent streaming clients got), and ``/health`` and
``/metrics`` are still served. Plain ASGI calls, no server, no sleeps."""

from __future__ import annotations

import asyncio
import json

from pdd.config import ClusterConfig
from pdd.gateway.admission import Admission, AdmissionLimits
from pdd.gateway.api import ConcurrencyLimit, create_app, http_server_config


def _scope(path: str, method: str = "POST") -> dict:
    return {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}


async def _receive():
    return {"type": "http.request", "body": b"", "more_body": False}


class Held:
    """An app whose generation requests wait for ``release``; every other path answers at once."""

    def __init__(self):
        self.release, self.inside = asyncio.Event(), asyncio.Event()

    async def __call__(self, scope, receive, send):
        if scope["path"].startswith("/v1/"):
            self.inside.set()
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _call(app, path: str) -> tuple[int, dict, bytes]:
    sent = []

    async def send(msg):
        sent.append(msg)

    await app(_scope(path, "GET" if path in ("/health", "/metrics") else "POST"), _receive, send)
    head = sent[0]
    return head["status"], {k.decode(): v.decode() for k, v in head.get("headers", [])}, b"".join(
        m.get("body", b"") for m in sent[1:])


async def test_past_the_limit_a_request_gets_an_openai_429_and_health_is_still_served():
    inner = Held()
    adm = Admission(AdmissionLimits(None, None, None))
    app = ConcurrencyLimit(inner, admission=adm, limit=1)
    first = asyncio.create_task(_call(app, "/v1/completions"))
    await inner.inside.wait()
    assert app.serving == 1

    status, headers, body = await _call(app, "/v1/chat/completions")
    assert status == 429 and headers["retry-after"] == "1"
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"error": {
        "message": "server overloaded: the gateway serves at most 1 HTTP requests at once (a stream counts until "
                   "it ends) and all are in use; retry later",
        "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
    assert adm.rejected == {"concurrency": 1}
    # a load balancer's probe and the scrape are served however many requests wait
    assert (await _call(app, "/health"))[0] == 200
    assert (await _call(app, "/metrics"))[0] == 200
    assert app.serving == 1 and adm.rejected == {"concurrency": 1}

    inner.release.set()
    assert (await first)[0] == 200
    assert app.serving == 0
    assert (await _call(app, "/v1/completions"))[0] == 200  # its place is free again
    assert app.serving == 0 and adm.rejected == {"concurrency": 1}


def test_the_gateway_bounds_requests_itself_and_uvicorn_refuses_none(tiny_model):
    """uvicorn's own ``limit_concurrency`` answered past 1,024 connections with a plain-text 503
    (``text/plain``, body "Service Unavailable", no Retry-After), /health included: it is off,
    and the app's outermost middleware is the bound."""
    from tokenizers import Tokenizer

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model})
    app = create_app(cfg, object(), Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    assert http_server_config(cfg, app).limit_concurrency is None
    # Starlette runs the first of this list outermost: CORS (Starlette's, its refusals in JSON),
    # X-Request-Id, HEAD as GET, the drain gate (shutdown), then this bound
    # (and, outside those, the Connection: close of a refusal made before the body was read)
    from pdd.gateway.api import CloseUnreadBody, JsonCORS
    from pdd.gateway.head import HeadAsGet
    from pdd.gateway.request_id import RequestIdHeader
    from pdd.gateway.shutdown import DrainGate

    assert [m.cls for m in app.user_middleware[:6]] == [JsonCORS, CloseUnreadBody, RequestIdHeader, HeadAsGet,
                                                        DrainGate, ConcurrencyLimit]
    assert app.user_middleware[5].kwargs["admission"] is app.state.admission
