"""The client's ``X-Request-Id`` (:class:`RequestIdHeader`), as vLLM's OpenAI server takes it.

vLLM uses the header as the base of its request id: the response's ``id`` is ``cmpl-<header>``
(``chatcmpl-<header>`` for chat), and with ``--enable-request-id-headers`` the response carries
``X-Request-Id`` back (the client's, else a fresh one). pdd does both, always: the response's
``id`` is ``cmpl-`` / ``chatcmpl-`` + the client's id (without one, pdd's own rid of the request's
first choice, as before), and the response carries ``X-Request-Id``: the client's (on every
path), else, on a completion, the base of its ``id``. A response that has neither carries none
(vLLM's flag adds a random one there, which names nothing).

Unlike vLLM, which takes any header value, pdd takes at most :data:`MAX_CHARS` characters of
:data:`ALLOWED` (what UUIDs, ULIDs, base64, nginx's, Envoy's and most tracing ids are made of), so
a hostile header can neither grow every id and log line nor put spaces, quotes or other
delimiters into them. Another value (or the header sent twice) on a completion or chat request is
refused with HTTP 400, code ``invalid_header``, naming the header, before the request does any
work; on any other path (``/health``, ``/metrics``, ``/v1/models``: nothing is named after it) it
is ignored and not echoed, so a load balancer's probe through a proxy that adds its own id passes.
"""

from __future__ import annotations

import re

from starlette.datastructures import MutableHeaders
from starlette.responses import JSONResponse

from pdd.gateway.shutdown import GENERATION_PATHS

HEADER = "X-Request-Id"
MAX_CHARS = 128  # vLLM's own ids are 32 hex digits after "cmpl-"
ALLOWED = "letters, digits and . _ ~ : / + = @ -"
_ID = re.compile(r"[A-Za-z0-9._~:/+=@-]+")
STATE_KEY = "pdd_request_id"  # scope["state"]: the client's id, or the base a completion used (echoed back)


def request_id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a request id (one phrase naming the length or the first character
    refused, never echoing the value), or None when it can: 1 to :data:`MAX_CHARS` characters of
    :data:`ALLOWED`."""
    if not value:
        return f"empty; send 1 to {MAX_CHARS} of {ALLOWED}"
    if len(value) > MAX_CHARS:
        return f"{len(value)} characters; at most {MAX_CHARS}"
    if not _ID.fullmatch(value):
        bad = next(c for c in value if not _ID.fullmatch(c))
        return f"character {ascii(bad)} is not allowed; use {ALLOWED}"
    return None


class RequestIdHeader:
    """ASGI middleware, outside every other but CORS and the HTTP metrics: refuses an unusable
    ``X-Request-Id`` on a generation path (:func:`request_id_problem`; HTTP 400 in the OpenAI
    error shape; ignored on others), puts a usable one in
    ``scope["state"][STATE_KEY]`` (an endpoint that names its response after another id writes
    that one there, :func:`id_base`), and adds ``X-Request-Id`` with that state value to the
    response when it holds one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"]
        value = None
        if given:
            value = given[0].decode("latin-1")
            bad = f"sent {len(given)} times; send one" if len(given) > 1 else request_id_problem(value)
            if bad is not None:
                if scope.get("path") not in GENERATION_PATHS:
                    value = None  # names nothing here: ignored, not echoed (a probe through a proxy still passes)
                else:
                    body = {"error": {"message": f"{HEADER} header: {bad}", "type": "invalid_request_error",
                                      "param": HEADER.lower(), "code": "invalid_header"}}
                    return await JSONResponse(body, status_code=400)(scope, receive, send)
        state = scope.setdefault("state", {})
        state[STATE_KEY] = value

        async def send_with_id(msg):
            if msg["type"] == "http.response.start" and state.get(STATE_KEY):
                MutableHeaders(scope=msg)[HEADER] = state[STATE_KEY]
            await send(msg)

        return await self.app(scope, receive, send_with_id)


def id_base(request, rid: str) -> str:
    """The base of a completion's response ``id``: the client's ``X-Request-Id`` if it sent one,
    else ``rid`` (pdd's id of the request's first choice), which is then what the response's
    ``X-Request-Id`` header carries too."""
    state = request.scope.setdefault("state", {})
    base = state.get(STATE_KEY) or rid
    state[STATE_KEY] = base
    return base
