"""The gateway's bound on a request body that stops arriving (:class:`BodyIdleTimeout`).

A request counts against the gateway's HTTP requests at once (``api.ConcurrencyLimit``, 1,024)
from its headers on, while its body is read. A client that sent the headers of a POST and then
no more of its body (it stalled, crashed behind a NAT, or does so on purpose) held its place
for as long as the connection stayed open, and 1,024 such connections answered every later
request 429 until they closed. Here a body whose next byte has not arrived ``idle_s`` seconds
after the last (``BODY_IDLE_S``, 30 s, as the idle keep-alive connection's bound; nginx's
``client_body_timeout`` is 60 s) ends the request: HTTP 408 with an OpenAI-style body and
``Connection: close``, so its place (and its connection) are freed.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse

from pdd.gateway.openai_schemas import error_body

BODY_IDLE_S = 30.0  # seconds a request body may go without a byte before the request ends with 408


def timeout_body(idle_s: float, received: int = 0) -> dict:
    """The OpenAI-style error body of a request whose body stopped arriving for ``idle_s`` seconds
    after ``received`` bytes of it: "none of it arrived" when no byte came, "no more of it arrived
    ... after N bytes" when some did."""
    if received:
        what = f"no more of it arrived for {idle_s:g} s after {received} byte{'s' if received != 1 else ''}"
    else:
        what = f"none of it arrived for {idle_s:g} s"
    return error_body(f"request body incomplete: {what}; send the whole body without pausing",
                      code="request_timeout")


class BodyIdleTimeout:
    """ASGI middleware (inside ``api.ConcurrencyLimit``): while the app reads a request's body, a
    wait of more than ``idle_s`` seconds for its next part ends the request. The app is told the
    client went away (``http.disconnect``: its reads of the body stop) and whatever it answers
    is replaced by HTTP 408 :func:`timeout_body` (saying how many bytes had arrived) with
    ``Connection: close``. Once the body is complete the receive channel is the server's,
    unbounded (a stream's disconnect watch)."""

    def __init__(self, app, idle_s: float | None = None):
        self.app = app
        self.idle_s = BODY_IDLE_S if idle_s is None else float(idle_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done, timed_out, answered = False, False, False
        received = 0  # bytes of the body that arrived

        async def timed_receive():
            nonlocal body_done, timed_out, received
            if body_done or timed_out:
                return await receive() if not timed_out else {"type": "http.disconnect"}
            try:
                msg = await asyncio.wait_for(receive(), self.idle_s)
            except asyncio.TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                body_done = True
            return msg

        async def answer_timeout():
            nonlocal answered
            answered = True
            resp = JSONResponse(timeout_body(self.idle_s, received), status_code=408, headers={"Connection": "close"})
            await resp(scope, receive, send)

        async def guarded_send(msg):
            if not timed_out:
                return await send(msg)
            if not answered and msg["type"] == "http.response.start":  # the app's answer to the "disconnect"
                await answer_timeout()
            # the rest of the app's answer is dropped: the 408 was sent in its place

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:  # a reader that raised on the "disconnect" (ClientDisconnect): the 408 answers it
            if not timed_out:
                raise
        if timed_out and not answered:  # the app answered nothing (a chunked body's reader just returns)
            await answer_timeout()
