"""The gateway's per-request state machine across P, RLD and MD (the request's one owner).

``generate()`` plans a request (``policy.pipeline``), drives every tier over persistent
connections, and yields the request's output tokens strictly by position, whichever decoder
produced them, so the switch from RLD to MD neither drops nor repeats a token.

Pipelines (PDD report, "Pipelines"):
  colocated:  C.generate
  P_D / P_MD: D.reserve || P.prefill(targets deferred) -> plan -> P.target(D from its cached
              pages) -> D decodes
  P_RLD_MD:   RLD.expect, then MD.reserve || P.prefill(targets deferred) -> plan ->
              P.target(RLD all pages, MD missing pages) -> RLD decodes -> MD.kv_ready ->
              RLD.handoff (ids) -> MD.extend -> MD decodes
  (with a zero TTFT budget the relay is planned at once: RLD's target is not deferred, MD's is)
  P's prefill never waits for MD's reservation (a WAN round trip): the plan needs what MD's
  cache holds, and P sends nothing before it knows where.

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
from dataclasses import asdict

from pdd.config import ClusterConfig
from pdd.policy.cutoff import should_cut_off
from pdd.policy.handoff import early_handoff_delay_s
from pdd.policy.pipeline import PipelineInputs, choose_pipeline, relays_every_request
from pdd.policy.routing import InstanceLoad, choose_instance
from pdd.policy.siblings import sibling_waits_for_kv
from pdd.policy.wan_estimate import WanEstimate
from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY, Layout
from pdd.transfer import rpc
from pdd.transfer.kv import prompt_kv_bytes
from pdd.transfer.messages import (OMIT, Abort, Cancel, Drop, Expect, Finish, Flush, Generate, Handoff, KvReady, Peek,
                                   Prefill, ReqError, Reserve, Stats, Target, Tok, Toks, WanSample, XferDone)
from pdd.gateway import recovery
from pdd.gateway.recovery import Recovery
from pdd.gateway.admission import refusal
from pdd.gateway.phase import Phase
from pdd.gateway.prefix_index import PrefixIndex
from pdd.gateway.state import (  # noqa: F401  (re-exported: the API layer and tests import them from here)
    ABORT_CLIENT, ABORT_FAILED, ABORT_OUTCOMES, ABORT_REJECTED, ABORT_STOP, ATTEMPT_EVENTS, OUTCOMES, PHASES, InstanceLost,
    NoInstance, RequestFailed, ReqState, TokenOut, extend_message)
from pdd.types import Pipeline, SamplingParams

log = logging.getLogger(__name__)


# cache-aware routing (as in the simulator): affinity only for a prefix covering at least half the
# prompt (a shared system-prompt block alone would pull all traffic to one instance), and never to
# an instance more than this many requests busier than the idlest
ROUTING_MIN_HIT_FRAC = 0.5
ROUTING_LOAD_SLACK = 4


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


class Orchestrator(Recovery):
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
        self.kv_bytes_per_token: int | None = mc.kv_bytes_per_token(cfg.engine.dtype) if mc is not None else None
        self._tasks: set = set()
        self.inflight: dict[str, int] = {}  # instance -> requests routed there and not finished
        self._rr: dict[str, int] = {}
        self._reconnecting: set[str] = set()
        self.wan_estimate = WanEstimate()  # MD's measured KV receive rates (policy.wan_estimate)
        self.wan_gbps_live: float | None = None  # its current value, Gbit/s
        self.awaiting_kv: dict[str, tuple[str, str]] = {}  # finished trid -> (P, MD) until MD's kv_ready
        # what the gateway routed to each instance across the WAN (cache-aware routing without a peek)
        self.prefix_index: dict[str, PrefixIndex] = {
            sp.name: PrefixIndex(cfg.engine.page_size, cfg.engine.num_pages)
            for sp in lay.by_role(ROLE_MAIN) if sp.dc == "B"}
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

        host, port, _wan = self.layout.address_from_a(name)
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

    async def _route(self, role: str, prompt: list[int]) -> str:
        """Choose an instance of ``role`` for a request: :meth:`_route_hit`'s name."""
        return (await self._route_hit(role, prompt))[0]

    async def _route_hit(self, role: str, prompt: list[int]) -> tuple[str, int | None]:
        """Choose an instance of ``role`` for a request (``policy.routing``); return its name and,
        for an instance the gateway keeps a :class:`PrefixIndex` of (an MD across the WAN), the
        prompt tokens that index held before this request was recorded there (else None).

        cache_aware (P, MD): each live candidate reports how many of the prompt's tokens its radix
        cache holds (``peek``, no lock) and ``choose_instance`` takes the longest prefix within a
        load slack; RLD holds no cache, so it is chosen by load. An MD across the WAN is not
        asked (a round trip before the reservation): the gateway's record of what it routed there
        (:class:`PrefixIndex`) stands for its cache, unless ``policy.md_route_peek``. Load =
        requests the gateway has in flight there. Instances whose connection is down are skipped
        (and reconnected).
        """
        specs = self.layout.by_role(role)
        live = [sp for sp in specs if not self.peers[sp.name].closed]
        for sp in specs:
            if self.peers[sp.name].closed:
                self._spawn(self._reconnect(sp.name))
        if not live:
            raise NoInstance(f"no {role} instance is reachable")
        if len(live) == 1:
            return live[0].name, self._record_route(live[0].name, prompt)
        policy = self.cfg.policy.routing
        hits = [0] * len(live)
        if policy == "cache_aware" and role != ROLE_RELAY:
            index = role == ROLE_MAIN and not self.cfg.policy.md_route_peek
            ask = [sp for sp in live if not (index and sp.name in self.prefix_index)]
            reps = await asyncio.gather(*(self.peers[sp.name].call(Peek(prompt).wire(), timeout=10)
                                          for sp in ask), return_exceptions=True)
            peeked = {sp.name: (int(r[0].get("hit_tokens", 0)) if not isinstance(r, BaseException) else -1)
                      for sp, r in zip(ask, reps)}
            hits = [peeked[sp.name] if sp.name in peeked else self.prefix_index[sp.name].match(prompt) for sp in live]
        elif policy == "cache_aware":
            policy = "load"
        cands = [InstanceLoad(sp.name, running=self.inflight.get(sp.name, 0), prefix_hit_tokens=max(0, h))
                 for sp, h in zip(live, hits)]
        rr = self._rr.get(role, 0)
        self._rr[role] = rr + 1
        name = live[choose_instance(cands, policy, rr, load_slack=ROUTING_LOAD_SLACK, prompt_tokens=len(prompt),
                                    min_hit_frac=ROUTING_MIN_HIT_FRAC)].name
        return name, self._record_route(name, prompt)

    def _record_route(self, name: str, prompt: list[int]) -> int | None:
        """``prompt`` was routed to ``name``: its whole pages will be in that instance's cache.
        Returns the prompt tokens the index held before (None: no index for ``name``)."""
        ix = self.prefix_index.get(name)
        if ix is None:
            return None
        held = ix.match(prompt)
        ix.insert(prompt)
        return held

    def _assign(self, st: ReqState, *roles: str) -> None:
        for role in roles or tuple(st.names):
            name = st.names.get(role)
            if name is not None and name not in st.assigned:
                st.assigned.add(name)
                self.inflight[name] = self.inflight.get(name, 0) + 1

    def _unassign(self, st: ReqState) -> None:
        for name in st.assigned:
            self.inflight[name] = max(0, self.inflight.get(name, 0) - 1)
        st.assigned.clear()

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

    async def on_xfer_done(self, peer, h, payload):
        m = XferDone.decode(h)
        st = self.reqs.get(m.rid)
        wan = sum(v for k, v in m.bytes.items() if self._in_b(k))
        # bytes of pages whose sending was cancelled (cut-off): expected = planned - cancelled
        planned = self.planned_wan.pop(m.rid, None)
        self.planned_src.pop(m.rid, None)
        if planned is None:  # an attempt that recovery replaced
            planned = self.superseded_wan.pop(m.rid, (0, ""))[0]
        unsent = sum(planned if v < 0 else v for k, v in m.unsent.items() if self._in_b(k))
        if unsent:
            self.totals["wan_bytes_cancelled"] += unsent
            self.totals["wan_bytes_expected"] -= unsent
        self.totals["wan_bytes_sent"] += wan
        if m.rid in self.awaiting_kv and m.errors.get(self.awaiting_kv[m.rid][1]):
            self._kv_source_lost(m.rid)  # MD's KV stream failed after the request ended
        if st is not None:
            st.wan_bytes = wan
            md_name = st.names.get(ROLE_MAIN)
            if (st.trid == m.rid and md_name is not None and md_name in m.bytes
                    and not m.errors.get(md_name) and not m.unsent.get(md_name)):
                st.kv_sent = True
                if (self.cfg.policy.early_handoff and st.pipeline == Pipeline.P_RLD_MD and self._in_b(md_name)
                        and not (st.kv_ready or st.finished or st.md_lost or st.cut_off or st.handoff_started)):
                    self._spawn(self._handoff_at_landing(st))
            for name, err in m.errors.items():
                # a KV stream failed (target dead or silent, stalled, refused at the handshake, a
                # frame that failed its MAC closed the fast path): that leg is lost, recover now
                # instead of waiting for the request timeout
                self._instance_lost(st, name, f"KV transfer to {name} failed: {err}")
        return None

    def _in_b(self, name: str) -> bool:
        """Whether instance ``name`` is in datacenter B (False for a slot never given an instance)."""
        try:
            return self.layout.get(name).dc == "B"
        except KeyError:
            return False

    async def on_wan_sample(self, peer, h, payload):
        """MD's receive rate of one request's KV (first frame to last), Gbit/s: the live WAN
        estimate the pipeline policy reads (policy.wan_estimate). Sender-side timings would measure socket
        buffers, not the line."""
        self.wan_gbps_live = self.wan_estimate.add(float(WanSample.decode(h).gbps))
        return None

    def _remaining_wan_s(self, st: ReqState) -> float:
        """Expected seconds to finish ``st``'s WAN transfer: its planned bytes at the live (else
        configured) rate, less the time since P started streaming it."""
        started = st.events.get("prefilled")
        elapsed = time.perf_counter() - started if started is not None else 0.0
        return early_handoff_delay_s(st.wan_bytes_expected, self.wan_gbps_live or self.cfg.link.wan_gbps, elapsed)

    async def _cut_off(self, st: ReqState) -> None:
        """Anomaly filter (PDD report): RLD finished before MD's KV arrived, so stop the WAN
        transfer; MD frees what it received on ``kv_cancel``."""
        md_name, md = self._peer(st, ROLE_MAIN)
        _, p = self._peer(st, ROLE_PREFILL)
        st.cut_off = True
        self.totals["cut_offs"] += 1
        for peer, msg in ((p, Cancel(st.trid, md_name).wire()), (md, Drop(st.trid).wire())):
            try:
                await peer.send(msg)
            except Exception as e:  # that tier is gone: its state died with it
                log.warning("cut-off of %s failed: %s", st.rid, e)

    # ------------------------------------------------------------------ handoff
    async def _handoff_at_landing(self, st: ReqState) -> None:
        """Early handoff (``policy.early_handoff``): P wrote MD's KV to the WAN, so start the
        handoff when that KV is predicted to land on MD less the WAN's one-way delay: RLD's ids
        then cross while the KV's last bytes do, instead of a crossing after MD's kv_ready has
        crossed back. Landing = when P began streaming + the transfer's bytes at the live WAN
        rate (:meth:`_remaining_wan_s`). A prediction that is early makes MD's extend wait for
        the KV (the client's switch gap grows by the error); a late one hands over at kv_ready."""
        trid = st.trid

        def moot() -> bool:
            return st.trid != trid or st.kv_ready or st.finished or st.md_lost or st.cut_off or st.handoff_started or st.lost

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
        st.handoff_early = True
        await self._handoff(st)

    async def _handoff(self, st: ReqState) -> None:
        """Extend-Decode handoff, one-shot or catch-up (RLD decides each round by its load).

        Each round RLD returns every output id so far. Catch-up rounds before the final one
        are absorbed by MD (KV computed, no sampling) while RLD keeps decoding; after the final
        round MD extends, samples and decodes on, and :meth:`stream` switches the client to MD
        at the first position MD reaches, once MD's tokens match what was streamed. One-shot:
        RLD stops at once, MD continues at the next position.
        """
        if st.handoff_started:
            return
        st.handoff_started = True
        trid = st.trid
        try:
            await self._handoff_rounds(st)
        except Exception as e:
            if st.trid != trid or st.finished or st.lost:
                return
            # a tier died mid-handoff; its closed connection tells _instance_lost what to do
            log.warning("request %s: handoff failed: %s", st.rid, e)
            for role in (ROLE_RELAY, ROLE_MAIN):
                name = st.names.get(role)
                if name is not None and self.peers[name].closed:
                    self._instance_lost(st, name, f"instance {name} is unreachable ({e})")
                    return
            self._fail_lost(st, f"handoff failed: {e}")

    async def _handoff_rounds(self, st: ReqState) -> None:
        md_name, md = self._peer(st, ROLE_MAIN)
        _, rld = self._peer(st, ROLE_RELAY)
        t = self.cfg.request_timeout_s
        k = self.cfg.policy.handoff_min_tokens
        while k and st.next_pos < k and not st.finished and not st.md_lost:
            await asyncio.sleep(0.001)
        rounds, sent = 0, 0
        while True:
            if st.md_lost or st.takeover:
                return  # MD's leg was given up (RLD finishes), or MD took over already
            if st.finished:
                rep = {"finished": True}
            else:
                st.events["handoff_call"] = time.perf_counter()
                if self._relayed_live(st) and st.phase in (Phase.TRANSFER, Phase.RLD_DECODE):
                    st.to(Phase.HANDOFF, "RLD asked for its ids")
                rep, _ = await rld.call(Handoff(st.trid, sent, rounds).wire(), timeout=t)
            if rep.get("finished"):  # RLD finished the request first: MD keeps the prompt's KV
                st.rld_finished_first = True
                self.totals["rld_finished_first"] += 1
                await md.send(Finish(st.trid).wire())
                return
            ids = rep["token_ids"]
            rounds += 1
            if "inputs" in rep:
                st.decisions.append({"policy": "handoff", "inputs": rep["inputs"],
                                     "result": {"mode": rep["mode"], "final": rep["final"]}})
            st.handoff_mode, st.handoff_rounds = rep["mode"], rounds
            st.handoff_tokens = len(ids)
            if rep["final"]:
                st.md_start = len(ids)
                st.events["handoff"] = time.perf_counter()
                st.events["handoff_rld_ms"] = st.events["handoff"] - float(rep.get("rld_ms", 0.0)) / 1000
                self.totals["handoffs"] += 1
                if st.handoff_early:
                    self.totals["early_handoffs"] += 1
                key = f"handoffs_{rep['mode']}"
                self.totals[key] = self.totals.get(key, 0) + 1
                await md.send(extend_message(st.trid, ids, final=True))
                return
            r, _ = await md.call(extend_message(st.trid, ids, final=False), timeout=t)
            if not r.get("found", True):
                return
            sent = len(ids) - 1  # MD holds all but the newest id (see MainDecodeInstance.on_extend)
            st.extend_extra_step_ms.append(float(r.get("extra_step_ms", 0.0)))

    # ------------------------------------------------------------------ plan + drive
    def _plan(self, st: ReqState, prompt_len: int, md_cached_tokens: int, md_available: bool = True) -> Pipeline:
        mode = self.cfg.mode
        inp = PipelineInputs(
            mode=mode,
            prompt_tokens=prompt_len,
            md_cached_tokens=md_cached_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token or 0,
            wan_gbps_estimate=self.wan_gbps_live or self.cfg.link.wan_gbps,
            wan_rtt_ms=self.cfg.link.wan_rtt_ms,
            ttft_budget_ms=self.cfg.policy.pipeline_ttft_budget_ms,
            allow_p_rld=self.cfg.policy.allow_p_rld,
            md_available=md_available,
        )
        out = choose_pipeline(inp)
        st.decisions.append({"policy": "pipeline", "inputs": asdict(inp), "result": out.value})
        return out

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
        rid = rid or f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
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
            st.pipeline = Pipeline.COLOCATED
            st.names[ROLE_COLOCATED] = await self._route(ROLE_COLOCATED, prompt)
            self._assign(st)
            _, c = self._peer(st, ROLE_COLOCATED)
            rep, _ = await c.call(Generate(st.trid, prompt, sampling).wire(), timeout=t)
            st.to(Phase.DECODE, "first token sampled")
            st.p_cached_tokens = int(rep["p_cached_tokens"])
            return
        rld_specs = self.layout.by_role(ROLE_RELAY)
        relay_possible = bool(rld_specs)
        md_specs = self.layout.by_role(ROLE_MAIN)
        md_live = any(not self.peers[sp_.name].closed for sp_ in md_specs)
        if relay_possible and md_live and all(self.peers[sp_.name].closed for sp_ in rld_specs):
            # no RLD is reachable (dead, restarting) but an MD is: plan P->MD rather than fail
            for sp_ in rld_specs:
                self._spawn(self._reconnect(sp_.name))
            relay_possible = False
        st.names[ROLE_PREFILL] = await self._route(ROLE_PREFILL, prompt)
        if relay_possible:
            st.names[ROLE_RELAY] = await self._route(ROLE_RELAY, prompt)
        _, p = self._peer(st, ROLE_PREFILL)
        if relay_possible and not md_live:
            # degraded: no MD is reachable, RLD completes the request (counted apart)
            for sp_ in md_specs:
                self._spawn(self._reconnect(sp_.name))
            st.pipeline = self._plan(st, len(prompt), 0, md_available=False)
            st.degraded = True
            self._assign(st, ROLE_PREFILL, ROLE_RELAY)
            rld_name, rld = self._peer(st, ROLE_RELAY)
            await rld.call(Expect(st.trid, prompt, sampling).wire(), timeout=t)
            st.events["rld_expect"] = time.perf_counter()
            rep, _ = await p.call(Prefill(st.trid, prompt, sampling,
                                          [{"name": rld_name, "first_page": 0, "relay": False}]).wire(), timeout=t)
            self._prefilled(st)
            st.p_cached_tokens = int(rep["p_cached_tokens"])
            return

        trid, names = st.trid, st.names  # this attempt's (a recovery makes new ones)
        sib = self._sibling_md(st) if st.attempt == 0 else None
        relay_sibling = sib is not None and sib[2] == Pipeline.P_RLD_MD
        # a relayed plan made before MD's reservation may also start MD's WAN send before it: P
        # sends the pages the gateway's prefix index says MD lacks at once, and only the pages
        # MD turns out to lack besides (a fill) wait for the reservation's reply
        predicted = (relay_possible and self.cfg.policy.md_predicted_send and self._always_relay() and not force_relay
                     and sib is None and self.page_bytes is not None)
        st.md_predicted_pages, st.md_predicted_bytes, st.md_fill_slot = None, 0, False  # this attempt's own

        async def route_and_reserve():
            msg = Reserve(trid, prompt, sampling)
            held = None
            if sib is not None:  # the first choice's MD, once the prompt's KV is there
                md_name_ = sib[0]
                msg.after = sib[1]
            else:  # choosing MD may cost a WAN round trip (peek), so it runs beside P's prefill
                md_name_, held = await self._route_hit(ROLE_MAIN, prompt)
            if st.trid != trid:
                raise ConnectionError(f"attempt {trid} was given up")
            names[ROLE_MAIN] = md_name_
            self._assign(st, ROLE_MAIN)
            if not (predicted and held is not None):
                rep_, _ = await self.peers[md_name_].call(msg.wire(), timeout=t)
                return md_name_, rep_
            pred = held // self.cfg.engine.page_size
            msg.first_page = pred
            call = asyncio.ensure_future(self.peers[md_name_].call(msg.wire(), timeout=t))
            try:
                self._book_predicted(st, pred, p)
                await p.send(Target(trid, "md", md_name_, first_page=pred, relay=True).wire())
            except BaseException:
                _give_up(call)
                raise
            rep_, _ = await call
            return md_name_, rep_

        self._assign(st, ROLE_PREFILL, ROLE_RELAY)
        reserve = asyncio.ensure_future(route_and_reserve())
        # a sibling of a relayed choice is relayed at once too (relay_sibling): its MD reservation
        # waits for the first choice's KV, and the relay's first token must not
        if relay_possible and (self._always_relay() or force_relay or relay_sibling):
            # the relay is planned whatever MD holds: P starts now and learns MD's part of the
            # plan (which MD, which pages) a WAN round trip later, so TTFT never waits on the WAN
            # (MD's cached tokens are not known yet; with a zero budget they do not matter). MD's
            # leg runs on its own: if MD cannot be reached, RLD finishes the request.
            rld_name, rld = self._peer(st, ROLE_RELAY)
            md_leg = None
            if force_relay or relay_sibling:
                st.pipeline = Pipeline.P_RLD_MD
            else:
                st.pipeline = self._plan(st, len(prompt), 0)
            st.md_fill_slot = predicted
            p_call = None
            try:
                await rld.call(Expect(st.trid, prompt, sampling).wire(), timeout=t)
                st.events["rld_expect"] = time.perf_counter()
                p_call = asyncio.ensure_future(p.call(
                    Prefill(st.trid, prompt, sampling,
                            [{"name": rld_name, "first_page": 0, "relay": False}, {"slot": "md", "deferred": True}]
                            + ([{"slot": "md_fill", "deferred": True}] if predicted else [])).wire(), timeout=t))
                md_leg = asyncio.ensure_future(self._md_leg(st, trid, reserve, p))
                rep, _ = await p_call
                if rep.get("fin") is not None:
                    # finished by its first token (EOS, a stop id, max_tokens 1): MD will never
                    # decode it, so its WAN transfer is cut before it starts (P waits for MD's
                    # part of the plan): the cut-off's "short remainders finish" rule is about
                    # transfers that feed MD's cache for a next turn; this one would only
                    # carry a finished request's prompt (RLD emits the token and frees)
                    self._md_leg_lost(st, "finished by its first token", degraded=False)
            except BaseException:
                _give_up(reserve, md_leg)
                if p_call is None or (p_call.done() and not p_call.cancelled()
                                      and isinstance(p_call.exception(), rpc.RemoteError)):
                    # P never started this attempt's streams (RLD refused or was lost before P was
                    # asked, or P refused the prefill): the WAN bytes planned for it (a predicted
                    # MD send's are booked before any reply) will never be sent nor reported
                    self._unplan_wan(st.trid)
                raise
            self._prefilled(st)
            st.p_cached_tokens = int(rep["p_cached_tokens"])
            return
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
            p_call = asyncio.ensure_future(p.call(
                Prefill(st.trid, prompt, sampling, slots).wire(), timeout=t))
            p_call.add_done_callback(self._event_when_done(st, "p_first_token"))
            md_name, rep = await reserve
        except BaseException:
            _give_up(reserve, p_call, expect)
            if p_call is not None:  # P may hold the prompt waiting for its targets: free it there
                self._spawn(self._abort_on(p, st.trid))
            if expect is not None:
                self._spawn(self._abort_on(rld, st.trid))
            raise
        self._reserved(st, md_name, rep, p)
        md = self.peers[md_name]
        md_wan = self.layout.get(md_name).dc == "B"
        md_first = int(rep["md_cached_pages"])
        st.pipeline = self._plan(st, len(prompt), st.md_cached_tokens) if relay_possible else (
            Pipeline.P_MD if md_wan else Pipeline.P_D)
        relay = st.pipeline == Pipeline.P_RLD_MD
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
                    self.totals["wan_bytes_expected"] -= st.wan_bytes_expected
                    self.totals["wan_bytes_planned"] -= st.wan_bytes_expected
                    self.planned_wan.pop(st.trid, None)
                    self.planned_src.pop(st.trid, None)
                    st.wan_bytes_expected = 0
            else:
                await p.send(md_target)  # first: it is on the request's critical path
                if relay_possible:
                    # planned P->MD: RLD's slot is never filled and RLD frees its reservation
                    # (MD learns it from kv_done)
                    await p.send(Target(st.trid, "rld", cancelled=True).wire())
                    self._spawn(self._release_unused(rld, expect, st.trid))
            rep, _ = await p_call
        except BaseException:
            _give_up(p_call, expect)
            raise
        self._prefilled(st)
        st.p_cached_tokens = int(rep["p_cached_tokens"])

    def _sibling_md(self, st: ReqState) -> tuple[str, str, Pipeline] | None:
        """For another choice of a prompt whose first choice ``st.sibling_of`` is on its way to an
        MD across the WAN: ``(md name, first choice's tier rid, its pipeline)`` when this choice
        should reserve there after that KV arrived (pdd.policy.siblings: the copy would cost the
        line more than a round trip), else None (it routes and ships as any request). The first
        choice's planned bytes, or while its reservation is out its whole prompt's."""
        first = st.sibling_of
        if first is None or not self.cfg.policy.sibling_kv_once or first.aborted or first.md_lost or first.attempt != 0:
            return None
        md_name = first.names.get(ROLE_MAIN)
        if md_name is None or self.peers[md_name].closed or not self._in_b(md_name):
            return None
        nbytes = first.wan_bytes_expected if "md_reserved" in first.events else \
            first.prompt_len * (self.kv_bytes_per_token or 0)
        if not sibling_waits_for_kv(nbytes, st.siblings, self.wan_gbps_live or self.cfg.link.wan_gbps,
                                    self.cfg.link.wan_rtt_ms):
            return None
        return md_name, first.trid, first.pipeline

    async def _release_unused(self, peer: rpc.Peer, expect: asyncio.Future, trid: str) -> None:
        """Free the reservation an instance the plan does not use made for ``trid`` (RLD of a
        P->MD plan), once its ``expect`` reply is in; best effort, off the request's path (an
        RLD lost meanwhile holds nothing)."""
        try:
            await expect
        except Exception:
            return
        await self._abort_on(peer, trid)

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

    async def _md_leg(self, st: ReqState, trid: str, reserve, p: rpc.Peer) -> None:
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
        md = self.peers[md_name]
        if st.trid != trid or st.md_lost or st.aborted or st.cut_off:
            try:  # the attempt was given up (or cut off) meanwhile: free the reservation
                await md.send((Abort(trid) if st.aborted else Drop(trid)).wire())
            except Exception:
                pass
            return
        pred = st.md_predicted_pages
        self._reserved(st, md_name, rep, p, booked=st.md_predicted_bytes if pred is not None else 0)
        if st.finished and not st.kv_ready:
            self._await_kv(st)
        md_first = int(rep["md_cached_pages"])
        msgs = [] if pred is not None else [Target(trid, "md", md_name, first_page=md_first, relay=True)]
        if pred is not None and md_first < pred:  # MD lacks pages the prediction skipped: P fills them
            self.totals["md_predicted_fills"] += 1
            msgs.append(Target(trid, "md_fill", md_name, first_page=md_first, last_page=pred, relay=True))
        elif st.md_fill_slot:  # P holds an md_fill slot: nothing to fill
            msgs.append(Target(trid, "md_fill", md_name, skip=True))
        try:
            for msg in msgs:
                await p.send(msg.wire())
        except Exception as e:
            self._instance_lost(st, st.names.get(ROLE_PREFILL, ""), f"P unreachable: {e}")

    def _book_predicted(self, st: ReqState, pred_pages: int, p: rpc.Peer) -> None:
        """A predicted MD send: P sends pages ``[pred_pages, n)`` before MD's reservation replies,
        so their WAN bytes are planned now (the reply adds a fill's, :meth:`_reserved`)."""
        nbytes = prompt_kv_bytes(st.prompt_len, pred_pages, self.cfg.engine.page_size, self.page_bytes,
                                 self.cfg.policy.kv_whole_pages)
        st.md_predicted_pages, st.md_predicted_bytes = pred_pages, nbytes
        st.wan_bytes_expected = nbytes  # until the reply (the cut-off's and early handoff's estimate)
        self.totals["md_predicted_sends"] += 1
        self._book_wan(st, nbytes, p)

    def _book_wan(self, st: ReqState, nbytes: int, p: rpc.Peer | None) -> None:
        """Book ``nbytes`` more planned (and expected) WAN bytes for ``st``'s transfer from its P
        (``p``: the connection the attempt started on, default the current one of its P); when
        that P is already gone they go to ``wan_bytes_unreported`` instead (:meth:`_reserved`)."""
        self.totals["wan_bytes_expected"] += nbytes
        self.totals["wan_bytes_planned"] += nbytes
        src = st.names.get(ROLE_PREFILL, "")
        p = p if p is not None else self.peers.get(src)
        if p is not None and (p.closed or self.peers.get(src) is not p):
            self._write_off(nbytes)
            return
        self.planned_wan[st.trid] = self.planned_wan.get(st.trid, 0) + nbytes
        self.planned_src[st.trid] = src

    def _reserved(self, st: ReqState, md_name: str, rep: dict, p: rpc.Peer | None = None, booked: int = 0) -> None:
        """Book MD's reservation reply: cached tokens, the WAN bytes planned. ``p``: the P
        connection the attempt started on (default: the current one of ``st``'s P). When that P
        is already gone (closed, or replaced by a restarted P's connection: its loss was booked
        before this reservation returned, e.g. a sibling choice's ``reserve {after}`` waiting on
        MD while P was killed), it will never report the transfer: the bytes go straight to
        ``wan_bytes_unreported`` instead of staying expected forever."""
        st.events["md_reserved"] = time.perf_counter()
        md_wan = self.layout.get(md_name).dc == "B"
        self.page_bytes = int(rep["page_bytes"])
        self.kv_bytes_per_token = self.page_bytes // self.cfg.engine.page_size  # MD's pool: authoritative
        st.md_cached_tokens = int(rep["md_cached_tokens"])
        md_first = int(rep["md_cached_pages"])
        if md_wan:  # the prompt's tokens MD lacks (P sends the last page's filled slots only)
            st.wan_bytes_expected = prompt_kv_bytes(int(rep["prompt_tokens"]), md_first, int(rep["page_size"]),
                                                    self.page_bytes, self.cfg.policy.kv_whole_pages)
            # ``booked``: a predicted send's bytes, planned when it started; the rest is its fill
            self._book_wan(st, st.wan_bytes_expected - booked, p)

    def _unplan_wan(self, trid: str) -> None:
        """Attempt ``trid`` ended before P started its streams: the WAN bytes planned for it leave
        the planned and expected totals (P will never send nor report them)."""
        nbytes = self.planned_wan.pop(trid, 0)
        self.planned_src.pop(trid, None)
        self.totals["wan_bytes_planned"] -= nbytes
        self.totals["wan_bytes_expected"] -= nbytes

    def _write_off(self, nbytes: int) -> None:
        """Planned WAN bytes whose P died before reporting them: out of the expected balance,
        into ``totals.wan_bytes_unreported``."""
        self.totals["wan_bytes_unreported"] += nbytes
        self.totals["wan_bytes_expected"] -= nbytes

    def _always_relay(self) -> bool:
        """pdd mode with a zero TTFT budget: every request is planned P->RLD->MD."""
        pol = self.cfg.policy
        return relays_every_request(self.cfg.mode, pol.pipeline_ttft_budget_ms, pol.allow_p_rld)

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
        if relayed and tok.tier != "rld":
            if st.md_diverged:
                return []
            if tok.pos < st.next_pos:
                if st.emitted[tok.pos] != tok.token_id:
                    if st.switch_pos is None:
                        self._md_diverged(st, tok.pos)
                    return []
                if st.switch_pos is None:
                    self._switch(st, st.next_pos)  # MD is live and agrees: it streams from here
            else:
                st.md_pending[tok.pos] = tok
        elif st.switch_pos is None or tok.pos < st.switch_pos:
            if tok.pos >= st.next_pos:
                st.pending[tok.pos] = tok
        out = []
        while True:
            p = st.next_pos
            if st.switch_pos is not None:
                if p not in st.md_pending:
                    return out
                t = st.md_pending.pop(p)
            elif p in st.pending:
                t = st.pending.pop(p)
            elif relayed and p in st.md_pending and not st.md_diverged:
                self._switch(st, p)
                t = st.md_pending.pop(p)
            else:
                return out
            st.next_pos += 1
            if st.next_pos == st.base + 1:
                self._first_streamed(st)
            st.emitted.append(t.token_id)
            out.append(t)
            if t.fin is not None:
                return out

    @staticmethod
    def _prefilled(st: ReqState) -> None:
        """P's prefill returned (its first token sampled): the KV is on its way to the decoder."""
        st.events["prefilled"] = time.perf_counter()
        st.to(Phase.TRANSFER, "prefilled")

    def _first_streamed(self, st: ReqState) -> None:
        """The attempt's first token was streamed: a decoder that finishes the request without a
        handoff (MD of P->MD, RLD of P->RLD or of a relayed request whose MD leg was lost) decodes."""
        if st.phase is Phase.TRANSFER and not self._relayed_live(st):
            relay = st.pipeline in (Pipeline.P_RLD, Pipeline.P_RLD_MD)
            st.to(Phase.RLD_DECODE if relay else Phase.MD_DECODE, "first token streamed")

    def _switch(self, st: ReqState, pos: int) -> None:
        st.switch_pos = pos
        if not st.md_lost:
            st.to(Phase.MD_DECODE, "MD's stream is live")
        st.handoff_pos = pos
        st.pending.clear()
        st.events["switch"] = time.perf_counter()
        asyncio.get_running_loop().create_task(self._release_relay(st))

    def _md_diverged(self, st: ReqState, pos: int) -> None:
        st.md_diverged = True
        st.md_pending.clear()
        self.totals["md_diverged"] = self.totals.get("md_diverged", 0) + 1
        log.warning("request %s: MD's token at %d differs from RLD's (near-tie); RLD finishes it", st.rid, pos)
        _, md = self._peer(st, ROLE_MAIN)
        asyncio.get_running_loop().create_task(md.send(Drop(st.trid).wire()))

    async def _release_relay(self, st: ReqState) -> None:
        """MD's stream is live: stop RLD (catch-up kept it decoding until now)."""
        if st.handoff_mode == "catch_up":
            _, rld = self._peer(st, ROLE_RELAY)
            try:
                await rld.call(Abort(st.trid).wire(), timeout=10)
            except Exception as e:
                log.warning("stopping %s on RLD failed: %s", st.rid, e)

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
        self.reqs.pop(st.trid, None)
        await self._abort_everywhere(st.trid)

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
