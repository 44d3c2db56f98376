"""The autoscaling loop in the gateway (``pdd serve --autoscale``, config ``autoscale``; docs/SERVE.md
"Autoscaling"). Every ``autoscale.sample_s`` it samples each scaled role's load; every
``autoscale.interval_s`` it runs the pure rule (``pdd.policy.autoscale.decide_mix``) on the
interval's means and applies the decision through the membership operations
(``pdd.gateway.membership``):

- up: add the role's first free slot (``Membership.add``; the gateway starts its process when
  ``autoscale.start``);
- down: drain the active instance of the role with the fewest requests in flight (the latest added
  first on a tie) with ``remove_when_idle``: no new request goes there, its in-flight ones finish
  where they are, and it is removed once idle. The membership refuses to drain a role's last
  active instance, and the rule never goes below ``min`` (>= 1), so no request fails because of a
  scaling change.

Measured per role, over the interval: utilisation = mean of (the gateway's in-flight requests on
the role's active instances / the sum of their engines' ``max_running``). Measured for the log
(``AutoscaleInputs``): arrival rate (new requests seen by the samples / interval), their mean prompt
length and requested ``max_tokens``, P's and MD's prefix-hit rates (``gateway.live_counters``),
the WAN estimate (``orch.wan_gbps_live``). A refused or failed operation is logged with its error
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

from pdd.policy.autoscale import DOWN, UP, AutoscaleInputs, AutoscaleRule, RoleLoad, decide_mix
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
        self._util: dict[str, list[float]] = {r: [] for r in self.roles}
        self._arrivals = 0
        self._prompt: list[int] = []
        self._output: list[int] = []
        self._window_start = self.clock()

    def _members(self, role: str, state: str = ACTIVE) -> list:
        return list(self.orch.membership.members_of(role, state))

    def sample(self) -> None:
        """One load sample of every scaled role, and the requests that arrived since the last."""
        o = self.orch
        for role in self.roles:
            act = self._members(role)
            cap = sum(max(1, int(o.cfg.engine_for(m.name).max_running)) for m in act)
            busy = sum(int(o.inflight.get(m.name, 0)) for m in act)
            self._util[role].append(busy / cap if cap else 0.0)
        reqs = dict(getattr(o, "reqs", {}))
        new = [st for rid, st in reqs.items() if rid not in self._seen]
        self._seen = set(reqs)
        self._arrivals += len(new)
        for st in new:
            self._prompt.append(int(getattr(st, "prompt_len", 0)))
            mt = getattr(getattr(st, "sampling", None), "max_tokens", None)
            if mt is not None:
                self._output.append(int(mt))

    def inputs(self) -> AutoscaleInputs:
        """The interval's measured state (the samples taken since the last decision)."""
        now = self.clock()
        ms = self.orch.membership
        roles = tuple(RoleLoad(r, len(self._members(r)),
                               round(sum(self._util[r]) / len(self._util[r]), 4) if self._util[r] else 0.0)
                      for r in self.roles)
        pending = ms.changing or any(self._members(r, DRAINING) for r in self.roles)
        lc = getattr(self.orch, "live_counters", None)
        hits = lc.align.rates() if lc is not None else {}
        span = max(1e-9, now - self._window_start)
        return AutoscaleInputs(
            roles, since_last_change_s=None if self.last_change is None else round(now - self.last_change, 3),
            pending=pending, arrival_rps=round(self._arrivals / span, 4),
            prompt_tokens_mean=round(sum(self._prompt) / len(self._prompt), 2) if self._prompt else None,
            output_tokens_mean=round(sum(self._output) / len(self._output), 2) if self._output else None,
            p_hit_rate=hits.get("p_hit_rate"), md_hit_rate=hits.get("md_hit_rate"),
            wan_gbps=getattr(self.orch, "wan_gbps_live", None))

    # ------------------------------------------------------------------ deciding and applying
    def _victim(self, role: str) -> str | None:
        ms = self.orch.membership
        act = self._members(role)
        if len(act) < 2:
            return None
        order = [m.name for m in ms.members_of(None, None)]
        return min(act, key=lambda m: (ms.busy(m.name), m.source == "config", -order.index(m.name))).name

    async def step(self) -> dict:
        """Decide on the interval's measurements, apply, record; never raises."""
        x = self.inputs()
        self._reset_window()
        d = decide_mix(x, self.rule)
        rec = {"time": round(time.time(), 3), "inputs": _inputs_dict(x), "decision": d.as_dict(), "applied": []}
        ms = self.orch.membership
        for rd in d.changes:
            try:
                if rd.action == UP:
                    out = await ms.add(rd.role, start=bool(self.acfg.start))
                    rec["applied"].append({"role": rd.role, "op": "add", "instance": out["name"]})
                elif rd.action == DOWN:
                    name = self._victim(rd.role)
                    if name is None:
                        raise RuntimeError(f"no {rd.role} instance can be drained (the last active one stays)")
                    await ms.drain(name, remove_when_idle=True)
                    rec["applied"].append({"role": rd.role, "op": "drain", "instance": name,
                                           "remove_when_idle": True})
                self.applied[rd.action] += 1
                self.last_change = self.clock()
            except Exception as e:  # MembershipError or a failed start: logged, the loop goes on
                self.applied["errors"] += 1
                self.last_change = self.clock()  # the cool-down also spaces retries (a start is costly)
                msg = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
                rec["applied"].append({"role": rd.role, "op": "add" if rd.action == UP else "drain", "error": msg})
        self.decisions.append(rec)
        log.warning("autoscale: %s", json.dumps(rec, sort_keys=True, default=str))
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
                "applied": dict(self.applied), "decisions": list(self.decisions)}


def _inputs_dict(x: AutoscaleInputs) -> dict:
    d = {k: v for k, v in x.__dict__.items() if k != "roles"}
    d["roles"] = [r.__dict__ for r in x.roles]
    return d


def add_autoscale_routes(app, orch) -> None:
    """``GET /pdd/autoscale``: the loop's config, applied counts and its last decisions (each with
    its inputs); ``{"enabled": false}`` when the loop is off."""

    @app.get("/pdd/autoscale")
    async def autoscale_view():
        a = getattr(orch, "autoscaler", None)
        return a.view() if a is not None else {"enabled": False, "decisions": []}


__all__ = ["Autoscaler", "add_autoscale_routes", "DECISIONS_KEPT"]
