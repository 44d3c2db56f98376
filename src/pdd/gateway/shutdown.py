"""The gateway's graceful shutdown (the drain): what SIGTERM or Ctrl-C to the gateway does.

On the first signal (:meth:`Drain.begin`) the gateway takes no new generation request: a POST to
``/v1/completions`` or ``/v1/chat/completions`` gets HTTP 503 with an OpenAI-style error body
(:data:`SHUTTING_DOWN`, ``Connection: close``) and ``/health`` answers 503
``"shutting_down"``, while the listening socket stays open (a clear refusal rather than a refused
connection); the other endpoints (``/v1/models``, ``/pdd/stats``, ``/metrics``) keep answering.
A request whose start is waiting for a crashed instance to come back gets the same answer at
once (the drain does not wait on a restart; the client has received nothing; counted failed).
The requests in flight run on for up to ``shutdown_timeout_s`` seconds (:meth:`Drain.run`), and
so does what a finished request leaves behind on the tiers (aborts being answered, a relayed
request's KV still crossing to MD). When the timeout runs out first (at once for 0, as vLLM's
``--shutdown-timeout 0``), every request still running is ended (:meth:`Drain.expire`): a
stream with an SSE error event (the gateway's mid-stream error) and ``data: [DONE]``, a
non-streamed request with a 503 error body, each aborted on every tier (counted failed, its KV
pages freed there once), and a relayed request's KV still awaited on MD dropped there. Then the
gateway's HTTP server stops (listening socket closed) and the process exits; ``pdd serve`` and
:class:`pdd.launch.Topology` stop the instances only after that (docs/SERVE.md "Stop it").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref

from starlette.responses import JSONResponse

from pdd.gateway.openai_schemas import error_body

log = logging.getLogger(__name__)

SHUTTING_DOWN = "shutting_down"  # the error code of a request refused during the drain
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
END_WAIT_S = 12.0  # after the timeout: how long the ends may take (a tier's abort call waits at most 10 s)
POLL_S = 0.05  # how often the drain looks whether what it waits for is done
REQUEST_KEY = "pdd.drain.request"  # an HTTP request's scope key: its number in Drain.track


def refusal_body() -> dict:
    """The OpenAI-style error body of a generation request that arrives during the drain."""
    return error_body("the server is shutting down and takes no new requests; send this request to another server",
                      code=SHUTTING_DOWN, etype="server_error")


def expired_message(timeout_s: float) -> str:
    """The error a request still running when the shutdown timeout ran out fails with."""
    return (f"the server is shutting down and this request did not finish within its shutdown timeout "
            f"(shutdown_timeout_s {timeout_s:g} s): it was aborted")


class Drain:
    """One gateway's shutdown state. ``timeout_s``: ``shutdown_timeout_s``, seconds >= 0 the
    requests in flight may run on after :meth:`begin` (0: none). Attributes: ``draining``
    (begun: new generation requests are refused), ``expired`` (the timeout ran out: what was
    still running was ended), ``in_flight`` (generation requests past :class:`DrainGate` whose
    response is not sent yet), ``ended`` (HTTP requests ended by the timeout: a batch of prompts,
    one Generation each, is one)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.draining = False
        self.expired = False
        self.in_flight = 0
        self.ended = 0
        self.gens: weakref.WeakSet = weakref.WeakSet()  # the running Generations (pdd.gateway.openai_run)
        # Generation -> its HTTP request's number (REQUEST_KEY: from a counter, never reused, unlike
        # ``id(request)``, which a request made after an earlier one was freed can have)
        self._request_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._numbers = itertools.count()

    def begin(self, orch=None) -> None:
        """Refuse new generation requests from now on, and tell ``orch`` (its ``begin_drain``: a
        start waiting for a restarting instance ends at once with the same 503: the drain
        does not wait on a restart). Idempotent."""
        self.draining = True
        if hasattr(orch, "begin_drain"):  # (a test's orchestrator may have none)
            orch.begin_drain()

    def track(self, gen, request=None) -> None:
        """A :class:`pdd.gateway.openai_run.Generation` just made: ended by :meth:`expire` if it
        still runs then (at once when the timeout ran out already). ``request``: the HTTP request
        it serves (the prompts of a batch share it), so that :attr:`ended` counts requests."""
        self.gens.add(gen)
        if request is None:
            self._request_of[gen] = next(self._numbers)
        else:  # the prompts of a batch share their request's scope, so its number
            if REQUEST_KEY not in request.scope:
                request.scope[REQUEST_KEY] = next(self._numbers)
            self._request_of[gen] = request.scope[REQUEST_KEY]
        if self.expired:
            gen.shut_down(expired_message(self.timeout_s))

    def pending(self, orch) -> list[str]:
        """What the drain still waits for, one short phrase each (empty: done): HTTP requests in
        flight, attempts the orchestrator still runs, relayed requests whose KV MD has not
        reported (``kv_awaited``), and the gateway's background calls to the tiers (aborts,
        drops). An orchestrator without one of these (a test's) has none of it."""
        from pdd.gateway import disconnect, openai_run

        out = [f"{self.in_flight} requests in flight"] if self.in_flight else []
        for what, n in (("attempts live", len(getattr(orch, "reqs", {}))),
                        ("kv_awaited", len(getattr(orch, "awaiting_kv", {}))),
                        ("calls to the tiers", (orch.pending_calls() if hasattr(orch, "pending_calls") else 0)
                         + len(openai_run._BACKGROUND) + len(disconnect._BACKGROUND))):
            if n:
                out.append(f"{what} {n}")
        return out

    def expire(self, orch) -> int:
        """The timeout ran out: end every request still running (:meth:`Generation.shut_down`:
        its response ends with the error of :func:`expired_message`; its choices are aborted on
        every tier, counted failed), abort as failed any attempt no request holds, and drop on MD
        every relayed request's KV still awaited. Returns the HTTP requests ended (a batch's
        prompts count once, as the drain's "requests in flight" do)."""
        from pdd.gateway.state import ABORT_FAILED

        self.expired = True
        msg = expired_message(self.timeout_s)
        n = len({self._request_of[gen] for gen in list(self.gens) if gen.shut_down(msg)})
        self.ended += n
        for st in list(getattr(orch, "reqs", {}).values()):
            if not st.finished:  # (one a Generation holds was aborted by it: abort is idempotent)
                orch._spawn(orch.abort(st, ABORT_FAILED))
        drop = getattr(orch, "drop_awaited_kv", None)
        if drop is not None:
            drop()
        return n

    async def run(self, orch, clock=time.monotonic) -> dict:
        """Drain: wait until nothing is :meth:`pending` or ``timeout_s`` has passed; then (if
        something still runs) :meth:`expire` and wait for the ends, at most ``END_WAIT_S``
        more. Returns ``{"waited_s", "ended", "left"}``: seconds spent, requests the timeout
        ended, what was still pending when the drain gave up (empty when all ended)."""
        self.begin(orch)
        if hasattr(orch, "stop_probes"):  # no new WAN probe holds the drain up
            orch.stop_probes()
        t0 = clock()
        pending = self.pending(orch)
        if pending:
            log.info("shutting down: new requests are refused (503 %s); waiting up to %g s (shutdown_timeout_s) "
                     "for %s", SHUTTING_DOWN, self.timeout_s, ", ".join(pending))
        else:
            log.info("shutting down: new requests are refused (503 %s); nothing in flight, nothing to wait for",
                     SHUTTING_DOWN)
        while self.pending(orch) and clock() - t0 < self.timeout_s:
            await asyncio.sleep(POLL_S)
        if self.pending(orch):
            n = self.expire(orch)
            log.warning("shutdown timeout (%g s) ran out: %d requests ended with an error, aborted on every tier",
                        self.timeout_s, n)
            t1 = clock()
            while self.pending(orch) and clock() - t1 < END_WAIT_S:
                await asyncio.sleep(POLL_S)
        left = self.pending(orch)
        if left:
            log.warning("shutdown: still pending after the drain: %s", ", ".join(left))
        out = {"waited_s": round(clock() - t0, 3), "ended": self.ended, "left": left}
        # a clean drain is routine (INFO); one that ended requests or left work pending is not
        level = logging.WARNING if self.ended or left else logging.INFO
        log.log(level, "shutdown: drained in %.2f s (%d requests ended by the timeout)", out["waited_s"], self.ended)
        return out


class DrainGate:
    """ASGI middleware, inside the HTTP metrics, CORS, X-Request-Id and
    :class:`pdd.gateway.head.HeadAsGet`: counts the generation requests in flight
    (``Drain.in_flight``: from the gate until the response is sent) and, once the drain began,
    answers a new one 503 with :func:`refusal_body` and ``Connection: close``."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.drain.draining:
            resp = JSONResponse(refusal_body(), status_code=503, headers={"Connection": "close"})
            return await resp(scope, receive, send)
        self.drain.in_flight += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
