"""Launching an attempt (a collaborator of :class:`pdd.gateway.orchestrator.Orchestrator`): the
pipeline plan (``policy.pipeline``) and one launcher per pipeline, each returning once P (or the
colocated instance) sampled the first token: colocated, P->RLD (no MD reachable: degraded),
P->RLD->MD planned at once (a zero TTFT budget, a recovery, a relayed sibling), and the plan
made when MD's reservation returns (P->MD, P->D, P->RLD->MD or P->RLD), with P prefilling
meanwhile. Moves a request from prefill to transfer. Writes a request's ``pipeline``,
``p_cached_tokens`` and ``names``.

Pipelines (PDD report, "Pipelines"):
  colocated:  C.generate
  P_D / P_MD: D.reserve || P.prefill(targets deferred) -> plan -> P.target(D from its cached
              pages) -> D decodes
  P_RLD_MD:   RLD.expect, then MD.reserve || P.prefill(targets deferred) -> plan ->
              P.target(RLD all pages, MD missing pages) -> RLD decodes -> MD.kv_ready ->
              RLD.handoff (ids) -> MD.extend -> MD decodes
  (the relay is planned at once, RLD's target not deferred, MD's is: with a zero TTFT budget,
  and with a non-zero one when the gateway's prefix index of the chosen MD says the missing KV
  does not fit it; a request that fits waits for MD's reservation, which re-plans)
P's prefill never waits for MD's reservation (a WAN round trip): the plan needs what MD's cache
holds, and P sends nothing before it knows where.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.policy.pipeline import PipelineInputs, choose_pipeline, plans_from_index, relays_every_request
from pdd.policy.siblings import claim_waits_for_kv, sibling_waits_for_kv
from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY
from pdd.transfer.peer import Peer, RemoteError
from pdd.transfer.messages import OMIT, Abort, Drop, Expect, Generate, Prefill, Reserve, Target
from pdd.types import Pipeline, SamplingParams


def _give_up(*futs: asyncio.Future | None) -> None:
    """Cancel each future still pending and retrieve the exception of each one done (no "never
    retrieved" noise); None entries are skipped."""
    for fut in futs:
        if fut is None:
            continue
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()


class Launchers:
    """Mixin of the orchestrator: plan a request's pipeline and start its attempt on the tiers."""

    def _plan(self, st: ReqState, prompt_len: int, md_cached_tokens: int, md_available: bool = True) -> Pipeline:
        """The pipeline of ``st``'s attempt (``policy.pipeline.choose_pipeline``) toward the MD it
        names, holding ``md_cached_tokens`` of the prompt; appended to the request's decisions."""
        inp = self._pipeline_inputs(st, prompt_len, md_cached_tokens, md_available)
        out = choose_pipeline(inp)
        self._record_plan(st, inp, out)
        return out

    @staticmethod
    def _record_plan(st: ReqState, inp: PipelineInputs, out: Pipeline) -> None:
        st.decisions.append({"policy": "pipeline", "inputs": asdict(inp), "result": out.value})

    def _pipeline_inputs(self, st: ReqState, prompt_len: int, md_cached_tokens: int, md_available: bool = True,
                         md: str | None = None) -> PipelineInputs:
        """What the gateway knows of ``st``'s attempt toward MD ``md`` (default: the one ``st``
        names) holding ``md_cached_tokens`` of the prompt."""
        mode = self.cfg.mode
        md = md or st.names.get(ROLE_MAIN)  # the chosen MD's path (policy.wan_estimate: live or config)
        return PipelineInputs(
            mode=mode,
            prompt_tokens=prompt_len,
            md_cached_tokens=md_cached_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token or 0,
            wan_gbps_estimate=self.wan_peers.gbps(md),
            wan_rtt_ms=self.wan_peers.rtt_ms_of(md),
            ttft_budget_ms=self.cfg.policy.pipeline_ttft_budget_ms,
            allow_p_rld=self.cfg.policy.allow_p_rld,
            md_available=md_available,
            wan_backlog_bytes=self._wan_backlog_bytes(md, st),
            md_crosses_wan=md is None or self._in_b(md),
        )

    async def _launch(self, st: ReqState, prompt: list[int], sp: SamplingParams | None = None,
                      force_relay: bool = False) -> None:
        """Start ``st``'s current attempt on ``prompt`` (returns once P sampled its first token);
        the caller moved ``st`` to the prefill phase.

        ``force_relay`` (recovery): plan P->RLD->MD whatever the TTFT budget, so a WAN fault
        cannot stall the recovered request. With no MD reachable, plans P->RLD (degraded); with no
        RLD reachable but an MD, plans P->MD (new requests and recoveries alike).
        Raises ConnectionError when an instance it calls is lost meanwhile.
        """
        sampling = (sp or st.sampling).to_dict()
        t = self.cfg.request_timeout_s
        if self.cfg.mode == "colocated":
            await self._launch_colocated(st, prompt, sampling)
            return
        ms = getattr(self, "membership", None)

        def usable(name: str) -> bool:  # connected, and an active member (not draining, removed or re-roled away)
            peer = self.peers.get(name)
            return peer is not None and not peer.closed and (ms is None or ms.routable(name))

        # each instance is counted as soon as it is chosen (gateway.routing: its queue's places),
        # so the next choice of the request, routed meanwhile, sees it
        st.names[ROLE_PREFILL] = await self._route(ROLE_PREFILL, prompt)
        self._assign(st, ROLE_PREFILL)
        # read after P's routing (a peek of each P, a round trip): an RLD or MD lost, drained or
        # re-roled meanwhile changes the plan here, with no await before RLD's routing below
        rld_specs = self.layout.by_role(ROLE_RELAY)
        relay_possible = bool(rld_specs)
        md_specs = self.layout.by_role(ROLE_MAIN)
        md_live = any(usable(sp_.name) for sp_ in md_specs)
        if relay_possible and md_live and not any(usable(sp_.name) for sp_ in rld_specs):
            # no RLD is reachable (dead, restarting, drained) but an MD is: plan P->MD rather than fail
            for sp_ in rld_specs:
                if sp_.name in self.peers and self.peers[sp_.name].closed:
                    self._spawn(self._reconnect(sp_.name))
            relay_possible = False
        if relay_possible:
            st.names[ROLE_RELAY] = await self._route(ROLE_RELAY, prompt)
            self._assign(st, ROLE_RELAY)
        _, p = self._peer(st, ROLE_PREFILL)
        if relay_possible and not md_live:
            await self._launch_p_rld(st, prompt, sampling, p, md_specs)
            return

        trid, names = st.trid, st.names  # this attempt's (a recovery makes new ones)
        # another choice of a prompt: its first choice's MD reservation may still be out (a
        # relayed first choice returns at P's first token), then this one decides where to
        # reserve once that reply is in, not on what the gateway happens to know now
        pending_sib = st.attempt == 0 and self._sibling_pending(st)
        sib = self._sibling_md(st) if st.attempt == 0 and not pending_sib else None
        relay_sibling = pending_sib or (sib is not None and sib[2] == Pipeline.P_RLD_MD)
        # a relayed plan made before MD's reservation may also start MD's WAN send before it: P
        # sends the pages the gateway's prefix index says MD lacks at once, and only the pages
        # MD turns out to lack besides (a fill) wait for the reservation's reply
        predicted = (relay_possible and self.cfg.policy.md_predicted_send and self._always_relay() and not force_relay
                     and sib is None and not pending_sib and self.page_bytes is not None)
        # a non-zero budget: MD is chosen now from the gateway's prefix index (no round trip), and
        # a request whose missing KV does not fit the budget by that index is relayed at once, as
        # with a zero budget, so its TTFT never waits for MD's reservation; one that fits waits for
        # the reservation's reply, which re-plans on what MD's cache really holds
        pre = None  # (MD's name, prompt tokens its index held), routed before P starts
        pre_relay = False
        claim = None  # (the attempt whose KV brings the end of the held prefix, its landed tokens)
        if relay_possible and not force_relay and sib is None and not pending_sib and self._plans_from_index():
            pre = await self._route_hit(ROLE_MAIN, prompt, trid)
            self._hold(st, pre[0])
            claim = self._claim_to_wait_for(trid)
            if pre[1] is not None:
                # a prefix still on its way to MD (a claim) is not there yet: the budget is judged
                # on what landed (MD's reservation matches only that; relayed, it waits for the rest)
                landed = pre[1] if claim is None or not self.cfg.policy.md_wait_claims else claim[1]
                inp = self._pipeline_inputs(st, len(prompt), landed, md=pre[0])
                pre_relay = choose_pipeline(inp) == Pipeline.P_RLD_MD
                if pre_relay:  # the decision (a P->MD prediction is not one: MD's reply re-plans)
                    self._record_plan(st, inp, Pipeline.P_RLD_MD)
                    predicted = self.cfg.policy.md_predicted_send and self.page_bytes is not None

        # relayed before MD's reservation: RLD streams the first token, so the reservation may wait
        relay_now = relay_possible and (self._always_relay() or force_relay or relay_sibling or pre_relay)

        async def route_and_reserve():
            msg = Reserve(trid, prompt, sampling)
            held = None
            claim_ = claim
            sib_ = sib
            if pending_sib:
                try:
                    await asyncio.wait_for(st.sibling_of.md_settled.wait(), t)
                except asyncio.TimeoutError:
                    pass  # the first choice's MD leg never settled: this one routes as any request
                sib_ = self._sibling_md(st)
            if sib_ is not None and self.queue_full(sib_[0]):
                sib_ = None  # the first choice's MD holds as many choices as its queue: routed as any request
            if sib_ is not None:  # the first choice's MD, once the prompt's KV is there
                md_name_ = sib_[0]
                msg.after = sib_[1]
            elif pre is not None:  # chosen from the prefix index before P started
                md_name_, held = pre
            else:  # choosing MD may cost a WAN round trip (peek), so it runs beside P's prefill
                md_name_, held = await self._route_hit(ROLE_MAIN, prompt, trid)
                claim_ = self._claim_to_wait_for(trid)
            if st.trid != trid:
                raise ConnectionError(f"attempt {trid} was given up")
            if (sib_ is None and claim_ is not None and self.cfg.policy.md_wait_claims
                    and held is not None and self._claim_worth_waiting(held - claim_[1])
                    and (relay_now or self._claim_on_the_line(claim_[0]))):
                # MD's index holds the prompt's prefix as another attempt's claim (its KV still
                # crossing): MD reserves once that KV is in its cache (as a sibling does) and P
                # sends only what MD then lacks, instead of those pages again. Relayed, the wait
                # is off the first token's path; else only a claim whose KV is already being
                # sent is waited for (it lands no later than a copy sent now, which would queue
                # behind or beside it). Not a predicted send: its frames would wait at MD
                # (EarlyFrames) for as long as the claim
                msg.after = claim_[0]
                self.totals["md_claim_waits"] += 1
            names[ROLE_MAIN] = md_name_
            self._assign(st, ROLE_MAIN)
            sent = time.perf_counter()
            waits = msg.after is not OMIT
            if not (predicted and held is not None) or waits:
                rep_, _ = await self.peer_named(md_name_).call(msg.wire(), timeout=t)
                if not waits:  # a round trip through the line (a reserve {after} waits for KV)
                    self._wan_rtt_sample(md_name_, time.perf_counter() - sent)
                return md_name_, rep_
            pred = held // self.cfg.engine_for(md_name_).page_size  # MD's pages
            msg.first_page = pred
            call = asyncio.ensure_future(self.peer_named(md_name_).call(msg.wire(), timeout=t))
            try:
                self._book_predicted(st, pred, p)
                await p.send(Target(trid, "md", md_name_, first_page=pred, relay=True).wire())
            except BaseException:
                _give_up(call)
                raise
            rep_, _ = await call
            self._wan_rtt_sample(md_name_, time.perf_counter() - sent)
            return md_name_, rep_

        reserve = asyncio.ensure_future(route_and_reserve())
        # a sibling of a relayed choice is relayed at once too (relay_sibling): its MD reservation
        # waits for the first choice's KV, and the relay's first token must not
        if relay_now:
            await self._launch_relayed(st, prompt, sampling, p, reserve, predicted, force_relay or relay_sibling,
                                       planned=pre_relay)
            return
        await self._launch_on_reservation(st, prompt, sampling, p, reserve, relay_possible)

    async def _launch_colocated(self, st: ReqState, prompt: list[int], sampling: dict) -> None:
        """Colocated: one instance prefills and decodes (prefill -> decode once it sampled)."""
        t = self.cfg.request_timeout_s
        st.pipeline = Pipeline.COLOCATED
        st.names[ROLE_COLOCATED] = await self._route(ROLE_COLOCATED, prompt)
        self._assign(st)
        _, c = self._peer(st, ROLE_COLOCATED)
        self._prefill_sent(st)
        rep, _ = await c.call(Generate(st.trid, prompt, sampling).wire(), timeout=t)
        st.to(Phase.DECODE, "first token sampled")
        st.note_p_cached(int(rep["p_cached_tokens"]))

    async def _launch_p_rld(self, st: ReqState, prompt: list[int], sampling: dict, p: Peer, md_specs) -> None:
        """P->RLD, degraded: no MD is reachable, RLD completes the request (counted apart)."""
        t = self.cfg.request_timeout_s
        for sp_ in md_specs:
            self._spawn(self._reconnect(sp_.name))
        st.pipeline = self._plan(st, len(prompt), 0, md_available=False)
        self._plan_degraded(st)
        self._assign(st, ROLE_PREFILL, ROLE_RELAY)
        rld_name, rld = self._peer(st, ROLE_RELAY)
        await rld.call(Expect(st.trid, prompt, sampling).wire(), timeout=t)
        st.events["rld_expect"] = time.perf_counter()
        self._prefill_sent(st)
        rep, _ = await p.call(Prefill(st.trid, prompt, sampling,
                                      [{"name": rld_name, "first_page": 0, "relay": False}]).wire(), timeout=t)
        self._prefilled(st)
        st.note_p_cached(int(rep["p_cached_tokens"]))

    async def _launch_relayed(self, st: ReqState, prompt: list[int], sampling: dict, p: Peer,
                              reserve: asyncio.Future, predicted: bool, at_once: bool,
                              planned: bool = False) -> None:
        """P->RLD->MD planned before MD's reservation: P starts now with RLD's target, MD's part
        of the plan (``reserve``: which MD, which pages; ``predicted``: P sends the pages the
        prefix index says MD lacks at once) follows. ``at_once``: relayed whatever the plan (a
        recovery, or a sibling of a relayed choice); ``planned``: ``policy.pipeline`` chose the
        relay on the prefix index's prediction (recorded by the caller); else ``policy.pipeline``
        with a zero budget."""
        t = self.cfg.request_timeout_s
        trid = st.trid
        # the relay is planned whatever MD holds: P starts now and learns MD's part of the
        # plan (which MD, which pages) a WAN round trip later, so TTFT never waits on the WAN
        # (MD's cached tokens are not known yet; with a zero budget they do not matter). MD's
        # leg runs on its own: if MD cannot be reached, RLD finishes the request.
        rld_name, rld = self._peer(st, ROLE_RELAY)
        md_leg = None
        if at_once or planned:
            st.pipeline = Pipeline.P_RLD_MD
        else:
            st.pipeline = self._plan(st, len(prompt), 0)
        if predicted:
            self._open_fill_slot(st)
        p_call = None
        try:
            await rld.call(Expect(st.trid, prompt, sampling).wire(), timeout=t)
            st.events["rld_expect"] = time.perf_counter()
            self._prefill_sent(st)
            p_call = asyncio.ensure_future(p.call(
                Prefill(st.trid, prompt, sampling,
                        [{"name": rld_name, "first_page": 0, "relay": False}, {"slot": "md", "deferred": True}]
                        + ([{"slot": "md_fill", "deferred": True}] if predicted else [])).wire(), timeout=t))
            p_call.add_done_callback(self._event_when_done(st, "p_first_token"))
            md_leg = asyncio.ensure_future(self._md_leg(st, trid, reserve, p))
            md_leg.add_done_callback(lambda _f: st.md_settled.set())
            rep, _ = await p_call
            self._cut_md_if_first_token_ended(st, rep)
        except BaseException:
            _give_up(reserve, md_leg)
            st.md_settled.set()
            if p_call is None or (p_call.done() and not p_call.cancelled()
                                  and isinstance(p_call.exception(), RemoteError)
                                  and not (p_call.exception().header.get("detail") or {}).get("streams")):
                # P never started this attempt's streams (RLD refused or was lost before P was
                # asked, or P refused the prefill): the WAN bytes planned for it (a predicted
                # MD send's are booked before any reply) will never be sent nor reported. A
                # layer-wise P whose streams had started says so (``detail.streams``): it reports
                # them in ``xfer_done``
                self._unplan_wan(st.trid)
            raise
        self._prefilled(st)
        st.note_p_cached(int(rep["p_cached_tokens"]))

    def _cut_md_if_first_token_ended(self, st: ReqState, rep: dict) -> None:
        """A relayed request P's reply says its first token finished (EOS, a stop id, max_tokens
        1): MD will never decode it, and P never starts its WAN stream (``roles.prefill``), so MD's
        leg is cut here, MD's reservation dropped (else MD holds its place and the gateway awaits
        a kv_ready that never comes, until the request timeout). The cut-off's "short remainders
        finish" rule is about transfers that feed MD's cache for a next turn; this one would only
        carry a finished request's prompt (RLD emits the token and frees). Whichever way the relay
        was planned: at once (:meth:`_launch_relayed`) or on MD's reply
        (:meth:`_launch_on_reservation`)."""
        if rep.get("fin") is not None:
            self._md_leg_lost(st, "finished by its first token", degraded=False)

    async def _launch_on_reservation(self, st: ReqState, prompt: list[int], sampling: dict, p: Peer,
                                     reserve: asyncio.Future, relay_possible: bool) -> None:
        """P prefills with its targets deferred while MD reserves; the plan (P->MD, P->D,
        P->RLD->MD or P->RLD) is made from what MD's cache holds when its reply returns."""
        t = self.cfg.request_timeout_s
        # P starts prefilling now, its targets deferred: which pipeline (and so which targets)
        # depends on what MD's cache holds, known a WAN round trip later when MD's reservation
        # returns; the round trip overlaps the prefill instead of preceding it (as a decode
        # instance's bootstrap does in SGLang's PD disaggregation)
        rld_name = rld = p_call = expect = None
        slots = [{"slot": "md", "deferred": True}]
        try:
            if relay_possible:
                # RLD learns the request beside P's prefill, not before it: P sends RLD nothing
                # until RLD's target (which waits for this reply) reaches it
                rld_name, rld = self._peer(st, ROLE_RELAY)
                expect = asyncio.ensure_future(rld.call(
                    Expect(st.trid, prompt, sampling).wire(), timeout=t))
                expect.add_done_callback(self._event_when_done(st, "rld_expect"))
                slots.insert(0, {"slot": "rld", "deferred": True})
            self._prefill_sent(st)
            p_call = asyncio.ensure_future(p.call(
                Prefill(st.trid, prompt, sampling, slots).wire(), timeout=t))
            p_call.add_done_callback(self._event_when_done(st, "p_first_token"))
            md_name, rep = await reserve
        except BaseException:
            _give_up(reserve, p_call, expect)
            st.md_settled.set()
            if p_call is not None:  # P may hold the prompt waiting for its targets: free it there
                self._spawn(self._abort_on(p, st.trid))
            if expect is not None:
                self._spawn(self._abort_on(rld, st.trid))
            raise
        # aborted while MD reserved (the client gone before its first byte, a sibling refused): P's
        # targets were never sent, so it will neither stream nor report this attempt's WAN bytes,
        # and the abort's write-off (_unplan_wan) may have run already: book none
        self._reserved(st, md_name, rep, p, book=not st.end.aborted)
        md = self.peer_named(md_name)
        md_wan = self.layout.get(md_name).dc == "B"
        md_first = int(rep["md_cached_pages"])
        st.pipeline = self._plan(st, len(prompt), st.md_cached_tokens) if relay_possible else (
            Pipeline.P_MD if md_wan else Pipeline.P_D)
        relay = st.pipeline == Pipeline.P_RLD_MD
        if relay_possible and st.pipeline not in (Pipeline.P_RLD_MD, Pipeline.P_RLD):
            # the plan does not use the RLD routed beside P (its slot is cancelled and its
            # reservation freed below): it is no longer this attempt's, so its loss is not either
            # (it re-prefilled a request that never needed it: Recovery._instance_lost), nor
            # its load (it counted in that RLD's inflight until the request ended)
            self._unassign_one(st, st.names.pop(ROLE_RELAY, None))
        md_target = Target(st.trid, "md", md_name, first_page=md_first, relay=relay).wire()
        rld_target = Target(st.trid, "rld", rld_name, first_page=0, relay=False).wire()
        try:
            if relay:
                await expect
                await p.send(rld_target)
                await p.send(md_target)
            elif st.pipeline == Pipeline.P_RLD:
                # the excluded pipeline (--allow-p-rld ablation / degraded): MD never gets the KV
                await expect
                await p.send(rld_target)
                await p.send(Target(st.trid, "md", md_name, cancelled=True).wire())
                await md.send(Drop(st.trid).wire())
                if md_wan:
                    self._unbook_md(st)
            else:
                await p.send(md_target)  # first: it is on the request's critical path
                if relay_possible:
                    # planned P->MD: RLD's slot is never filled and RLD frees its reservation
                    # (MD learns it from kv_done)
                    await p.send(Target(st.trid, "rld", cancelled=True).wire())
                    self._spawn(self._release_unused(rld, expect, st.trid))
            rep, _ = await p_call
            if relay:
                self._cut_md_if_first_token_ended(st, rep)
        except BaseException:
            _give_up(p_call, expect)
            raise
        self._prefilled(st)
        st.note_p_cached(int(rep["p_cached_tokens"]))

    def _claim_worth_waiting(self, claimed_tokens: int) -> bool:
        """Whether the KV of ``claimed_tokens`` prompt tokens still crossing to MD is worth a wait
        rather than a copy (``policy.siblings.claim_waits_for_kv``, at the live WAN rate and the
        configured RTT); KV size not known yet (no MD reply so far): waits."""
        if not self.kv_bytes_per_token:
            return True
        return claim_waits_for_kv(claimed_tokens * self.kv_bytes_per_token, self.wan_gbps_live or self.cfg.link.wan_gbps,
                                  self.cfg.link.wan_rtt_ms)

    def _claim_on_the_line(self, trid: str) -> bool:
        """Whether attempt ``trid`` (a claim in an MD's prefix index) is having its KV sent: its
        prefill returned and P knows where to send (MD's reservation reply is in, or a predicted
        send started at once)."""
        st = self.reqs.get(trid)  # keyed by the attempt's tier rid
        if st is None or st.trid != trid:
            return False
        ev = st.events
        return "prefilled" in ev and ("md_reserved" in ev or st.wan.predicted_pages is not None)

    def _sibling_md(self, st: ReqState) -> tuple[str, str, Pipeline] | None:
        """For another choice of a prompt whose first choice ``st.sibling_of`` is on its way to an
        MD across the WAN: ``(md name, first choice's tier rid, its pipeline)`` when this choice
        should reserve there after that KV arrived (pdd.policy.siblings: the copy would cost the
        line more than a round trip), else None (it routes and ships as any request). The first
        choice's planned bytes, or while its reservation is out its whole prompt's."""
        first = st.sibling_of
        if first is None or not self.cfg.policy.sibling_kv_once or first.end.aborted or first.recovery.md_lost \
                or first.attempt != 0:
            return None
        md_name = first.names.get(ROLE_MAIN)
        if md_name is None or "md_reserved" not in first.events or md_name not in self.peers or self.peers[md_name].closed \
                or not self._in_b(md_name):
            return None
        nbytes = first.wan.expected
        if not sibling_waits_for_kv(nbytes, st.siblings, self.wan_gbps_live or self.cfg.link.wan_gbps,
                                    self.cfg.link.wan_rtt_ms):
            return None
        return md_name, first.trid, first.pipeline

    def _sibling_pending(self, st: ReqState) -> bool:
        """Whether ``st`` is another choice of a prompt whose first choice, relayed, still waits
        for its MD reservation's reply (the first choice's start returned at P's first token):
        then which MD ``st`` reserves on, and whether after the first choice's KV
        (:meth:`_sibling_md`), is decided once that reply is in (``md_settled``)."""
        first = st.sibling_of
        return (first is not None and self.cfg.policy.sibling_kv_once and not first.md_settled.is_set()
                and not (first.end.aborted or first.recovery.md_lost) and first.attempt == 0
                and first.pipeline == Pipeline.P_RLD_MD)

    async def _release_unused(self, peer: Peer, expect: asyncio.Future, trid: str) -> None:
        """Free the reservation an instance the plan does not use made for ``trid`` (RLD of a
        P->MD plan), once its ``expect`` reply is in; best effort, off the request's path (an
        RLD lost meanwhile holds nothing)."""
        try:
            await expect
        except Exception:
            return
        await self._abort_on(peer, trid)

    @staticmethod
    def _prefill_sent(st: ReqState) -> None:
        """``st``'s prompt is sent to its prefill instance (P, or the colocated one) now: recorded
        once, for its first attempt (``st.events["prefill_sent"]``, where its queue time at the
        gateway ends and its prefill time begins: :func:`pdd.gateway.metrics.prefill_start`)."""
        st.events.setdefault("prefill_sent", time.perf_counter())

    @staticmethod
    def _event_when_done(st: ReqState, event: str):
        """A done-callback for a call made beside others: records ``event`` (e.g.
        ``p_first_token``, P's reply, which may come before MD's reservation) when the call
        succeeds, for the attempt that made it."""
        trid = st.trid

        def done(f: asyncio.Future) -> None:
            if st.trid == trid and not f.cancelled() and f.exception() is None:
                st.events[event] = time.perf_counter()

        return done

    async def _md_leg(self, st: ReqState, trid: str, reserve, p: Peer) -> None:
        """MD's part of an always-relayed plan (attempt ``trid``): once MD has reserved, tell P
        where to send the pages MD lacks. MD unreachable: its leg is lost and RLD finishes the
        request. The attempt given up meanwhile, or its transfer cut off before it was planned
        (RLD finished while the reservation was out): the reservation is dropped and no bytes are
        booked (P already cancelled MD's slot, so none would be sent)."""
        try:
            md_name, rep = await reserve
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if st.trid == trid:
                self._md_leg_lost(st, f"MD reservation failed: {type(e).__name__}: {e}")
            return
        try:
            md = self.peer_named(md_name)
        except ConnectionError as e:  # MD removed since it reserved: its reservation went with it
            if st.trid == trid:
                self._md_leg_lost(st, str(e))
            return
        if st.trid != trid or st.recovery.md_lost or st.end.aborted or st.wan.cut_off:
            try:  # the attempt was given up (or cut off) meanwhile: free the reservation
                await md.send((Abort(trid) if st.end.aborted else Drop(trid)).wire())
            except Exception:
                pass
            return
        pred = st.wan.predicted_pages
        self._reserved(st, md_name, rep, p, booked=st.wan.predicted_bytes if pred is not None else 0)
        if st.finished and not st.handoff.kv_ready:
            self._await_kv(st)
        md_first = int(rep["md_cached_pages"])
        msgs = [] if pred is not None else [Target(trid, "md", md_name, first_page=md_first, relay=True)]
        if pred is not None and md_first < pred:  # MD lacks pages the prediction skipped: P fills them
            self.totals["md_predicted_fills"] += 1
            msgs.append(Target(trid, "md_fill", md_name, first_page=md_first, last_page=pred, relay=True))
        elif st.wan.fill_slot:  # P holds an md_fill slot: nothing to fill
            msgs.append(Target(trid, "md_fill", md_name, skip=True))
        try:
            for msg in msgs:
                await p.send(msg.wire())
        except Exception as e:
            self._instance_lost(st, st.names.get(ROLE_PREFILL, ""), f"P unreachable: {e}")

    def _plans_from_index(self) -> bool:
        """pdd mode with a non-zero TTFT budget (``policy.pipeline.plans_from_index``): MD is
        chosen from the gateway's prefix index before P starts, and the relay is planned at once
        when the index says the missing KV does not fit the budget."""
        pol = self.cfg.policy
        return plans_from_index(self.cfg.mode, pol.pipeline_ttft_budget_ms, pol.allow_p_rld, pol.md_route_peek)

    def _always_relay(self) -> bool:
        """pdd mode with a zero TTFT budget: every request is planned P->RLD->MD."""
        pol = self.cfg.policy
        # an MD in datacenter A (a re-roled relay decoder, gateway.membership): wait for MD's choice
        md_in_a = any(s.dc == "A" for s in self.layout.by_role(ROLE_MAIN)) if self.cfg.mode == "pdd" else False
        return relays_every_request(self.cfg.mode, pol.pipeline_ttft_budget_ms, pol.allow_p_rld, md_in_a)

    def _prefilled(self, st: ReqState) -> None:
        """P's prefill returned (its first token sampled): the KV is on its way to the decoder.
        A relayed request's MD may have reported its KV (a small prompt), and its handoff begun,
        before P's reply was read here: the phase then moves on to where those events put it."""
        st.events["prefilled"] = time.perf_counter()
        self._unhold(st, st.names.get(ROLE_PREFILL))  # P's sequence has finished: its place is free
        st.to(Phase.TRANSFER, "prefilled")
        if self._relayed_live(st) and ("handoff_call" in st.events or st.handoff.takeover):
            st.to(Phase.HANDOFF, "handoff begun before P's reply was read")
        elif self._relayed_live(st) and st.handoff.kv_ready:
            st.to(Phase.RLD_DECODE, "MD had the KV before P's reply was read")
