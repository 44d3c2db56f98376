"""The client's stream and the request's end (a collaborator of
:class:`pdd.gateway.orchestrator.Orchestrator`): tokens from the tiers (``tok``, ``toks``) onto
the request's queue, :meth:`Streams.stream` yielding them strictly by position (the handoff
collaborator routes each one, :meth:`pdd.gateway.handoff.Handoffs._next_tokens`), and the end:
the outcome counted once (:meth:`Streams._count_outcome`, the owner of
:class:`pdd.gateway.state.EndState`), an abort on every tier (:meth:`Streams.abort`), and what a
relayed request leaves behind (a WAN transfer to cut off or finish). Moves a request to done.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdd.gateway.phase import Phase
from pdd.gateway.state import ABORT_CLIENT, ABORT_FAILED, ABORT_OUTCOMES, OUTCOMES, ReqState, RequestFailed, TokenOut
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY
from pdd.transfer.messages import OMIT, Abort, AbortOk, Finish, MessageError, Tok, Toks
from pdd.transfer.messages import decode as decode_message
from pdd.types import Pipeline

log = logging.getLogger("pdd.gateway.orchestrator")  # one logger for the gateway's request life


class Streams:
    """Mixin of the orchestrator: tokens in, the client's stream out, the request's end."""

    async def on_tok(self, peer, h, payload):
        """One output token of a tier (RLD, MD, D or the colocated instance)."""
        self._tok(Tok.decode(h))
        return None

    def _tok(self, m: Tok) -> None:
        st = self.reqs.get(m.rid)
        if st is None:
            return  # finished, or an attempt given up on (a recovered request's old rid)
        # an attempt's positions count from its own first output (base: tokens streamed before it)
        st.queue.put_nowait(TokenOut(m.pos + st.base, m.id, m.tier, m.fin, None if m.lp is OMIT else m.lp))

    async def on_toks(self, peer, h, payload):
        """Several ``tok`` messages in one frame (one engine step's tokens), in order."""
        for m in Toks.decode(h).tok_messages():
            self._tok(m)
        return None

    async def stream(self, st: ReqState):
        """Yield tokens in position order until the request finishes (or fails).

        Counts the request's outcome once (:meth:`_count_outcome`): "completed" when its last
        token was yielded; "failed" when it raises (``RequestFailed``: a tier failed it, or no
        token came for ``cfg.request_timeout_s`` seconds); "cancelled" when the consumer cancels
        or closes it (the client went away). A request aborted before the stream saw it
        (:meth:`abort` from the HTTP layer) was counted by the abort, with its reason.
        Raises ``RequestFailed`` as above; cancellation propagates."""
        # relayed requests that may hand over in catch-up mode stream through a jitter buffer, so MD's
        # later stream takes over without a gap (pdd.policy.switch; docs/BENCH.md states the delays)
        from pdd.policy.switch import PaceParams, SwitchPacer

        pacer = (SwitchPacer(PaceParams(prior_lag_ms=1.5 * self.cfg.link.wan_rtt_ms))
                 if st.pipeline == Pipeline.P_RLD_MD and self.cfg.policy.handoff_mode != "one_shot" else None)
        try:
            while not st.finished:
                wait = None if pacer is None else pacer.wait_ms(1000 * time.perf_counter())
                try:
                    if wait is not None and not st.queue.empty():
                        tok = st.queue.get_nowait()
                    else:
                        tok = await asyncio.wait_for(
                            st.queue.get(), timeout=self.cfg.request_timeout_s if wait is None else max(wait, 0.2) / 1000)
                except asyncio.TimeoutError:
                    if wait is None:
                        raise self._request_failed(f"request {st.rid}: no token for "
                                                   f"{self.cfg.request_timeout_s:.0f} s")
                    tok = False  # a buffered token is due
                if tok is None:
                    if st.recovery.lost and await self._recover(st):
                        continue  # a new attempt streams on from st.next_pos
                    raise self._request_failed(f"request {st.rid} failed: {st.recovery.error}",
                                               st.recovery.client_error, st.recovery.client_reason)
                if pacer is not None and tok is not False:
                    pacer.feed(st, tok, 1000 * time.perf_counter(), self._next_tokens)
                for t in (self._next_tokens(st, tok) if pacer is None else pacer.due(1000 * time.perf_counter())):
                    now = time.perf_counter()
                    if t.pos == 0:
                        st.events["first_token"] = now
                    st.last_token_s = now
                    if t.fin is not None:
                        st.finished = True
                        st.to(Phase.DONE, f"finished ({t.fin})")
                    yield t
            # (a finished loop after an abort elsewhere was counted by that abort: no-op then)
            self._count_outcome(st, "completed")
        except BaseException as e:
            if not st.finished:
                # the client went away (the consumer cancelled or closed this stream), or the
                # request failed; the HTTP server cancels this scope, so every await here would
                # be cancelled too: abort in a task of its own (it counts the outcome; so does
                # this line, at once, in case the loop closes before the task runs)
                reason = ABORT_CLIENT if isinstance(e, (asyncio.CancelledError, GeneratorExit)) else ABORT_FAILED
                self._count_outcome(st, ABORT_OUTCOMES[reason])
                # under way from now (flush waits for it): reqs forgets st below, before the task runs
                self._spawn_abort(st.trid, self.abort(st, reason))
            elif not st.end.aborted:  # its last token was yielded; the consumer just did not ask again
                self._count_outcome(st, "completed")
            raise
        finally:
            self.reqs.pop(st.trid, None)
            self._unassign(st)
            if st.finished and st.recovery.error is None and not st.end.aborted:
                self._record_decoded(st)
            if st.finished and st.recovery.error is None and st.pipeline == Pipeline.P_RLD_MD:
                await self._settle_relayed(st)

    def _record_decoded(self, st: ReqState) -> None:
        """``st`` ended on an MD across the WAN that decoded it to its last token: that MD caches
        the prompt and every output token whose KV it computed (all but the last), so the
        gateway's index of it records them too; a next turn (this prompt + this output + more)
        then matches them there (routing, and the predicted send's first page)."""
        md_name = st.names.get(ROLE_MAIN)
        ix = self.prefix_index.get(md_name) if md_name else None
        on_md = st.pipeline == Pipeline.P_MD or (st.pipeline == Pipeline.P_RLD_MD and st.handoff.switch_pos is not None
                                                 and not st.handoff.md_diverged and not st.recovery.md_lost)
        if ix is not None and on_md and st.base == 0 and st.emitted:
            self.index_claims.pop(st.trid, None)
            ix.insert(list(st.prompt_ids) + list(st.emitted[:-1]), landed=True)

    async def _settle_relayed(self, st: ReqState) -> None:
        """After a relayed request ended at the client: cut off a WAN transfer still running
        (anomaly filter), or stop whichever decoder is still going."""
        if st.recovery.md_lost:
            return  # MD's leg was given up: dropped there already
        if st.end.aborted:
            return  # dropped on every tier (the abort): no KV lands on MD, no kv_ready to await
        landed = st.trid in self.kv_landed
        cut = not landed and self._cut_off_due(st)
        if st.handoff.md_start is None and not (cut and self.cfg.policy.cutoff):
            # RLD ended it before any handoff to MD, and MD keeps the prompt's KV; counted here,
            # before any await, so the response's pdd record (read once this stream has ended) has it
            self._rld_finished_first(st)
        if landed:
            # MD's kv_ready came after the request ended: MD was told then to keep the prompt's KV.
            # The entry stays (bounded, KV_LANDED_MAX): MD's reservation reply may come later still
            return
        if cut:
            if self.cfg.policy.cutoff:
                await self._cut_off(st)
                return
            self._await_kv(st)
            return  # else: MD's kv_ready finds the request gone and tells MD to keep the KV
        if not st.handoff.kv_ready:
            self._await_kv(st)
            if self.cfg.policy.cutoff and st.trid in self.awaiting_kv:
                self.cutoff_watch[st.trid] = st  # MD's next kv_progress may show it crawling
            return  # the transfer finishes; on_kv_ready tells MD to keep the prompt's KV
        md_name, md = self._peer(st, ROLE_MAIN)
        _, rld = self._peer(st, ROLE_RELAY)
        try:
            if st.handoff.switch_pos is None:  # RLD finished it (MD keeps the prompt's KV)
                await md.send(Finish(st.trid).wire())
            if not rld.closed:  # a lost RLD (its connection closed) holds nothing to stop
                await rld.send(Abort(st.trid).wire())
        except Exception as e:
            log.warning("settling %s failed: %s", st.rid, e)

    def _await_kv(self, st: ReqState) -> None:
        """A finished relayed request whose KV is still on its way to MD (MD keeps the prompt's
        pages when it lands): remembered until MD's kv_ready, so that if P is lost meanwhile
        the reservation on MD is dropped instead of waiting forever. Not when that kv_ready came
        already: MD replays a predicted send's early frames while it admits the reservation, so
        its kv_ready can reach the gateway before its reservation reply (``_md_leg``)."""
        if st.handoff.kv_ready or st.trid in self.kv_landed:
            return
        p_name, md_name = st.names.get(ROLE_PREFILL), st.names.get(ROLE_MAIN)
        if p_name and md_name:
            self.awaiting_kv[st.trid] = (p_name, md_name)
            self.awaiting_kv_deadline[st.trid] = time.monotonic() + self.cfg.request_timeout_s

    def _request_failed(self, message: str, client_error: bool = False, reason: str | None = None) -> RequestFailed:
        """The :class:`RequestFailed` a request ends with (``message`` names it: "request <rid>
        failed..."), logged once as it is made: at WARNING when it is the server's failure (the
        API answers 503 ``server_error``: nothing else in the gateway's log said the request
        failed), at INFO when it is the request's own (``client_error``: a 400, which a client's
        bad request should not raise to WARNING)."""
        if client_error:
            log.info("%s (the request's own failure: the client gets 400 invalid_request_error)", message)
        else:
            log.warning("%s (the client gets 503 server_error)", message)
        return RequestFailed(message, client_error, reason)

    def _count_outcome(self, st: ReqState, outcome: str) -> bool:
        """Count ``st`` in ``totals[outcome]`` (one of :data:`OUTCOMES`) unless it was counted
        already; True if this call counted it. A completed request that made a new attempt after
        a lost instance is counted in ``totals["recovered"]`` too, and one that ended on RLD
        without MD in ``totals["degraded"]`` (a failed or cancelled one in neither). Raises
        ``ValueError`` for another outcome. A completed one's time from its start to its last token
        goes into the ``pdd_gateway_e2e_request_latency_seconds`` histogram."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}; expected one of {OUTCOMES}")
        if st.end.outcome is not None:
            return False
        st.end.outcome = outcome
        self.totals[outcome] = self.totals.get(outcome, 0) + 1
        if outcome == "completed":  # what completed requests went through, each counted once
            # its time at the gateway, to its last token (a choice held at its end until its siblings
            # started is counted later, at its settling, but ended then)
            end = st.last_token_s or time.perf_counter()
            self.metrics.e2e.labels(st.pipeline.value).observe(max(0.0, end - st.t_arrival))
            if st.recovery.recoveries:  # after at least one new attempt (a lost instance)
                self.totals["recovered"] += 1
            if st.recovery.degraded:  # ended on RLD: no MD was usable
                self.totals["degraded"] += 1
        return True

    async def abort(self, st: ReqState, reason: str) -> None:
        """End ``st`` now: tell every engine to drop it and free its pages (idempotent there;
        an unreachable engine is logged, not raised), and count its outcome unless already
        counted: ``reason`` :data:`ABORT_STOP` (a stop string ended it at the gateway) counts
        "completed", :data:`ABORT_CLIENT` (client disconnected) "cancelled", :data:`ABORT_FAILED`
        "failed", :data:`ABORT_REJECTED` (a tier refused it while starting) "rejected". The first
        abort's reason is kept in ``st.end.abort_reason``. Raises ``ValueError``
        for an unknown ``reason`` (before anything is changed)."""
        if reason not in ABORT_OUTCOMES:
            raise ValueError(f"unknown abort reason {reason!r}; expected one of {tuple(ABORT_OUTCOMES)}")
        trid = st.trid
        self._abort_begun(trid)  # st leaves reqs below; its instances free its pages when they answer
        try:
            await self._abort(st, reason)
        finally:
            self._abort_ended(trid)

    async def _abort(self, st: ReqState, reason: str) -> None:
        if st.end.abort_reason is None:
            st.end.abort_reason = reason
        self._count_outcome(st, ABORT_OUTCOMES[reason])
        st.finished = st.end.aborted = True
        st.to(Phase.DONE, f"aborted ({reason})")
        st.md_settled.set()
        self.reqs.pop(st.trid, None)
        # its instances' in-flight counts and queue places end here, not only when its stream ends:
        # a choice of a refused request may be aborted before its stream ever started (its pump
        # cancelled unstarted), which left them counted for good (routing read the instances as
        # busy or full, and removing one was refused as in flight)
        self._unassign(st)
        # every tier drops it: MD keeps none of its KV, so no kv_ready is awaited (one settled
        # before this abort, e.g. a stop string seen after the last token, would wait forever)
        self.awaiting_kv.pop(st.trid, None)
        self.kv_landed.pop(st.trid, None)
        self._index_given_up(st)  # MD caches none of what had not landed
        await self._abort_tiers(st)

    async def _abort_tiers(self, st: ReqState) -> None:
        """Abort ``st``'s current attempt on every reachable instance at once (as
        ``_abort_everywhere``); when its P answers that it never streamed the attempt's KV (aborted
        while prefilling, or before its prefill arrived: :class:`AbortOk` ``streams`` False), P will
        never report that transfer, so its planned WAN bytes leave the planned and expected totals
        now (``_unplan_wan``; idempotent)."""
        trid, p_name = st.trid, st.names.get(ROLE_PREFILL)
        names = [n for n, p in list(self.peers.items()) if not p.closed]
        reps = await asyncio.gather(*(self._call_abort(n, self.peers[n], trid) for n in names),
                                    return_exceptions=True)
        for n, r in zip(names, reps):
            if isinstance(r, BaseException):
                log.warning("abort %s on %s failed: %s", trid, n, r)
            elif n == p_name:
                try:
                    m = decode_message(r[0])
                except MessageError as e:  # not a reply: the planned bytes stay until xfer_done or P's loss
                    log.warning("abort %s on %s: bad reply: %s", trid, n, e)
                    continue
                # an instance that answers a plain Ok (or an AbortOk without streams) says nothing of them
                if isinstance(m, AbortOk) and m.streams is False:
                    self._unplan_wan(trid)
