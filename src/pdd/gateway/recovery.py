"""Fault recovery of the gateway's requests ("degrade, don't fail"; docs/FAULTS.md).

:class:`Recovery` is the part of :class:`pdd.gateway.orchestrator.Orchestrator` that decides
what a request keeps when an instance it uses is lost (:meth:`Recovery._instance_lost`): a leg no
longer needed is ignored; MD's leg of a relayed request before the handoff is dropped and RLD
finishes (degraded); RLD lost after MD has the KV: MD takes over from the streamed ids;
otherwise a new attempt (tier rid ``<rid>.<n>``) prefills the prompt plus every token already
streamed on live instances, always through a relay, and the stream continues at the next
position; a tier's ``req_error`` fails the attempt (MD's, of a relayed request RLD still decodes,
loses only MD's leg). The only writer of a request's
:class:`~pdd.gateway.state.RecoveryState` and of its attempt's identity (``trid``, ``base``,
``attempt``); each other owner resets its own part for a new attempt (``_handoff_new_attempt``,
``_wan_new_attempt``). Also the request phases fault injection reads (:meth:`Recovery.phase`: the
phase held on the request, :mod:`pdd.gateway.phase`). Moves a request to recovery and back to
prefill. It uses the orchestrator's connections, tables and ``_launch`` through ``self``.
"""

from __future__ import annotations

import asyncio
import logging

from pdd.gateway.admission import refusal
from pdd.gateway.phase import Phase
from pdd.gateway.state import (ATTEMPT_EVENTS, NoInstance, NoMember, ReqState, client_error_of,
                               client_reason_of)
from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY
from pdd.transfer.peer import Peer
from pdd.transfer.messages import Cancel, Drop, ReqError, Target
from pdd.types import Pipeline, SamplingParams

log = logging.getLogger("pdd.gateway.orchestrator")  # one logger for the gateway's request life

RECOVERY_WAIT_S = 30.0  # how long a recovery retries while a full tier (KV pool, queue) refuses it or none is up
RECOVERY_RETRY_S = 0.5  # between those retries, at most (a topology change retries at once)


def waits_for_tier(e: BaseException) -> bool:
    """Whether an attempt that could not start with ``e`` is worth retrying for a while: a full
    tier refused it (it frees pages and places as its requests finish) or no instance of a tier
    is up (a crashed one is restarted in seconds), but not when the role has no instance in
    service at all (:class:`NoMember`: removed by the operator, it does not come back)."""
    return refusal(e) is not None or (isinstance(e, NoInstance) and not isinstance(e, NoMember))


class Recovery:
    """Mixin of :class:`~pdd.gateway.orchestrator.Orchestrator`: phases, failed attempts, lost
    instances, new attempts, aborts of an attempt on every tier."""

    async def on_req_error(self, peer, h, payload):
        """A tier failed the attempt: the stream raises with its error. Except MD's failure of a
        relayed request that RLD still decodes (MD refused a KV frame of it, ``refuse_kv``): that
        is MD's leg lost, as when MD itself is (:meth:`_md_leg_lost`: RLD finishes, degraded).
        A stale one is ignored (logged at debug), as a stale ``kv_progress`` or token is: of an
        attempt no longer current (ended, or replaced by a recovery's), or read from a connection
        the attempt does not depend on (one since replaced by a reconnect or an add of the same
        instance, or an instance the attempt is not routed to: :meth:`_error_source`)."""
        m = ReqError.decode(h)
        st = self.reqs.get(m.rid)
        if st is None or st.trid != m.rid:
            log.debug("req_error of %s from %r ignored: not a current attempt (%s)", m.rid, peer, m.error)
            return None
        src = self._error_source(st, peer)
        if src is None:
            log.debug("req_error of %s from %r ignored: not a connection the attempt uses now (%s)", m.rid, peer,
                      m.error)
            return None
        if (src == st.names.get(ROLE_MAIN) and not st.finished and not st.recovery.lost
                and self._rld_finishes_without_md(st)):
            self._md_leg_lost(st, m.error)
            return None
        st.recovery.error = m.error
        st.recovery.client_error = m.client_error is True
        # the tier's why without its name ("rld0: "): the instance is the server's, not the client's
        st.recovery.client_reason = m.error.removeprefix(f"{src}: ") if m.client_error is True else None
        st.queue.put_nowait(None)
        return None

    def _error_source(self, st: ReqState, peer) -> str | None:
        """The instance of ``st``'s current attempt (``st.names``) whose current connection
        (``self.peers``) is ``peer``, else None: a message read from a connection since replaced
        (the gateway reconnected to the instance, or an add put a new one in its place) or from an
        instance the attempt is not routed to says nothing about the attempt now."""
        return next((n for n in st.names.values() if self.peers.get(n) is peer), None)

    @staticmethod
    def _rld_finishes_without_md(st: ReqState) -> bool:
        """Whether RLD can finish ``st`` alone if its MD leg goes: a relayed request the client
        has not switched to MD for, before MD's final handoff, or after a catch-up one (RLD
        still decodes then)."""
        if st.pipeline != Pipeline.P_RLD_MD or st.handoff.switch_pos is not None:
            return False
        return st.handoff.md_start is None or st.handoff.mode == "catch_up"

    def phase(self, st: ReqState) -> str:
        """The held phase of ``st`` (:class:`pdd.gateway.phase.Phase`) as its string, e.g.
        "transfer"; "done" once finished."""
        return st.phase.value

    @staticmethod
    def _relayed_live(st: ReqState) -> bool:
        """A P->RLD->MD request whose MD leg is still on (MD is to finish it)."""
        return st.pipeline == Pipeline.P_RLD_MD and not st.recovery.md_lost

    def requests_view(self) -> dict:
        """Live requests for fault injection and debugging: rid -> phase, pipeline, attempt, next_pos,
        md_reserved (MD's reservation reply is in), kv_ready (MD holds the attempt's KV), ..."""
        return {st.rid: {"trid": st.trid, "phase": st.phase.value, "pipeline": st.pipeline.value,
                         "attempt": st.attempt, "next_pos": st.next_pos, "names": dict(st.names),
                         "md_reserved": "md_reserved" in st.events, "kv_ready": st.handoff.kv_ready,
                         "md_lost": st.recovery.md_lost,
                         "degraded": st.recovery.degraded, "recoveries": list(st.recovery.recoveries)}
                for st in list(self.reqs.values()) if st.trid in self.reqs}

    def _new_attempt(self, st: ReqState, reason: str, counted: bool = True) -> None:
        """Forget the current attempt (aborted on every tier, in the background) and make the
        next one: prompt + streamed tokens, new tier rid, per-attempt state reset. ``counted``
        False (a recovery retried because a full tier refused it): not another recovery in
        ``st.recovery.recoveries`` or ``totals["recoveries"]`` (``totals["recovered"]`` counts
        requests, once each, when they complete: :mod:`pdd.gateway.stream`)."""
        old = st.trid
        if counted:
            st.recovery.recoveries.append({"attempt": st.attempt, "reason": reason, "phase": st.phase.value,
                                           "pos": st.next_pos, "pipeline": st.pipeline.value,
                                           "names": dict(st.names)})
        st.to(Phase.RECOVERY, reason)
        self.reqs.pop(old, None)
        if old in self.planned_wan:  # P still reports the old attempt's transfer (xfer_done) ...
            self.superseded_wan[old] = (self.planned_wan.pop(old), self.planned_src.pop(old, ""))
            while len(self.superseded_wan) > 10000:  # ... unless it never streamed: bounded
                self.superseded_wan.pop(next(iter(self.superseded_wan)))
        self._index_given_up(st)  # the old attempt's KV not landed on MD never will
        self._spawn_abort(old, self._abort_everywhere(old))
        self._unassign(st)
        st.attempt += 1
        st.trid = f"{st.rid}.{st.attempt}"
        st.base = st.next_pos
        for k in ATTEMPT_EVENTS:
            if k in st.events:
                st.events[f"{k}@{st.attempt - 1}"] = st.events.pop(k)
        st.names = {}
        st.recovery.md_lost = st.recovery.lost = False
        # how the request ends is the new attempt's: planned without MD, or its MD leg lost, sets
        # it again (a request degraded on RLD whose next attempt ended on MD counted degraded)
        st.recovery.degraded = False
        st.recovery.error = None
        st.recovery.client_error = False
        st.recovery.client_reason = None
        st.recovery.asked = False
        self._handoff_new_attempt(st)
        self._wan_new_attempt(st)
        while not st.queue.empty():  # stale tokens / failure marks of the old attempt
            st.queue.get_nowait()
        if not st.finished:  # an ended request (its stream's end or an abort took it out) stays out
            self.reqs[st.trid] = st
        if counted:
            self.totals["recoveries"] += 1

    def _attempt_prompt(self, st: ReqState) -> tuple[list[int], SamplingParams]:
        """This attempt's prompt (the request's prompt + tokens already streamed) and sampling
        (budgets reduced by what was streamed)."""
        if st.base == 0:
            return st.prompt_ids, st.sampling
        d = st.sampling.to_dict()
        d["max_tokens"] = max(1, int(d["max_tokens"]) - st.base)
        # the streamed tokens stay outputs for draws, min_tokens and penalties
        d["output_offset"] = int(d.get("output_offset", 0)) + st.base
        return st.prompt_ids + st.emitted[: st.base], SamplingParams.from_dict(d)

    def _recoveries_left(self, st: ReqState) -> bool:
        """Whether ``st`` may make another new attempt after a lost instance: fewer than
        ``liveness.recovery_attempts`` made (``st.recovery.recoveries``). The tries made while
        waiting for a full tier or a restarting instance (:meth:`_retry_later`) are attempts too
        (``st.attempt`` counts them) but spend none of this budget."""
        return len(st.recovery.recoveries) < self.cfg.liveness.recovery_attempts

    def _budget_spent(self, st: ReqState) -> str:
        """The words an error of ``st`` ends with once its recovery budget is spent."""
        return (f" (after {len(st.recovery.recoveries)} new attempts: liveness.recovery_attempts "
                f"{self.cfg.liveness.recovery_attempts})")

    async def _recover(self, st: ReqState) -> bool:
        """Start the next attempt of ``st`` after a lost instance; False if none is left
        (:meth:`_recoveries_left`) or it cannot start (``st.recovery.error`` says why)."""
        if st.finished or not self._recoveries_left(st):
            if not st.finished:
                st.recovery.error = f"{st.recovery.error or 'instance lost'}{self._budget_spent(st)}"
            return False
        # the operator's removal (force) is asked for, and recovered: INFO; a real loss: WARNING
        log.log(logging.INFO if st.recovery.asked else logging.WARNING, "request %s: %s at position %d (phase %s); "
                "recovering", st.rid, st.recovery.error, st.next_pos, st.phase.value)
        self._new_attempt(st, st.recovery.error or "instance lost")
        waited = 0.0
        while True:
            prompt, sp = self._attempt_prompt(st)
            seen = self.topology_version  # a change from here on retries at once
            try:
                st.to(Phase.PREFILL, f"attempt {st.attempt} starts")
                await self._launch(st, prompt, sp, force_relay=True)
                return True
            except Exception as e:
                if isinstance(e, ConnectionError) and self._recoveries_left(st):
                    self._new_attempt(st, f"{type(e).__name__}: {e}")
                    continue
                if waits_for_tier(e) and waited < RECOVERY_WAIT_S and not st.finished:
                    # a full tier (KV pool or queue) refused the new attempt: it frees pages as its
                    # requests finish, so wait and try again instead of failing a request that has
                    # streamed tokens already (a new user: 3 of 4 recoveries failed on a full RLD);
                    # likewise when no instance of a tier is up (its supervisor restarts a killed
                    # one in seconds; a new user: 6 of 8 streams failed when the only P was killed).
                    # Not when the role has none in service (NoMember: all removed): that fails now
                    waited += await self._retry_later(st, e, seen)
                    continue
                spent = self._budget_spent(st) if isinstance(e, ConnectionError) else ""
                st.recovery.error = f"recovery failed: {e}{spent}"
                st.recovery.client_error = client_error_of(e)  # its grammar failed on the new attempt's P
                st.recovery.client_reason = client_reason_of(e)
                return False

    async def _retry_later(self, st: ReqState, e: BaseException, seen: int) -> float:
        """A new attempt could not start now (a full tier, or none of a tier up): replace it with
        the next one, not counted as a recovery, and wait until the topology changes (an instance
        added, removed or reconnected: ``Orchestrator.topology_changed``) after version ``seen``
        (read before the failed attempt), for at most ``RECOVERY_RETRY_S`` (a full tier frees
        room without an event); returns the seconds waited. Callers bound their total wait by
        ``RECOVERY_WAIT_S``."""
        self._new_attempt(st, f"{type(e).__name__}: {e}", counted=False)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._topology_wait(seen, RECOVERY_RETRY_S)
        return loop.time() - t0

    def _fail_lost(self, st: ReqState, reason: str, asked: bool = False) -> None:
        """The request needs an instance that is gone: wake its stream, which recovers it.
        ``asked``: gone because the operator removed it (its recovery is logged at INFO)."""
        if st.finished or st.recovery.lost:
            return
        st.recovery.lost = True
        st.recovery.error = reason
        st.recovery.asked = asked
        st.queue.put_nowait(None)

    def _instance_lost(self, st: ReqState, name: str, reason: str, asked: bool = False) -> None:
        """Instance ``name`` is unreachable: act on ``st`` only if it still needs it (module doc).
        ``asked``: the operator removed it (``Orchestrator._peer_closed``'s ``removed``)."""
        if st.finished or st.recovery.lost:
            return
        role = next((r for r, n in st.names.items() if n == name), None)
        if role is None:
            return
        relayed = st.pipeline == Pipeline.P_RLD_MD
        started = st.next_pos > st.base  # the decoder streamed this attempt's first token
        if role == ROLE_PREFILL:
            if not started:  # the decoder (RLD when relayed) has not got its KV yet
                self._fail_lost(st, reason, asked)
            elif relayed and not st.handoff.kv_ready:
                # P's xfer_done (kv_sent) only says its sockets took the bytes: what the line had
                # not read yet died with P, so MD may never get the KV
                if "handoff_call" in st.events:  # RLD was asked for its ids (early handoff): it may
                    self._fail_lost(st, reason, asked)  # have stopped, and MD waits for that KV: a new attempt
                else:
                    self._md_leg_lost(st, reason)  # RLD finishes the request
        elif role == ROLE_RELAY:
            if not relayed:
                self._fail_lost(st, reason, asked)
            elif st.handoff.switch_pos is not None:
                return  # MD streams: RLD is no longer needed
            elif st.handoff.md_diverged:
                self._fail_lost(st, reason, asked)  # MD's tokens differed: RLD was to finish it
            elif st.handoff.md_start is not None:
                # MD has the final handoff: RLD is needed only for its tokens below it not yet streamed
                self._rld_lost_after_final(st, reason)
            elif st.recovery.md_lost:
                self._fail_lost(st, reason, asked)
            elif st.handoff.kv_ready and started and st.handoff.rounds == 0:
                self._spawn(self._md_takeover(st, reason))
            else:
                self._fail_lost(st, reason, asked)
        elif role in (ROLE_MAIN, ROLE_COLOCATED):
            if self._rld_finishes_without_md(st):
                self._md_leg_lost(st, reason)  # RLD still decodes (also after a catch-up final round)
            else:
                self._fail_lost(st, reason, asked)

    def _md_leg_lost(self, st: ReqState, reason: str, degraded: bool = True) -> None:
        """MD's leg of a relayed request is gone before MD's stream went live: RLD finishes the
        request (degraded); P stops (or never starts) the WAN transfer, MD drops what it has.
        ``degraded`` False: the leg is cut because no decoder is needed (first token finished it)."""
        if st.recovery.md_lost:
            return
        finished = st.finished  # ended at the client (on RLD) before MD's leg settled
        st.recovery.md_lost = True
        self._index_given_up(st)  # MD drops what it has of the prompt, uncached
        self._forget_md_tokens(st)
        if st.pipeline == Pipeline.P_RLD_MD and st.phase in (Phase.TRANSFER, Phase.RLD_DECODE, Phase.HANDOFF):
            # RLD finishes: it decodes (or waits for its first token)
            st.to(Phase.RLD_DECODE if st.next_pos > st.base else Phase.TRANSFER, "MD leg lost")
        if finished:
            pass  # nothing to degrade or count, but P may still wait for MD's part of the plan
        elif degraded:
            st.recovery.degraded = True
            self.totals["md_legs_lost"] = self.totals.get("md_legs_lost", 0) + 1
        else:
            self._count_cut_off(st)
        # a request that had ended (a client gone, an abort), or one whose first token ended it (no
        # decoder needed: degraded False), loses nothing: not worth a warning (a soak's gateway log
        # was mostly these, one per relayed request that stopped at its first token)
        log.log(logging.INFO if finished or not degraded else logging.WARNING, "request %s: MD leg lost (%s); %s", st.rid, reason,
                "it had ended already" if finished else "RLD finishes it")
        md_name = st.names.get(ROLE_MAIN)
        p_name = st.names.get(ROLE_PREFILL)
        trid = st.trid
        self.awaiting_kv.pop(trid, None)  # that KV will never arrive
        # a predicted MD send gave P an md_fill slot that only MD's reservation reply resolves: the
        # reply may never come, and P's cancel below is lost if P has not admitted the request yet
        # (its prefill queued), so P would hold the request's pages until the request timeout
        fill = ((p_name, Target(trid, "md_fill", md_name, cancelled=True).wire()),) \
            if st.wan.fill_slot else ()

        async def tidy():
            for name, msg in ((p_name, Target(trid, "md", md_name, cancelled=True).wire()),
                              *fill,
                              (p_name, Cancel(trid, md_name).wire()),
                              (md_name, Drop(trid).wire())):
                peer = self.peers.get(name) if name else None
                if peer is not None and not peer.closed:
                    try:
                        await peer.send(msg)
                    except Exception:
                        pass

        self._spawn(tidy())

    @staticmethod
    def _plan_degraded(st: ReqState) -> None:
        """``st``'s attempt is planned without MD (none reachable, :mod:`pdd.gateway.launch`):
        RLD finishes it, and it is counted degraded."""
        st.recovery.degraded = True

    async def _abort_everywhere(self, trid: str) -> None:
        """Abort one attempt's tier rid on every reachable instance at once (idempotent there;
        an unreachable one frees it when its own heartbeat drops the gateway's connection)."""
        await asyncio.gather(*(self._abort_on(p, trid) for p in list(self.peers.values()) if not p.closed))

    async def _abort_on(self, peer: Peer, trid: str) -> None:
        """Abort tier rid ``trid`` on one instance (best effort: a lost instance freed it
        already), counted under way until it is answered (``aborting``, ``aborts_out``:
        :meth:`Orchestrator.flush` waits for it)."""
        name = next((n for n, p in list(self.peers.items()) if p is peer), str(peer))
        self._abort_begun(trid)
        try:
            await self._call_abort(name, peer, trid)
        except Exception as e:
            log.warning("abort %s on %s failed: %s", trid, peer, e)
        finally:
            self._abort_ended(trid)

    def _kv_source_lost(self, trid: str) -> None:
        _p, md_name = self.awaiting_kv.pop(trid, (None, None))
        peer = self.peers.get(md_name) if md_name else None
        if peer is not None and not peer.closed:
            self._spawn(peer.send(Drop(trid).wire()))
