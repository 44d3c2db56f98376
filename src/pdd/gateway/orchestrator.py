"""The gateway's orchestrator: the one owner of every request's life across P, RLD and MD. It
holds the wiring (connections to every instance, the request table, the totals, stats); each
step of a request's life is a collaborator's, mixed in here and reached through ``self``.

A request's phase (:class:`pdd.gateway.phase.Phase`, held on its :class:`ReqState`, moved only
by ``ReqState.to``) and the collaborator that moves it:

  queued -> prefill          :mod:`.start` makes the request, :mod:`.routing` picks instances
  prefill -> transfer        :mod:`.launch` plans the pipeline and starts P; P sampled the
                             first token; :mod:`.wan_booking` books MD's WAN bytes
  transfer -> rld_decode     :mod:`.handoff`: RLD streams, MD's ``kv_ready`` (or P->RLD)
  transfer -> md_decode      :mod:`.handoff`: the first token of P->MD / P->D streams
  rld_decode -> handoff -> md_decode   :mod:`.handoff`: RLD's ids to MD, the client's switch
  prefill -> decode          :mod:`.launch` (colocated: one instance does both)
  any -> recovery -> prefill :mod:`.recovery`: an instance the attempt needs was lost
  any -> done                :mod:`.stream`: the last token, or an abort (outcome counted once)

:mod:`pdd.gateway.state` says which module writes each part of a request's state. The pipelines
and what each sends are :mod:`.launch`'s docstring; the fault rules :mod:`.recovery`'s
(docs/FAULTS.md). Every message is a dataclass of :mod:`pdd.transfer.messages`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from pdd.config import ClusterConfig
from pdd.policy.wan_estimate import PeerWanEstimates, WanEstimate
from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY, Layout
from pdd.transfer.client import connect
from pdd.transfer.peer import Peer
from pdd.transfer.layout import wire_dtype
from pdd.transfer.messages import Abort, Drop, Flush, Stats, WaitIdle
from pdd.gateway.handoff import Handoffs
from pdd.gateway.launch import Launchers
from pdd.policy.prefix_index import PrefixIndex
from pdd.gateway.recovery import Recovery
from pdd.gateway.routing import ROUTING_MIN_HIT_FRAC, Routing  # noqa: F401
from pdd.gateway.start import Starts, UnavailableLog
from pdd.gateway.state import (  # noqa: F401  (re-exported: the API layer and tests import them from here)
    ABORT_CLIENT, ABORT_FAILED, ABORT_OUTCOMES, ABORT_REJECTED, ABORT_STOP, ATTEMPT_EVENTS, OUTCOMES, PHASES, InstanceLost,
    NoInstance, NoMember, ReleaseDict, RequestFailed, ReqState, ShuttingDown, TokenOut, extend_message)
from pdd.gateway.stream import Streams
from pdd.gateway.wan_booking import WanBooking

log = logging.getLogger(__name__)


START_RETRIES = 200  # connects to each instance at start-up (backing off to 2 s apart: about 6.5 min)


class TierUnreachable(ConnectionError):
    """The gateway could not connect to an instance of its layout at start-up: nothing answered
    at its address, or its handshake refused the gateway."""


class Orchestrator(Starts, Streams, Routing, Launchers, WanBooking, Handoffs, Recovery):
    """The wiring: connections to every instance, which collaborator handles each message
    from the tiers (:meth:`handlers`), the request table and totals, stats; the collaborators
    (module docstring) do the rest through ``self``."""

    def __init__(self, cfg: ClusterConfig, lay: Layout):
        self.cfg, self.layout = cfg, lay
        self.peers: dict[str, Peer] = {}
        # what Membership.busy counts is kept in ReleaseDicts: whatever leaves them wakes a removal
        # waiting for an instance to go idle (_released)
        self.reqs: dict[str, ReqState] = ReleaseDict(self._released)
        self.totals = {"wan_bytes_expected": 0, "wan_bytes_planned": 0, "wan_bytes_cancelled": 0, "wan_bytes_sent": 0,
                       "wan_bytes_unreported": 0, "requests": 0,
                       "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0,  # OUTCOMES: each request once
                       "handoffs": 0, "rld_finished_first": 0, "cut_offs": 0,
                       "md_predicted_sends": 0, "md_predicted_fills": 0, "early_handoffs": 0,
                       "md_routes_by_wan": 0,  # MD routes the WAN estimates changed (gateway.routing)
                       # reservations that waited for another attempt's KV still crossing to their MD
                       # (its claim in MD's index held their prefix: gateway.launch, reserve {after})
                       "md_claim_waits": 0,
                       # completed requests that made a new attempt after a lost instance / ended on
                       # RLD without MD, each counted once when it completes (gateway.stream), and the
                       # new attempts made (gateway.recovery): docs/FAULTS.md reads them, 0 included
                       "recovered": 0, "degraded": 0, "recoveries": 0}
        self.pipelines: dict[str, int] = {}
        self.page_bytes: int | None = None
        self.planned_wan: dict[str, int] = {}  # rid -> planned WAN bytes, until P's xfer_done
        self.planned_src: dict[str, str] = ReleaseDict(self._released)  # rid -> the P that will report it (forgotten if P dies)
        # replaced attempts' plans (recovery): (planned bytes, P), until P reports them or dies
        self.superseded_wan: dict[str, tuple[int, str]] = ReleaseDict(self._released)
        self._ids = itertools.count()
        # from the checkpoint's config, so the first request is planned with it too (a new user saw 0
        # there); MD's first reservation reply confirms it from its pool (_reserved)
        mc = checkpoint_config(cfg)
        self.kv_bytes_per_token: int | None = mc.kv_bytes_per_token(  # as it crosses: the narrower dtype
            wire_dtype(cfg.engine_for("prefill").dtype, cfg.engine_for("main_decode").dtype)) if mc is not None else None
        self._tasks: set = set()
        self.inflight: dict[str, int] = ReleaseDict(self._released)  # instance -> requests routed there and not finished
        # instance -> places of its bounded queue the gateway holds there: attempts routed to it that
        # may still need compute (gateway.routing's module docstring; ReqState.holds)
        self.holding: dict[str, int] = {}
        self._rr: dict[str, int] = {}
        self._reconnecting: set[str] = set()
        # topology changes (a membership change, a reconnected instance): their count, and the
        # futures of recoveries waiting for one (:meth:`topology_changed`, :meth:`_topology_wait`)
        self.topology_version = 0
        self._topology_waiters: set[asyncio.Future] = set()
        # aborts under way (:meth:`_abort_begun`): tier rid -> aborts of it not finished (a
        # request out of ``reqs`` whose instances may still hold its pages), instance -> abort
        # calls to it not answered yet, and the futures of flushes waiting for none to be left
        self.aborting: dict[str, int] = {}
        self.aborts_out: dict[str, int] = {}
        self._abort_waiters: set[asyncio.Future] = set()
        self.draining = False  # the shutdown drain began (:meth:`begin_drain`): no start waits for an instance
        self.unavailable_log = UnavailableLog()  # requests refused for lack of an instance: logged, a flood summarised
        # MD's measured KV receive rates, capped at the configured loss's TCP rate (policy.wan_estimate)
        self.wan_estimate = WanEstimate.for_line(cfg.link.wan_gbps, cfg.link.wan_rtt_ms, cfg.link.wan_loss_rate,
                                                 cfg.link.wan_mss_bytes, connections=cfg.link.wan_connections)
        self.wan_gbps_live: float | None = self.wan_estimate.gbps  # its current value, Gbit/s (None: none yet)
        # per MD across the WAN: goodput and RTT, what the pipeline choice and MD routing read
        self.wan_peers = PeerWanEstimates(cfg.link.wan_gbps, cfg.link.wan_rtt_ms, cfg.link.wan_loss_rate,
                                          cfg.link.wan_mss_bytes, source=cfg.policy.wan_estimate,
                                          connections=cfg.link.wan_connections)
        self.md_routes: dict[str, int] = {}  # MD -> requests routed there (routing's counter)
        # WAN probes of idle MDs (policy.wan_probe_interval_s; gateway.wan_booking): when each MD
        # last gave a goodput sample and was last probed (monotonic s), and the probes' counters
        self.wan_last_sample: dict[str, float] = {}
        self.wan_last_probe: dict[str, float] = {}
        self.wan_probes = {"probes": 0, "failures": 0, "bytes": 0, "goodput_samples": 0}
        self.awaiting_kv: dict[str, tuple[str, str]] = ReleaseDict(self._released)  # finished trid -> (P, MD) until MD's kv_ready
        # finished trid -> monotonic deadline (request_timeout_s after the wait began): an entry
        # still awaited then is dropped on MD and forgotten (_expire_awaited_kv)
        self.awaiting_kv_deadline: dict[str, float] = {}
        # awaited trid -> its request (let through by the cut-off at its end): MD's kv_progress of
        # it checks the cut-off again (gateway.wan_booking.on_kv_progress); read only while the trid
        # is in awaiting_kv, pruned with it (_expire_awaited_kv)
        self.cutoff_watch: dict[str, ReqState] = {}
        # trids whose kv_ready came after the request had ended (MD was told to keep the KV then): the
        # relayed request's settling must not wait for it again (gateway.stream._await_kv). Oldest
        # dropped beyond KV_LANDED_MAX, so one never settled (failed meanwhile) cannot grow it.
        self.kv_landed: dict[str, None] = {}
        # what the gateway routed to each instance across the WAN (cache-aware routing without a peek)
        self.prefix_index: dict[str, PrefixIndex] = {
            sp.name: PrefixIndex(cfg.engine_for(sp.name).page_size, cfg.engine_for(sp.name).num_pages)
            for sp in lay.by_role(ROLE_MAIN) if sp.dc == "B"}
        # attempt -> (MD, its prompt's page keys in that MD's index, None or the monotonic time a
        # drop is kept until) its routing recorded there, until its KV lands
        # (gateway.routing._index_landed; a drop is kept request_timeout_s for a kv_ready that
        # crossed it: _expire_dropped_claims). Keys, not the prompt's tokens; INDEX_CLAIMS_MAX at most
        self.index_claims: dict[str, tuple[str, tuple, float | None]] = {}
        # attempt -> (the attempt whose unsettled claim on its MD holds the end of its indexed
        # prefix, the prefix's landed tokens), for an attempt routed to an MD whose index held such
        # a claim (KV still on its way): read once by its launch (gateway.launch: reserve {after});
        # INDEX_CLAIMS_MAX at most
        self.index_after: dict[str, tuple[str, int]] = {}
        # KV elements per token (2 x layers x kv heads x head dim), from MD's reservation replies:
        # with each tier's page size and dtype it gives a transfer's exact bytes (_wan_page_bytes)
        self.kv_elems_per_token: int | None = mc.kv_bytes_per_token("float32") // 4 if mc is not None else None
        from pdd.gateway.metrics import GatewayMetrics

        self.metrics = GatewayMetrics(self)

    # ------------------------------------------------------------------ connections
    def handlers(self) -> dict:
        """Each message a tier sends the gateway, and the collaborator that handles it."""
        return {"tok": self.on_tok, "toks": self.on_toks,  # stream: output tokens
                "kv_ready": self.on_kv_ready,  # handoff: MD holds the KV
                "xfer_done": self.on_xfer_done, "wan_sample": self.on_wan_sample,  # wan_booking
                "kv_progress": self.on_kv_progress,
                "req_error": self.on_req_error}  # recovery: a tier failed the attempt

    async def start(self, retries: int = START_RETRIES) -> None:
        """Connect to every engine of the layout (each retried ``retries`` times, backing off to 2 s
        apart); raises :class:`TierUnreachable` naming the one that did not answer or refused."""
        for s in self.layout.engines:
            self.peers[s.name] = await self._connect_at_start(s.name, retries)
        await self._match_roles_at_start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_closed())
        if self.cfg.policy.wan_probe_interval_s > 0:
            self._probes = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _match_roles_at_start(self) -> None:
        """After :meth:`start` connected: the membership of a (re)started gateway records each
        slot as the config has it (its run-time changes, re-roles included, are not kept), while
        an instance's process may still run a role the gateway before it gave it. Each slot the
        config's ``rerole`` lists is brought back to its recorded role
        (``Membership.match_role``: logged at WARNING when it ran another); one that cannot be is
        disconnected (``/health`` lists it down, ``/pdd/instances`` says why in ``role_error``)
        and the reconnect watcher tries again. A standby slot whose port is taken (an instance
        added at run time before the gateway restarted, still running) is logged at WARNING: it
        is no member until added again."""
        ms = getattr(self, "membership", None)
        if ms is None:
            return
        for name in list(self.peers):
            peer = self.peers[name]
            if not await ms.match_role(name, peer, "gateway start"):
                await peer.close()
        from pdd.policy.membership import STANDBY
        from pdd.topology import port_taken

        for m in ms.members.values():
            if m.state == STANDBY and port_taken(ms.full.host, int(m.address.rsplit(":", 1)[1])):
                log.warning("membership: standby slot %s (%s): something listens at its address %s (an instance "
                            "added at run time before the gateway started, still running?); it is no member until "
                            "added again (POST /pdd/instances)", m.name, m.role, m.address)

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
            self._expire_awaited_kv(time.monotonic())
            self._expire_dropped_claims(time.monotonic())

    def _expire_awaited_kv(self, now: float) -> list[str]:
        """Forget the finished relayed requests whose KV MD has not reported (kv_ready) within
        ``request_timeout_s`` of the wait's start (``awaiting_kv_deadline``): each is dropped on
        its MD (which frees a reservation still held; its cache keeps nothing of it), counted in
        ``totals["kv_awaited_expired"]`` and logged. Without it one lost kv_ready (a path not
        foreseen) would keep the gateway awaiting for good, and the topology never settled.
        Returns the tier rids expired (``now``: ``time.monotonic()``)."""
        out = []
        for trid in [t for t in self.cutoff_watch if t not in self.awaiting_kv]:
            self.cutoff_watch.pop(trid)
        for trid, deadline in list(self.awaiting_kv_deadline.items()):
            if trid not in self.awaiting_kv:
                self.awaiting_kv_deadline.pop(trid, None)
            elif now >= deadline:
                md_name = self._drop_awaited_kv(trid)
                self.totals["kv_awaited_expired"] = self.totals.get("kv_awaited_expired", 0) + 1
                log.warning("request %s: MD %s did not report its KV within %.0f s of the request's end; dropped there",
                            trid, md_name, self.cfg.request_timeout_s)
                out.append(trid)
        return out

    def _drop_awaited_kv(self, trid: str) -> str:
        """Stop awaiting tier rid ``trid``'s KV (``awaiting_kv``, its deadline) and drop it on its
        MD if that one is reachable (MD frees a reservation still held; its cache keeps nothing of
        it). Returns the MD's name."""
        self.awaiting_kv_deadline.pop(trid, None)
        _p, md_name = self.awaiting_kv.pop(trid)
        peer = self.peers.get(md_name)
        if peer is not None and not peer.closed:
            self._spawn(peer.send(Drop(trid).wire()))
        return md_name

    def pending_calls(self) -> int:
        """Background calls to the tiers not finished yet (aborts, drops, probes, reconnects)."""
        return len(self._tasks)

    def stop_probes(self) -> None:
        """Stop probing idle MDs across the WAN (``policy.wan_probe_interval_s``): a gateway
        that shuts down starts no new WAN work (``pdd.gateway.shutdown``). Idempotent."""
        task = getattr(self, "_probes", None)
        if task is not None:
            task.cancel()

    def drop_awaited_kv(self) -> list[str]:
        """Shutdown (``pdd.gateway.shutdown``): forget every finished relayed request whose KV
        its MD has not reported yet and drop it there (MD frees a reservation still held, its
        cache keeps nothing of it), as :meth:`_expire_awaited_kv` does at a wait's deadline: with
        the gateway gone no ``kv_ready`` would be answered. Returns the tier rids dropped."""
        out = list(self.awaiting_kv)
        for trid in out:
            self._drop_awaited_kv(trid)
        return out

    async def _connect_at_start(self, name: str, retries: int) -> Peer:
        """:meth:`_connect` at start-up: once at once, then (saying so on stderr: the gateway
        launched alone before its instances was silent for minutes) with ``retries``. A refused
        handshake or no answer is a :class:`TierUnreachable` naming the instance and its address
        (it was a HandshakeError or ConnectionError traceback)."""
        from pdd.transfer.handshake import HandshakeError

        ms = getattr(self, "membership", None)
        host, port, _wan = (ms.full if ms is not None else self.layout).address_from_a(name)
        for attempt, n in enumerate((0, retries)):
            try:
                return await self._connect(name, retries=n)
            except HandshakeError as e:
                raise TierUnreachable(f"{name} at {host}:{port} refused the gateway's connection: {e} (an "
                                      f"instance of another topology, or one with other security settings?)") from None
            except ConnectionError as e:
                if attempt:
                    raise TierUnreachable(f"{name} at {host}:{port} did not answer: {e}") from None
                log.warning("gateway: waiting for %s at %s:%d (start the topology's instances first)", name, host, port)
        raise AssertionError("unreachable")

    async def _connect(self, name: str, retries: int) -> Peer:
        from pdd.security import link_security

        ms = getattr(self, "membership", None)  # an instance being added is not in self.layout yet
        host, port, _wan = (ms.full if ms is not None else self.layout).address_from_a(name)
        lv = self.cfg.liveness
        peer = await connect(host, port, self.handlers(), role="gateway", instance="gateway",
                             retries=retries, backoff_s=0.1, heartbeat_s=lv.heartbeat_interval_s,
                             dead_after_s=lv.dead_after_s,
                             **link_security(self.cfg, "gateway").client(name))  # mutual TLS
        peer.on_close(lambda p, n=name: self._peer_closed(n, p))
        return peer

    async def close(self) -> None:
        for name in ("_watch", "_probes"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        for p in list(self.peers.values()):
            await p.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _abort_begun(self, trid: str) -> None:
        """An abort of tier rid ``trid`` began (or is about to, in a task of its own): until its
        :meth:`_abort_ended`, the instances may still hold ``trid``'s pages although the request
        has left ``reqs``; :meth:`flush` waits for it."""
        self.aborting[trid] = self.aborting.get(trid, 0) + 1

    def _abort_ended(self, trid: str) -> None:
        """An abort of ``trid`` begun by :meth:`_abort_begun` is over (its instances answered,
        or their calls failed): the last one wakes the flushes waiting for aborts."""
        n = self.aborting.get(trid, 0) - 1
        if n > 0:
            self.aborting[trid] = n
        else:
            self.aborting.pop(trid, None)
        if not self.aborting:
            waiters, self._abort_waiters = self._abort_waiters, set()
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def _spawn_abort(self, trid: str, coro) -> None:
        """Run ``coro`` (an abort of ``trid``) in a task of its own, counted under way
        (:meth:`_abort_begun`) from now, before the task first runs, to its end."""
        self._abort_begun(trid)

        async def run():
            try:
                await coro
            finally:
                self._abort_ended(trid)
        self._spawn(run())

    async def _call_abort(self, name: str, peer: Peer, trid: str, timeout: float = 10):
        """``peer.call(Abort(trid))`` (instance ``name``), counted in ``aborts_out[name]``
        until it is answered or fails: an instance answers an abort once it freed the pages."""
        self.aborts_out[name] = self.aborts_out.get(name, 0) + 1
        try:
            return await peer.call(Abort(trid).wire(), timeout=timeout)
        finally:
            left = self.aborts_out.get(name, 0) - 1
            if left > 0:
                self.aborts_out[name] = left
            else:
                self.aborts_out.pop(name, None)

    async def _aborts_settled(self, timeout_s: float) -> None:
        """Return once no abort is under way (``aborting`` empty: woken by the last one's end,
        no poll), or after ``timeout_s`` seconds."""
        if not self.aborting:
            return
        fut = asyncio.get_running_loop().create_future()
        self._abort_waiters.add(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        finally:
            self._abort_waiters.discard(fut)
            fut.cancel()

    def _peer_closed(self, name: str, peer: Peer | None = None, removed: str | None = None) -> None:
        """A tier's connection dropped (the instance died or closed it, or its heartbeat went
        silent): one WARNING line names the instance and why (not for a close of the gateway's
        own, nor again for each failed reconnect: :meth:`_reconnect` logs only its success), and
        each in-flight request routed there loses what it still needs of it, at once
        (:meth:`_instance_lost`; no silent stall). ``/health`` lists it in ``down`` until a
        reconnect succeeds. ``removed``: the operator removed the instance (Membership.remove,
        ``"force"`` when forced): its requests' error says so, and their recovery is logged at
        INFO (:meth:`_recover`), not as a lost connection."""
        if peer is not None and self.peers.get(name) is not peer:
            return  # an old connection, already replaced
        why = "no heartbeat" if getattr(peer, "dead_peer", False) else "connection lost"
        if peer is not None and peer.closed and not getattr(peer, "closed_locally", False):
            log.warning("lost the connection to instance %s (%s); it is down in /health until a reconnect "
                        "succeeds (tried every %g s)", name, getattr(peer, "close_reason", None) or why,
                        self.cfg.liveness.reconnect_interval_s)
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
        if removed is not None:
            reason = f"instance {name} was removed by the operator" + (f" ({removed})" if removed else "")
        else:
            reason = f"instance {name} is unreachable ({why})"
        for st in list(self.reqs.values()):
            self._instance_lost(st, name, reason, asked=removed is not None)

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "unavailable", "down": [instances whose connection is
        closed], "missing": [roles of the config's layout with no active member reachable]}:
        "degraded" while requests can still be served (a P and some decoder are up:
        recovery and routing go around the rest) but an instance is down or a role of the config's
        layout has no active member (all drained, removed or re-roled away: e.g. no RLD, requests
        go P->MD), "unavailable" when they cannot (e.g. every P removed)."""
        down = sorted(n for n, p in self.peers.items() if p.closed)
        ms = getattr(self, "membership", None)

        def up(*roles: str) -> bool:
            return any(not self.peers[s.name].closed and (ms is None or ms.routable(s.name))
                       for r in roles for s in self.layout.by_role(r) if s.name in self.peers)

        if self.cfg.mode == "colocated":
            serving = up(ROLE_COLOCATED)
        else:
            serving = up(ROLE_PREFILL) and up(ROLE_RELAY, ROLE_MAIN)
        roles = (ROLE_PREFILL, ROLE_RELAY, ROLE_MAIN, ROLE_COLOCATED)
        full = ms.full if ms is not None else self.layout  # a role whose every member was removed is missing too
        missing = [r for r in roles if full.by_role(r) and not up(r)]
        status = "unavailable" if not serving else ("ok" if not down and not missing else "degraded")
        return {"status": status, "mode": self.cfg.mode, "down": down, "missing": missing}

    def _peer(self, st: ReqState | None, role: str) -> tuple[str, Peer]:
        """The instance of ``role`` serving ``st`` (routed at its start)."""
        name = st.names.get(role) if st is not None else None
        if name is None:
            name = self.layout.by_role(role)[0].name
        return name, self.peer_named(name)

    def peer_named(self, name: str) -> Peer:
        """The connection to instance ``name``. Raises ConnectionError when it is no longer a
        member (removed after a request was routed to it: the request starts again elsewhere, as
        after a loss, instead of failing on a KeyError)."""
        peer = self.peers.get(name)
        if peer is None:
            raise ConnectionError(f"instance {name} was removed")
        return peer

    async def _reconnect(self, name: str) -> None:
        """Try once to reach a restarted instance again (it rejoins without restarting the rest).
        The new connection replaces the closed one only if that is still the instance's: one
        removed meanwhile (``Membership.remove``), or connected again by an add, is left as it
        is and the new connection closed, so a removal need not wait for a reconnect under way;
        one asked for an instance with no connection at all (removed before it was asked: a
        recovery routed during the removal asks for each MD of the layout it read) connects
        nothing, so a removed instance never comes back into ``peers``. An old connection still draining (closed by the instance; the one-way messages read
        before, e.g. its last tokens, still being handled: ``Peer.draining``) is waited for first,
        at most its ``drain_timeout_s``: its close reported, :meth:`_peer_closed` declares its
        requests lost before a new connection replaces it (and would make it skip them). A
        restarted instance of a ``rerole`` slot runs its launch role: the role the membership
        records (an operator's re-role) is applied to it first (``Membership.match_role``); one
        that refuses is not swapped in (it stays down, ``role_error`` says why) and is tried
        again at the next reconnect."""
        if name in self._reconnecting:
            return
        old = self.peers.get(name)
        if old is None:  # no connection to replace: removed (or never added); it stays out
            return
        self._reconnecting.add(name)
        try:
            if old is not None and getattr(old, "draining", False):
                await old.wait_close_reported()
            peer = await self._connect(name, retries=0)
            ms = getattr(self, "membership", None)
            # a restarted instance runs its launch role: the role recorded here (an operator's
            # re-role) is applied to it before it is routed to; one that cannot be is left out
            if ms is not None and self.peers.get(name) is old and not await ms.match_role(name, peer, "reconnect"):
                await peer.close()
                return
            if self.peers.get(name) is not old:
                await peer.close()
                return
            self.peers[name] = peer
            log.info("reconnected to %s", name)
            self.topology_changed()  # a recovery waiting for this instance goes on now
        except Exception:
            pass
        finally:
            self._reconnecting.discard(name)

    def _released(self) -> None:
        """Something in flight left the bookkeeping (a request, a planned or superseded
        transfer, KV awaited on MD, an instance's in-flight count lowered: the ReleaseDicts):
        the membership wakes a removal waiting for an instance to go idle
        (``Membership.in_flight_fell``)."""
        ms = getattr(self, "membership", None)
        if ms is not None:
            ms.in_flight_fell()

    def topology_changed(self) -> None:
        """The instances a request can be routed to changed (added, drained, removed, re-roled,
        or a closed connection is back): wake every recovery waiting for an instance
        (:meth:`_topology_wait`), which tries again at once."""
        self.topology_version += 1
        self._wake_waiters()

    def begin_drain(self) -> None:
        """The gateway's shutdown drain began (:mod:`pdd.gateway.shutdown`): a start waiting for
        an instance to come back (:mod:`pdd.gateway.start`) ends at once with
        :class:`ShuttingDown` instead of waiting up to ``recovery.RECOVERY_WAIT_S`` (its client has
        received nothing; a restart not begun may never come). Idempotent."""
        self.draining = True
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        waiters, self._topology_waiters = self._topology_waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _topology_wait(self, seen: int, timeout_s: float) -> None:
        """Wait until the topology changes after version ``seen`` (:attr:`topology_version` read
        before the attempt that failed: a change since returns at once), or ``timeout_s`` seconds."""
        if self.topology_version != seen:
            return
        fut = asyncio.get_running_loop().create_future()
        self._topology_waiters.add(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        finally:
            self._topology_waiters.discard(fut)
            fut.cancel()

    # ------------------------------------------------------------------ stats
    async def _ask_every_instance(self, make, timeout: float,
                                  names: list[str] | None = None) -> list[tuple[str, object]]:
        """Call every connected instance (or those of ``names``) at once (``make()``: the
        message, a new one each) and return ``(name, reply header or the Exception it raised)``
        in connection order, leaving out an instance removed or replaced while the calls were
        out (a membership change may land during the awaits). At once, so an instance that does
        not answer (across a WAN outage) costs the caller one ``timeout`` seconds, not one per
        such instance before the others are asked."""
        pairs = [(n, p) for n, p in self.peers.items() if names is None or n in names]

        async def ask(peer):
            try:
                rep, _ = await peer.call(make(), timeout=timeout)
                return rep
            except Exception as e:
                return e
        reps = await asyncio.gather(*(ask(p) for _, p in pairs))
        return [(n, r) for (n, p), r in zip(pairs, reps) if self.peers.get(n) is p]

    async def stats(self) -> dict:
        await self._reconnect_closed()
        inst = {}
        for name, rep in await self._ask_every_instance(lambda: Stats().wire(), timeout=10):
            inst[name] = ({"error": str(rep)} if isinstance(rep, Exception)
                          else {k: v for k, v in rep.items() if k not in ("t", "cid", "reply")})
        out = {"mode": self.cfg.mode, "instances": inst, "totals": dict(self.totals), "pipelines": dict(self.pipelines)}
        # as P reported them per transfer (xfer_done): kept by the gateway, so a restarted P's
        # fresh counters do not reset it (each instance's own count is in instances[...])
        out["wan_bytes"] = self.totals["wan_bytes_sent"]
        out["wan_bytes_expected"] = self.totals["wan_bytes_expected"]
        out["wan_gbps_live"] = self.wan_gbps_live
        out["wan_estimate"] = self.wan_peers.source
        out["wan_peers"] = self.wan_peers.view()  # per MD: goodput and RTT, read by routing and the pipeline
        out["wan_probes"] = dict(self.wan_probes)  # probes of idle MDs (policy.wan_probe_interval_s)
        out["md_routes"] = dict(self.md_routes)
        out["transfers_pending"] = len(self.planned_wan)  # WAN plans whose outcome P has not reported yet
        out["requests_live"] = len(self.reqs)  # attempts the gateway still runs (a stream not yet settled)
        # relayed requests that ended at the client while their KV still crosses to MD (MD keeps
        # the prompt's pages once it lands): the topology is not settled until MD has them
        out["kv_awaited"] = len(self.awaiting_kv)
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

    async def flush(self, settle_s: float = 10.0) -> dict:
        """Empty every instance's prefix cache and count the pages still in use (``leaked_pages``).

        A request the client has seen finish may still be live on an instance for a while (a
        cut-off transfer's cancel crossing the WAN behind bytes already on the line, an MD
        releasing after its last token, a request whose client went away and whose abort the
        instances have not answered yet): those pages are not leaked. So the flush first waits
        (at most ``settle_s`` seconds, woken by the last one's end) for every abort under way
        (``aborting``: a request leaves ``reqs`` when its abort begins, before its instances
        free its pages and answer); then, when the gateway has no request in flight nor abort
        under way, each instance whose flush found live requests (an instance counts those
        whose pages it is still freeing) is asked to answer once those requests are gone
        (``WaitIdle``: it answers on their release, at most ``settle_s`` seconds later; one
        arriving meanwhile is not waited for) and is flushed again then; a live request left
        after that, with the gateway idle, is orphaned and its pages count as leaked. With
        requests in flight there is no wait: instances holding live requests, and those an
        abort is still out to, are listed in ``busy`` and only the others' pages are counted;
        ``aborting`` lists the tier rids whose abort was still under way. An instance that cannot be
        asked (down, silent) is listed in ``unreachable`` and ``leaked_pages`` is None
        (unknown): its pages cannot be counted, and a 0 that left them out would read as
        "nothing leaked"."""
        await self._reconnect_closed()
        await self._aborts_settled(settle_s)
        inst = await self._flush_instances()
        live = [n for n, v in inst.items() if v.get("live_requests")]
        if live and not self.reqs and not self.aborting:
            await self._ask_every_instance(lambda: WaitIdle(settle_s).wire(),
                                           timeout=settle_s + self.cfg.liveness.dead_after_s, names=live)
            inst.update(await self._flush_instances(live))
            inst = {n: v for n, v in inst.items() if n in self.peers}  # one removed meanwhile is no member
        for ix in self.prefix_index.values():  # the instances' caches are empty now
            ix.clear()
        in_flight = bool(self.reqs) or bool(self.aborting)
        busy = sorted(n for n, v in inst.items() if (in_flight and v.get("live_requests")) or self.aborts_out.get(n))
        unreachable = sorted(n for n, v in inst.items() if "pages_total" not in v)
        leaked = None if unreachable else sum(int(v["pages_total"]) - int(v["pages_free"])
                                              for n, v in inst.items() if n not in busy)
        return {"instances": inst, "leaked_pages": leaked, "busy": busy, "unreachable": unreachable,
                "aborting": sorted(self.aborting)}

    async def _flush_instances(self, names: list[str] | None = None) -> dict:
        """Flush every connected instance's prefix cache (or those of ``names``) at once:
        ``{name: {pages_total, pages_free, live_requests} or {error}}``."""
        inst: dict = {}
        for name, rep in await self._ask_every_instance(lambda: Flush().wire(), timeout=30, names=names):
            if isinstance(rep, Exception):
                inst[name] = {"error": f"{type(rep).__name__}: {rep}"}
                continue
            inst[name] = {"pages_total": rep["pages_total"], "pages_free": rep["pages_free"],
                          "live_requests": rep.get("live_requests", 0)}
        return inst


def checkpoint_config(cfg: ClusterConfig):
    """The :class:`pdd.engine.config.ModelConfig` of ``cfg``'s checkpoint, as the engines read it
    (config.json with generation_config.json's EOS ids), or None when it cannot be read (the
    engines would not start either). No torch import."""
    from pdd.engine.config import ModelConfig

    try:
        return ModelConfig.from_pretrained(cfg.model_path)
    except Exception:
        return None
