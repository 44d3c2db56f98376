"""Elastic topology at the gateway: which instances are members, and adding, draining and removing
them while the gateway serves (docs/SERVE.md "Elastic topology"; the state machine is
``pdd.policy.membership``).

An instance is a *slot* of the config's layout (``pdd.topology.layout``: its name, role,
datacenter and ports). Every process reads the same layout, so P already knows where a new MD's
KV goes, the WAN link emulator already forwards to its port and its certificate exists: that is
what lets an instance join without restarting anything. ``ClusterConfig.standby`` lists the slots
that start out of service (``instances.main_decode: 2, standby: [md1]``); a removed instance
becomes a free slot again.

:class:`Membership` keeps each slot's state and replaces the orchestrator's ``layout`` with the
members' (active and draining) on every change, so routing (``gateway.routing`` asks
:meth:`Membership.routable`), ``/health``, the reconnect watcher, ``/pdd/stats`` and
``/pdd/flush`` follow without a restart. What happens to a request or a cache:

- add: the gateway connects (mutual TLS as at start) and routes new requests there at once; an
  MD across the WAN gets an empty prefix index (its cache starts cold as far as routing knows).
- drain: no new request (nor a recovery attempt) is routed there; requests in flight finish
  where they are, their WAN transfers and handoffs included.
- remove: refused (409) while anything is in flight there unless ``force`` (then its requests
  are recovered exactly as after an instance loss, docs/FAULTS.md). Once a role has no instance
  in service (all removed or drained), a request needing it fails at once with a 503 naming the
  role (:class:`pdd.gateway.state.NoMember`) instead of waiting for one, as for a crashed
  instance; every change wakes the recoveries that do wait (``Orchestrator.topology_changed``).
  The instance's prefix cache is flushed and dropped with it (with requests in flight there:
  after the gateway's connection closed and the instance aborted them, over a fresh
  connection, so the cache pages they locked go too): what the flush did is reported
  (``prefix_cache``: ``flushed``, the pages dropped, or why not) and logged, the gateway's
  prefix index of it is forgotten so routing counts no hits that are gone, and the instance's
  leaked pages (0 when it released everything) are reported.
- re-role (:meth:`Membership.rerole`, only for the relay decoders the config's ``rerole`` lists):
  the instance is drained (no new request of its current role; in-flight relays finish or hand
  off to MD as usual), then, once nothing is in flight there, the same process switches its role
  object (``pdd.roles.rerole``: same address, connections, weights) and is active again in the
  new role: as an MD in datacenter A it is routed P->MD requests over the fast path (no WAN,
  pipeline ``p_d``). Its prefix cache is flushed on the switch and the pages dropped are
  reported (``prefix_cache``) with its leaked pages, as on remove. Removed while re-roled, the
  slot is free again in its configured role; an add of it switches a process still running the
  other role back first (:meth:`Membership._slot_role_back`), before it is active. A re-roled
  instance's process restarted (in its launch role), and every ``rerole`` slot at the gateway's
  own start (which records the config's roles), are switched to the recorded role before they
  are routed to (:meth:`Membership.match_role`).
- a gateway restart keeps none of this: the membership lives in the gateway process, and a new
  one starts from the config (docs/SERVE.md "A restarted gateway starts from the config").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdd.text import shown
from pdd.policy.prefix_index import PrefixIndex
from pdd.policy.membership import ACTIVE, DRAINING, REMOVED, STANDBY, decide, decide_rerole
from pdd.roles.rerole import set_role_msg
from pdd.topology import ROLE_COLOCATED, ROLE_GATEWAY, ROLE_LINK, ROLE_MAIN, Layout, port_taken
from pdd.transfer.messages import Flush, Stats, WaitIdle

log = logging.getLogger(__name__)

ENGINE_ROLES = ("prefill", "relay_decode", "main_decode", "colocated")
# connect attempts to an instance being added (pdd.transfer.client.connect: 0.1 s, doubling up to
# 2 s apart): one already running (a join, ``start: false``) answers at once, so 7 tries (~6 s)
# are enough and a wrong slot is refused quickly; one the gateway starts itself needs its engine
# loaded first, so it is tried for ~90 s, and stops at once if its process exits
JOIN_RETRIES = 7
START_RETRIES = 50
START_TIMEOUT_S = 120.0  # an instance the gateway starts must print READY within this
EVENTS_KEPT = 200


def join_budget_s(retries: int, dead_after_s: float, backoff_s: float = 0.1, max_backoff_s: float = 2.0) -> float:
    """Seconds a join (an add of an instance already running) is given in all: the back-off
    between its ``retries`` + 1 connect attempts (``pdd.transfer.client.connect``: ``backoff_s``
    doubling up to ``max_backoff_s``) plus ``dead_after_s`` (liveness) once, for an instance that
    accepts connections but never answers (stopped, hung, behind a WAN outage), where each
    attempt would otherwise wait out its own 10 s handshake timeout."""
    total, delay = 0.0, backoff_s
    for _ in range(retries):
        total += delay
        delay = min(delay * 2, max_backoff_s)
    return total + dead_after_s


def event_level(ev: dict) -> int:
    """The log level of a membership event ``ev`` (as :meth:`Membership._set` records it): INFO
    for a change done as asked (an add, drain, remove or re-role, a forced removal whose requests
    were recovered elsewhere included); WARNING for a refusal (``rerole_refused``) and for a
    removal or re-role that left something behind: its cache flush failed (``prefix_cache.error``)
    or pages stayed in use (``leaked_pages`` > 0)."""
    if ev.get("op") == "rerole_refused":
        return logging.WARNING
    cache = ev.get("prefix_cache")
    if isinstance(cache, dict) and cache.get("error"):
        return logging.WARNING
    leaked = ev.get("leaked_pages")
    return logging.WARNING if isinstance(leaked, int) and leaked > 0 else logging.INFO


class MembershipError(Exception):
    """A refused operation: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request", 404: "not_found", 409: "conflict"}.get(status, "unavailable")


@dataclass
class Member:
    name: str
    role: str
    dc: str
    address: str  # host:port the instance listens on
    reached_at: str  # host:port the gateway dials (an MD in B: the WAN link's port for it)
    state: str
    source: str = "config"  # config (started with the topology), joined (added by address), started (by the gateway)
    since: float = field(default_factory=time.time)
    proc: subprocess.Popen | None = None


@dataclass(frozen=True)
class MemberInfo:
    """A read-only snapshot of one member (:meth:`Membership.members_of`)."""

    name: str
    role: str
    dc: str
    state: str
    source: str


def parse_address(addr: str) -> tuple[str, int]:
    """``host:port`` (an ``http://`` or ``tcp://`` prefix is allowed) -> (host, port). Raises
    MembershipError(400) for anything else."""
    a = addr.strip()
    for pre in ("http://", "https://", "tcp://"):
        if a.startswith(pre):
            a = a[len(pre):]
    a = a.rstrip("/")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535 or "/" in host or " " in host:
        raise MembershipError(400, f"address {shown(addr)} is not host:port (port 1-65535)", "address",
                              "bad_address")
    return host, int(port)


class Membership:
    """The gateway's membership of one topology (module docstring). Installs itself as
    ``orch.membership`` and sets ``orch.layout`` to its members' layout."""

    def __init__(self, orch, full: Layout, standby: list[str] | tuple[str, ...] = ()):
        self.orch, self.full = orch, full
        self.members: dict[str, Member] = {}
        for s in full.engines:
            host, port = full.host, s.port
            reach = full.address_from_a(s.name)
            self.members[s.name] = Member(s.name, s.role, s.dc, f"{host}:{port}", f"{reach[0]}:{reach[1]}",
                                          STANDBY if s.name in standby else ACTIVE)
        self.events: list[dict] = []
        self.changes: dict[str, int] = {"add": 0, "drain": 0, "remove": 0}  # and "rerole" once one happens
        self._busy_ops: set[str] = set()  # names with an add or remove under way
        self._removing: set[str] = set()  # names being removed: routed nothing from the removal's start
        self._watchers: dict[str, asyncio.Task] = {}  # name -> its _remove_when_idle
        # one per wait for an instance to go idle (a re-role's _until_idle, a _remove_when_idle):
        # in_flight_fell sets them all when something in flight may have ended (:meth:`_idle_waker`)
        self._idle_waits: set[asyncio.Event] = set()
        # instance -> why its process runs another role than the one recorded here and could not
        # be switched (:meth:`match_role`): not routed to until a reconnect switches it
        self.role_errors: dict[str, str] = {}
        self.admission = None  # the gateway's Admission once its HTTP app exists (its capacities follow)
        lv = getattr(getattr(orch, "cfg", None), "liveness", None)
        self.join_timeout_s = join_budget_s(JOIN_RETRIES, lv.dead_after_s if lv is not None else 5.0)
        orch.membership = self
        self._sync_layout()
        reg = getattr(getattr(orch, "metrics", None), "registry", None)
        if reg is not None:
            reg.register(MembershipCollector(self))

    # ------------------------------------------------------------------ queries
    def members_of(self, role: str | None = None, state: str | None = ACTIVE) -> tuple[MemberInfo, ...]:
        """Snapshots of the slots of ``role`` (None: every role) in ``state`` (None: any), in the
        config's slot order."""
        return tuple(MemberInfo(m.name, m.role, m.dc, m.state, m.source) for m in self.members.values()
                     if (role is None or m.role == role) and (state is None or m.state == state))

    @property
    def changing(self) -> bool:
        """Whether an add, remove or re-role is under way now."""
        return bool(self._busy_ops)

    def routable(self, name: str) -> bool:
        """Whether new requests may go to ``name``: an active member not being removed (or a
        name that is no slot of the membership)."""
        m = self.members.get(name)
        return m is None or (m.state == ACTIVE and name not in self._removing)

    def out_of_service(self, role: str) -> str:
        """Why no new request (nor a recovery attempt) can go to a ``role`` instance when none is
        routable: the message of :class:`pdd.gateway.state.NoMember`, naming the role and each
        of its slots' states (e.g. "p0 removed")."""

        def state(m: Member) -> str:
            return "being removed" if m.name in self._removing and m.state != REMOVED else m.state

        slots = ", ".join(f"{m.name} {state(m)}" for m in self.members.values() if m.role == role) or "no slot"
        return (f"no {role} instance is in service ({slots}): every one was removed or drained, and none serves "
                f"again until an operator adds one (POST /pdd/instances)")

    def in_flight_counts(self, name: str) -> dict[str, int]:
        """What is still in flight on ``name``, by kind: ``requests`` (the gateway's in-flight
        requests routed there, or the live requests naming it if more) and ``transfers`` (KV
        transfers: P's whose outcome it has not reported, and finished requests' KV still on its
        way to or from it). A request's own planned transfer counts once in each."""
        o = self.orch
        n = int(o.inflight.get(name, 0))
        n = max(n, sum(1 for st in list(o.reqs.values()) if name in getattr(st, "names", {}).values()))
        t = sum(1 for src in list(getattr(o, "planned_src", {}).values()) if src == name)
        t += sum(1 for _b, src in list(getattr(o, "superseded_wan", {}).values()) if src == name)
        t += sum(1 for pm in list(getattr(o, "awaiting_kv", {}).values()) if name in pm)
        return {"requests": n, "transfers": t}

    def busy(self, name: str) -> int:
        """Requests and transfers still in flight on ``name`` together (:meth:`in_flight_counts`):
        what ``in_flight`` reports and a removal without ``force`` waits for."""
        c = self.in_flight_counts(name)
        return c["requests"] + c["transfers"]

    def view(self, name: str) -> dict:
        m = self.members[name]
        peer = self.orch.peers.get(name)
        return {"name": m.name, "role": m.role, "slot_role": self.full.get(name).role, "dc": m.dc,
                "address": m.address, "reached_at": m.reached_at,
                "state": m.state, "source": m.source, "in_flight": self.busy(name) if m.state != STANDBY else 0,
                "routed": int(self.orch.routed.get(name, 0)),
                "connected": bool(peer is not None and not peer.closed), "since": round(m.since, 3),
                **({"role_error": self.role_errors[name]} if name in self.role_errors else {})}

    def listing(self) -> dict:
        return {"object": "list", "data": [self.view(n) for n in self.members],
                "changes": dict(self.changes), "events": self.events[-20:]}

    # ------------------------------------------------------------------ internals
    def _sync_layout(self) -> None:
        keep = tuple(s if s.role in (ROLE_GATEWAY, ROLE_LINK) or self.members[s.name].role == s.role
                     else dataclasses.replace(s, role=self.members[s.name].role)  # re-roled
                     for s in self.full.instances
                     if s.role in (ROLE_GATEWAY, ROLE_LINK) or self.members[s.name].state in (ACTIVE, DRAINING))
        self.orch.layout = Layout(self.full.mode, self.full.host, keep, self.full.link_control_port)

    def serving_layout(self) -> Layout:
        """The layout of the *active* members (each in its current role): what new requests can
        be routed to, so what admission's derived capacities count (``gateway.admission``)."""
        keep = tuple(s for s in self.orch.layout.instances
                     if s.role in (ROLE_GATEWAY, ROLE_LINK) or self.members[s.name].state == ACTIVE)
        return Layout(self.full.mode, self.full.host, keep, self.full.link_control_port)

    def sync_admission(self) -> None:
        """Recompute admission's capacities (in-flight slots, prefill queue tokens) for the
        active members (called on every membership change; a no-op before the HTTP app exists)."""
        adm = self.admission
        if adm is not None:
            from pdd.gateway.admission import resolve_limits

            adm.follow(resolve_limits(self.orch.cfg, self.serving_layout()))

    def _set(self, m: Member, state: str, op: str, frm: str | None = None, **info) -> None:
        old = frm or m.state
        m.state, m.since = state, time.time()
        self.changes[op] = self.changes.get(op, 0) + 1
        ev = {"time": round(m.since, 3), "op": op, "instance": m.name, "role": m.role, "from": old, "to": state, **info}
        self.events.append(ev)
        del self.events[:-EVENTS_KEPT]
        self._sync_layout()
        self.sync_admission()
        self._changed()
        self.in_flight_fell()  # a watcher of it stops waiting once it is no longer draining
        log.log(event_level(ev), "membership: %s", json.dumps(ev, sort_keys=True))

    def _changed(self) -> None:
        """Wake the recoveries waiting for an instance (``Orchestrator.topology_changed``): one
        added serves them at once; with a role's last one removed they fail at once (NoMember)."""
        notify = getattr(self.orch, "topology_changed", None)
        if notify is not None:
            notify()

    def _get(self, name: str) -> Member:
        m = self.members.get(name)
        if m is None:
            raise MembershipError(404, f"no instance named {shown(name)} in the {self.full.mode} topology (instances: "
                                       f"{', '.join(self.members)})", "name", "instance_not_found")
        return m

    def _others_active(self, m: Member) -> int:
        """The other active instances of ``m``'s role: one being removed (its cache flush
        awaited, still ``active`` until it is done) is not, so two overlapping removals (or a
        removal and a drain) cannot take a role's last instances out of service without force."""
        return sum(1 for x in self.members.values()
                   if x.role == m.role and x.name != m.name and x.state == ACTIVE and x.name not in self._removing)

    def _slot_for(self, role: str, name: str | None, address: str | None) -> Member:
        roles = sorted({m.role for m in self.members.values()})
        if role not in ENGINE_ROLES:
            raise MembershipError(400, f"unknown role {shown(role)}; expected one of {', '.join(ENGINE_ROLES)}", "role",
                                  "unknown_role")
        if role not in roles:
            raise MembershipError(400, f"the {self.full.mode} topology has no {role} instances (roles: "
                                       f"{', '.join(roles)})", "role", "unknown_role")
        want = None
        if address is not None:
            host, port = parse_address(address)
            want = port
            if host not in (self.full.host, "localhost", "127.0.0.1") and self.full.host not in (host,):
                raise MembershipError(409, f"address {shown(address)}: host {shown(host)} is not this topology's host "
                                           f"{self.full.host}", "address", "address_conflict")
            holder = next((x for x in self.members.values() if x.state in (ACTIVE, DRAINING)
                           and port in (int(x.address.rsplit(":", 1)[1]), int(x.reached_at.rsplit(":", 1)[1]))),
                          None)
            if holder is not None:
                raise MembershipError(409, f"address {shown(address)} is already a member's: {holder.name} "
                                           f"({holder.state})", "address", "duplicate_address")
        if name is not None:
            m = self._get(name)
            if role not in (m.role, self.full.get(name).role):  # its role now (re-roled) or its slot's
                raise MembershipError(400, f"instance {name} is a {m.role} slot, not {role}", "role", "role_mismatch")
            if want is not None and want not in (int(m.address.rsplit(":", 1)[1]), int(m.reached_at.rsplit(":", 1)[1])):
                raise MembershipError(409, f"address {shown(address)} is not instance {name}'s ({m.address}; every "
                                           f"instance listens where the config's layout puts it)", "address",
                                      "address_conflict")
            return m
        cands = [m for m in self.members.values() if m.role == role]
        if want is not None:
            at = [m for m in cands if want in (int(m.address.rsplit(":", 1)[1]), int(m.reached_at.rsplit(":", 1)[1]))]
            if not at:
                raise MembershipError(404, f"no {role} slot of the config listens at {shown(address)} (slots: "
                                           f"{', '.join(m.name + ' ' + m.address for m in cands)})", "address",
                                      "instance_not_found")
            return at[0]
        free = [m for m in cands if m.state in (STANDBY, REMOVED)]
        if not free:
            raise MembershipError(409, f"every {role} slot is a member: raise instances.{role} in the config and "
                                       "list the new ones in standby", "role", "no_free_slot")
        return free[0]

    # ------------------------------------------------------------------ operations
    async def add(self, role: str, name: str | None = None, address: str | None = None, start: bool = False) -> dict:
        """Add an instance of ``role``: the slot ``name``, or the one listening at ``address``, or
        the role's first free slot. ``start``: the gateway starts the process itself (its engine
        block from the config's tiers), unless the slot's instance already runs (its port is
        taken: one ``pdd serve`` started and a remove left running idle), which is joined instead,
        as a second process could not bind its ports; else it must be running already (``pdd
        launch --join``). A slot the config's ``rerole`` lists is switched back to its role first if
        its instance runs the other (:meth:`_slot_role_back`). Raises MembershipError (400 bad role
        or address, 404 no such slot, 409 duplicate or another instance answering there, 503 not
        reachable / did not start / did not switch back to the slot's role)."""
        m = self._slot_for(role, name, address)
        d = decide("add", m.name, m.role, m.state)
        if not d.ok or m.name in self._busy_ops:
            raise MembershipError(409, d.message or f"instance {m.name} is being changed now", "name", "duplicate")
        self._busy_ops.add(m.name)
        try:
            if start and port_taken(self.full.host, int(m.address.rsplit(":", 1)[1])):
                log.info("membership: %s already listens at %s: joining it rather than starting a second "
                         "process", m.name, m.address)
                start = False
            if start:
                m.proc = await asyncio.to_thread(self._start_process, m)
            try:
                peer = await self._reach(m, START_RETRIES if start else JOIN_RETRIES)
            except Exception as e:
                self._stop_process(m)
                log.warning("add %s (%s) failed: not reachable at %s: %s: %s", m.name, m.role, m.reached_at,
                            type(e).__name__, e)
                raise MembershipError(503, f"instance {m.name} is not reachable at {m.reached_at}: "
                                           f"{type(e).__name__}: {e}", "address", "unreachable") from None
            who = (getattr(peer, "remote_hello", None) or {}).get("instance")
            if who is not None and who != m.name:  # without TLS nothing else says who listens there
                await peer.close()
                self._stop_process(m)
                role = (peer.remote_hello or {}).get("role")
                log.warning("add %s (%s) refused: %s (%s) answers at %s", m.name, m.role, shown(who), shown(role),
                            m.reached_at)
                raise MembershipError(409, f"the instance at {m.reached_at} is {shown(who)} ({shown(role)}), not "
                                           f"{m.name}: another instance listens at this slot's address", "address",
                                      "identity_mismatch")
            switched = await self._slot_role_back(m, peer)
            old = self.orch.peers.get(m.name)
            self.orch.peers[m.name] = peer
            if old is not None and old is not peer:
                await old.close()
            if m.role == ROLE_MAIN and m.dc == "B":  # a cold cache as far as routing knows
                e = self.orch.cfg.engine_for(m.name)
                self.orch.prefix_index[m.name] = PrefixIndex(e.page_size, e.num_pages)
            m.source = "started" if start else "joined"
            self._set(m, ACTIVE, "add", source=m.source, **switched)
        finally:
            self._busy_ops.discard(m.name)
        return {**self.view(m.name), **switched}

    async def _slot_role_back(self, m: Member, peer) -> dict:
        """Before slot ``m`` (one the config's ``rerole`` lists) is active again: ask its instance
        the role it runs (``stats``) and, if not the slot's (``m.role``: re-roled, then removed,
        its process kept running), switch it back in-process as a re-role does (``set_role``, its
        prefix cache flushed), so no request meets a role object the gateway does not route it
        as. Returns ``{}`` (nothing to switch, or a slot that cannot be re-roled) or
        ``{"role_from", "prefix_cache"}``. Raises MembershipError(503, ``rerole_failed``) when
        the instance does not answer or refuses (``peer`` closed, a process the gateway started
        stopped): it is not added."""
        if m.name not in getattr(self.orch.cfg, "rerole", ()):
            return {}
        runs = None
        try:
            rep, _ = await peer.call(Stats().wire(), timeout=10)
            runs = rep.get("role")
            if runs is None or runs == m.role:
                return {}
            rep, _ = await peer.call(set_role_msg(m.role), timeout=60)
        except Exception as e:
            await peer.close()
            self._stop_process(m)
            what = (f"runs as {shown(runs)} and did not switch back to its slot's role {m.role}" if runs else
                    f"did not say the role it runs (stats; a re-roled one is switched back to its slot's role "
                    f"{m.role} before it is added)")
            log.warning("add %s refused: it %s: %s: %s", m.name, what, type(e).__name__, e)
            raise MembershipError(503, f"instance {m.name} {what}: {type(e).__name__}: {e}; it is not added", "name",
                                  "rerole_failed") from None
        return {"role_from": runs,
                "prefix_cache": {"fate": "flushed on the role switch back to the slot's role",
                                 "pages_dropped": int(rep["pages_dropped"]),
                                 "tokens_dropped": int(rep["tokens_dropped"])}}

    async def match_role(self, name: str, peer, after: str) -> bool:
        """Make the role instance ``name``'s process runs agree with the role the gateway records
        for it (``Member.role``) before ``peer``, a new connection to it, is routed to: for a slot
        the config's ``rerole`` lists, ask it the role it runs (``stats``) and, if not the recorded
        one, switch it in-process as a re-role does (``set_role``, its prefix cache flushed). A
        restarted instance runs its launch role (its supervisor restarts it as the slot's role,
        not as the operator re-roled it), and a restarted gateway records the slot's role while
        the process may still run the other. ``after``: what brought the new connection
        ("reconnect", "gateway start"), named in the log line and the event. A switch is logged
        at WARNING (its event line at INFO) and recorded as event ``role_restored`` (``role_from``, ``after``,
        ``prefix_cache``). Returns True when the roles agree (nothing to do, the switch made, a
        slot that cannot be re-roled, or an instance that does not say its role); False when the
        instance did not answer or refused the switch: then ``role_errors[name]`` says why
        (``/pdd/instances`` shows it as ``role_error``), one WARNING is logged per new reason, and
        the caller must not route to it (it closes ``peer``; the reconnect watcher tries again).
        Raises nothing."""
        m = self.members.get(name)
        if m is None or name not in getattr(self.orch.cfg, "rerole", ()):
            return True
        runs = None
        try:
            rep, _ = await peer.call(Stats().wire(), timeout=10)
            runs = rep.get("role")
            if runs is None or runs == m.role:
                self._role_ok(name)
                return True
            rep, _ = await peer.call(set_role_msg(m.role), timeout=60)
        except Exception as e:
            what = (f"runs as {runs}, not as {m.role} (the role the gateway records for it), found at {after}, and "
                    f"did not switch" if runs else f"did not say the role it runs (stats) at {after}")
            why = (f"instance {name} {what}: {type(e).__name__}: {e}; no request is routed to it; tried again at "
                   f"each reconnect (every {self.orch.cfg.liveness.reconnect_interval_s:g} s)")
            if self.role_errors.get(name) != why:
                log.warning("membership: %s", why)
            self.role_errors[name] = why
            return False
        self._role_ok(name)
        cache = {"fate": f"flushed on the role switch to {m.role}", "pages_dropped": int(rep["pages_dropped"]),
                 "tokens_dropped": int(rep["tokens_dropped"])}
        log.warning("membership: instance %s ran as %s, not as %s (the role the gateway records for it), found at %s "
                    "(a restarted instance runs its launch role; a restarted gateway records the slot's role): "
                    "switched it to %s before routing to it", name, runs, m.role, after, m.role)
        self._set(m, m.state, "role_restored", role_from=runs, after=after, prefix_cache=cache)
        return True

    def _role_ok(self, name: str) -> None:
        """Instance ``name``'s process runs the role the gateway records: its ``role_errors``
        entry (:meth:`match_role`) goes, logged at INFO once it was there."""
        if self.role_errors.pop(name, None) is not None:
            log.info("membership: instance %s runs the role the gateway records for it again", name)

    async def _reach(self, m, retries: int):
        """Connect to the instance being added (``retries``: see JOIN_RETRIES); raises the connect
        error, ConnectionError at once when a process the gateway started has exited, or
        TimeoutError when one already running (a join) has not answered within
        ``join_timeout_s`` (:func:`join_budget_s`)."""
        conn = asyncio.ensure_future(self.orch._connect(m.name, retries=retries))
        proc = getattr(m, "proc", None)
        if proc is None:
            try:
                return await asyncio.wait_for(conn, self.join_timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                if conn.done() and not conn.cancelled() and conn.exception() is not None:
                    raise conn.exception() from None  # the connect's own timeout error
                raise TimeoutError(f"no connection to it answered the handshake within "
                                   f"{self.join_timeout_s:g} s") from None
        while proc is not None and not conn.done():
            await asyncio.wait({conn}, timeout=0.5)
            code = proc.poll() if hasattr(proc, "poll") else None
            if code is not None and not conn.done():
                conn.cancel()
                raise ConnectionError(f"its process exited with {code} before it listened")
        return await conn

    def _refuse_while_changing(self, name: str) -> None:
        """MembershipError(409, ``conflict``) while an add, remove or re-role of ``name`` is under
        way (a drain or remove then would race it)."""
        if name in self._busy_ops:
            raise MembershipError(409, f"instance {name} is being changed now (an add, remove or re-role): retry "
                                       f"once that has answered", "name", "conflict")

    async def drain(self, name: str, force: bool = False, remove_when_idle: bool = False) -> dict:
        """Stop routing new requests to ``name``; requests in flight finish there. With
        ``remove_when_idle`` it is removed (:meth:`remove`) once nothing is in flight. Raises
        MembershipError: 404 no such instance, 409 not a member, the role's last active one
        (unless ``force``), or an add, remove or re-role of it under way."""
        m = self._get(name)
        self._refuse_while_changing(name)  # a re-role's own drain would be undone as it ends (active again)
        d = decide("drain", name, m.role, m.state, others_active=self._others_active(m), force=force)
        if not d.ok:
            raise MembershipError(d.status, d.message, "name", "conflict")
        if m.state != DRAINING:
            self._set(m, DRAINING, "drain", in_flight=self.busy(name))
        out = self.view(name)
        then = ("the gateway removes it once in_flight is 0" if remove_when_idle or name in self._watchers
                else "remove it when in_flight is 0")
        out["message"] = d.message or (f"no new requests go to {name}; its {out['in_flight']} in-flight request(s) "
                                       f"finish there; {then}")
        out["prefix_cache"] = await self._cache_view(name)
        if remove_when_idle and name not in self._watchers:
            self._watchers[name] = asyncio.get_running_loop().create_task(self._remove_when_idle(name))
            out["remove_when_idle"] = True
        return out

    def in_flight_fell(self) -> None:
        """Something in flight left the orchestrator's bookkeeping (``Orchestrator._released``),
        or a member's state changed (:meth:`_set`): wake every removal waiting for its instance to
        go idle (:meth:`_remove_when_idle`) and every re-role waiting for its drain
        (:meth:`_until_idle`), which look again. Cheap: no count is taken here."""
        for ev in self._idle_waits:
            ev.set()

    @contextlib.contextmanager
    def _idle_waker(self):
        """An event :meth:`in_flight_fell` sets, while the ``with`` block lasts (a waiter clears
        it before each look, so an end after the look sets it again)."""
        wake = asyncio.Event()
        self._idle_waits.add(wake)
        try:
            yield wake
        finally:
            self._idle_waits.discard(wake)

    async def _until_idle(self, name: str, wait_s: float) -> bool:
        """Wait until nothing is in flight on ``name`` (:meth:`busy` 0), woken by
        :meth:`in_flight_fell` as each request or transfer there ends, not by a poll; at most
        ``wait_s`` seconds of the event loop's clock. True once idle, False when the time ran out
        first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        with self._idle_waker() as wake:
            while self.busy(name) > 0:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                wake.clear()  # (nothing ran since the look: an end sets it again)
                try:
                    await asyncio.wait_for(wake.wait(), left)
                except asyncio.TimeoutError:
                    pass  # looked at once more: it may have gone idle as the time ran out
            return True

    async def _remove_when_idle(self, name: str) -> None:
        """Remove ``name`` (draining) as soon as nothing is in flight there (:meth:`busy` 0), woken
        by :meth:`in_flight_fell` as each request or transfer there ends, not by a poll; stop
        waiting once it is no longer draining (removed, added back). A refused removal is logged."""
        try:
            with self._idle_waker() as wake:
                while self.members[name].state == DRAINING:
                    if self.busy(name) == 0:
                        try:
                            await self.remove(name)
                        except MembershipError as e:
                            log.warning("membership: removing drained %s when idle failed: %s", name, e.message)
                        return
                    wake.clear()  # (nothing ran since the look: an end sets it again)
                    await wake.wait()
        finally:
            self._watchers.pop(name, None)

    async def _cache_view(self, name: str) -> dict:
        """What ``name``'s pool holds now, split as the instance's ``pdd_kv_pages{state}``
        (``StatsOk``): ``pages_in_use`` held by requests, ``pages_cached`` held only by the prefix
        cache (``pages_cached``; both None from an instance that does not report it), and
        ``pages_free``, ``pages_total`` (free + cached + in_use = total; all None when it cannot
        be asked); ``running``; and what happens to the cache (``fate``)."""
        out: dict = {"fate": "kept while draining (no new request reads it); dropped with the instance on remove"}
        unknown = dict.fromkeys(("pages_in_use", "pages_cached", "pages_free", "pages_total"))
        peer = self.orch.peers.get(name)
        if peer is None or peer.closed:
            out.update(unknown)
            return out
        try:
            rep, _ = await peer.call(Stats().wire(), timeout=10)
            total, free = int(rep["pages_total"]), int(rep["pages_free"])
            cached = rep.get("pages_cached")
            cached = None if cached is None else min(int(cached), total - free)  # as metrics.kv_pages
            out.update(pages_in_use=None if cached is None else total - free - cached, pages_cached=cached,
                       pages_free=free, pages_total=total)
            out["running"] = int(rep.get("running", 0))
        except Exception as e:
            out.update(unknown)
            out["error"] = f"{type(e).__name__}: {e}"
        ix = self.orch.prefix_index.get(name)
        if ix is not None:
            out["gateway_index_pages"] = len(ix)
        return out

    async def remove(self, name: str, force: bool = False) -> dict:
        """Remove ``name`` from the topology: refused (409) while anything is in flight there
        unless ``force``, and for the role's last active instance unless ``force``. Returns its
        view with ``in_flight_at_removal`` (what was in flight there at the removal, by kind:
        :meth:`in_flight_counts`), ``prefix_cache`` (what became of its cache: ``flushed``,
        ``fate``, pages and tokens dropped), ``leaked_pages`` (its pages still in use after the
        flush; None when unknown), ``forced`` (True only when requests were in flight there and
        were recovered elsewhere: a ``force`` removal with nothing in flight answers False) and,
        when requests reached it while it was being removed, ``in_flight_recovered`` (those
        requests and transfers together). Raises MembershipError
        (404 no such slot, 409 ``conflict`` while an add, remove or re-role of it is under way, before
        anything else is checked, else refused as above).

        An idle instance's cache is flushed over the gateway's connection, which is then closed.
        Its requests in flight (``force``, or routed there just before the call and assigned
        while its cache was flushed) are recovered as after an instance loss and the gateway's
        connection closed before the flush: the instance then aborts every request it held for
        the gateway, freeing each one's pages once (``pdd.roles.base``: ``_owner_gone``; an abort
        is idempotent there), and its cache is flushed over a fresh connection once nothing runs
        there, so the cache pages those requests held (a flush evicts only unlocked pages) are
        dropped too. A flush that fails leaves the cache with the instance's process, and says
        so (``flushed`` false, ``error``). The gateway's prefix index of it is forgotten; a
        process the gateway started is stopped."""
        m = self._get(name)
        self._refuse_while_changing(name)  # first: a re-role's own drain is what keeps requests there (not in_flight)
        counts = self.in_flight_counts(name)
        busy = counts["requests"] + counts["transfers"]
        d = decide("remove", name, m.role, m.state, busy=busy, others_active=self._others_active(m), force=force)
        if not d.ok:
            raise MembershipError(d.status, d.message, "name", d.code)
        self._busy_ops.add(name)
        self._removing.add(name)  # no new request goes there while its cache is flushed (awaits)
        self._changed()  # a recovery waiting for the role's last instance fails now (NoMember)
        late = 0
        try:
            o = self.orch
            peer = o.peers.get(name)
            connected = peer is not None and not peer.closed
            cache: dict = {"flushed": False}
            leaked = None
            freed = False  # whether the instance confirmed it freed the requests it aborted (wait_idle)
            reachable = connected
            if connected and not busy:  # idle: flushed over the gateway's connection
                try:
                    leaked = await self._flush_cache(name, peer, cache)
                except Exception as e:
                    cache["error"] = f"{type(e).__name__}: {e}"
                    # no answer (its heartbeat went silent, the call timed out): not asked again below
                    reachable = not isinstance(e, (ConnectionError, TimeoutError))
                late_counts = self.in_flight_counts(name)  # routed there before the removal began, assigned since
                counts = {k: counts[k] + late_counts[k] for k in counts}
                late = late_counts["requests"] + late_counts["transfers"]
            recovered = busy + late
            ix = o.prefix_index.pop(name, None)
            cache["gateway_index_pages_forgotten"] = len(ix) if ix is not None else 0
            wp = getattr(o, "wan_peers", None)
            if wp is not None:  # its WAN estimates (pdd_wan_peer_* on /metrics) go with it
                wp.forget(name)
            if recovered and peer is not None:  # forced (or late): recovered as after a loss, asked for
                o._peer_closed(name, peer, removed="force" if force and busy else "")
            old = m.state
            m.state = REMOVED  # not routable from here on
            o.peers.pop(name, None)  # a reconnect under way leaves it out (Orchestrator._reconnect)
            if peer is not None:  # the instance aborts what it still holds for the gateway (each freed once)
                await peer.close()
            if reachable and (recovered or cache.get("live_requests")):
                # the flush (if any) ran beside requests, whose cache pages it could not evict:
                # again, once the instance has freed them
                leaked, freed = await self._flush_after_close(name, cache)
            cache["fate"] = self._removal_fate(cache, connected, counts, freed=freed, started=m.proc is not None)
            self._set(m, REMOVED, "remove", frm=old, forced=bool(force and busy), in_flight=recovered,
                      in_flight_at_removal=counts, prefix_cache=cache, leaked_pages=leaked)
            served = m.role  # the event and the answer say the role it served in
            m.role = self.full.get(name).role  # a free slot again, of its configured role (an add switches it back)
            await asyncio.to_thread(self._stop_process, m)
        finally:
            self._busy_ops.discard(name)
            self._removing.discard(name)
        out = {**self.view(name), "role": served}
        out.update(in_flight_at_removal=counts, prefix_cache=cache, leaked_pages=leaked, forced=bool(force and busy))
        if late:
            out["in_flight_recovered"] = late
        return out

    async def _flush_cache(self, name: str, peer, cache: dict) -> int | None:
        """Flush ``name``'s prefix cache over ``peer`` and add to ``cache``: ``flushed``,
        ``pages_dropped`` (the pages the flush evicted, as the instance counts them: ``FlushOk``;
        from an instance that does not, its pages in use before (``Stats``) less after),
        ``tokens_dropped``, and ``live_requests`` when requests still ran there. Returns its
        pages in use after the flush (leaked), or None when requests still ran there (their
        pages are no leak, and the count cannot tell them apart). Raises what the calls raise."""
        rep, _ = await peer.call(Stats().wire(), timeout=10)
        held = int(rep["pages_total"]) - int(rep["pages_free"])
        fl, _ = await peer.call(Flush().wire(), timeout=30)
        left = int(fl["pages_total"]) - int(fl["pages_free"])
        evicted = fl.get("pages_dropped")
        dropped = cache.get("pages_dropped", 0) + (int(evicted) if evicted is not None else max(0, held - left))
        cache.update(flushed=True, pages_dropped=dropped,
                     tokens_dropped=dropped * self.orch.cfg.engine_for(name).page_size)
        live = int(fl.get("live_requests", 0))
        if live:
            cache["live_requests"] = live
            return None
        cache.pop("live_requests", None)
        return left

    async def _flush_after_close(self, name: str, cache: dict, settle_s: float = 10.0) -> tuple[int | None, bool]:
        """Flush ``name``'s cache over a fresh connection after the gateway's own one closed with
        requests in flight there (the instance aborts them, each freed once, as its owner is
        gone): once the instance says the requests it held are gone, their pages freed
        (``WaitIdle``: it answers on their release, at most ``settle_s`` seconds later), so the
        pages they shared with the cache are flushed too. Returns the leaked pages as
        :meth:`_flush_cache` (None when requests still ran there or the flush failed:
        ``cache["error"]`` says why) and whether the instance confirmed it had freed the requests
        it held (its ``WaitIdle`` answer: ``left`` 0). Raises nothing."""
        o = self.orch
        dead_s = o.cfg.liveness.dead_after_s
        try:  # an instance that does not answer (across a WAN outage) costs dead_after_s, once
            peer = await asyncio.wait_for(o._connect(name, retries=2), dead_s)
        except (asyncio.TimeoutError, TimeoutError):
            cache["error"] = (f"TimeoutError: instance {name} did not answer a new connection within "
                              f"{dead_s:g} s (liveness.dead_after_s)")
            return None, False
        except Exception as e:
            cache["error"] = f"{type(e).__name__}: {e}"
            return None, False
        freed = False
        try:  # connected: its heartbeat finds it dead within dead_after_s should it go silent now
            rep, _ = await peer.call(WaitIdle(settle_s).wire(), timeout=settle_s + dead_s)
            freed = int(rep.get("left", 0)) == 0
            cache.pop("error", None)
            return await self._flush_cache(name, peer, cache), freed
        except Exception as e:
            cache["error"] = f"{type(e).__name__}: {e}"
            return None, freed
        finally:
            await peer.close()

    @staticmethod
    def _removal_fate(cache: dict, connected: bool, counts: dict[str, int], freed: bool = False,
                      started: bool = False) -> str:
        """What became of a removed instance's prefix cache and pages, in words
        (``prefix_cache.fate``), from what the gateway knows: ``cache`` as :meth:`remove` filled
        it, ``connected`` whether the gateway was connected to it, ``counts`` what was in flight
        there (:meth:`in_flight_counts`: the requests, recovered elsewhere, and the KV transfers,
        given up), each kind counted and named, ``freed`` whether the instance confirmed it had
        freed the pages of the requests it aborted as the gateway's connection closed
        (``wait_idle`` answered), ``started`` whether the gateway started its process (it stops
        it next: SIGTERM, then SIGCONT, so a frozen one, which frees nothing while stopped, runs
        its clean stop too)."""
        index = "the gateway's prefix index of it is forgotten, so routing counts no hits there"
        err = cache.get("error")
        r, t = counts.get("requests", 0), counts.get("transfers", 0)
        what = " and ".join(x for x in (f"{r} request(s)" if r else "", f"{t} KV transfer(s)" if t else "") if x)
        stopped = ("the gateway stops the process it started (SIGTERM, then SIGCONT so that a frozen one runs its "
                   "clean stop too; SIGKILL if it has not exited 10 s later), and its pages go with it")
        kept = ("the gateway did not start its process and does not stop it: running, or frozen (SIGSTOP) until it "
                "is resumed, it keeps them (stop it yourself)")
        unconfirmed = ("frees their pages once it reads that close, which it did not confirm (a frozen instance "
                       "frees nothing until it is resumed)")
        if not connected:
            proc = stopped if started else (
                "the gateway did not start its process and does not stop it: one that died took its pages with it, "
                "one restarted since started empty, one still running, or frozen (SIGSTOP) until it is resumed, "
                "keeps them (stop it yourself)")
            return (f"not flushed: the gateway was not connected to the instance (its connection lost: the instance "
                    f"dead, frozen or cut off), so it neither flushed its cache nor learned its pages; {proc}; "
                    f"{index}")
        proc = stopped if started else kept
        if not cache.get("flushed"):
            if not what:
                aborted = ""
            elif freed:
                aborted = (f"; the instance said it had aborted the {what} in flight there and freed their pages "
                           f"(the gateway closed its connection first)")
            else:
                aborted = (f"; the gateway closed its connection, on which the instance aborts the {what} in flight "
                           f"there and {unconfirmed}")
            return f"not flushed: the flush failed ({err}){aborted}; its cache pages are unknown here: {proc}; {index}"
        if err:  # flushed before requests reached it, not once they were freed
            them = ("the instance said it had aborted them and freed their pages" if freed else
                    f"the gateway closed its connection, on which the instance aborts them and {unconfirmed}")
            return (f"flushed, but not again after the {what or 'requests'} that reached it during that flush "
                    f"({err}): {them}; the cache pages they held are unknown here: {proc}; {index}")
        if what:
            fate = {(True, False): "recovered elsewhere", (False, True): "given up",
                    (True, True): "the requests recovered elsewhere, the transfers given up"}[(r > 0, t > 0)]
            how = (f"flushed once the instance had freed the pages of the {what} in flight there ({fate}: the "
                   f"gateway closed its connection first, so the instance aborted them)")
        else:
            how = "flushed"
        if cache.get("live_requests"):
            how += (f"; {cache['live_requests']} request(s) still ran there at the flush: the pages they held "
                    f"are not counted")
        return f"{how} and dropped with the instance; {index}"

    async def rerole(self, name: str, role: str, force: bool = False, wait_s: float | None = None) -> dict:
        """Give instance ``name`` (a relay decoder the config's ``rerole`` lists) ``role``
        (main_decode: MD duty in datacenter A; relay_decode: back). Drains it, waits until nothing
        is in flight there (:meth:`_until_idle`: woken as the last request or transfer there ends;
        at most ``wait_s`` seconds, default the request timeout), switches the role in
        the same process (``pdd.roles.rerole``) and makes it active again in the new role.
        Returns its view with ``prefix_cache`` (pages flushed on the switch), ``leaked_pages`` and
        ``drained_in_flight``. Raises MembershipError: 400 bad role, 403 not allowed by the config,
        404 no such instance, 409 not active / last of its role / still busy after ``wait_s``
        (it is active again in its old role), 503 the instance refused or was lost."""
        m = self._get(name)
        o = self.orch
        if name in self._busy_ops:
            raise MembershipError(409, f"instance {name} is being changed now", "name", "conflict")
        d = decide_rerole(name, m.role, role, m.state, m.dc, allowed=name in getattr(o.cfg, "rerole", ()),
                          others_active=self._others_active(m), force=force)
        if not d.ok:
            code = {400: "unknown_role", 403: "rerole_not_allowed"}.get(d.status, "conflict")
            msg = d.message.replace(repr(role), shown(role), 1)  # an unknown role, bounded
            raise MembershipError(d.status, msg, "role" if d.status == 400 else "name", code)
        if not d.changed:
            return {**self.view(name), "message": d.message, "changed": False}
        self._busy_ops.add(name)
        frm = m.role
        try:
            in_flight = self.busy(name)
            self._set(m, DRAINING, "drain", in_flight=in_flight, reason=f"rerole to {role}")
            # in-flight relays finish (or hand off to MD) where they are
            if not await self._until_idle(name, o.cfg.request_timeout_s if wait_s is None else wait_s):
                self._set(m, ACTIVE, "rerole_refused", frm=DRAINING, refused=f"still {self.busy(name)} in flight")
                raise MembershipError(409, f"instance {name} still has {self.busy(name)} request(s) in flight "
                                           f"after draining; it is active as {frm} again", "name", "in_flight")
            peer = o.peers.get(name)
            try:
                if peer is None or peer.closed:
                    raise ConnectionError("not connected")
                rep, _ = await peer.call(set_role_msg(role), timeout=60)
            except Exception as e:
                self._set(m, ACTIVE, "rerole_refused", frm=DRAINING, refused=f"{type(e).__name__}: {e}")
                raise MembershipError(503, f"instance {name} did not change role: {type(e).__name__}: {e}; it is "
                                           f"active as {frm} again", "name", "rerole_failed") from None
            leaked = int(rep["pages_total"]) - int(rep["pages_free"])
            cache = {"fate": "flushed on the role switch (an RLD keeps no prefix cache; an MD's starts cold)",
                     "pages_dropped": int(rep["pages_dropped"]), "tokens_dropped": int(rep["tokens_dropped"])}
            ix = o.prefix_index.pop(name, None)  # routing peeks an instance in A; nothing indexed of it stays
            cache["gateway_index_pages_forgotten"] = len(ix) if ix is not None else 0
            m.role = role
            self._set(m, ACTIVE, "rerole", frm=DRAINING, role_from=frm, drained_in_flight=in_flight,
                      prefix_cache=cache, leaked_pages=leaked)
        finally:
            self._busy_ops.discard(name)
        return {**self.view(name), "changed": True, "role_from": frm, "drained_in_flight": in_flight,
                "prefix_cache": cache, "leaked_pages": leaked}

    # ------------------------------------------------------------------ processes (pdd serve)
    def _start_process(self, m: Member) -> subprocess.Popen:
        """Start slot ``m`` as ``pdd launch`` would (its engine block: the config's tiers), a child
        of the gateway (it stops with it); wait for its READY line."""
        cfg = self.orch.cfg
        d = Path(tempfile.mkdtemp(prefix=f"pdd-{m.name}-"))
        cfg_file = d / "cluster.json"
        cfg_file.write_text(cfg.model_dump_json(indent=1))
        from pdd.spawn import spawn_instance, start_failure_cause

        p, ready = spawn_instance(cfg, m.role, m.name, cfg_file, d / f"{m.name}.log")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.05):
            if p.poll() is not None or time.monotonic() > deadline:
                self._kill(p)
                raise MembershipError(503, f"instance {m.name} did not start: "
                                           f"{start_failure_cause(d / f'{m.name}.log')}", "start", "start_failed")
        log.info("membership: started %s (%s), log %s", m.name, m.role, d / f"{m.name}.log")
        return p

    @staticmethod
    def _kill(p: subprocess.Popen) -> None:
        """Stop a process the gateway started: SIGTERM to its process group (its clean stop),
        then SIGCONT, so that one stopped (SIGSTOP, a frozen instance) runs that clean stop too
        rather than sitting out the grace, as systemd does; SIGKILL if it has not exited 10 s
        later. (A stopped one took the whole 10 s, then was killed.)"""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                os.killpg(p.pid, signal.SIGCONT)  # after SIGTERM: it is the first thing a resumed one sees
                p.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _stop_process(self, m: Member) -> None:
        if m.proc is not None:
            self._kill(m.proc)
            m.proc = None

    def stop_all(self) -> None:
        for m in self.members.values():
            self._stop_process(m)


class MembershipCollector:
    """Prometheus view of the membership: per instance its state, in-flight count and the
    requests ever routed to it."""

    def __init__(self, ms: Membership):
        self.ms = ms

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ms = self.ms
        c = CounterMetricFamily("pdd_gateway_routed", "requests (attempts) the gateway routed to each instance",
                                labels=["instance", "role"])
        g = GaugeMetricFamily("pdd_gateway_instance_in_flight", "requests and transfers in flight on each instance",
                              labels=["instance", "role"])
        s = GaugeMetricFamily("pdd_gateway_instance_state", "1 for each instance's membership state",
                              labels=["instance", "role", "state"])
        for m in ms.members.values():
            c.add_metric([m.name, m.role], int(ms.orch.routed.get(m.name, 0)))
            g.add_metric([m.name, m.role], ms.busy(m.name) if m.state != STANDBY else 0)
            s.add_metric([m.name, m.role, m.state], 1)
        yield c
        yield g
        yield s
        ch = CounterMetricFamily("pdd_gateway_membership_changes", "membership changes by operation", labels=["op"])
        for op, n in sorted(ms.changes.items()):
            ch.add_metric([op], n)
        yield ch


__all__ = ["Membership", "MembershipError", "Member", "MemberInfo", "parse_address", "ROLE_COLOCATED"]
