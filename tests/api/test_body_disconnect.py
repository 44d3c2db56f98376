"""A client that disconnects while the gateway reads its request body (the body's bytes never all
arrive: the ASGI receive channel yields ``http.disconnect``) is an expected event: the gateway
answers 499 to nobody, and no "Exception in ASGI application" traceback is logged. Before,
``Utf8JsonRoute``'s ``await request.body()`` let starlette's ClientDisconnect escape the route
(uvicorn logged the traceback; the server's error middleware answered 500). Driven through the
ASGI app directly, with a receive channel that reports the disconnect: no socket, no clock."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_while_the_body_is_read_is_499_not_an_error(api, path):
    client, orch = api
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"64")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    await client.app(scope, receive, send)  # raised ClientDisconnect before
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not orch.started  # no tier did any work
