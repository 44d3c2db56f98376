"""Routing (a collaborator of :class:`pdd.gateway.orchestrator.Orchestrator`): which instance of
a tier serves a request (``policy.routing``: cache-aware by prefix hits within a load slack, or by
load), the gateway's record of what it routed to each MD across the WAN (:class:`PrefixIndex`),
and the in-flight counts routing reads. Uses the orchestrator's connections through ``self``.

Each choice of an API request is routed on its own, on every tier (P, RLD, MD / D, colocated):
the choices of one request may land on several instances of a tier. What keeps them within the
instances' bounded queues is the gateway's count of the places it holds there (``holding``: the
attempts routed to an instance that may still need compute there, counted when the instance is
chosen, before the next choice is routed; on P until its prefill returned, elsewhere until the
attempt ends), at least what the engine counts against ``max_running + tier_max_waiting``. An
instance whose count reaches that is routed to only when every candidate's has
(``pdd.policy.routing``: ``InstanceLoad.full``), so an idle tier takes any request whose choices
fit the sum of its active instances' queues (``pdd.gateway.admission.choice_cap``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pdd.gateway.state import NoInstance, NoMember, ReqState
from pdd.policy.routing import MIN_HIT_FRAC, InstanceLoad, choose_instance
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY
from pdd.transfer.messages import Peek
from pdd.types import Pipeline

# cache-aware routing (as in the simulator): affinity only for a prefix covering at least half the
# prompt (a shared system-prompt block alone would pull all traffic to one instance); never to an
# instance more than policy.load_slack (MD: policy.md_load_slack) requests busier than the idlest
ROUTING_MIN_HIT_FRAC = MIN_HIT_FRAC
# MD routing by estimated transfer time (policy.wan_estimate live): one request in flight at an MD
# counts as this many seconds, so a small shared prefix (16 tokens: 5 ms on the default line) does
# not draw every request to one MD while a halved line (a cold prompt: 130 ms more) does move them
ROUTING_LOAD_COST_S = 0.01
# requests whose prompt an MD's index recorded at routing, kept until their KV lands there or is
# dropped (a bound, not a tuned figure: the oldest unresolved claims go first)
INDEX_CLAIMS_MAX = 1024


class Routing:
    """Mixin of the orchestrator: route a request to an instance of a tier, count it there."""

    @property
    def routed(self) -> dict[str, int]:
        """instance -> requests (attempts) ever assigned to it (the per-instance counter of
        ``/pdd/instances`` and ``pdd_gateway_routed_total``)."""
        d = self.__dict__.get("_routed")
        if d is None:
            d = self.__dict__["_routed"] = {}
        return d

    async def _route(self, role: str, prompt: list[int]) -> str:
        """Choose an instance of ``role`` for a request: :meth:`_route_hit`'s name."""
        return (await self._route_hit(role, prompt))[0]

    async def _route_hit(self, role: str, prompt: list[int], trid: str | None = None) -> tuple[str, int | None]:
        """Choose an instance of ``role`` for a request (``policy.routing``); return its name and,
        for an instance the gateway keeps a :class:`PrefixIndex` of (an MD across the WAN), the
        prompt tokens that index held before this request was recorded there (else None).

        cache_aware (P, MD): each live candidate reports how many of the prompt's tokens its radix
        cache holds (``peek``, no lock) and ``choose_instance`` takes the longest prefix within a
        load slack; RLD holds no cache, so it is chosen by load. An MD across the WAN is not
        asked (a round trip before the reservation): the gateway's record of what it routed there
        (:class:`PrefixIndex`) stands for its cache, unless ``policy.md_route_peek``. Load: on
        RLD and MD the requests the gateway has in flight there (``inflight``: they decode there
        until they end); on P the prefills it runs (:attr:`holding`: from routing until P's
        prefill returns), so a P whose earlier requests decode on RLD / MD is not busy, as the
        simulator counts P (``pdd.sim.cluster.ClusterSim._route``: sequences, queued admissions
        and requests routed on their way). P's KV sends after its prefill do not count: they
        share the line, not P's compute. Instances whose connection is down are skipped
        (and reconnected). Raises NoInstance when none of ``role`` is reachable (down or
        restarting), NoMember when none is in service at all (every one removed or drained by
        the operator). ``trid``: the attempt whose KV the routed MD's index now expects
        (:meth:`_index_landed` / :meth:`_index_dropped` settle it).
        """
        specs = self.layout.by_role(role)
        ms = getattr(self, "membership", None)
        if ms is not None:  # elastic topology: only active members take new requests (pdd.gateway.membership)
            specs = [sp for sp in specs if ms.routable(sp.name)]
            if not specs:  # none of the role in service: none comes back until an operator adds one
                raise NoMember(ms.out_of_service(role))
        live = [sp for sp in specs if not self.peers[sp.name].closed]
        for sp in specs:
            if self.peers[sp.name].closed:
                self._spawn(self._reconnect(sp.name))
        if not live:
            raise NoInstance(f"no {role} instance is reachable")
        if len(live) == 1:
            return live[0].name, self._record_route(live[0].name, prompt, trid)
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
        load = self.holding if role == ROLE_PREFILL else self.inflight  # P: its prefills (docstring)
        cands = [InstanceLoad(sp.name, running=load.get(sp.name, 0), prefix_hit_tokens=max(0, h),
                              full=self.queue_full(sp.name)) for sp, h in zip(live, hits)]
        rr = self._rr.get(role, 0)
        self._rr[role] = rr + 1
        pol, md = self.cfg.policy, role == ROLE_MAIN
        kw = dict(load_slack=pol.md_load_slack if md else pol.load_slack, prompt_tokens=len(prompt),
                  min_hit_frac=ROUTING_MIN_HIT_FRAC, load_cap=pol.md_load_cap if md else 0)
        i = choose_instance(cands, policy, rr, **kw)
        timed = self._with_transfer_times(role, policy, cands, len(prompt))
        if timed is not None:  # each MD's estimated transfer time of the KV it lacks decides
            j = choose_instance(timed, policy, rr, load_cost_s=ROUTING_LOAD_COST_S, **kw)
            self.totals["md_routes_by_wan"] += j != i
            i = j
        name = live[i].name
        return name, self._record_route(name, prompt, trid)

    def _with_transfer_times(self, role: str, policy: str, cands: list, prompt_len: int) -> list | None:
        """``cands`` with each MD's estimated seconds to receive the prompt's KV it lacks
        (``policy.wan_estimate.PeerWanEstimates.transfer_s``: (bytes queued to it + these bytes) /
        its goodput + its RTT), for
        cache-aware routing of MDs across the WAN with ``policy.wan_estimate: live``; else None
        (the hit-and-load rule)."""
        if (role != ROLE_MAIN or policy != "cache_aware" or self.wan_peers.source != "live"
                or not self.kv_bytes_per_token or not all(self._in_b(c.name) for c in cands)):
            return None
        return [dataclasses.replace(c, transfer_s=self.wan_peers.transfer_s(
            c.name, max(0, prompt_len - c.prefix_hit_tokens) * self.kv_bytes_per_token,
            self._wan_backlog_bytes(c.name))) for c in cands]

    def _record_route(self, name: str, prompt: list[int], trid: str | None = None) -> int | None:
        """``prompt`` was routed to ``name``: its whole pages will be in that instance's cache
        once attempt ``trid``'s KV lands there. Returns the prompt tokens the index held before
        (None: no index for ``name``)."""
        if name in self.prefix_index:  # an MD across the WAN: routing's per-MD counter
            self.md_routes[name] = self.md_routes.get(name, 0) + 1
        ix = self.prefix_index.get(name)
        if ix is None:
            return None
        keys = ix.page_keys(prompt)
        n_held, n_landed = ix.match_landed_keys(keys)
        held = ix.record_keys(keys) * ix.page_size
        claimer = self._claimer(name, keys, n_held) if trid is not None and n_landed < n_held else None
        if claimer is not None:  # the prefix ends in pages another attempt's KV is still bringing
            after = self.index_after
            after[trid] = (claimer, n_landed * ix.page_size)
            while len(after) > INDEX_CLAIMS_MAX:
                after.pop(next(iter(after)))
        if trid is not None:  # the page keys, not the prompt's tokens: a claim's memory is a 16th of them
            claims = self.index_claims
            claims[trid] = (name, keys, None)
            while len(claims) > INDEX_CLAIMS_MAX:
                claims.pop(next(iter(claims)))
        return held

    def _claimer(self, name: str, keys: tuple, n: int) -> str | None:
        """The attempt, newest first, whose unsettled claim on MD ``name`` holds the prompt's
        first ``n`` pages (their ``keys``: its own keys agree up to page ``n``, a key naming its
        whole prefix); None when no claim the gateway tracks does (it was pushed out)."""
        if n <= 0:
            return None
        key = keys[n - 1]
        for trid, (md, ks, dropped) in reversed(self.index_claims.items()):
            if md == name and dropped is None and len(ks) >= n and ks[n - 1] == key:
                return trid
        return None

    def _claim_to_wait_for(self, trid: str) -> tuple[str, int] | None:
        """``(claimer, landed tokens)`` for attempt ``trid`` when its MD's index held its prefix
        partly as the unsettled claim of attempt ``claimer`` (:meth:`_record_route`), taken once;
        else None (a claim no tracked attempt brings, e.g. pushed out of ``index_claims``, is
        taken as held: its KV most likely landed long ago)."""
        return self.index_after.pop(trid, None)

    def _index_landed(self, trid: str) -> None:
        """Attempt ``trid``'s KV is in its MD's cache (MD's ``kv_ready``): the pages its routing
        recorded stay in that MD's index whatever becomes of other requests routed with them.
        A kv_ready that crossed the attempt's cut-off (MD had it all when the cut came, and keeps
        it) records them again."""
        name, keys, dropped = self.index_claims.pop(trid, (None, None, None))
        ix = self.prefix_index.get(name) if name is not None else None
        if ix is None:
            return
        if dropped is not None:
            ix.insert_keys(keys, landed=True)
        else:
            ix.landed_keys(keys)

    def _index_dropped(self, trid: str) -> None:
        """Attempt ``trid``'s KV will not be cached on its MD (the transfer was cut off, or MD's
        leg given up before it landed): its MD's index takes back the pages only its routing
        recorded (``PrefixIndex.dropped``), so that later requests are not planned on them (a
        fill when MD's reservation finds them missing) and they do not push out prefixes MD
        does hold. The claim is kept, dropped, for a kv_ready that crossed the drop, until
        ``request_timeout_s`` from now (:meth:`_expire_dropped_claims`)."""
        claim = self.index_claims.get(trid)
        if claim is None or claim[2] is not None:
            return
        name, keys, _ = claim
        self.index_claims[trid] = (name, keys, time.monotonic() + self.cfg.request_timeout_s)
        ix = self.prefix_index.get(name)
        if ix is not None:
            ix.dropped_keys(keys)

    def _expire_dropped_claims(self, now: float) -> int:
        """Forget the dropped claims (:meth:`_index_dropped`) whose wait for a crossing kv_ready
        ran out (``now``: ``time.monotonic()``): such a kv_ready comes within a WAN round trip of
        the drop, and MD keeps no relayed KV awaited longer than ``request_timeout_s``. Without
        it a dropped claim (an aborted, cut-off or first-token-finished request's) stayed until
        INDEX_CLAIMS_MAX pushed it out, evicting live requests' claims before it. Returns the
        claims forgotten."""
        gone = [trid for trid, (_n, _k, until) in self.index_claims.items() if until is not None and now >= until]
        for trid in gone:
            del self.index_claims[trid]
        return len(gone)

    def _index_given_up(self, st: ReqState) -> None:
        """``st``'s current attempt will not bring any more of its KV to MD: aborted on every tier
        (the client went away, a stop string, a tier refused it, or recovery replaced it), its
        transfer cut off, or its MD leg given up. Its claim is settled now instead of keeping its
        pages in MD's index as on their way for good: its KV already in MD's cache stays (a
        relayed attempt's kv_ready settled the claim as landed; a P->MD attempt MD emitted from
        had imported the prompt into its cache); else dropped (MD frees what arrived uncached)."""
        if st.trid not in self.index_claims:
            return
        if st.handoff.kv_ready or (st.pipeline == Pipeline.P_MD and st.emitted):
            self._index_landed(st.trid)
        else:
            self._index_dropped(st.trid)

    def queue_places(self, name: str) -> int:
        """The sequences instance ``name``'s engine holds before it refuses another with
        ``TierBusy``: its ``engine.max_running + limits.tier_max_waiting`` (``ClusterConfig.bounded_queue``)."""
        return sum(self.cfg.bounded_queue(name))

    def queue_full(self, name: str) -> bool:
        """Whether the places the gateway holds on ``name`` (:attr:`holding`) fill its queue."""
        return self.holding.get(name, 0) >= self.queue_places(name)

    def _hold(self, st: ReqState, name: str) -> None:
        """``st``'s attempt takes a place of ``name``'s queue (once per attempt and instance)."""
        if name not in st.holds:
            st.holds.add(name)
            self.holding[name] = self.holding.get(name, 0) + 1

    def _unhold(self, st: ReqState, name: str | None) -> None:
        """``st``'s attempt no longer needs compute on ``name`` (P: its prefill returned)."""
        if name is not None and name in st.holds:
            st.holds.discard(name)
            self.holding[name] = max(0, self.holding.get(name, 0) - 1)

    def _assign(self, st: ReqState, *roles: str) -> None:
        """Count ``st``'s attempt on the instances it names for ``roles`` (all when none): in
        flight there (``inflight``, ``routed``) and holding a place of its queue (:meth:`_hold`).
        Called as soon as an instance is chosen, before another choice is routed."""
        for role in roles or tuple(st.names):
            name = st.names.get(role)
            if name is not None and name not in st.assigned:
                st.assigned.add(name)
                self.inflight[name] = self.inflight.get(name, 0) + 1
                self.routed[name] = self.routed.get(name, 0) + 1
                self._hold(st, name)

    def _unassign_one(self, st: ReqState, name: str | None) -> None:
        """``st``'s attempt no longer uses ``name`` (the RLD routed beside P when the plan is
        P->MD or P->D): it leaves that instance's ``inflight`` and queue place now, not when the
        request ends. ``routed`` keeps it (it was routed there). No-op when not assigned."""
        if name is None or name not in st.assigned:
            return
        st.assigned.discard(name)
        self.inflight[name] = max(0, self.inflight.get(name, 0) - 1)
        self._unhold(st, name)

    def _unassign(self, st: ReqState) -> None:
        lc = getattr(self, "live_counters", None)
        if lc is not None and st.assigned:  # the attempt ends (once: later calls find nothing assigned)
            lc.attempt_ended(st)
        for name in st.assigned:
            self.inflight[name] = max(0, self.inflight.get(name, 0) - 1)
        st.assigned.clear()
        for name in list(st.holds):
            self._unhold(st, name)
