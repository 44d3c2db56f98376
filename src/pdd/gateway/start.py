"""A request's start (a collaborator of :class:`pdd.gateway.orchestrator.Orchestrator`): its
:class:`~pdd.gateway.state.ReqState` and its first attempt, launched (:mod:`pdd.gateway.launch`)
and started again on live instances when one is lost while it starts (:mod:`pdd.gateway.recovery`
makes the new attempt). Moves a request from queued to prefill.
"""

from __future__ import annotations

import logging
import time
import uuid

from pdd.gateway import recovery
from pdd.gateway.admission import refusal
from pdd.gateway.phase import Phase
from pdd.gateway.state import (ABORT_CLIENT, ABORT_FAILED, ABORT_REJECTED, NoInstance, NoMember, ReqState,
                               RequestFailed, ShuttingDown, client_error_of, client_reason_of)
from pdd.types import SamplingParams

log = logging.getLogger("pdd.gateway.orchestrator")  # one logger for the gateway's request life

UNAVAILABLE_LOG_EVERY_S = 10.0  # a refusal for lack of an instance is logged at most this often


class UnavailableLog:
    """The gateway's log of requests refused because no instance of a role they need is
    reachable (the client gets 503 with Retry-After; counted ``rejected``): one WARNING line for
    the first, then at most one per ``every_s`` seconds of ``clock`` (``time.monotonic``), which
    names how many were refused since the last line, so a flood while the only P restarts leaves
    a line every ``every_s`` s instead of one per request."""

    def __init__(self, every_s: float = UNAVAILABLE_LOG_EVERY_S, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.last: float | None = None  # clock seconds of the last line, None before the first
        self.unlogged = 0  # refusals since the last line, not logged

    def refused(self, message: str) -> None:
        """Note one refusal (``message``: what the client reads); log it unless a line was
        written less than ``every_s`` s ago."""
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            self.unlogged += 1
            return
        more = f"; {self.unlogged} more refused so since the last such line" if self.unlogged else ""
        log.warning("%s (the client gets 503 with Retry-After; refused for lack of an instance: logged at most "
                    "once every %g s%s)", message, self.every_s, more)
        self.last, self.unlogged = now, 0

    def started(self) -> None:
        """A request started: the refusals not logged since the last line (the outage ended
        within ``every_s`` of it) get their line now, so none goes unlogged."""
        if self.unlogged:
            log.warning("%d more request(s) refused for lack of an instance since the last such line; requests "
                        "start again", self.unlogged)
            self.unlogged = 0


class Starts:
    """Mixin of the orchestrator: name and start a request."""

    def new_rid(self) -> str:
        """A fresh request id (``r<n>-<8 hex>``): the caller may name a request before starting it
        (``start_request(rid=...)``), so it can abort it while it starts."""
        return f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    async def start_request(self, prompt_ids: list[int], sp: SamplingParams, rid: str | None = None,
                            sibling_of: ReqState | None = None, siblings: int = 0) -> ReqState:
        """Plan and start a request (its first token sampled on P). An instance lost while
        starting (ConnectionError) starts it again on live instances, up to
        ``liveness.recovery_attempts`` times (new attempts after a lost instance: the tries made
        while waiting below do not count); a restart that then finds no live instance of a
        tier (NoInstance: the only P was killed, its supervisor restarts it in seconds) waits
        and tries again for up to ``recovery.RECOVERY_WAIT_S``, as a recovery does, at once when
        the topology changes (an instance added or reconnected); then, or for any other error,
        RequestFailed (counted failed; its message names the budget when it was spent). Once the
        gateway's shutdown drain began (``Orchestrator.begin_drain``) such a start does not wait:
        ShuttingDown at once (the API answers 503 ``shutting_down``). A request aborted meanwhile
        (``Orchestrator.abort``: its client left, the server's shutdown timeout ended it) is not
        started again: RequestFailed at once. A tier with no instance in service at all (NoMember:
        every one removed by the operator, so none comes back by itself) fails it at once. A
        request that finds no instance on its first try fails at once (the client gets a 503 with
        Retry-After: it did no work, so it is counted rejected, as a tier's 429 refusal is; and
        logged, unlike a 429: :class:`UnavailableLog`, a flood summarised),
        unless it is another choice of a request whose first choice already started
        (``sibling_of``): that request did work, and its first choice waits for the tier
        (recovery), so this one waits with it instead of failing the whole request.
        ``sibling_of``: the first of ``siblings`` + 1 choices of this prompt, already started (see
        :meth:`_sibling_md`)."""
        rid = rid or self.new_rid()
        st = ReqState(rid, len(prompt_ids), sp, trid=rid, prompt_ids=list(prompt_ids), sibling_of=sibling_of,
                      siblings=siblings)
        self.reqs[rid] = st
        self.totals["requests"] += 1
        waited = 0.0
        while True:
            if st.finished:
                # aborted while it waited to start again (its client left, the server's shutdown
                # timeout ended it): launching it now would run it on the tiers with nobody to
                # end it there (a new user: 4 requests whose clients left while their only P
                # restarted held 289 of P's pages for good)
                raise RequestFailed(f"request {rid} failed while starting: it was aborted "
                                    f"({st.end.abort_reason}) while it waited to start again")
            seen = self.topology_version  # a topology change from here on retries at once
            try:
                st.to(Phase.PREFILL, f"attempt {st.attempt} starts")
                await self._launch(st, prompt_ids, force_relay=st.attempt > 0)
                break
            except Exception as e:
                lost = isinstance(e, ConnectionError)
                if lost and self._recoveries_left(st) and not st.finished:
                    log.warning("request %s: %s while starting; starting it again elsewhere", rid, e)
                    self._new_attempt(st, f"{type(e).__name__}: {e}")
                    continue
                waits = isinstance(e, NoInstance) and not isinstance(e, NoMember) and not st.finished \
                    and (st.attempt > 0 or sibling_of is not None)
                if waits and not self.draining and waited < recovery.RECOVERY_WAIT_S:
                    waited += await self._retry_later(st, e, seen)
                    continue
                spent = lost and not st.finished  # every new attempt the recovery budget allows was made
                self._unassign(st)
                # refused before any tier ran it (the API answers 429, or 503 with Retry-After when
                # no instance of a role is reachable on its first try): rejected, not failed
                first_try = st.attempt == 0 and sibling_of is None
                rejected = refusal(e) is not None or (isinstance(e, NoInstance) and first_try)
                await self.abort(st, ABORT_REJECTED if rejected else ABORT_FAILED)
                if waits and self.draining:  # the drain does not wait on a restart: the client has nothing yet
                    log.warning("request %s: the gateway is shutting down; its start, waiting (%s), ends now", rid, e)
                    raise ShuttingDown(f"request {rid} failed while starting: the gateway is shutting down "
                                       f"while it waited ({e})") from e
                budget = self._budget_spent(st) if spent else ""
                # the request's own failure (its grammar failed on P's first token) stays its own: a 400
                msg = f"request {rid} failed while starting: {e}{budget}"
                if st.end.abort_reason == ABORT_CLIENT:  # its client left (counted cancelled; 499 to nobody)
                    log.info("request %s: its client disconnected while it started; its start ended (%s)", rid, e)
                    raise RequestFailed(msg) from e
                if rejected:  # a 429, or a 503 with Retry-After: refused, not failed (no WARNING per request)
                    if refusal(e) is None:  # no instance reachable: capacity lost, logged (a flood summarised)
                        self.unavailable_log.refused(msg)
                    raise RequestFailed(msg, client_error_of(e), client_reason_of(e)) from e
                raise self._request_failed(msg, client_error_of(e), client_reason_of(e)) from e
        self.unavailable_log.started()
        self.pipelines[st.pipeline.value] = self.pipelines.get(st.pipeline.value, 0) + 1
        return st
