"""The gateway's orchestrator: the one owner of every request's life across P, RLD and MD.

The life of a request (its phase, :class:`pdd.gateway.phase.Phase`, held on its
:class:`ReqState` and moved only by ``ReqState.to``), and which collaborator moves it:

  queued -> prefill      :meth:`Orchestrator.start_request` routes it (:mod:`.routing`) and
                         starts an attempt; the pipeline is planned (``policy.pipeline``)
  prefill -> transfer    a launcher (:mod:`.launch`: colocated, P->RLD, P->RLD->MD at once, or
                         planned on MD's reservation) returns once P sampled the first token;
                         MD's WAN bytes are booked and settled by :mod:`.wan_booking`
  transfer -> md_decode  (P->MD, P->D) / rld_decode (P->RLD, relayed: MD holds the KV, or MD's
                         leg was lost): the first token streams, or MD's ``kv_ready`` comes
  rld_decode -> handoff -> md_decode   :mod:`.handoff`: RLD's ids to MD, the client's switch
  colocated: prefill -> decode
  any -> recovery -> prefill   :mod:`.recovery`: an instance it needed was lost (new attempt)
  any -> done            :meth:`Orchestrator.stream` (its last token) or :meth:`Orchestrator.abort`

:meth:`Orchestrator.stream` yields the request's output tokens strictly by position, whichever
decoder produced them, so the switch from RLD to MD neither drops nor repeats a token.

Pipelines (PDD report, "Pipelines"):
  colocated:  C.generate
  P_D / P_MD: D.reserve || P.prefill(targets deferred) -> plan -> P.target(D from its cached
              pages) -> D decodes
  P_RLD_MD:   RLD.expect, then MD.reserve || P.prefill(targets deferred) -> plan ->
              P.target(RLD all pages, MD missing pages) -> RLD decodes -> MD.kv_ready ->
              RLD.handoff (ids) -> MD.extend -> MD decodes
  (with a zero TTFT budget the relay is planned at once: RLD's target is not deferred, MD's is)
  P's prefill never waits for MD's reservation (a WAN round trip): the plan needs what MD's
  cache holds, and P sends nothing before it knows where. Every message is a dataclass of
  :mod:`pdd.transfer.messages`.

Faults ("degrade, don't fail"; the rules live in :mod:`pdd.gateway.recovery`). A connection to an instance closes when the instance dies or its
heartbeat goes silent (``cfg.liveness``; a WAN outage is found that way). Each in-flight request
then loses only the legs it still needs (:meth:`Orchestrator._instance_lost`):
  - a leg no longer needed is ignored (P after its KV arrived, RLD after the handoff, ...);
  - MD's leg of a relayed request before the handoff: RLD finishes the request (degraded);
  - RLD lost while MD holds the KV: MD takes over from the tokens already streamed (extend);
  - otherwise the request is *recovered*: a new attempt (tier rid ``<rid>.<n>``) prefills the
    prompt plus every token already streamed (P's prefix cache holds the prompt) on live
    instances, always through a relay (P->RLD->MD, or P->RLD when no MD is reachable: degraded),
    and the stream continues at the next position (``ReqState.base``): no token dropped or
    repeated. The old attempt is aborted on every tier (pages freed once there; an unreachable
    tier frees them when its own heartbeat drops the gateway's connection).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from pdd.config import ClusterConfig
from pdd.policy.cutoff import should_cut_off
from pdd.policy.wan_estimate import WanEstimate
from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY, Layout
from pdd.transfer import rpc
from pdd.transfer.layout import wire_dtype
from pdd.transfer.messages import OMIT, Abort, AbortOk, Finish, Flush, KvReady, MessageError, ReqError, Stats, Tok, Toks
from pdd.transfer.messages import decode as decode_message
from pdd.gateway import recovery
from pdd.gateway.admission import refusal
from pdd.gateway.handoff import Handoffs
from pdd.gateway.launch import Launchers
from pdd.gateway.phase import Phase
from pdd.gateway.prefix_index import PrefixIndex
from pdd.gateway.recovery import Recovery
from pdd.gateway.routing import ROUTING_LOAD_SLACK, ROUTING_MIN_HIT_FRAC, Routing  # noqa: F401
from pdd.gateway.state import (  # noqa: F401  (re-exported: the API layer and tests import them from here)
    ABORT_CLIENT, ABORT_FAILED, ABORT_OUTCOMES, ABORT_REJECTED, ABORT_STOP, ATTEMPT_EVENTS, OUTCOMES, PHASES, InstanceLost,
    NoInstance, RequestFailed, ReqState, TokenOut, extend_message)
from pdd.gateway.wan_booking import WanBooking
from pdd.types import Pipeline, SamplingParams

log = logging.getLogger(__name__)


class Orchestrator(Routing, Launchers, WanBooking, Handoffs, Recovery):
    """The wiring: connections to every instance, the inbound handlers, a request's start,
    stream and end, stats; the collaborators (module docstring) do the rest through ``self``."""

    def __init__(self, cfg: ClusterConfig, lay: Layout):
        self.cfg, self.layout = cfg, lay
        self.peers: dict[str, rpc.Peer] = {}
        self.reqs: dict[str, ReqState] = {}
        self.totals = {"wan_bytes_expected": 0, "wan_bytes_planned": 0, "wan_bytes_cancelled": 0, "wan_bytes_sent": 0,
                       "wan_bytes_unreported": 0, "requests": 0,
                       "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0,  # OUTCOMES: each request once
                       "handoffs": 0, "rld_finished_first": 0, "cut_offs": 0,
                       "md_predicted_sends": 0, "md_predicted_fills": 0, "early_handoffs": 0}
        self.pipelines: dict[str, int] = {}
        self.page_bytes: int | None = None
        self.planned_wan: dict[str, int] = {}  # rid -> planned WAN bytes, until P's xfer_done
        self.planned_src: dict[str, str] = {}  # rid -> the P that will report it (forgotten if P dies)
        # replaced attempts' plans (recovery): (planned bytes, P), until P reports them or dies
        self.superseded_wan: dict[str, tuple[int, str]] = {}
        self._ids = itertools.count()
        # from the checkpoint's config, so the first request is planned with it too (a new user saw 0
        # there); MD's first reservation reply confirms it from its pool (_reserved)
        mc = checkpoint_config(cfg)
        self.kv_bytes_per_token: int | None = mc.kv_bytes_per_token(  # as it crosses: the narrower dtype
            wire_dtype(cfg.engine_for("prefill").dtype, cfg.engine_for("main_decode").dtype)) if mc is not None else None
        self._tasks: set = set()
        self.inflight: dict[str, int] = {}  # instance -> requests routed there and not finished
        self._rr: dict[str, int] = {}
        self._reconnecting: set[str] = set()
        # MD's measured KV receive rates, capped at the configured loss's TCP rate (policy.wan_estimate)
        self.wan_estimate = WanEstimate.for_line(cfg.link.wan_gbps, cfg.link.wan_rtt_ms, cfg.link.wan_loss_rate,
                                                 cfg.link.wan_mss_bytes)
        self.wan_gbps_live: float | None = self.wan_estimate.gbps  # its current value, Gbit/s (None: none yet)
        self.awaiting_kv: dict[str, tuple[str, str]] = {}  # finished trid -> (P, MD) until MD's kv_ready
        # what the gateway routed to each instance across the WAN (cache-aware routing without a peek)
        self.prefix_index: dict[str, PrefixIndex] = {
            sp.name: PrefixIndex(cfg.engine_for(sp.name).page_size, cfg.engine_for(sp.name).num_pages)
            for sp in lay.by_role(ROLE_MAIN) if sp.dc == "B"}
        # KV elements per token (2 x layers x kv heads x head dim), from MD's reservation replies:
        # with each tier's page size and dtype it gives a transfer's exact bytes (_wan_page_bytes)
        self.kv_elems_per_token: int | None = mc.kv_bytes_per_token("float32") // 4 if mc is not None else None
        from pdd.metrics import GatewayMetrics

        self.metrics = GatewayMetrics(self)

    # ------------------------------------------------------------------ connections
    def handlers(self) -> dict:
        return {"tok": self.on_tok, "toks": self.on_toks, "kv_ready": self.on_kv_ready, "xfer_done": self.on_xfer_done,
                "req_error": self.on_req_error, "wan_sample": self.on_wan_sample}

    async def start(self) -> None:
        for s in self.layout.engines:
            self.peers[s.name] = await self._connect(s.name, retries=200)
        self._watch = asyncio.get_running_loop().create_task(self._watch_closed())

    async def _watch_closed(self) -> None:
        """Every ``liveness.reconnect_interval_s`` seconds, try once to reach each instance whose
        connection is closed: a restarted instance rejoins (and ``/health`` says so) with no
        request routed to it; one still down costs a refused connect (a silent one, a connect
        timeout, one attempt at a time per instance)."""
        while True:
            await asyncio.sleep(self.cfg.liveness.reconnect_interval_s)
            try:
                await self._reconnect_closed()
            except Exception as e:  # never let the watcher die
                log.warning("reconnecting closed instances failed: %s", e)

    async def _connect(self, name: str, retries: int) -> rpc.Peer:
        from pdd.security import link_security

        ms = getattr(self, "membership", None)  # an instance being added is not in self.layout yet
        host, port, _wan = (ms.full if ms is not None else self.layout).address_from_a(name)
        lv = self.cfg.liveness
        peer = await rpc.connect(host, port, self.handlers(), role="gateway", instance="gateway",
                                 retries=retries, backoff_s=0.1, heartbeat_s=lv.heartbeat_interval_s,
                                 dead_after_s=lv.dead_after_s,
                                 **link_security(self.cfg, "gateway").client(name))  # mutual TLS
        peer.on_close(lambda p, n=name: self._peer_closed(n, p))
        return peer

    async def close(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        for p in self.peers.values():
            await p.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _peer_closed(self, name: str, peer: rpc.Peer | None = None) -> None:
        """A tier's connection dropped (the instance died, or its heartbeat went silent): each
        in-flight request routed there loses what it still needs of it, at once
        (:meth:`_instance_lost`; no silent stall)."""
        if peer is not None and self.peers.get(name) is not peer:
            return  # an old connection, already replaced
        why = "no heartbeat" if getattr(peer, "dead_peer", False) else "connection lost"
        self.totals["instances_lost"] = self.totals.get("instances_lost", 0) + 1
        if name in self.prefix_index:  # a restarted instance starts with an empty cache
            self.prefix_index[name].clear()
        for trid, src in list(self.planned_src.items()):
            if src == name:  # that P will never report the transfer's outcome: out of the balance
                self.planned_src.pop(trid, None)
                self._write_off(self.planned_wan.pop(trid, 0))
        for trid, (lost, src) in list(self.superseded_wan.items()):
            if src == name:
                self.superseded_wan.pop(trid, None)
                self._write_off(lost)
        for trid, (p_name, md_name) in list(self.awaiting_kv.items()):
            if p_name == name:
                self._kv_source_lost(trid)  # the KV will never arrive: MD drops what it holds
            elif md_name == name:
                self.awaiting_kv.pop(trid, None)
        for st in list(self.reqs.values()):
            self._instance_lost(st, name, f"instance {name} is unreachable ({why})")

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "unavailable", "down": [instances whose connection is
        closed]}: "degraded" while requests can still be served (a P and some decoder are up:
        recovery and routing go around the rest), "unavailable" when they cannot."""
        down = sorted(n for n, p in self.peers.items() if p.closed)

        def up(*roles: str) -> bool:
            return any(not self.peers[s.name].closed for r in roles for s in self.layout.by_role(r)
                       if s.name in self.peers)

        if self.cfg.mode == "colocated":
            serving = up(ROLE_COLOCATED)
        else:
            serving = up(ROLE_PREFILL) and up(ROLE_RELAY, ROLE_MAIN)
        status = "ok" if not down else ("degraded" if serving else "unavailable")
        return {"status": status, "mode": self.cfg.mode, "down": down}

    def _peer(self, st: ReqState | None, role: str) -> tuple[str, rpc.Peer]:
        """The instance of ``role`` serving ``st`` (routed at its start)."""
        name = st.names.get(role) if st is not None else None
        if name is None:
            name = self.layout.by_role(role)[0].name
        return name, self.peers[name]

    async def _reconnect(self, name: str) -> None:
        """Try once to reach a restarted instance again (it rejoins without restarting the rest)."""
        if name in self._reconnecting:
            return
        self._reconnecting.add(name)
        try:
            self.peers[name] = await self._connect(name, retries=0)
            log.info("reconnected to %s", name)
        except Exception:
            pass
        finally:
            self._reconnecting.discard(name)

    # ------------------------------------------------------------------ inbound
    async def on_tok(self, peer, h, payload):
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

    async def on_req_error(self, peer, h, payload):
        m = ReqError.decode(h)
        st = self.reqs.get(m.rid)
        if st is not None:
            st.error = m.error
            st.queue.put_nowait(None)
        return None

    async def on_kv_ready(self, peer, h, payload):
        rid = KvReady.decode(h).rid
        self.awaiting_kv.pop(rid, None)
        st = self.reqs.get(rid)
        md = peer  # the MD that has the KV
        if st is not None and st.md_lost:  # given up on MD's leg meanwhile: keep the prompt, free the rest
            await md.send(Finish(rid).wire())
            return None
        if st is None or st.finished:
            if st is not None:
                st.rld_finished_first = True
            self.totals["rld_finished_first"] += 1
            await md.send(Finish(rid).wire())
            return None
        st.kv_ready = True
        st.events["md_kv_ready"] = time.perf_counter()
        if self._relayed_live(st) and st.phase is Phase.TRANSFER:
            st.to(Phase.RLD_DECODE, "MD has the KV")
        if not st.handoff_started:
            asyncio.get_running_loop().create_task(self._handoff(st))
        return None

    # ------------------------------------------------------------------ start + stream
    def new_rid(self) -> str:
        """A fresh request id (``r<n>-<8 hex>``): the caller may name a request before starting it
        (``start_request(rid=...)``), so it can abort it while it starts."""
        return f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    async def start_request(self, prompt_ids: list[int], sp: SamplingParams, rid: str | None = None,
                            sibling_of: ReqState | None = None, siblings: int = 0) -> ReqState:
        """Plan and start a request (its first token sampled on P). An instance lost while
        starting (ConnectionError) starts it again on live instances, up to
        ``liveness.recovery_attempts`` times; a restart that then finds no live instance of a
        tier (NoInstance: the only P was killed, its supervisor restarts it in seconds) waits
        and tries again for up to ``recovery.RECOVERY_WAIT_S``, as a recovery does; then, or
        for any other error, RequestFailed. A request that finds no instance on its first try
        fails at once (the client gets a 503 with Retry-After: it did no work), unless it is
        another choice of a request whose first choice already started (``sibling_of``): that
        request did work, and its first choice waits for the tier (recovery), so this one waits
        with it instead of failing the whole request. ``sibling_of``: the first of ``siblings`` + 1
        choices of this prompt, already started (see :meth:`_sibling_md`)."""
        rid = rid or self.new_rid()
        st = ReqState(rid, len(prompt_ids), sp, trid=rid, prompt_ids=list(prompt_ids), sibling_of=sibling_of,
                      siblings=siblings)
        self.reqs[rid] = st
        self.totals["requests"] += 1
        waited = 0.0
        while True:
            try:
                st.to(Phase.PREFILL, f"attempt {st.attempt} starts")
                await self._launch(st, prompt_ids, force_relay=st.attempt > 0)
                break
            except Exception as e:
                retry = isinstance(e, ConnectionError) and st.attempt < self.cfg.liveness.recovery_attempts
                if retry:
                    log.warning("request %s: %s while starting; starting it again elsewhere", rid, e)
                    self._new_attempt(st, f"{type(e).__name__}: {e}")
                    continue
                if isinstance(e, NoInstance) and (st.attempt > 0 or sibling_of is not None) \
                        and waited < recovery.RECOVERY_WAIT_S:
                    waited += await self._retry_later(st, e)
                    continue
                self._unassign(st)
                # a tier refusing new work for now (the API answers 429) is not a failure
                await self.abort(st, ABORT_REJECTED if refusal(e) is not None else ABORT_FAILED)
                raise RequestFailed(f"request {rid} failed while starting: {e}") from e
        self.pipelines[st.pipeline.value] = self.pipelines.get(st.pipeline.value, 0) + 1
        return st

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
                        raise RequestFailed(f"request {st.rid}: no token for {self.cfg.request_timeout_s:.0f} s")
                    tok = False  # a buffered token is due
                if tok is None:
                    if st.lost and await self._recover(st):
                        continue  # a new attempt streams on from st.next_pos
                    raise RequestFailed(f"request {st.rid} failed: {st.error}")
                if pacer is not None and tok is not False:
                    pacer.feed(st, tok, 1000 * time.perf_counter(), self._next_tokens)
                for t in (self._next_tokens(st, tok) if pacer is None else pacer.due(1000 * time.perf_counter())):
                    now = time.perf_counter()
                    if t.pos == 0:
                        st.events["first_token"] = now
                        self.metrics.ttft.labels(st.pipeline.value).observe(now - st.t_arrival)
                    else:
                        self.metrics.itl.labels(st.pipeline.value, t.tier).observe(now - st.last_token_s)
                    st.last_token_s = now
                    if t.fin is not None:
                        st.finished = True
                        st.to(Phase.DONE, f"finished ({t.fin})")
                    yield t
            # (a finished loop after an abort elsewhere was counted by that abort: no-op then)
            if self._count_outcome(st, "completed") and st.degraded:  # ended on RLD: no MD was usable
                self.totals["degraded"] = self.totals.get("degraded", 0) + 1
        except BaseException as e:
            if not st.finished:
                # the client went away (the consumer cancelled or closed this stream), or the
                # request failed; the HTTP server cancels this scope, so every await here would
                # be cancelled too: abort in a task of its own (it counts the outcome; so does
                # this line, at once, in case the loop closes before the task runs)
                reason = ABORT_CLIENT if isinstance(e, (asyncio.CancelledError, GeneratorExit)) else ABORT_FAILED
                self._count_outcome(st, ABORT_OUTCOMES[reason])
                self._spawn(self.abort(st, reason))
            elif not st.aborted:  # its last token was yielded; the consumer just did not ask again
                self._count_outcome(st, "completed")
            raise
        finally:
            self.reqs.pop(st.trid, None)
            self._unassign(st)
            if st.finished and st.error is None and not st.aborted:
                self._record_decoded(st)
            if st.finished and st.error is None and st.pipeline == Pipeline.P_RLD_MD:
                await self._settle_relayed(st)

    def _record_decoded(self, st: ReqState) -> None:
        """``st`` ended on an MD across the WAN that decoded it to its last token: that MD caches
        the prompt and every output token whose KV it computed (all but the last), so the
        gateway's index of it records them too; a next turn (this prompt + this output + more)
        then matches them there (routing, and the predicted send's first page)."""
        md_name = st.names.get(ROLE_MAIN)
        ix = self.prefix_index.get(md_name) if md_name else None
        on_md = st.pipeline == Pipeline.P_MD or (st.pipeline == Pipeline.P_RLD_MD and st.switch_pos is not None
                                                 and not st.md_diverged and not st.md_lost)
        if ix is not None and on_md and st.base == 0 and st.emitted:
            ix.insert(list(st.prompt_ids) + list(st.emitted[:-1]))

    async def _settle_relayed(self, st: ReqState) -> None:
        """After a relayed request ended at the client: cut off a WAN transfer still running
        (anomaly filter), or stop whichever decoder is still going."""
        if st.md_lost:
            return  # MD's leg was given up: dropped there already
        if should_cut_off(rld_finished=True, md_kv_complete=st.kv_ready, remaining_wan_s=self._remaining_wan_s(st),
                          min_remaining_s=self.cfg.policy.cutoff_min_remaining_s):
            if self.cfg.policy.cutoff:
                await self._cut_off(st)
                return
            self._await_kv(st)
            return  # else: MD's kv_ready finds the request gone and tells MD to keep the KV
        if not st.kv_ready:
            self._await_kv(st)
            return  # the transfer finishes; on_kv_ready tells MD to keep the prompt's KV
        md_name, md = self._peer(st, ROLE_MAIN)
        _, rld = self._peer(st, ROLE_RELAY)
        try:
            if st.switch_pos is None:  # RLD finished it (MD keeps the prompt's KV)
                await md.send(Finish(st.trid).wire())
            await rld.send(Abort(st.trid).wire())
        except Exception as e:
            log.warning("settling %s failed: %s", st.rid, e)

    def _await_kv(self, st: ReqState) -> None:
        """A finished relayed request whose KV is still on its way to MD (MD keeps the prompt's
        pages when it lands): remembered until MD's kv_ready, so that if P is lost meanwhile
        the reservation on MD is dropped instead of waiting forever."""
        p_name, md_name = st.names.get(ROLE_PREFILL), st.names.get(ROLE_MAIN)
        if p_name and md_name:
            self.awaiting_kv[st.trid] = (p_name, md_name)

    def _count_outcome(self, st: ReqState, outcome: str) -> bool:
        """Count ``st`` in ``totals[outcome]`` (one of :data:`OUTCOMES`) unless it was counted
        already; True if this call counted it. Raises ``ValueError`` for another outcome."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}; expected one of {OUTCOMES}")
        if st.outcome is not None:
            return False
        st.outcome = outcome
        self.totals[outcome] = self.totals.get(outcome, 0) + 1
        return True

    async def abort(self, st: ReqState, reason: str) -> None:
        """End ``st`` now: tell every engine to drop it and free its pages (idempotent there;
        an unreachable engine is logged, not raised), and count its outcome unless already
        counted: ``reason`` :data:`ABORT_STOP` (a stop string ended it at the gateway) counts
        "completed", :data:`ABORT_CLIENT` (client disconnected) "cancelled", :data:`ABORT_FAILED`
        "failed", :data:`ABORT_REJECTED` (a tier refused it while starting) "rejected". The first
        abort's reason is kept in ``st.abort_reason``. Raises ``ValueError``
        for an unknown ``reason`` (before anything is changed)."""
        if reason not in ABORT_OUTCOMES:
            raise ValueError(f"unknown abort reason {reason!r}; expected one of {tuple(ABORT_OUTCOMES)}")
        if st.abort_reason is None:
            st.abort_reason = reason
        self._count_outcome(st, ABORT_OUTCOMES[reason])
        st.finished = st.aborted = True
        st.to(Phase.DONE, f"aborted ({reason})")
        st.md_settled.set()
        self.reqs.pop(st.trid, None)
        await self._abort_tiers(st)

    async def _abort_tiers(self, st: ReqState) -> None:
        """Abort ``st``'s current attempt on every reachable instance at once (as
        ``_abort_everywhere``); when its P answers that it never streamed the attempt's KV (aborted
        while prefilling, or before its prefill arrived: :class:`AbortOk` ``streams`` False), P will
        never report that transfer, so its planned WAN bytes leave the planned and expected totals
        now (``_unplan_wan``; idempotent)."""
        trid, p_name = st.trid, st.names.get(ROLE_PREFILL)
        names = [n for n, p in list(self.peers.items()) if not p.closed]
        reps = await asyncio.gather(*(self.peers[n].call(Abort(trid).wire(), timeout=10) for n in names),
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

    # ------------------------------------------------------------------ stats
    async def stats(self) -> dict:
        await self._reconnect_closed()
        inst = {}
        for name, peer in self.peers.items():
            try:
                rep, _ = await peer.call(Stats().wire(), timeout=10)
                inst[name] = {k: v for k, v in rep.items() if k not in ("t", "cid", "reply")}
            except Exception as e:
                inst[name] = {"error": str(e)}
        out = {"mode": self.cfg.mode, "instances": inst, "totals": dict(self.totals), "pipelines": dict(self.pipelines)}
        # as P reported them per transfer (xfer_done): kept by the gateway, so a restarted P's
        # fresh counters do not reset it (each instance's own count is in instances[...])
        out["wan_bytes"] = self.totals["wan_bytes_sent"]
        out["wan_bytes_expected"] = self.totals["wan_bytes_expected"]
        out["wan_gbps_live"] = self.wan_gbps_live
        out["transfers_pending"] = len(self.planned_wan)  # WAN plans whose outcome P has not reported yet
        out["wan_line_bytes"] = 0
        if self.layout.link_control_port is not None:
            try:
                from pdd.transfer.link import query_stats

                ls = await query_stats(self.cfg.host, self.layout.link_control_port)
                out["link"] = ls
                out["wan_line_bytes"] = int(ls.get("bytes_a_to_b", 0)) + int(ls.get("bytes_b_to_a", 0))
            except Exception as e:
                out["link"] = {"error": str(e)}
        return out

    async def _reconnect_closed(self) -> None:
        """Try once to reach every instance whose connection is closed (restarted, or back
        after a WAN outage)."""
        await asyncio.gather(*(self._reconnect(n) for n, p in list(self.peers.items()) if p.closed))

    async def flush(self, settle_s: float = 10.0, poll_s: float = 0.05) -> dict:
        """Empty every instance's prefix cache and count the pages still in use (``leaked_pages``).

        A request the client has seen finish may still be live on an instance for a while (a
        cut-off transfer's cancel crossing the WAN behind bytes already on the line, an MD
        releasing after its last token): those pages are not leaked. So when the gateway has no
        request in flight, the flush is repeated every ``poll_s`` until no instance reports a
        live request, for at most ``settle_s`` seconds; a live request left after that, with the
        gateway idle, is orphaned and its pages count as leaked. With requests in flight there is
        no wait: instances holding live requests are listed in ``busy`` and only the others'
        pages are counted. An instance that cannot be asked (down, silent) is listed in
        ``unreachable`` and ``leaked_pages`` is None (unknown): its pages cannot be counted, and
        a 0 that left them out would read as "nothing leaked"."""
        await self._reconnect_closed()
        deadline = time.monotonic() + settle_s
        while True:
            inst: dict = {}
            for name, peer in self.peers.items():
                try:
                    rep, _ = await peer.call(Flush().wire(), timeout=30)
                except Exception as e:
                    inst[name] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                inst[name] = {"pages_total": rep["pages_total"], "pages_free": rep["pages_free"],
                              "live_requests": rep.get("live_requests", 0)}
            busy = sorted(n for n, v in inst.items() if v.get("live_requests")) if self.reqs else []
            live = any(v.get("live_requests") for v in inst.values())
            if not live or self.reqs or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_s)
        for ix in self.prefix_index.values():  # the instances' caches are empty now
            ix.clear()
        unreachable = sorted(n for n, v in inst.items() if "pages_total" not in v)
        leaked = None if unreachable else sum(int(v["pages_total"]) - int(v["pages_free"])
                                              for n, v in inst.items() if n not in busy)
        return {"instances": inst, "leaked_pages": leaked, "busy": busy, "unreachable": unreachable}


def checkpoint_config(cfg: ClusterConfig):
    """The :class:`pdd.engine.config.ModelConfig` of ``cfg``'s checkpoint, as the engines read it
    (config.json with generation_config.json's EOS ids), or None when it cannot be read (the
    engines would not start either). No torch import."""
    from pdd.engine.config import ModelConfig

    try:
        return ModelConfig.from_pretrained(cfg.model_path)
    except Exception:
        return None
