"""``HEAD`` on the gateway (:class:`HeadAsGet`): answered as ``GET``, without the body.

Load balancers and ``curl -I`` probe ``/health`` with HEAD, and HTTP requires a server to answer
HEAD wherever it answers GET (RFC 9110 9.3.2). FastAPI's routes take only the methods they name,
so ``HEAD /health`` was a 405. Here a HEAD request runs as the GET it stands for, through every
layer (the drain's 503, API keys, 404 / 405 alike), and its response keeps the GET's status and
headers (``Content-Length`` and ``Content-Type`` included) with an empty body.
"""

from __future__ import annotations


class HeadAsGet:
    """ASGI middleware, inside the HTTP metrics (:mod:`pdd.gateway.http_metrics`), CORS and
    X-Request-Id: a ``HEAD`` request is passed on as ``GET`` (a copy of its scope: the server's
    own scope still says HEAD) and every body part of its response is sent empty, the status and
    headers unchanged. Other methods pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def send_without_body(msg):
            if msg["type"] == "http.response.body":
                msg = {**msg, "body": b""}
            await send(msg)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)
