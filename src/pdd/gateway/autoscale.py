"""The autoscaling loop in the gateway (``pdd serve --autoscale``, config ``autoscale``; docs/SERVE.md
"Autoscaling"). Every ``autoscale.sample_s`` it samples each scaled role's load; every
``autoscale.interval_s`` it runs the pure rule (``pdd.policy.autoscale.decide_mix``) on the
interval's means and applies the decision through the membership operations
(``pdd.gateway.membership``):

- up: add the role's first free slot (``Membership.add``; the gateway starts its process when
  ``autoscale.start``);
- down: the active instance of the role ``pick_drain`` picks (one serving the role outside
  its slots' datacenter first, a relay decoder re-roled to main-decode duty in A; then the fewest
  requests in flight, the latest added first on a tie). A re-roled relay decoder is switched back
  to its slot's role (``Membership.rerole``: drained, its in-flight requests finish there, then
  it relays again), so a scale-down of MD never shrinks the relay tier the config declared; any
  other is drained with ``remove_when_idle``: no new request goes there, its in-flight ones finish
  where they are, and it is removed once idle. The membership refuses to drain a role's last
  active instance, and the rule never goes below ``min`` (>= 1), so no request fails because of a
  scaling change.

Measured per role, over the interval: utilisation = mean of (the gateway's in-flight requests on
the role's active instances / the sum of their engines' ``max_running``). Measured for the log
(``AutoscaleInputs``): arrival rate (new requests seen by the samples / interval), their mean prompt
length and requested ``max_tokens``, P's and MD's prefix-hit rates (``gateway.live_counters``),
the WAN estimate (``orch.wan_gbps_live``). A decision is listed as soon as it is made; the operation running for it is in
its ``under_way`` (an add that starts a process takes seconds), and goes to its ``applied`` with
its ``instance`` (or its ``error``) when done. A refused or failed operation is logged with its error
and restarts the cool-down (so a slot that does not start is retried every ``cooldown_s``, not
every interval). Every decision, with its inputs and what was applied,
is logged (``autoscale:`` log line) and kept in a bounded list on ``GET /pdd/autoscale``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque

from pdd.policy.autoscale import (DOWN, UP, AutoscaleInputs, AutoscaleRule, AutoscaleWindow, decide_mix,
                                  pick_drain, role_home_dc)
from pdd.policy.membership import ACTIVE, DRAINING

log = logging.getLogger(__name__)

DECISIONS_KEPT = 200


class Autoscaler:
    """The loop of one gateway (module docstring); installs itself as ``orch.autoscaler``.
    ``clock``: monotonic seconds (a test passes its own)."""

    def __init__(self, orch, acfg, clock=time.monotonic):
        self.orch, self.acfg, self.clock = orch, acfg, clock
        self.rule = AutoscaleRule(cooldown_s=acfg.cooldown_s, min_n=dict(acfg.min), max_n=dict(acfg.max),
                                  up_at=acfg.up_at, down_at=acfg.down_at)
        self.roles = sorted(set(acfg.max) | set(acfg.min))
        self.decisions: deque[dict] = deque(maxlen=DECISIONS_KEPT)
        self.applied = {"up": 0, "down": 0, "errors": 0}
        self.last_change: float | None = None
        self._reset_window()
        self._seen: set[str] = set(getattr(orch, "reqs", {}))
        self._task: asyncio.Task | None = None
        orch.autoscaler = self

    # ------------------------------------------------------------------ measuring
    def _reset_window(self) -> None:
        self.window = AutoscaleWindow(tuple(self.roles), self.clock())

    def _members(self, role: str, state: str = ACTIVE) -> list:
        return list(self.orch.membership.members_of(role, state))

    def sample(self) -> None:
        """One load sample of every scaled role, and the requests that arrived since the last."""
        o = self.orch
        load = {}
        for role in self.roles:
            act = self._members(role)
            load[role] = (sum(int(o.inflight.get(m.name, 0)) for m in act),
                          sum(max(1, int(o.cfg.engine_for(m.name).max_running)) for m in act))
        self.window.sample(load)
        reqs = dict(getattr(o, "reqs", {}))
        new = [st for rid, st in reqs.items() if rid not in self._seen]
        self._seen = set(reqs)
        for st in new:
            mt = getattr(getattr(st, "sampling", None), "max_tokens", None)
            self.window.arrived(int(getattr(st, "prompt_len", 0)), None if mt is None else int(mt))

    def inputs(self) -> AutoscaleInputs:
        """The interval's measured state (the samples taken since the last decision)."""
        ms = self.orch.membership
        pending = ms.changing or any(self._members(r, DRAINING) for r in self.roles)
        lc = getattr(self.orch, "live_counters", None)
        hits = lc.align.rates() if lc is not None else {}
        return self.window.inputs(self.clock(), {r: len(self._members(r)) for r in self.roles}, self.last_change,
                                  pending, hits.get("p_hit_rate"), hits.get("md_hit_rate"),
                                  getattr(self.orch, "wan_gbps_live", None))

    # ------------------------------------------------------------------ deciding and applying
    def _victim(self, role: str) -> str | None:
        """The instance a scale-down of ``role`` drains (``pick_drain``): one serving the role
        outside its slots' datacenter first (a relay decoder re-roled to main-decode duty in A)."""
        ms = self.orch.membership
        home = role_home_dc([(s.role, s.dc) for s in ms.full.engines], role)
        return pick_drain([(m.name, ms.busy(m.name), m.source == "config", m.dc) for m in self._members(role)], home)

    def _slot_role(self, name: str) -> str | None:
        """The role of ``name``'s slot in the config's layout (a re-roled relay decoder's stays
        ``relay_decode``); None when the layout has no such slot."""
        try:
            return self.orch.membership.full.get(name).role
        except (KeyError, ValueError, AttributeError):
            return None

    async def step(self) -> dict:
        """Decide on the interval's measurements, apply, record; never raises."""
        x = self.inputs()
        self._reset_window()
        d = decide_mix(x, self.rule)
        rec = {"time": round(time.time(), 3), "inputs": _inputs_dict(x), "decision": d.as_dict(), "applied": []}
        self.decisions.append(rec)  # listed at once: an add that starts a process is "under way" for seconds
        ms = self.orch.membership
        for rd in d.changes:
            op = "add" if rd.action == UP else "drain"
            entry = {"role": rd.role, "op": op}
            rec["under_way"] = [entry]
            try:
                if rd.action == UP:
                    out = await ms.add(rd.role, start=bool(self.acfg.start))
                    entry["instance"] = out["name"]
                elif rd.action == DOWN:
                    name = self._victim(rd.role)
                    if name is None:
                        raise RuntimeError(f"no {rd.role} instance can be drained (the last active one stays)")
                    entry["instance"] = name
                    slot_role = self._slot_role(name)
                    if slot_role is not None and slot_role != rd.role:
                        # a relay decoder re-roled to MD duty: back to its slot's role, not removed
                        entry["op"], entry["to"] = "rerole", slot_role
                        await ms.rerole(name, slot_role)
                    else:
                        await ms.drain(name, remove_when_idle=True)
                        entry["remove_when_idle"] = True
                self.applied[rd.action] += 1
                self.last_change = self.clock()
            except Exception as e:  # MembershipError or a failed start: logged, the loop goes on
                self.applied["errors"] += 1
                self.last_change = self.clock()  # the cool-down also spaces retries (a start is costly)
                entry.pop("instance", None)
                entry["error"] = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            finally:
                rec.pop("under_way", None)
                rec["applied"].append(entry)
        # a decision is routine (INFO); one whose operation was refused or failed is a WARNING
        level = logging.WARNING if any("error" in e for e in rec["applied"]) else logging.INFO
        log.log(level, "autoscale: %s", json.dumps(rec, sort_keys=True, default=str))
        return rec

    async def run(self) -> None:
        """Sample every ``sample_s``, decide every ``interval_s``, until cancelled."""
        sample_s = min(self.acfg.sample_s, self.acfg.interval_s)
        while True:
            deadline = self.clock() + self.acfg.interval_s
            while self.clock() < deadline:
                try:
                    self.sample()
                except Exception:  # a sample must never stop the loop
                    log.exception("autoscale: sample failed")
                await asyncio.sleep(sample_s)
            await self.step()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    def view(self) -> dict:
        a = self.acfg
        return {"enabled": True, "config": a.model_dump() if hasattr(a, "model_dump") else dict(vars(a)),
                "roles": {r: {"active": len(self._members(r)), "draining": len(self._members(r, DRAINING)),
                              "min": self.rule.bounds(r, 1)[0], "max": int(a.max.get(r, 0)) or None}
                          for r in self.roles},
                "applied": dict(self.applied), "decisions": list(self.decisions), **membership_log(self.orch)}


def membership_log(orch) -> dict:
    """``time`` (the gateway's wall clock now, s) and ``membership``: every engine instance's role,
    state and ``since``, and the membership's kept events (``time``, ``op``, ``instance``,
    ``role``, ``from``, ``to``), from which a client computes instance-seconds over a window of
    its own (``pdd.policy.autoscale.instance_seconds``; ``pdd bench``)."""
    ms = getattr(orch, "membership", None)
    out: dict = {"time": round(time.time(), 3)}
    if ms is not None:
        out["membership"] = {"instances": {m.name: {"role": m.role, "state": m.state, "since": round(float(getattr(m, "since", 0.0)), 3)}
                                           for m in ms.members.values()},
                             "events": list(getattr(ms, "events", ()))}
    return out


def _inputs_dict(x: AutoscaleInputs) -> dict:
    d = {k: v for k, v in x.__dict__.items() if k != "roles"}
    d["roles"] = [r.__dict__ for r in x.roles]
    return d


def add_autoscale_routes(app, orch) -> None:
    """``GET /pdd/autoscale``: the loop's config, applied counts and its last decisions (each with
    its inputs); ``{"enabled": false}`` when the loop is off. Both carry :func:`membership_log`."""

    @app.get("/pdd/autoscale")
    async def autoscale_view():
        a = getattr(orch, "autoscaler", None)
        return a.view() if a is not None else {"enabled": False, "decisions": [], **membership_log(orch)}


__all__ = ["Autoscaler", "add_autoscale_routes", "membership_log", "DECISIONS_KEPT"]
