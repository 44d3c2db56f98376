"""The handoff (a collaborator of :class:`pdd.gateway.orchestrator.Orchestrator`): MD's
``kv_ready``, RLD's output ids to MD (one-shot or catch-up rounds, RLD decides each by its load;
or early, at the KV's predicted landing; or an MD takeover when RLD was lost), and the client's
stream in position order, switching from RLD's tokens to MD's at one position, neither dropping
nor repeating a token (:meth:`Handoffs._next_tokens`). The only writer of a request's
:class:`~pdd.gateway.state.HandoffState` and of its stream positions (``next_pos``, ``pending``,
``emitted``). Moves a request from transfer to rld_decode or md_decode, and a relayed one
through rld_decode -> handoff -> md_decode.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState, TokenOut, extend_message
from pdd.topology import ROLE_MAIN, ROLE_RELAY
from pdd.transfer.messages import Abort, Drop, Finish, Handoff, KvReady
from pdd.types import Pipeline

log = logging.getLogger("pdd.gateway.orchestrator")  # one logger for the gateway's request life


KV_LANDED_MAX = 4096  # kv_ready of ended requests remembered (a bound, not a tuned figure)


class Handoffs:
    """Mixin of the orchestrator: the RLD -> MD handoff and the client's switch."""

    async def on_kv_ready(self, peer, h, payload):
        """MD holds an attempt's KV: the handoff starts (unless it began early). A request that
        ended meanwhile (RLD finished it first) or whose MD leg was given up: MD keeps the
        prompt's KV in its cache and frees the rest."""
        rid = KvReady.decode(h).rid
        self.awaiting_kv.pop(rid, None)
        self._index_landed(rid)
        st = self.reqs.get(rid)
        md = peer  # the MD that has the KV
        if st is not None and st.recovery.md_lost:  # given up on MD's leg meanwhile: keep the prompt, free the rest
            await md.send(Finish(rid).wire())
            return None
        if st is None or st.finished:
            # the request's settling (stream._settle_relayed) may not have run yet: it must not
            # wait for this kv_ready again. Not counted here: this attempt may also have been
            # aborted, cut off or replaced by a recovery (its kv_ready crossed the abort, the cut-off
            # or the new attempt); the settling counts a request RLD finished first
            # (:meth:`_rld_finished_first`)
            self.kv_landed[rid] = None
            while len(self.kv_landed) > KV_LANDED_MAX:
                self.kv_landed.pop(next(iter(self.kv_landed)))
            await md.send(Finish(rid).wire())
            return None
        st.handoff.kv_ready = True
        st.events["md_kv_ready"] = time.perf_counter()
        if self._relayed_live(st) and st.phase is Phase.TRANSFER:
            st.to(Phase.RLD_DECODE, "MD has the KV")
        if not st.handoff.started and st.next_pos > st.base:
            asyncio.get_running_loop().create_task(self._handoff(st))
        # else RLD has not streamed the attempt's first token: it may not be decoding yet (its
        # fast-path KV still on its way in, a loaded host), and asked for its ids then it answers
        # "finished" (it holds nothing in its engine): MD would be told to finish while RLD goes on
        # to decode the whole request alone. The first token starts the handoff (_first_streamed)
        return None

    def _rld_finished_first(self, st: ReqState) -> None:
        """``st`` (a relayed request that completed, not aborted nor failed, whose MD leg was not
        given up) ended on RLD before any handoff to MD (no final round, no takeover in its last
        attempt), and its WAN transfer was not cut off: MD keeps the prompt's KV. The request's
        ``rld_finished_first`` and ``totals.rld_finished_first`` are set together, once, by the
        stream's settling (:meth:`pdd.gateway.stream.Streams._settle_relayed`), before the
        response's ``pdd`` record is read; a cut-off request is counted in ``cut_offs`` only."""
        if not st.handoff.rld_finished_first:
            st.handoff.rld_finished_first = True
            self.totals["rld_finished_first"] += 1

    def _rld_finished_first_undone(self, st: ReqState) -> None:
        """``st``'s transfer is cut off after its settling counted it RLD-finished-first (let
        through at its end, cut off on a later ``kv_progress``): MD keeps none of its KV, so it
        leaves ``rld_finished_first`` and the total (it is counted in ``cut_offs`` instead). Its
        response's ``pdd`` record, read at its end, said ``rld_finished_first``. No-op otherwise."""
        if st.handoff.rld_finished_first:
            st.handoff.rld_finished_first = False
            self.totals["rld_finished_first"] -= 1

    def _handoff_new_attempt(self, st: ReqState) -> None:
        """A new attempt (recovery) starts: forget the old one's handoff and the tokens waiting
        for their position; the request's record (``pos``, ``tokens``, ``rld_finished_first``,
        ``extend_extra_step_ms``) stays."""
        ho = st.handoff
        st.pending.clear()
        ho.md_pending.clear()
        ho.switch_pos = ho.md_start = None
        ho.kv_ready = ho.md_diverged = ho.takeover = ho.started = ho.early = ho.rld_lost = False
        ho.final_ids = []
        ho.mode, ho.rounds = None, 0

    def _forget_md_tokens(self, st: ReqState) -> None:
        """MD's leg was given up (recovery): its tokens waiting for their position never stream."""
        st.handoff.md_pending.clear()

    async def _handoff_at_landing(self, st: ReqState) -> None:
        """Early handoff (``policy.early_handoff``): P wrote MD's KV to the WAN, so start the
        handoff when that KV is predicted to land on MD less the WAN's one-way delay: RLD's ids
        then cross while the KV's last bytes do, instead of a crossing after MD's kv_ready has
        crossed back. Landing = when P began streaming + the transfer's bytes at the live WAN
        rate (:meth:`_remaining_wan_s`). A prediction that is early makes MD's extend wait for
        the KV (the client's switch gap grows by the error); a late one hands over at kv_ready."""
        trid = st.trid

        def moot() -> bool:
            return (st.trid != trid or st.handoff.kv_ready or st.finished or st.recovery.md_lost or st.wan.cut_off
                    or st.handoff.started or st.recovery.lost)

        # RLD must be decoding (its first token out) before it can be asked for its ids: its
        # fast-path KV was written beside MD's, but may still be on its way in. And MD must have
        # admitted the request (its reservation reply is in): a refused reservation loses MD's leg
        # and RLD, not yet stopped, finishes the request instead of handing it to nobody
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while (not moot() and (st.next_pos <= st.base or "md_reserved" not in st.events)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.001)
        if moot() or st.next_pos <= st.base or "md_reserved" not in st.events:
            return
        wait = self._remaining_wan_s(st)  # the planned bytes, with a fill's, are known from here on
        if wait > 0:
            await asyncio.sleep(wait)
            if moot():
                return
        st.handoff.early = True
        await self._handoff(st)

    async def _handoff(self, st: ReqState) -> None:
        """Extend-Decode handoff, one-shot or catch-up (RLD decides each round by its load).

        Each round RLD returns every output id so far. Catch-up rounds before the final one
        are absorbed by MD (KV computed, no sampling) while RLD keeps decoding; after the final
        round MD extends, samples and decodes on, and :meth:`stream` switches the client to MD
        at the first position MD reaches, once MD's tokens match what was streamed. One-shot:
        RLD stops at once, MD continues at the next position.
        """
        if st.handoff.started:
            return
        st.handoff.started = True
        trid = st.trid
        try:
            await self._handoff_rounds(st)
        except Exception as e:
            if st.trid != trid or st.finished or st.recovery.lost:
                return
            # a tier died mid-handoff; its closed connection tells _instance_lost what to do
            log.warning("request %s: handoff failed: %s", st.rid, e)
            reported = await self._close_reports(st)
            if st.trid != trid or st.finished or st.recovery.lost:
                return  # recovered (by the close's report, _peer_closed) or ended while it drained
            for role in (ROLE_RELAY, ROLE_MAIN):
                name = st.names.get(role)
                peer = self.peers.get(name) if name is not None else None
                if name is not None and (peer is None or peer.closed):  # closed, or removed by the operator
                    if peer is not None and peer in reported:
                        return  # _peer_closed applied this loss to the attempt when it reported the close
                    self._instance_lost(st, name, f"instance {name} is unreachable ({e})")
                    return
            self._fail_lost(st, f"handoff failed: {e}")

    async def _close_reports(self, st: ReqState) -> list:
        """Wait until the close of each closed connection to the attempt's RLD and MD is reported
        (``Peer.wait_close_reported``): one that ended from the instance's side first hands the
        one-way messages it read before the end (e.g. RLD's last tokens) to their handlers, for
        at most its ``drain_timeout_s`` seconds (:mod:`pdd.transfer.peer`, "Close"), so a loss
        decided after this sees those tokens in the stream's queue. Returns those connections
        that are still their instance's: reporting the close ran :meth:`_peer_closed` (as
        ``_connect`` registered it), which applied the loss to every request routed there, this
        one included. Never waits on a call: the handlers drained are one-way (tokens, kv_ready,
        errors) and never await a handoff, so this ends within the longest ``drain_timeout_s``.
        A stand-in connection without close reports (tests' fakes) is not waited for nor returned."""
        out = []
        for role in (ROLE_RELAY, ROLE_MAIN):
            name = st.names.get(role)
            peer = self.peers.get(name) if name is not None else None
            wait = getattr(peer, "wait_close_reported", None)
            if peer is None or not peer.closed or wait is None:
                continue
            await wait()
            if self.peers.get(name) is peer:
                out.append(peer)
        return out

    async def _handoff_rounds(self, st: ReqState) -> None:
        """The rounds of one attempt (tier rid ``st.trid`` when called): they stop as soon as
        recovery replaced that attempt, so a later attempt's handoff never sees its rounds, ids
        or peers."""
        trid = st.trid
        md_name, md = self._peer(st, ROLE_MAIN)
        _, rld = self._peer(st, ROLE_RELAY)
        t = self.cfg.request_timeout_s
        k = self.cfg.policy.handoff_min_tokens
        while k and st.next_pos < k and not st.finished and not st.recovery.md_lost and st.trid == trid:
            await asyncio.sleep(0.001)
        rounds, sent = 0, 0
        while True:
            if st.trid != trid or st.recovery.lost:
                return  # the attempt was given up (recovery): its successor hands over on its own
            if st.recovery.md_lost or st.handoff.takeover:
                return  # MD's leg was given up (RLD finishes), or MD took over already
            if st.finished:
                rep = {"finished": True}
            else:
                st.events["handoff_call"] = time.perf_counter()
                if self._relayed_live(st) and st.phase in (Phase.TRANSFER, Phase.RLD_DECODE):
                    st.to(Phase.HANDOFF, "RLD asked for its ids")
                rep, _ = await rld.call(Handoff(trid, sent, rounds).wire(), timeout=t)
                if st.trid != trid or st.handoff.takeover:
                    return  # ... or RLD was lost as it answered and MD took over already (one extend only)
                if st.recovery.md_lost:
                    # MD's leg was given up while RLD answered (MD lost, or it failed the request):
                    # RLD finishes it, unless this round was a one-shot final one, which stopped RLD
                    if rep.get("final") and rep.get("mode") == "one_shot":
                        self._fail_lost(st, "MD's leg was lost while RLD stopped for a one-shot handoff")
                    return
            if rep.get("not_started"):
                # RLD holds the attempt but is not decoding it yet (its KV still coming in): nothing
                # finished, no round applied. Ask again once it streamed its first token (the loop's
                # checks above end this if the attempt ends or is replaced meanwhile)
                await self._rld_first_token(st, trid)
                continue
            if rep.get("finished"):  # RLD finished the request (or it ended): MD keeps the prompt's KV
                # (the stream's settling counts it, _rld_finished_first: an aborted request ends here too)
                if not st.handoff.kv_ready:
                    # an early handoff (policy.early_handoff) whose KV has not landed on MD: a finish
                    # now would release MD's reservation before it lands, so no kv_ready would ever
                    # come while the request's settling awaits it (stream._await_kv). MD is told to
                    # keep the prompt's KV when its kv_ready comes (on_kv_ready), or the settling
                    # cuts the transfer off
                    return
                await md.send(Finish(trid).wire())
                return
            ids = rep["token_ids"]
            rounds += 1
            if "inputs" in rep:
                st.decisions.append({"policy": "handoff", "inputs": rep["inputs"],
                                     "result": {"mode": rep["mode"], "final": rep["final"]}})
            st.handoff.mode, st.handoff.rounds = rep["mode"], rounds
            st.handoff.tokens = len(ids)
            if rep["final"]:
                st.handoff.md_start = len(ids)
                st.handoff.final_ids = list(ids)  # RLD's tokens up to md_start, should its stream of them be cut
                st.events["handoff"] = time.perf_counter()
                st.events["handoff_rld_ms"] = st.events["handoff"] - float(rep.get("rld_ms", 0.0)) / 1000
                self.totals["handoffs"] += 1
                if st.handoff.early:
                    self.totals["early_handoffs"] += 1
                key = f"handoffs_{rep['mode']}"
                self.totals[key] = self.totals.get(key, 0) + 1
                await md.send(extend_message(trid, ids, final=True))
                return
            r, _ = await md.call(extend_message(trid, ids, final=False), timeout=t)
            if not r.get("found", True) or st.trid != trid:
                return
            sent = len(ids) - 1  # MD holds all but the newest id (see MainDecodeInstance.on_extend)
            st.handoff.extend_extra_step_ms.append(float(r.get("extra_step_ms", 0.0)))

    async def _rld_first_token(self, st: ReqState, trid: str, poll_s: float = 0.001) -> None:
        """Return once attempt ``trid`` of ``st`` streamed its first token (``next_pos`` past
        ``base``), or it finished, was replaced or lost; then at least ``poll_s`` later (an RLD
        that answered ``not_started`` is not asked again at once)."""
        await asyncio.sleep(poll_s)
        while (st.next_pos <= st.base and not st.finished and st.trid == trid and not st.recovery.lost
               and not st.recovery.md_lost):
            await asyncio.sleep(poll_s)

    def _next_tokens(self, st: ReqState, tok: TokenOut) -> list[TokenOut]:
        """Route one arriving token; return the tokens that can be streamed now, in order.

        Relayed requests have two sources: RLD streams from position 0; MD from ``md_start``
        (after the final handoff round). The client switches to MD as soon as MD's stream is
        live: at MD's first token, if RLD (still decoding in catch-up) already streamed that
        position and MD agrees, MD takes over from the next position and RLD is stopped; if MD's
        token is there first (one-shot: RLD has stopped), MD takes over at its position. MD's
        tokens for positions already streamed must equal them; they do unless a numerical
        near-tie made MD's recomputed KV pick another token: then MD is dropped and RLD, still
        decoding, finishes the request (only possible in catch-up).
        """
        relayed = st.pipeline == Pipeline.P_RLD_MD
        ho = st.handoff
        if relayed and tok.tier != "rld":
            if ho.md_diverged:
                return []
            if tok.pos < st.next_pos:
                if st.emitted[tok.pos] != tok.token_id:
                    if ho.switch_pos is None:
                        self._md_diverged(st, tok.pos)
                    return []
                if ho.switch_pos is None:
                    self._switch(st, st.next_pos)  # MD is live and agrees: it streams from here
            else:
                ho.md_pending[tok.pos] = tok
        elif ho.takeover and tok.pos >= ho.md_start:
            pass  # RLD's, queued before its loss: MD took over from md_start and makes this position
        elif ho.switch_pos is None or tok.pos < ho.switch_pos:
            if tok.pos >= st.next_pos:
                st.pending[tok.pos] = tok
        out = []
        while True:
            p = st.next_pos
            if ho.switch_pos is not None:
                if p not in ho.md_pending:
                    return out
                t = ho.md_pending.pop(p)
            elif p in st.pending:
                t = st.pending.pop(p)
            elif relayed and p in ho.md_pending and not ho.md_diverged:
                self._switch(st, p)
                t = ho.md_pending.pop(p)
            else:
                return out
            st.next_pos += 1
            if st.next_pos == st.base + 1:
                self._first_streamed(st)
            st.emitted.append(t.token_id)
            out.append(t)
            if t.fin is not None:
                return out

    def _first_streamed(self, st: ReqState) -> None:
        """The attempt's first token was streamed: a decoder that finishes the request without a
        handoff (MD of P->MD, RLD of P->RLD or of a relayed request whose MD leg was lost) decodes."""
        if st.phase is Phase.TRANSFER and not self._relayed_live(st):
            relay = st.pipeline in (Pipeline.P_RLD, Pipeline.P_RLD_MD)
            st.to(Phase.RLD_DECODE if relay else Phase.MD_DECODE, "first token streamed")
        if st.pipeline == Pipeline.P_MD:
            # MD emits P's first token once the prompt's KV is all there (it imports it into its
            # cache, in order before any later reservation's match): the claim has landed, so a
            # next turn is planned on it as held, not waited for (MD sends no kv_ready for P->MD)
            self._index_landed(st.trid)
        ho = st.handoff
        if (self._relayed_live(st) and ho.kv_ready and not ho.started and not st.finished
                and not st.recovery.lost):
            # MD's KV landed before RLD streamed (on_kv_ready waited for this): hand over now
            asyncio.get_running_loop().create_task(self._handoff(st))

    def _switch(self, st: ReqState, pos: int) -> None:
        st.handoff.switch_pos = pos
        if not st.recovery.md_lost:
            st.to(Phase.MD_DECODE, "MD's stream is live")
        st.handoff.pos = pos
        st.pending.clear()
        st.events["switch"] = time.perf_counter()
        asyncio.get_running_loop().create_task(self._release_relay(st))

    def _md_diverged(self, st: ReqState, pos: int) -> None:
        st.handoff.md_diverged = True
        st.handoff.md_pending.clear()
        self.totals["md_diverged"] = self.totals.get("md_diverged", 0) + 1
        if st.handoff.rld_lost or st.handoff.takeover:
            # RLD, which would finish it, is gone: nothing would stream again (a stall until
            # request_timeout_s); a new attempt continues from the next position
            log.warning("request %s: MD's token at %d differs from RLD's and RLD is lost; recovering", st.rid, pos)
            self._fail_lost(st, f"MD's token at {pos} differs from the one streamed and RLD is lost")
            return
        log.warning("request %s: MD's token at %d differs from RLD's (near-tie); RLD finishes it", st.rid, pos)
        _, md = self._peer(st, ROLE_MAIN)
        asyncio.get_running_loop().create_task(md.send(Drop(st.trid).wire()))

    async def _release_relay(self, st: ReqState) -> None:
        """MD's stream is live: stop RLD (catch-up kept it decoding until now)."""
        if st.handoff.mode == "catch_up":
            _, rld = self._peer(st, ROLE_RELAY)
            try:
                await rld.call(Abort(st.trid).wire(), timeout=10)
            except Exception as e:
                log.warning("stopping %s on RLD failed: %s", st.rid, e)

    def _rld_lost_after_final(self, st: ReqState, reason: str) -> None:
        """RLD was lost after its final round (MD decodes from ``md_start``) and before the client
        switched to MD. RLD's tokens below ``md_start`` that had not reached the stream died with
        its connection: RLD writes them ahead of its reply, but the gateway's connection delivers a
        reply as it reads it and its one-way messages (tokens) through a queue that its close
        drops, and catch-up does not flush them first at all. Nothing else would ever bring those
        positions, so the stream would wait until ``request_timeout_s``. The final round's ids are
        those tokens: each position from the next one to ``md_start`` is queued from them behind
        the tokens already queued (a position those streamed is ignored when it comes), so MD's
        stream goes on from ``md_start``. A request that asked for logprobs cannot have them for
        those ids: it is recovered instead (``reason``). After a takeover nothing of RLD's is
        awaited (MD continues from the streamed ids)."""
        ho = st.handoff
        if ho.takeover or ho.rld_lost:
            return
        ho.rld_lost = True
        first = st.next_pos - st.base  # the attempt's first output the stream has not had
        if first >= ho.md_start:
            return
        if st.sampling.logprobs is not None:
            self._fail_lost(st, reason)
            return
        log.warning("request %s: %s after its final handoff round; positions %d-%d from that round's ids", st.rid,
                    reason, st.next_pos, st.base + ho.md_start - 1)
        for i in range(first, ho.md_start):
            st.queue.put_nowait(TokenOut(st.base + i, int(ho.final_ids[i]), "rld", None, None))

    async def _md_takeover(self, st: ReqState, reason: str = "RLD is lost") -> None:
        """RLD is gone but MD holds the prompt's KV (recovery's rule): hand MD the tokens already
        streamed (one extend, as a one-shot handoff would) and let it decode on from the next
        position. RLD's tokens for that position on, still queued, are not streamed: MD makes
        them (:meth:`_next_tokens`), so MD continues from exactly what the client has."""
        ho = st.handoff
        if ho.takeover or st.finished:
            return
        if ho.md_start is not None:
            # the final round's reply was read with RLD's loss (it overtook the tokens before it):
            # the handoff went ahead of this task, and RLD's tokens below md_start may be lost
            self._rld_lost_after_final(st, reason)
            return
        ho.takeover = True
        if self._relayed_live(st) and st.phase in (Phase.TRANSFER, Phase.RLD_DECODE):
            st.to(Phase.HANDOFF, "MD takes over")
        md_name, md = self._peer(st, ROLE_MAIN)
        ids = st.emitted[st.base:]
        ho.md_start = st.next_pos
        ho.mode = "takeover"
        st.pending.clear()  # RLD's, past the next position: MD's to make
        st.events["handoff"] = time.perf_counter()
        self.totals["takeovers"] = self.totals.get("takeovers", 0) + 1
        try:
            await md.send(extend_message(st.trid, ids, final=True))
        except Exception as e:
            self._fail_lost(st, f"instance {md_name} is unreachable ({e})")
