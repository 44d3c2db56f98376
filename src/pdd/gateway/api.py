"""OpenAI-compatible HTTP API of the gateway (FastAPI): ``/v1/completions`` and
``/v1/chat/completions`` (SSE or not), models, health, and pdd's own ``/pdd/stats`` and
``/pdd/flush``.

Parameters (OpenAI names plus vLLM's extensions): temperature, top_p, top_k, min_p,
presence/frequency/repetition penalties, logit_bias, seed, stop (strings), stop_token_ids,
min_tokens, max_tokens / max_completion_tokens, ignore_eos, include_stop_str_in_output,
skip_special_tokens, logprobs (+ top_logprobs for chat), n, echo (completions), allowed_token_ids, bad_words
(tokenised here, sent to the tiers as id sequences) and return_token_ids (``prompt_token_ids`` and
``token_ids`` where vLLM puts them); a completion ``prompt``
may be a batch (a list of texts or token-id lists: choice ``index = prompt * n + i``, as vLLM), and
``/tokenize``, ``/detokenize``, ``/version`` and ``/v1/models/{id}`` answer as vLLM / OpenAI. Sampling runs on
the tiers (``pdd.engine.sampler``: the same draw for a position on every tier); stop strings,
detokenization and the choices of ``n`` are the gateway's (``openai_run``, ``openai_text``);
chat renders the checkpoint's own template (``openai_chat``) and, for ``tools`` with ``tool_choice``
"auto", parses the calls out of each choice's text (``tool_parsers``, the config's ``tool_call_parser``).
Structured outputs (``response_format`` json_object / json_schema, vLLM's ``structured_outputs`` and
``guided_*``, a forced ``tool_choice``) are compiled here into each choice's ``SamplingParams.grammar``
(``openai_schemas.structured_constraint``), which every tier masks by (``pdd.structured``).

Every streamed chunk (but a choice's first, its role) carries one token; besides the OpenAI fields it has ``"pdd": {"tier",
"pos", "token_id"}`` (which decoder produced it). With ``stream_options.include_usage`` a last
chunk carries ``usage`` (``prompt_tokens_details.cached_tokens`` = P's prefix-cache hits on the
prompt at the request's first prefill, the figure billing uses) and ``"pdd": {"pipeline", "wan_bytes", "wan_bytes_expected", ...}``.
Bad input gets HTTP 400 with an OpenAI-style error body before any tier does work. What the
system cannot take now (``pdd.gateway.admission``: requests in flight, prompt tokens queued for
prefill and their expected wait, or a tier whose bounded queue is full; :class:`ConcurrencyLimit`:
more HTTP requests at once than ``MAX_CONCURRENT_REQUESTS``) gets HTTP 429 with
``Retry-After`` and ``{"error": {"type": "rate_limit_error", "code": "rate_limit_exceeded"}}``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import sys
import time
import weakref
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from pdd.config import ClusterConfig
from pdd.gateway.admission import (Admission, causes, choice_refusal, kv_hint, kv_refusal, refusal,
                                   request_pages, short_pool)
from pdd.gateway.disconnect import ClientGone, client_gone as _client_gone, unless_gone
from pdd.gateway.openai_chat import ChatTemplate, ChatTemplateError
from pdd.gateway.openai_defaults import generation_defaults
from pdd.gateway.openai_run import Batch, Delta, Generation
from pdd.gateway.openai_schemas import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest, check_chat, check_completion, check_messages,
                                        check_truncate, error_body, int_range, lone_surrogate, media_type, not_utf8,
                                        too_deep, prompt_batch, sampling_for, structured_constraint, too_many_digits,
                                        truncated_prompt, first_error, constraint_requested,
                                        checked_constraint_summary)
from pdd.gateway.shutdown import GENERATION_PATHS, Drain, DrainGate, refusal_body
from pdd.gateway.request_id import RequestIdHeader, id_base
from pdd.gateway.openai_text import TokenText
from pdd.gateway import tool_parsers
from pdd.gateway.orchestrator import (ABORT_CLIENT, ABORT_FAILED, ABORT_REJECTED, NoInstance, Orchestrator,
                                     RequestFailed, ReqState, ShuttingDown, checkpoint_config)
from pdd.text import shown

log = logging.getLogger(__name__)

# the constraints the gateway remembers having compiled (its compile-queue cost), as many as
# pdd.structured keeps compiled (its lru_cache of 256)
COMPILED_KEYS = 256
SERVER_CLOSE_S = 3.0  # after the drain: uvicorn's own wait for responses still being sent, seconds
LP_FLOOR = -9999.0  # a logprob of -inf is reported as this (JSON has no infinity; vLLM does the same)


def bad_request(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, code), status_code=status)


MAX_BODY_BYTES = 32 * 1024 * 1024  # a max_input_len prompt as JSON token ids is well under 1 MiB
MAX_CHARS_PER_TOKEN = 64  # no tokenizer's token is longer: a longer text cannot fit max_input_len
# A text prompt with truncate_prompt_tokens is tokenized whole, then cut to its last k tokens (a
# suffix of the text is not tokenized exactly as the whole: a BPE word's merges, a byte-level
# pre-tokenizer's first space), so it may be longer than max_input_len x MAX_CHARS_PER_TOKEN, up to
# this many characters (about 0.7 s of one core for the demo's byte-level BPE); bounded work still
MAX_TRUNCATED_PROMPT_CHARS = 1 << 20


class Overloaded(ApiError):
    """HTTP 429: admission refused the request (or a tier's queue was full); ``retry_after_s``
    goes into the ``Retry-After`` header; ``reason``: a tier's refusal (``admission.refusal``)."""

    def __init__(self, message: str, retry_after_s: int, reason: str | None = None):
        super().__init__(message, None, status=429, code="rate_limit_exceeded", etype="rate_limit_error")
        self.retry_after_s = int(retry_after_s)
        self.reason = reason


def _failure(ex: BaseException) -> tuple[int, str]:
    """HTTP status and error type of a request that failed after it started: the request's own
    failure (``RequestFailed.client_error``: a structured output whose grammar failed at run
    time, so the same request fails the same way again) is 400 ``invalid_request_error``; any
    other failure the server's, 503 ``server_error`` (a client may retry it)."""
    return (400, "invalid_request_error") if getattr(ex, "client_error", False) is True else (503, "server_error")


def _failure_param(ex: BaseException, opts) -> str | None:
    """The ``param`` of a request's failed-after-start error: for the request's own failure (its
    grammar failed at run time, :func:`_failure`'s 400) the field it gave its constraint in
    (``opts``: its :class:`TextOptions`, ``constraint_param``: ``response_format``,
    ``structured_outputs``, ``guided_json``, ``tool_choice``, ...), as the 400 of a constraint
    refused up front names it; None for the server's failure, or a request without one."""
    return getattr(opts, "constraint_param", None) if getattr(ex, "client_error", False) is True else None


class Unavailable(ApiError):
    """HTTP 503 with ``Retry-After``: no instance of a role the request needs is reachable now
    (dead or restarting); the request did no work."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, None, status=503, etype="server_error")
        self.retry_after_s = int(retry_after_s)


class Draining(ApiError):
    """HTTP 503 ``shutting_down`` with ``Connection: close``: the shutdown drain began while the
    request's start waited for a restarting instance (:class:`pdd.gateway.state.ShuttingDown`);
    the body is a request's arriving during the drain (:func:`pdd.gateway.shutdown.refusal_body`)."""

    headers = {"Connection": "close"}

    def __init__(self):
        e = refusal_body()["error"]
        super().__init__(e["message"], e["param"], status=503, code=e["code"], etype=e["type"])


def _too_large(n: int | None) -> JSONResponse:
    what = f"request body of {n} bytes" if n is not None else "request body"
    return JSONResponse(error_body(f"{what} exceeds the limit of {MAX_BODY_BYTES} bytes", None,
                                   code="body_too_large"), status_code=413, headers={"Connection": "close"})


def _json_body(request: Request) -> bool:
    """Whether FastAPI parses ``request``'s body as JSON (a POST, PUT or PATCH sent with an
    ``application/json`` or ``application/*+json`` content type; other bodies get the 415)."""
    ctype = media_type(request.headers.get("content-type"))
    return request.method in ("POST", "PUT", "PATCH") and ctype.startswith("application/") and (
        ctype.endswith("/json") or ctype.endswith("+json"))


class Utf8JsonRoute(APIRoute):
    """Every route of the gateway: a JSON body that is not UTF-8 (:func:`not_utf8`) gets 400
    saying so before FastAPI parses it (a route that takes a body model; the operator endpoints
    read theirs themselves, ``pdd.gateway.membership_api``). FastAPI's ``json.loads`` on the bytes would read a body
    with a UTF-16 or UTF-32 byte-order mark, or with a NUL among its first bytes, as that
    encoding (``b"\\xff\\xfe"`` was "not valid JSON at character 0: Expecting value", and
    ASCII JSON in UTF-16 was served); other bytes that are not UTF-8 failed its parse with
    "There was an error parsing the body"."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            coding = request.headers.get("content-encoding", "identity").strip().lower()
            if self.body_field is not None and coding not in ("", "identity"):
                # a compressed body read as JSON was "not UTF-8 (byte 0x8b at offset 1)" (gzip's
                # magic); RFC 9110 section 15.5.16: 415 for a content coding the server does not take
                return bad_request(f"Unsupported Media Type: Content-Encoding {shown(coding)} is not supported; "
                                   "send the request body uncompressed", None, status=415)
            if self.body_field is not None and _json_body(request):
                try:
                    body = await request.body()  # read once: FastAPI's parse reuses it
                except ClientDisconnect:  # gone before its body arrived: nothing started, nobody reads this
                    gone = ClientGone()
                    return JSONResponse(gone.body(), status_code=gone.status)
                why = not_utf8(body) or too_deep(body)
                if why is not None:
                    return bad_request(why)
            return await handler(request)

        return checked


# the body model of each route that takes one (for the bounds a 400 names: openai_schemas.int_range)
_BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}

ARRIVAL = "pdd_arrival"  # scope["state"] key: time.monotonic() when the request reached the app


class EarlyReject:
    """ASGI middleware: while the in-flight limit is reached (``Admission.full``), a generation
    request gets 429 before its body is read or parsed, so refusing costs the gateway almost no
    CPU however hard clients push."""

    PATHS = GENERATION_PATHS

    def __init__(self, app, admission: Admission):
        self.app, self.adm = app, admission

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in self.PATHS:
            d = self.adm.full()
            if d is not None:
                ex = Overloaded(d.message, d.retry_after_s)
                resp = JSONResponse(ex.body(), status_code=429, headers={"Retry-After": str(ex.retry_after_s)})
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


MAX_CONCURRENT_REQUESTS = 1024  # HTTP requests the gateway serves at once (a stream counts until it ends)
ALWAYS_SERVED = ("/health", "/metrics")  # a load balancer's probe and the scrape, however many clients wait


class ConcurrencyLimit:
    """ASGI middleware, inside CORS, X-Request-Id, HEAD's and the shutdown's drain gate: at most
    ``limit`` HTTP requests are served at once (a stream counts until it ends); one more gets HTTP 429 with ``Retry-After: 1`` and an
    OpenAI-style ``rate_limit_error`` body at once, counted in ``admission.rejected["concurrency"]``
    (``pdd_gateway_rejected_total{reason="concurrency"}``). ``ALWAYS_SERVED`` paths neither count
    nor are refused. It replaces uvicorn's ``limit_concurrency``, whose refusal past 1,024
    connections was a plain-text 503 "Service Unavailable" (no JSON body, no ``Retry-After``)
    that refused ``/health`` too: 1,500 concurrent streaming clients got 701 of those."""

    def __init__(self, app, admission: Admission | None = None, limit: int | None = None):
        self.app, self.adm = app, admission
        self.limit = MAX_CONCURRENT_REQUESTS if limit is None else int(limit)
        self.serving = 0  # requests inside the app now

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in ALWAYS_SERVED:
            return await self.app(scope, receive, send)
        if self.serving >= self.limit:
            if self.adm is not None:
                self.adm.reject("concurrency")
            ex = Overloaded(f"server overloaded: the gateway serves at most {self.limit} HTTP requests at once "
                            f"(a stream counts until it ends) and all are in use; retry later", 1)
            resp = JSONResponse(ex.body(), status_code=429, headers={"Retry-After": str(ex.retry_after_s)})
            return await resp(scope, receive, send)
        self.serving += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.serving -= 1


class CloseUnreadBody:
    """ASGI middleware, outermost: a response that starts while the request's body is still
    unread gets ``Connection: close`` (if it has no ``Connection`` header of its own), so the
    server closes the connection after it instead of waiting to read (and drop) the rest of the
    body (a client still sending a body refused on its ``Content-Length`` alone would wait for
    its own timeout). Covers every refusal made
    before the body is read (413 on the header or past the limit of a chunked body, 415 for a
    content coding, the concurrency limit's 429, ...); the 408 of a stalled body and the drain's
    503 set it themselves. A request without a body (no ``Content-Length`` above 0 and no
    ``Transfer-Encoding``) keeps its connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _has_body(scope.get("headers", ())):
            return await self.app(scope, receive, send)
        unread = True

        async def receive_tracked():
            nonlocal unread
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                unread = False  # the last part of the body arrived (or the client left)
            return msg

        async def send_closing(msg):
            if msg["type"] == "http.response.start" and unread:
                headers = list(msg.get("headers", ()))
                if not any(k.lower() == b"connection" for k, _ in headers):
                    msg = {**msg, "headers": headers + [(b"connection", b"close")]}
            await send(msg)

        return await self.app(scope, receive_tracked, send_closing)


def _has_body(headers) -> bool:
    """Whether a request with these ASGI ``headers`` sends a body: ``Transfer-Encoding`` present,
    or a ``Content-Length`` that is not 0 (one that is not a number counts as a body)."""
    for k, v in headers:
        k = k.lower()
        if k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0"):
            return True
    return False


class BodyLimit:
    """ASGI middleware: a request body sent without ``Content-Length`` (chunked) is read up to
    ``MAX_BODY_BYTES`` and refused with 413 beyond it (so memory stays bounded), else replayed to
    the app unchanged. Bodies with ``Content-Length`` are checked by the header alone (below)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL] = time.monotonic()  # admission's TTFT counts from here
        if scope["type"] != "http" or any(k == b"content-length" for k, _ in scope.get("headers", ())):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnect: nothing to serve
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > MAX_BODY_BYTES:
                return await _too_large(None)(scope, receive, send)
            chunks.append(body)
            more = msg.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_again():
            return replay.pop() if replay else await receive()

        return await self.app(scope, receive_again, send)


class JsonCORS(CORSMiddleware):
    """Starlette's CORS middleware whose refused preflight (400, "Disallowed CORS origin" as
    plain text) is an OpenAI-style JSON error naming what was refused and the ``cors`` field
    (and ``pdd serve`` flag) that would allow it; status and CORS headers as Starlette gives them."""

    _WHAT = {"origin": ("origin", "is not in cors.allowed_origins", "--allowed-origins"),
             "method": ("access-control-request-method", "is not in cors.allowed_methods", "--allowed-methods"),
             "headers": ("access-control-request-headers", "are not all in cors.allowed_headers",
                         "--allowed-headers")}

    def preflight_response(self, request_headers):
        r = super().preflight_response(request_headers)
        if r.status_code != 400:
            return r
        why = []
        for failure in r.body.decode().removeprefix("Disallowed CORS ").split(", "):
            header, rule, flag = self._WHAT.get(failure, (None, "not allowed", None))
            sent = f" {shown(request_headers.get(header))}" if header else ""
            where = f" (the gateway's config; pdd serve {flag})" if flag else ""
            why.append(f"Disallowed CORS {failure}:{sent} {rule}{where}")
        headers = {k: v for k, v in r.headers.items() if k.lower() not in ("content-type", "content-length")}
        return JSONResponse(error_body("; ".join(why)), status_code=400, headers=headers)


def create_app(cfg: ClusterConfig, orch: Orchestrator, tokenizer, chat_template: ChatTemplate | None = None) -> FastAPI:
    # no 307 to the path without its trailing slash (FastAPI's redirect_slashes: an empty body, and
    # a client that follows it with its method changed may get a 405): ``/pdd/instances/`` is an
    # unknown path like any other, a 404 in the OpenAI error shape (no documented path ends in /)
    app = FastAPI(title="pdd gateway", version="0.1.0", redirect_slashes=False)
    app.router.route_class = Utf8JsonRoute  # before any route is added (membership_api's too)
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    mc = checkpoint_config(cfg)
    model_vocab = (mc.vocab_size if mc is not None else None) or vocab
    eos_ids = set(mc.eos_token_ids) if mc is not None else set()  # a choice ended by one hides its text (vLLM)
    if chat_template is None:
        try:
            chat_template = ChatTemplate.from_model_dir(cfg.model_path)
        except Exception as e:  # a broken tokenizer_config only disables chat
            log.warning("no chat template: %s", e)
    token_text = TokenText(tokenizer)
    model_name = cfg.served_model_name
    gen_defaults = generation_defaults(cfg.model_path)  # a request's sampling values left out (vLLM, SGLang)
    tool_parser = chat_tool_parser(cfg.tool_call_parser, mc.model_type if mc is not None else None, tokenizer)
    log.info("tool calls: %s", f"parsed as {tool_parser} (tool_call_parser {cfg.tool_call_parser})"
             if tool_parser else f"not parsed (tool_call_parser {cfg.tool_call_parser}): tool_choice auto is refused")
    from pdd.topology import layout

    adm = Admission.from_config(cfg, getattr(orch, "layout", None) or layout(cfg))
    app.state.admission = adm
    if hasattr(orch, "planned_wan"):
        def wan_backlog_s() -> float | None:
            """KV bytes planned for the WAN whose transfer P has not reported done, in seconds at the
            live WAN estimate (else the configured line rate)."""
            gbps = getattr(orch, "wan_gbps_live", None) or cfg.link.wan_gbps
            return sum(orch.planned_wan.values()) * 8 / (gbps * 1e9)

        adm.wan_backlog = wan_backlog_s
    app.add_middleware(EarlyReject, admission=adm)  # inside the API-key check (added below)
    if getattr(orch, "metrics", None) is not None:
        from pdd.gateway.metrics import AdmissionCollector

        orch.metrics.registry.register(AdmissionCollector(adm))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = first_error(exc.errors())  # a union field's error names none of pydantic's branches
        # where the bad value sits (body, query string, path) is not the parameter's name
        outer = {"body", "query", "path", "header"}
        raw_loc = list(first.get("loc", []))
        if raw_loc and raw_loc[0] in outer:
            raw_loc = raw_loc[1:]
        loc = [str(x) for x in raw_loc]
        param = loc[0] if loc else None
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")  # our validators' messages
        if first.get("type") == "json_invalid":
            err = (first.get("ctx") or {}).get("error")
            at = f" at character {loc[0]}" if loc and loc[0].isdigit() else ""
            return bad_request(f"request body is not valid JSON{at}: {err or msg}", None)
        ctype = media_type(request.headers.get("content-type"))
        if first.get("type") == "model_attributes_type" and "json" not in ctype:
            # a body sent as a form (``curl -d`` without ``-H 'content-type: application/json'``) or
            # with no content type is not parsed as JSON (FastAPI's strict content type, against
            # CSRF): say so, with vLLM's 415, instead of "Input should be a valid dictionary"
            got = f"got {ctype!r}" if ctype else "none was sent"
            return bad_request(f"Unsupported Media Type: the request body must be JSON sent with "
                               f"Content-Type: application/json ({got})", None, status=415)
        if not loc and first.get("type") == "missing":  # no body at all
            field = {"/v1/chat/completions": "messages", "/v1/responses": "input"}.get(request.url.path, "prompt")
            return bad_request(f"request body is missing: send a JSON object with at least {field!r}", field)
        if not loc and first.get("type") == "model_attributes_type":  # JSON null, an array, a string, a number
            got = first.get("input")
            kind = {type(None): "null", list: "an array", str: "a string", bool: "a boolean"}.get(type(got), "a number")
            return bad_request(f"request body must be a JSON object, got {kind}", None)
        # a list item by its index, as the validators and the chat renderer name it (messages[1])
        where = "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else x)
                        for i, x in enumerate(raw_loc))
        # a bad query string or path value (``?force=maybe``) carries a code, as a bad operator
        # body does (``invalid_body``); a bad /v1 body keeps OpenAI's null code
        code = {"query": "invalid_query", "path": "invalid_path", "header": "invalid_header"}.get(
            str((first.get("loc") or ("body",))[0]))
        model = _BODY_MODELS.get(request.url.path)
        if first.get("type") == "int_parsing_size" and len(raw_loc) == 1 and model and param in model.model_fields:
            # "seed": 1e30 (a number with an exponent past int64) was "Unable to parse input string as an integer"
            lo, hi = int_range(model, param)
            msg = f"must be an integer in [{lo}, {hi}], got {first.get('input')!r}"
        if msg.startswith(f"{param}[") or msg.startswith(f"{param}:"):  # the validator named the item
            return bad_request(msg, param, code=code)
        return bad_request(f"{where}: {msg}" if where else msg, param, code=code)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        retry = getattr(exc, "retry_after_s", None)
        headers = dict(getattr(exc, "headers", None) or {})
        if retry is not None:
            headers["Retry-After"] = str(retry)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    @app.get("/health")
    async def health():
        """200 while requests can be served ("ok", or "degraded" naming the unreachable instances
        and the roles with no reachable member, so a load balancer keeps a gateway that still
        serves); 503 when they cannot (the roles missing say why), or while the gateway shuts down
        ("shutting_down": :mod:`pdd.gateway.shutdown`)."""
        h = orch.health() if hasattr(orch, "health") else {"status": "ok", "mode": cfg.mode, "down": [], "missing": []}
        if app.state.drain.draining:  # shutting down (pdd.gateway.shutdown): a load balancer sends nothing more
            h = {**h, "status": "shutting_down"}
        return JSONResponse(h, status_code=503 if h["status"] in ("unavailable", "shutting_down") else 200)

    if cfg.security.api_keys:  # optional API keys (Authorization: Bearer KEY); health stays open
        from pdd.security import ApiKeyMiddleware

        app.add_middleware(ApiKeyMiddleware, keys=cfg.security.api_keys)

    if getattr(orch, "metrics", None) is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        @app.get("/metrics")
        async def metrics():
            """Prometheus text exposition of the gateway's registry (at /metrics itself, no redirect)."""
            return Response(generate_latest(orch.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        """Refuse bodies over MAX_BODY_BYTES before reading them (413, OpenAI-style body)."""
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > MAX_BODY_BYTES:
            return _too_large(int(n))
        return await call_next(request)

    app.add_middleware(BodyLimit)
    from pdd.gateway.slow_body import BodyIdleTimeout

    app.add_middleware(BodyIdleTimeout)  # a body that stops arriving frees its place below (408)
    app.add_middleware(ConcurrencyLimit, admission=adm)  # bounds everything above (inside the drain gate)
    drain = app.state.drain = Drain(cfg.shutdown_timeout_s)  # serve_gateway begins it on SIGTERM / Ctrl-C
    app.add_middleware(DrainGate, drain=drain)  # during the drain a new request costs nothing
    from pdd.gateway.head import HeadAsGet

    app.add_middleware(HeadAsGet)  # HEAD /health (a load balancer's probe) answers as GET, no body
    app.add_middleware(RequestIdHeader)  # every response (429s and 503s too) names its X-Request-Id
    app.add_middleware(CloseUnreadBody)  # a refusal before the body was read closes the connection
    # outside the others but the HTTP metrics: a browser's preflight is answered before the API key (it carries none) and every
    # answer, a refusal too, carries the CORS headers a page needs to read it (as vLLM's server)
    app.add_middleware(JsonCORS, allow_origins=cfg.cors.allowed_origins,
                       allow_credentials=cfg.cors.allow_credentials, allow_methods=cfg.cors.allowed_methods,
                       allow_headers=cfg.cors.allowed_headers, expose_headers=["X-Request-Id"])
    if getattr(orch, "metrics", None) is not None:  # outermost: every response counted (CORS preflights too), by route and status
        from pdd.gateway.http_metrics import HttpMetrics

        app.add_middleware(HttpMetrics, counters=orch.metrics.http, routes=app.router.routes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """404 / 405 and friends in the OpenAI error shape."""
        etype = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":
            detail = await _body_error(request) or detail
        # the exception's headers (a 405's ``Allow``, which HTTP requires) go out with the body
        return JSONResponse(error_body(detail, None, etype=etype), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    # created: when this gateway began serving the model (a Unix time, as OpenAI, vLLM and SGLang
    # give; 0 read as 1970); root / parent as vLLM's and SGLang's cards (no adapters: parent null)
    model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pdd",
                  "root": model_name, "parent": None, "max_model_len": cfg.engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """OpenAI's retrieve (the official client's ``models.retrieve``; SGLang serves it too)."""
        check_model(model)
        return model_card

    @app.get("/version")
    async def version():  # as vLLM's /version
        from pdd import __version__

        return {"version": __version__}

    @app.get("/pdd/stats")
    async def stats():
        return {**await orch.stats(), "admission": adm.stats()}

    @app.post("/pdd/flush")
    async def flush():
        return await orch.flush()

    @app.get("/pdd/requests")
    async def live_requests():  # live requests' phases (pdd.faults records them at each injection)
        return orch.requests_view() if hasattr(orch, "requests_view") else {}

    if getattr(orch, "membership", None) is not None:  # elastic topology (pdd.gateway.membership_api)
        from pdd.gateway.membership_api import add_membership_routes

        add_membership_routes(app, orch.membership)
        orch.membership.admission = adm  # capacities follow add / drain / remove / re-role
        orch.membership.sync_admission()
    from pdd.gateway.autoscale import add_autoscale_routes

    add_autoscale_routes(app, orch)  # GET /pdd/autoscale (``{"enabled": false}`` unless pdd serve --autoscale)

    from pdd.topology import ROLE_MAIN

    # MD on vLLM (vllm.main_decode, pdd.vllm_tier.md): it always continues a request that has
    # outputs already (P samples the first token, RLD more), and vLLM's structured outputs would
    # start the grammar at its own first token, so it cannot honour a constraint
    vllm_md = cfg.vllm.main_decode and any(s.role == ROLE_MAIN for s in (getattr(orch, "layout", None)
                                                                          or layout(cfg)).instances)

    def _constraint(body):
        from pdd.structured import ll_tokenizer

        lltok = None
        if mc is not None and mc.eos_token_ids:
            lltok = ll_tokenizer(tokenizer, list(mc.eos_token_ids), model_vocab)
        return structured_constraint(body, lltok)

    compiled_keys: collections.OrderedDict[str, None] = collections.OrderedDict()  # constraint_key, LRU

    async def structured(body, request=None):
        """The request's structured-output constraint (``openai_schemas.structured_constraint``:
        ApiError for a bad one, or one no token can begin), else None; ApiError (400 naming its
        field) when MD runs on vLLM. Compiled on ``pdd.structured.compiler``'s thread (a large
        stack), so the event loop serves other requests meanwhile; a request that asks for none
        (``constraint_requested``) does not wait for that thread. The queue runs the highest
        response ratio next (``pdd.compile_queue.next_job``; cost: ``compile_cost_s`` of the
        request's constraint characters (``checked_constraint_summary``), or none for a constraint compiled before, whose compile
        ``pdd.structured`` caches): a small constraint overtakes large ones queued before it. A client that disconnects while
        its compile waits (``request``'s connection, unless ``policy.cancel_on_disconnect`` is
        off) drops it from the queue and gets ClientGone (499, to nobody). A constraint over
        ``pdd.structured.MAX_CONSTRAINT_CHARS`` is refused before it queues
        (``checked_constraint_summary``: the constraint's JSON written once on the event loop)."""
        from pdd.structured import compile_cost_s, compiler

        if not constraint_requested(body):  # nothing to compile: no wait behind other clients' grammars
            return None
        # too large (or malformed): refused without waiting for the compiler; else its key and size
        key, chars = checked_constraint_summary(body)
        if key is not None and key in compiled_keys:  # compiled before: cached (pdd.structured), the least cost
            chars = 0
        job = asyncio.wrap_future(compiler().submit_costed(compile_cost_s(chars), _constraint, body))
        c = await unless_gone(request, job, job.cancel, enabled=cfg.policy.cancel_on_disconnect)
        if key is not None:
            compiled_keys[key] = None
            compiled_keys.move_to_end(key)
            while len(compiled_keys) > COMPILED_KEYS:
                compiled_keys.popitem(last=False)
        if c is not None and vllm_md:
            raise ApiError(f"{c.param}: structured outputs are not supported with MD on vLLM (vllm.main_decode): "
                           "vLLM continues each request after P's first token and would start the constraint "
                           "there; serve it with pdd's MD (vllm.main_decode: false)", c.param)
        return c

    def check_model(name: str | None) -> None:
        """404 ``model_not_found`` for a model this server does not serve; null or "" is the served
        model, as vLLM takes it (a client with no model configured sends ""); 400 for a name
        that is no Unicode text (a lone surrogate: no model's name), as any other field's."""
        if name and (bad := lone_surrogate(name)) is not None:
            raise ApiError(f"model: not valid Unicode text (a lone surrogate at character {bad})", "model")
        if name and name != model_name:
            raise ApiError(f"model {shown(name)} does not exist; this server serves {model_name!r}", "model",
                           status=404, code="model_not_found")

    def check_context(n_prompt: int, max_tokens: int, param: str, n: int = 1, asked: bool = True,
                      prompt_param: str = "prompt", defaulted: bool = False) -> None:
        """400 (ApiError naming the field) for an empty or too long prompt, a prompt + output past
        the context window, or ``n`` choices that an active decoder's KV pool (the smallest of
        its tier's: each instance's own engine block, ``tiers``, as routing may pick any) could
        not hold at once even with the prompt's full pages shared (in pdd mode: RLD's, which
        shares nothing, holds a copy of the prompt per choice): its choices would preempt one
        another over and over (Engine.step) or fail with OutOfPages after their work was done
        (docs/FAULTS.md).
        ``asked``: False when the client set no output length (``max_tokens`` is then the rest
        of the context, which choices rarely reach): the pool check then counts one output token
        per choice, as vLLM admits such requests. ``prompt_param``: the field the prompt came in
        (``messages`` for chat, whichever of max_tokens / max_completion_tokens it gave).
        ``defaulted``: ``max_tokens`` is the API's default, not sent (completions' 16), which the
        refusal says."""
        e = cfg.engine
        if not n_prompt:
            what = "prompt" if prompt_param == "prompt" else f"{prompt_param} (as a prompt)"
            raise ApiError(f"{what}: must not be empty", prompt_param)
        check_input_len(n_prompt, prompt_param)
        given = f"{max_tokens}, its default when not sent" if defaulted else max_tokens
        if n_prompt + max_tokens > e.max_model_len:
            raise ApiError(f"prompt ({n_prompt} tokens) + {param} ({given}) exceeds the context window "
                           f"of {e.max_model_len} tokens", param, code="context_length_exceeded")
        # the decoding tier holds every choice; each tier and instance has its own pages (cfg.tiers),
        # and a request may be routed to any active instance of the tier: held to the smallest pool
        pools_now = dict(adm.limits.kv_pools)
        for tier in ("colocated",) if cfg.mode == "colocated" else (
                ("main_decode", "relay_decode") if cfg.mode == "pdd" else ("main_decode",)):
            te = cfg.engine_for(tier)
            pools = pools_now.get(tier) or ((tier, te.num_pages, te.page_size),)  # none active: the tier's
            # RLD shares nothing between choices (no prefix cache): each choice's `expect` takes its
            # own copy of the prompt's pages (+ the first token) while the others are there too; past
            # its pool the request failed at start with a 429 that no retry could cure
            short = short_pool(tier, [(n_prompt, max_tokens if asked else 1)], n, pools)
            if short is not None:
                name, pages, pool, ps = short
                at_one = request_pages(tier, [(n_prompt, 1)], n, ps)  # one output token a choice
                hint = kv_hint(tier, n, max_tokens if asked else 1, param, output_helps=at_one <= pool)
                # what the pages count: the output given, else (not given, or RLD's copy) the first token
                counted = (f"{param} ({given})" if asked and tier != "relay_decode"
                           else "its first output token")
                which = (f"an instance's pool ({pool} pages)" if len({(p, s) for _, p, s in pools}) == 1 else
                         f"instance {name}'s pool ({pool} pages; any active {tier} instance may serve it)")
                raise ApiError(f"n ({n}) choices of prompt ({n_prompt} tokens) + {counted} need {pages} "
                               f"KV pages of {ps} tokens at once on the {tier} tier, more than {which}: {hint}",
                               "n" if n > 1 else param if hint != "send a shorter prompt" else prompt_param)

    def check_choices(n: int, prompts: int = 1) -> None:
        """400 naming ``n`` (``prompt`` for a batch of single choices) when the request's
        ``prompts`` x ``n`` choices can never be served: more than the decoding tier's bounded
        queues hold together, or more prefills at once than P's do
        (:func:`pdd.gateway.admission.choice_refusal`): a tier would refuse the excess however idle
        the system is, so a 429 (retry later) could never be cured."""
        why = choice_refusal(adm.limits, prompts, n)
        if why is not None:
            raise ApiError(why, "n" if n > 1 else "prompt")

    def check_pages(prompts: list[tuple[int, int]], n: int, param: str, asked: bool = True) -> None:
        """400 (naming ``n``, else ``prompt`` for a batch, else ``param``) when a request's
        choices together need more KV pages at once than a tier it passes holds: every prompt's
        pages x its ``n`` choices, each prompt's ``(tokens, output tokens)`` of ``prompts``
        page-rounded on each tier's active instances' pools (P, RLD, MD / D or colocated,
        :func:`pdd.gateway.admission.kv_refusal`). Such a batch failed with ``OutOfPages`` (a
        429 no retry cured) after P's work, on every try. ``asked``: as :func:`check_context`
        (one output token per choice counted when the client set no output length)."""
        why = kv_refusal(adm.limits, [(k, out if asked else 1) for k, out in prompts], n, param, asked)
        if why is not None:
            raise ApiError(why, "n" if n > 1 else "prompt" if len(prompts) > 1 else param)

    def check_input_len(n_prompt: int, prompt_param: str) -> None:
        """ApiError (400 ``context_length_exceeded`` naming ``prompt_param``, "prompt" or
        "messages") for a prompt of more than max_input_len tokens: the first length check, with
        ``max_tokens`` given or not, so such a prompt is refused in the same words either way."""
        e = cfg.engine
        if n_prompt > e.max_input_len:
            what = "prompt" if prompt_param == "prompt" else f"{prompt_param} (as a prompt)"
            raise ApiError(f"{what}: {n_prompt} tokens is longer than the maximum input length {e.max_input_len}",
                           prompt_param, code="context_length_exceeded")

    def rest_of_context(n_prompt: int, where: str) -> int:
        """Output tokens the context window leaves after ``n_prompt`` prompt tokens (vLLM's
        ``max_tokens`` when none is given); ApiError naming ``where`` ("prompt" / "messages")
        for a prompt over max_input_len (:func:`check_input_len`), or when it leaves none."""
        check_input_len(n_prompt, where)
        n = cfg.engine.max_model_len - n_prompt
        if n < 1:
            raise ApiError(f"{where}: {n_prompt} prompt tokens leave no room in the context window of "
                           f"{cfg.engine.max_model_len} tokens", where, code="context_length_exceeded")
        return n

    def encode(text: str, add_special_tokens: bool, param: str, truncating: bool = False) -> list[int]:
        """Tokenize (the caller runs this off the event loop), refusing what cannot be a prompt
        that fits: a text longer than max_input_len x MAX_CHARS_PER_TOKEN characters (with
        ``truncating``, the request's truncate_prompt_tokens set: longer than that or
        MAX_TRUNCATED_PROMPT_CHARS, whichever is more), or one with lone surrogates (not valid
        Unicode). ``param`` names the text in the message (a batch's ``prompt[1]``); the error's
        ``param`` is the field (``prompt``) for a length, the text's own path (``prompt[1]``) for
        text that is not valid Unicode."""
        field = param.partition("[")[0]
        fits = cfg.engine.max_input_len * MAX_CHARS_PER_TOKEN
        if truncating and len(text) > max(fits, MAX_TRUNCATED_PROMPT_CHARS):
            raise ApiError(f"{param}: {len(text)} characters is more than a prompt with truncate_prompt_tokens may "
                           f"have ({max(fits, MAX_TRUNCATED_PROMPT_CHARS)} characters)", field,
                           code="context_length_exceeded")
        if not truncating and len(text) > fits:
            raise ApiError(f"{param}: {len(text)} characters cannot fit the maximum input length of "
                           f"{cfg.engine.max_input_len} tokens", field, code="context_length_exceeded")
        bad = lone_surrogate(text)
        if bad is not None:
            raise ApiError(f"{param}: not valid Unicode text (a lone surrogate at character {bad})", param)
        try:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except (TypeError, ValueError, UnicodeError) as e:
            raise ApiError(f"{param}: not valid Unicode text ({e})", param) from None

    def bare_ids(text: str) -> list[int]:
        """``text``'s token ids without special tokens (``bad_words``, as vLLM tokenises them)."""
        return tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_ids(prompt, add_special_tokens: bool, param: str = "prompt", truncating: bool = False) -> list[int]:
        """Token ids of one prompt (text or token ids; ``truncating``: see :func:`encode`)."""
        if not prompt:  # a text refused even where the tokenizer would add a BOS to it
            raise ApiError(f"{param}: must not be empty", "prompt")
        if isinstance(prompt, str):
            return encode(prompt, add_special_tokens, param, truncating)
        return vocab_ids(list(prompt), param)

    def batch_ids(prompt, add_special_tokens: bool, truncating: bool = False) -> list[list[int]]:
        """Token ids of each prompt of a completion request: one, or a batch (a list of texts or
        of token-id lists, as vLLM and OpenAI take it)."""
        prompts = prompt_batch(prompt)
        if len(prompts) == 1:
            return [prompt_ids(prompts[0], add_special_tokens, truncating=truncating)]
        return [prompt_ids(p, add_special_tokens, f"prompt[{i}]", truncating) for i, p in enumerate(prompts)]

    def admit(n_choices: int, prompt_tokens: int, request: Request | None):
        """An admission ticket for ``n_choices`` choices over ``prompt_tokens`` prompt tokens, else
        Overloaded (429): nothing has started."""
        arrived = request.scope.get("state", {}).get(ARRIVAL) if request is not None else None
        ticket, d = adm.try_admit(n_choices, prompt_tokens, arrived)
        if ticket is None:
            raise Overloaded(d.message, d.retry_after_s)
        return ticket

    def hold_ticket(gen, ticket) -> None:
        """``gen`` (a Generation or a Batch) holds ``ticket`` until it ends (``gen.ticket_end``;
        also if ``gen`` is dropped unstarted)."""
        adm.prefilled(ticket, measured=cfg.mode != "colocated")  # colocated: generate returns before prefill
        for g in getattr(gen, "gens", [gen]):
            g.on_first_token = lambda: adm.first_token(ticket)

        def ticket_end(completed: bool) -> None:
            if completed and not ticket.released:
                adm.finished(ticket, gen.completion_tokens() // max(1, len(gen.choices)))
            adm.release(ticket, completed)

        gen.ticket_end = ticket_end
        weakref.finalize(gen, adm.release, ticket)

    async def start_watched(request: Request, plans: list, admitted: bool = False):
        """Start one prompt's :class:`Generation` (one plan), or every prompt of a batch at once
        (a list of them; ``admitted``: the caller holds the batch's ticket), while watching the
        client's connection (:func:`pdd.gateway.disconnect.unless_gone`, unless
        ``policy.cancel_on_disconnect`` is off): a client gone before the first byte aborts
        every choice on every tier (cancelled) and gets ClientGone (499). A prompt that cannot
        start stops the others at once (rejected when a tier refused it for now, else failed)
        and its error is raised. Once all started, their prompts' tokens (``usage.prompt_tokens``)
        count in ``pdd_gateway_prompt_tokens_total``."""
        made: list[Generation] = []
        batch = len(plans) > 1

        def gone() -> None:
            for g in made:
                g.abort_starting(ABORT_CLIENT)

        async def run():
            if not batch:
                return await start(*plans[0], request, admitted=admitted, made=made)
            # no prompt's choice ends (is counted) until every prompt started: a refused prompt
            # stops the others, finished or not, with its reason (Generation.settle)
            tasks = [asyncio.ensure_future(start(*p, request, admitted=True, made=made, settle=False)) for p in plans]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            except asyncio.CancelledError:
                gone()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            errs = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if errs:
                # a prompt a tier refused for now (429): the others are rejected too, not failed
                why = ABORT_REJECTED if isinstance(errs[0], Overloaded) else ABORT_FAILED
                for g in made:
                    g.abort_starting(why)
                await asyncio.gather(*tasks, return_exceptions=True)
                raise errs[0]
            for g in made:
                g.settle()
            return [t.result() for t in tasks]

        try:
            started = await unless_gone(request, run(), gone, enabled=cfg.policy.cancel_on_disconnect)
        except ClientGone:
            for g in made:  # a choice that started as the client left: its ticket ends now
                end = getattr(g, "ticket_end", None)
                if end is not None:
                    end(False)
            raise
        if getattr(orch, "metrics", None) is not None:  # every choice started: its prompts count (usage's)
            orch.metrics.prompt_tokens.inc(sum(len(g.prompt_ids) for g in made))
        return started

    async def start(ids, sps, opts, request: Request | None = None, admitted: bool = False,
                    made: list | None = None, settle: bool = True) -> Generation:
        """Admit (else 429), then start every choice. The admission ticket is released when the
        request ends (``gen.ticket_end``). ``admitted``: the caller holds the ticket (a batch of
        prompts is admitted as one request), so none is taken here. ``made``: the Generation is
        appended to it before it starts (so it can be aborted while it starts). ``settle``:
        False when the caller settles it (``Generation.settle``: a batch, once every prompt started)."""
        ticket = None if admitted else admit(len(sps), len(ids), request)
        gen = Generation(orch, tokenizer, ids, sps, opts, eos_ids)
        app.state.drain.track(gen, request)  # ended by the shutdown timeout if it still runs then
        if made is not None:
            made.append(gen)
        try:
            await gen.start(settle)
        except RequestFailed as ex:
            if ticket is not None:
                adm.release(ticket)
            why = refusal(ex)  # a tier that cannot take new work now: retry later (429), not a failure
            if why is not None:
                if not admitted:  # a batch's prompt: the batch counts its refusal once (completions)
                    adm.reject(why)
                raise Overloaded(f"server overloaded: {ex}", adm.retry_hint(), why) from ex
            if any(isinstance(c, ShuttingDown) for c in causes(ex)):  # it waited for an instance as the drain began
                raise Draining() from ex
            if any(isinstance(c, NoInstance) for c in causes(ex)):  # nothing was done: a client may retry once it rejoins
                raise Unavailable(str(ex), max(1, math.ceil(cfg.liveness.reconnect_interval_s))) from ex
            status, etype = _failure(ex)  # 503, or 400 when it was the request's own (its grammar failed)
            raise ApiError(ex.client_message, _failure_param(ex, opts), status=status, etype=etype) from ex
        except BaseException:
            if ticket is not None:
                adm.release(ticket)
            raise
        if ticket is not None:
            hold_ticket(gen, ticket)
        return gen

    async def collect(gen: Generation, request: Request) -> JSONResponse | None:
        """Run a non-streamed request to its end; None when it completed, else the response to
        send: 503 when it failed, or (nobody reads it) 499 when the client disconnected first.

        Starlette does not cancel a non-streaming endpoint whose client went away, so while the
        choices generate this watches the ASGI receive channel (as vLLM's ``with_cancellation``):
        on ``http.disconnect`` every choice still running is aborted with ``ABORT_CLIENT``
        (counted cancelled, freed on every tier) instead of decoding on to max_tokens."""
        ok = False
        run = asyncio.get_running_loop().create_task(gen.collect())
        watch = asyncio.get_running_loop().create_task(_client_gone(request))
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
            if not run.done():  # the client disconnected mid-generation
                gen.close(ABORT_CLIENT)
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                return JSONResponse(error_body("client disconnected", code="client_disconnected"), status_code=499)
            run.result()
            ok = True
        except RequestFailed as ex:
            status, etype = _failure(ex)
            return JSONResponse(error_body(ex.client_message, _failure_param(ex, gen.opts), etype=etype),
                                status_code=status)
        finally:
            for t in (run, watch):
                if not t.done():
                    t.cancel()
            if not run.done():  # this handler was cancelled: the generation ends as cancelled
                gen.close(ABORT_CLIENT)
            await asyncio.gather(run, watch, return_exceptions=True)
            gen.ticket_end(ok)
        return None

    def vocab_ids(ids: list[int], param: str) -> list[int]:
        bad = [t for t in ids if not (0 <= t < model_vocab)]
        if bad:
            raise ApiError(f"{param}: token id {bad[0]} is outside the vocabulary [0, {model_vocab})",
                           param.partition("[")[0])  # prompt[1] in the message, the field in param
        return ids

    def render_chat(body) -> str:
        if chat_template is None:
            raise ApiError("this model has no chat template (tokenizer_config.json chat_template); "
                           "use /v1/completions", "messages")
        try:
            return chat_template.render(body.messages, add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message, tools=body.tools,
                                        documents=getattr(body, "documents", None),
                                        chat_template_kwargs=body.chat_template_kwargs)
        except ChatTemplateError as e:
            raise ApiError(str(e), e.param or "messages") from e

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's /tokenize: the token ids the completion (``prompt``) or chat (``messages``)
        endpoint would serve, with the same defaults (special tokens added to a text prompt, the
        chat template for messages) and the same ``truncate_prompt_tokens`` (its last k ids; it
        was ignored, so ``count`` was not what the endpoint serves)."""
        from pdd.gateway.openai_schemas import check_unicode

        check_model(body.model)
        check_unicode(body, frozenset({"prompt", "messages"}))  # those: encode's and check_messages' checks
        check_truncate(body.truncate_prompt_tokens, cfg.engine.max_input_len)  # before the tokenizer's work
        if body.messages is not None:
            check_messages(body.messages)
            text, param, special = render_chat(body), "messages", False
        else:
            text, param, special = body.prompt, "prompt", True
        if body.add_special_tokens is not None:
            special = body.add_special_tokens
        ids = await asyncio.to_thread(encode, text, special, param, body.truncate_prompt_tokens is not None)
        ids = truncated_prompt(ids, body.truncate_prompt_tokens, cfg.engine.max_input_len)
        out = {"count": len(ids), "max_model_len": cfg.engine.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's /detokenize: ``{"prompt": text}`` of token ids (special tokens kept)."""
        check_model(body.model)
        ids = vocab_ids(body.tokens, "tokens")
        return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_completion(body)
        constraint = await structured(body, request)
        check_choices(body.n, len(prompt_batch(body.prompt)))
        check_truncate(body.truncate_prompt_tokens, cfg.engine.max_input_len)  # before the tokenizer's work
        batch = await asyncio.to_thread(batch_ids, body.prompt, body.add_special_tokens,  # off the event loop
                                        body.truncate_prompt_tokens is not None)
        plans, lens = [], []
        for ids in batch:
            ids = truncated_prompt(ids, body.truncate_prompt_tokens, cfg.engine.max_input_len)
            max_tokens = body.max_tokens
            if max_tokens is None:  # an explicit null, as vLLM: whatever the context window leaves
                max_tokens = rest_of_context(len(ids), "prompt")
            check_context(len(ids), max_tokens, "max_tokens", body.n, asked=body.max_tokens is not None,
                          defaulted="max_tokens" not in body.model_fields_set)
            plans.append((ids, *sampling_for(body, max_tokens, model_vocab, body.logprobs, defaults=gen_defaults,
                                             encode=bare_ids, eos_ids=eos_ids, constraint=constraint)))
            lens.append((len(ids), max_tokens))
        check_pages(lens, body.n, "max_tokens", asked=body.max_tokens is not None)
        opts = plans[0][2]
        if len(plans) == 1:
            gen = await start_watched(request, [plans[0]])
        else:
            # a batch is admitted as one request (all its choices, all its prompt tokens), so it is
            # refused before any prompt starts, never part-started and then stopped; then every
            # prompt starts at once, and if one cannot start, the others are stopped at once
            ticket = admit(len(plans) * body.n, sum(len(p[0]) for p in plans), request)
            try:
                started = await start_watched(request, plans, admitted=True)
            except BaseException as e:
                adm.release(ticket)
                if isinstance(e, Overloaded) and e.reason is not None:
                    adm.reject(e.reason)  # once for the batch, as it was admitted once
                raise
            gen = Batch(started, body.n)
            hold_ticket(gen, ticket)
        created, cid = int(time.time()), f"cmpl-{id_base(request, gen.choices[0].st.rid)}"
        echoes = [tokenizer.decode(p[0], skip_special_tokens=body.skip_special_tokens) if body.echo else ""
                  for p in plans for _ in range(body.n)]  # per choice index (prompt * n + i)
        # return_token_ids (vLLM): each choice's prompt ids, per choice index (prompt * n + i)
        prompts = [p[0] for p in plans for _ in range(body.n)] if body.return_token_ids else None
        if body.stream:
            return StreamingResponse(_completion_sse(gen, token_text, cid, created, model_name,
                                                     _usage_opts(body), echoes, prompts),
                                     media_type="text/event-stream")
        failed = await collect(gen, request)
        if failed is not None:
            return failed
        choices = [{"index": c.index, "text": echoes[c.index] + "".join(c.text),
                    "logprobs": (_completion_logprobs(token_text, c.tokens, len(echoes[c.index]))
                                 if opts.logprobs is not None else None),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in gen.choices]
        if prompts is not None:  # vLLM's places: both on each choice
            for ch, c in zip(choices, gen.choices):
                ch["prompt_token_ids"] = list(prompts[c.index])
                ch["token_ids"] = [t.token_id for t in c.tokens]
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(gen), "pdd": _pdd(gen)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_chat(body, tool_parser)
        constraint = await structured(body, request)
        check_choices(body.n)
        parallel = body.parallel_tool_calls is not False
        calls = None  # how tool calls are read out of each choice's text (tool_parsers.CallMode)
        if body.tools and body.tool_choice in (None, "auto"):
            # tools the model may call, tool_choice "auto": its calls are parsed out of the text
            calls = tool_parsers.CallMode(parser=tool_parser, parallel=parallel)
            body.skip_special_tokens = False  # the call markers may be special tokens (as SGLang does)
        elif constraint is not None and constraint.param == "tool_choice":
            # a forced call: the text is the named function's arguments, or "required"'s JSON array
            named = body.tool_choice["function"]["name"] if isinstance(body.tool_choice, dict) else None
            calls = tool_parsers.CallMode(forced=True, function=named, parallel=parallel)
        check_truncate(body.truncate_prompt_tokens, cfg.engine.max_input_len)
        text = render_chat(body)
        ids = await asyncio.to_thread(encode, text, body.add_special_tokens, "messages",
                                      body.truncate_prompt_tokens is not None)
        ids = truncated_prompt(ids, body.truncate_prompt_tokens, cfg.engine.max_input_len)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens
        asked = max_tokens is not None
        if max_tokens is None:  # as vLLM: whatever the context window leaves
            max_tokens = rest_of_context(len(ids), "messages")
        check_context(len(ids), max_tokens, param, body.n, asked, prompt_param="messages")
        check_pages([(len(ids), max_tokens)], body.n, param, asked)
        top = (body.top_logprobs or 0) if body.logprobs else None
        sps, opts = sampling_for(body, max_tokens, model_vocab, top, param, gen_defaults, encode=bare_ids,
                                 eos_ids=eos_ids, constraint=constraint)
        gen = await start_watched(request, [(ids, sps, opts)])
        created, cid = int(time.time()), f"chatcmpl-{id_base(request, gen.choices[0].st.rid)}"
        if body.stream:
            return StreamingResponse(_chat_sse(gen, token_text, cid, created, model_name, _usage_opts(body),
                                               ids if body.return_token_ids else None, calls),
                                     media_type="text/event-stream")
        failed = await collect(gen, request)
        if failed is not None:
            return failed
        choices = [{"index": c.index, "message": msg,
                    "logprobs": ({"content": [_chat_lp(token_text, t, top) for t in c.tokens]}
                                 if top is not None else None),
                    "finish_reason": finish, "stop_reason": c.stop_reason}
                   for c in gen.choices
                   for msg, finish in [_chat_message("".join(c.text), c.finish_reason, calls)]]
        out = {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
               "choices": choices, "usage": _usage(gen), "pdd": _pdd(gen)}
        if body.return_token_ids:  # vLLM's places: prompt_token_ids on the response, token_ids on each choice
            out["prompt_token_ids"] = list(ids)
            for ch, c in zip(choices, gen.choices):
                ch["token_ids"] = [t.token_id for t in c.tokens]
        return out

    from pdd.gateway.openai_responses import add_responses_route

    add_responses_route(app, chat_completions)  # POST /v1/responses, run as a chat request
    return app


def chat_tool_parser(setting: str, model_type: str | None, tokenizer) -> str | None:
    """The tool-call parser chat requests use (``pdd.gateway.tool_parsers.PARSERS``), None for
    none: ``setting`` is the config's ``tool_call_parser``; ``auto`` picks the checkpoint's
    family's (:func:`pdd.gateway.tool_parsers.family_default`, from ``model_type`` and the
    markers ``tokenizer`` has as tokens), ``none`` none."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    markers = (tool_parsers.HERMES_START, tool_parsers.PYTHON_TAG, tool_parsers.MISTRAL_START)
    token_id = getattr(tokenizer, "token_to_id", None)  # a stand-in tokenizer without one: no markers
    return tool_parsers.family_default(model_type, {m for m in markers
                                                    if token_id is not None and token_id(m) is not None})


def _chat_message(text: str, finish_reason: str | None,
                  calls: tool_parsers.CallMode | None) -> tuple[dict, str | None]:
    """A chat choice's ``(message, finish_reason)``: with ``calls`` (tools given and tool_choice
    auto, or a forced tool_choice), the tool calls in ``text`` (``message.tool_calls``,
    ``content`` the text before them or null, ``finish_reason`` as :meth:`CallMode.finish_reason`;
    ``parallel_tool_calls`` false: the first call only, as vLLM; :meth:`CallMode.parse`, the
    stream's rules); a text without calls, or no ``calls``, is the message it always was."""
    if calls is not None:
        p = calls.parse(text)
        if p.calls:
            return ({"role": "assistant", "content": p.content, "tool_calls": [c.to_openai() for c in p.calls]},
                    calls.finish_reason(finish_reason))
    return {"role": "assistant", "content": text}, finish_reason


def _lp(v) -> float:
    return LP_FLOOR if v is None or v != v or v < LP_FLOOR else float(v)


def _completion_logprobs(tt: TokenText, toks, offset: int = 0) -> dict:
    """Legacy completions format; ``top_logprobs`` holds the top k and the sampled token (vLLM)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in toks:
        s = tt.get(t.token_id)[0]
        lp = t.lp or {}
        top = {tt.get(int(i))[0]: _lp(v) for i, v in lp.get("top", [])}
        top.setdefault(s, _lp(lp.get("lp")))
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(lp.get("lp")))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _chat_lp(tt: TokenText, t, top: int | None) -> dict:
    s, raw = tt.get(t.token_id)
    lp = t.lp or {}
    tops = []
    for i, v in (lp.get("top", []) if top else []):
        ts, traw = tt.get(int(i))
        tops.append({"token": ts, "logprob": _lp(v), "bytes": traw})
    return {"token": s, "logprob": _lp(lp.get("lp")), "bytes": raw, "top_logprobs": tops}


def _prompt_cached(st: ReqState) -> int:
    """Tokens of the client's prompt P's prefix cache held at the request's first prefill P answered
    (:attr:`ReqState.prompt_cached_tokens`; 0 before any)."""
    return st.prompt_cached_tokens or 0


def _usage(gen: Generation | Batch) -> dict:
    parts = gen.gens if isinstance(gen, Batch) else [gen]  # a batch: each prompt counted once (vLLM)
    n_prompt = sum(len(g.prompt_ids) for g in parts)
    ntok = gen.completion_tokens()
    # P's hit on the client's prompt at its first prefill: a recovered request's new prefill covers
    # prompt + streamed tokens and hits the request's own earlier prefill, no saving to the client
    cached = sum(min(_prompt_cached(g.choices[0].st), len(g.prompt_ids)) for g in parts)
    return {"prompt_tokens": n_prompt, "completion_tokens": ntok, "total_tokens": n_prompt + ntok,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _choice_usage(gen: Generation | Batch, index: int, ntok: int) -> dict:
    """``usage`` of a streamed chunk of choice ``index`` under ``continuous_usage_stats``, counted as
    vLLM counts it: that choice's prompt tokens and ``ntok``, its own completion tokens as of that
    chunk (with n > 1 or a batch, not the request's sums, which the last usage chunk carries; a
    batch's prompts run ahead of the stream, so a choice's count now may be past the chunk's).
    Raises KeyError for an index no choice has."""
    for g in (gen.gens if isinstance(gen, Batch) else [gen]):
        if any(c.index == index for c in g.choices):
            n_prompt = len(g.prompt_ids)
            return {"prompt_tokens": n_prompt, "completion_tokens": ntok, "total_tokens": n_prompt + ntok}
    raise KeyError(f"no choice {index}")


def _pdd(gen: Generation) -> dict[str, Any]:
    out = _pdd_summary(gen.choices[0].st)
    if len(gen.choices) > 1:
        out["choices"] = [_pdd_summary(c.st) for c in gen.choices]
    return out


def _pdd_summary(st: ReqState) -> dict[str, Any]:
    ho = st.handoff
    return {"rid": st.rid, "recoveries": len(st.recovery.recoveries), "degraded": st.recovery.degraded,
            "pipeline": st.pipeline.value, "wan_bytes": st.wan.reported, "wan_bytes_expected": st.wan.expected,
            "md_cached_tokens": st.md_cached_tokens, "p_cached_tokens": st.p_cached_tokens,
            "handoff_pos": ho.pos, "rld_finished_first": ho.rld_finished_first,
            "handoff_mode": ho.mode, "handoff_rounds": ho.rounds,
            "handoff_tokens": ho.tokens, "cut_off": st.wan.cut_off, "md_diverged": ho.md_diverged,
            "extend_extra_step_ms": ho.extend_extra_step_ms, "decisions": st.decisions,
            "events_ms": {k: round((v - st.t_arrival) * 1000, 2) for k, v in st.events.items()},
            # the held phase's moves, in order: [[phase, ms since arrival], ...] (pdd.gateway.phase)
            "phases_ms": [[ph.value, round((t - st.t_arrival) * 1000, 2)] for ph, t in st.life.history]}


async def _body_error(request: Request) -> str | None:
    """What is wrong with a body FastAPI could not parse (its message says only "There was an
    error parsing the body"): :func:`not_utf8`, :func:`too_deep`, or an integer past Python's
    digit limit (:func:`too_many_digits`: only looked for here, once the parse failed). None when
    that is not the cause. (A route of :class:`Utf8JsonRoute` refuses a body that is not UTF-8
    or too deep before FastAPI parses it; this covers any other.)"""
    try:
        body = await request.body()
        return not_utf8(body) or too_deep(body) or too_many_digits(body)
    except Exception:
        return None


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _tok_ext(d: Delta) -> dict:
    return {"tier": d.token.tier, "pos": d.token.pos, "token_id": d.token.token_id}


def _usage_opts(body) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of ``stream_options``."""
    so = body.stream_options
    return bool(so and so.include_usage), bool(so and so.include_usage and so.continuous_usage_stats)


async def _sse(gen: Generation, head: dict, chunks, usage: tuple[bool, bool]):
    """One SSE stream: the ``chunks`` (``(tokens, dict)``) as ``data:`` lines, then the usage chunk if asked
    and ``[DONE]``; ``usage`` = (include_usage, continuous_usage_stats): with both, every chunk
    carries its choice's usage so far too (vLLM's extension, :func:`_choice_usage`); otherwise a
    chunk has no ``usage`` key but the last (as vLLM; OpenAI sends ``"usage": null`` on the
    others, which its client reads alike). A failed request ends with an error chunk.
    However the stream ends, what still runs is aborted on every tier: as cancelled when the
    client went away mid-stream (the server cancels or closes this generator), else as failed."""
    ok = False
    reason = ABORT_CLIENT
    include_usage, continuous = usage
    try:
        async for ntok, chunk in chunks:
            yield _data({**head, **chunk, "usage": _choice_usage(gen, chunk["choices"][0]["index"], ntok)}
                        if continuous else {**head, **chunk})
        ok = True
    except RequestFailed as ex:
        reason = ABORT_FAILED
        yield _data(error_body(ex.client_message, _failure_param(ex, gen.opts), etype=_failure(ex)[1]))
        yield "data: [DONE]\n\n"
        return
    except (asyncio.CancelledError, GeneratorExit):
        raise  # the client went away
    except BaseException:
        reason = ABORT_FAILED
        raise
    finally:
        gen.close(reason)
        end = getattr(gen, "ticket_end", None)
        if end is not None:
            end(ok)
    if include_usage:
        yield _data({**head, "choices": [], "usage": _usage(gen), "pdd": _pdd(gen)})
    yield "data: [DONE]\n\n"


def _completion_sse(gen: Generation | Batch, tt: TokenText, cid: str, created: int, model: str,
                    include_usage: tuple[bool, bool], echoes: list[str] | None = None,
                    prompts: list[list[int]] | None = None):
    head = {"id": cid, "object": "text_completion", "created": created, "model": model}
    return _sse(gen, head, _completion_chunks(gen, tt, echoes or [""] * len(gen.choices), prompts), include_usage)


async def _completion_chunks(gen: Generation | Batch, tt: TokenText, echoes: list[str],
                             prompts: list[list[int]] | None = None):
    """``(tokens, chunk)``: each chunk (one choice's) with its choice's completion tokens so far.
    ``echoes[i]``: the prompt text choice ``i`` starts with (``echo``), else "". ``prompts``
    (``return_token_ids``): choice ``i``'s prompt ids, sent as ``prompt_token_ids`` on its first
    chunk, and every chunk's choice carries ``token_ids``, the ids it adds (vLLM); None: neither."""
    offsets = [len(e) for e in echoes]
    want_lp = gen.opts.logprobs is not None
    first = set(range(len(gen.choices))) if prompts is not None else set()
    for c in gen.choices:
        if echoes[c.index]:
            ch = {"index": c.index, "text": echoes[c.index], "logprobs": None, "finish_reason": None}
            if prompts is not None:
                ch["prompt_token_ids"], ch["token_ids"] = list(prompts[c.index]), []
                first.discard(c.index)
            yield 0, {"choices": [ch]}
    async for d in gen.deltas():
        lp = None
        if want_lp:
            lp = _completion_logprobs(tt, [d.token], offsets[d.index])
            offsets[d.index] += len(lp["tokens"][0])
        ch = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
              "stop_reason": d.stop_reason}
        if prompts is not None:
            if d.index in first:
                first.discard(d.index)
                ch["prompt_token_ids"] = list(prompts[d.index])
            ch["token_ids"] = [d.token.token_id]
        yield d.ntok, {"choices": [ch], "pdd": _tok_ext(d)}


def _chat_sse(gen: Generation, tt: TokenText, cid: str, created: int, model: str, include_usage: tuple[bool, bool],
              prompt: list[int] | None = None, calls: tool_parsers.CallMode | None = None):
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    return _sse(gen, head, _chat_chunks(gen, tt, prompt, calls), include_usage)


async def _chat_chunks(gen: Generation, tt: TokenText, prompt: list[int] | None = None,
                       calls: tool_parsers.CallMode | None = None):
    """``(tokens, chunk)`` as :func:`_completion_chunks`: each choice's role chunk (0 tokens), then its
    tokens. ``prompt`` (``return_token_ids``): the prompt's ids, sent as the chunk's
    ``prompt_token_ids`` with each role chunk, and each choice's ``token_ids`` (the ids it adds) on
    every chunk (vLLM); None: neither.
    With ``calls`` (tools given and tool_choice auto, or a forced tool_choice: a
    :class:`~pdd.gateway.tool_parsers.ToolStream` per choice), each token's chunk carries what
    its choice's stream hands out for it: ``delta.content`` (held back from where a call may
    begin; none when forced) and ``delta.tool_calls`` (one item per call: its first with
    ``index``, ``id``, ``type`` and ``function.name`` once the call is made, then
    ``function.arguments`` pieces as they are generated); a chunk with calls has no
    ``content`` key unless it has content too. The last token's chunk has the
    ``finish_reason``, :meth:`~pdd.gateway.tool_parsers.CallMode.finish_reason` when the
    choice made calls; ``parallel_tool_calls`` false: the first call only. Accumulated, the
    stream is exactly :func:`_chat_message`'s answer (the same parse)."""
    top = gen.opts.logprobs
    streams = {}
    for c in gen.choices:
        chunk = {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]}
        if prompt is not None:
            chunk["prompt_token_ids"] = list(prompt)
            chunk["choices"][0]["token_ids"] = []
        yield 0, chunk
        if calls is not None:
            streams[c.index] = calls.stream()
    async for d in gen.deltas():
        lp = {"content": [_chat_lp(tt, d.token, top)]} if top is not None else None
        ts = streams.get(d.index)
        delta, finish = {"content": d.text}, d.finish_reason
        if ts is not None:
            out = ts.feed(d.text)
            if d.finish_reason is not None:
                out = out + ts.finish()
                if ts.called:
                    finish = calls.finish_reason(d.finish_reason)
            delta = {"content": out.content} if out.content or not out.calls else {}
            if out.calls:
                delta["tool_calls"] = [c.to_openai() for c in out.calls]
        ch = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
              "stop_reason": d.stop_reason}
        if prompt is not None:
            ch["token_ids"] = [d.token.token_id]
        yield d.ntok, {"choices": [ch], "pdd": _tok_ext(d)}


def http_server_config(cfg: ClusterConfig, app):
    """The gateway's uvicorn config: no ``limit_concurrency`` (its refusal is a plain-text 503;
    the app's own :class:`ConcurrencyLimit` bounds the requests served at once with a 429 in the
    OpenAI shape); idle keep-alive connections close after 30 s."""
    import uvicorn

    # timeout_graceful_shutdown: once the drain is over (pdd.gateway.shutdown), what uvicorn still waits
    # for (a response its client does not read) is cancelled after this many seconds
    return uvicorn.Config(app, host=cfg.host, port=cfg.gateway_port, log_level="warning", timeout_keep_alive=30,
                          limit_concurrency=None, timeout_graceful_shutdown=SERVER_CLOSE_S)


def set_switch_interval(cfg: ClusterConfig) -> float:
    """Set this process's thread switch interval (``sys.setswitchinterval``) to
    ``cfg.gateway_switch_interval_ms`` (ms); returns it in seconds. Each event-loop wakeup (a
    streamed token) waits for the interpreter lock while the compiler thread converts a GBNF
    grammar to Lark (Python) for up to this long: a 2 ms timer woke a median 6.6-10 ms late at
    Python's 5 ms and 1.2 ms late at 1 ms (``scripts/gateway_switch_interval.py``; docs/SERVE.md,
    the compiler thread)."""
    s = cfg.gateway_switch_interval_ms / 1000
    sys.setswitchinterval(s)
    return s


async def serve_gateway(cfg: ClusterConfig, lay) -> int | None:
    """Run the gateway process: connect to every tier, then serve HTTP; print ``READY gateway``.
    The first SIGTERM, SIGINT or SIGHUP (a ``pdd launch --role gateway`` whose terminal closed)
    drains (:mod:`pdd.gateway.shutdown`: new requests refused, those in flight finish within
    ``shutdown_timeout_s`` or are ended with an error), then the server stops and this returns
    that first signal's number (None: the server stopped by itself); a second one meanwhile
    stops the server at once."""
    import asyncio

    import uvicorn
    from tokenizers import Tokenizer

    from pdd.stop_signals import add_stop_handlers

    set_switch_interval(cfg)
    tokenizer = Tokenizer.from_file(f"{cfg.model_path}/tokenizer.json")
    orch = Orchestrator(cfg, lay)
    from pdd.gateway.membership import Membership

    Membership(orch, lay, cfg.standby)  # connects only to the members: standby slots join later
    from pdd.gateway.live_counters import LiveCounters

    LiveCounters(orch)  # handoff mode switches, P/MD prefix-hit alignment on /metrics
    await orch.start()
    scaler = None
    if cfg.autoscale.enabled:  # pdd serve --autoscale (pdd.gateway.autoscale)
        from pdd.gateway.autoscale import Autoscaler

        scaler = Autoscaler(orch, cfg.autoscale)
    app = create_app(cfg, orch, tokenizer)
    server = uvicorn.Server(http_server_config(cfg, app))
    loop = asyncio.get_running_loop()
    task = loop.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("gateway HTTP server did not start")
        await asyncio.sleep(0.05)
    if scaler is not None:
        scaler.start()

    drain, drained = app.state.drain, []

    async def _drain_then_exit():
        try:
            if scaler is not None:  # no instance added or removed while the topology stops
                await scaler.stop()
            await drain.run(orch)
        except Exception:  # the server stops all the same
            log.exception("shutdown: the drain failed")
        finally:
            server.should_exit = True

    got: list[int] = []

    def _stop(sig: int):
        """The first SIGTERM / SIGINT / SIGHUP drains (pdd.gateway.shutdown), a second stops at once."""
        got.append(sig)
        if drain.draining:
            server.should_exit = server.force_exit = True
            return
        drain.begin(orch)
        drained.append(loop.create_task(_drain_then_exit()))

    add_stop_handlers(loop, _stop)  # a SIGHUP ignored (nohup, inherited through pdd serve) stays so
    print("READY gateway", flush=True)  # after the handlers: a signal sent on READY drains
    await task
    for t in drained:
        t.cancel()
    if scaler is not None:
        await scaler.stop()
    await orch.close()
    orch.membership.stop_all()
    return got[0] if got else None
