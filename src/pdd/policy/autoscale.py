"""Autoscaling: the per-role instance mix the gateway's live loop should move to (issue #22 item 2;
applied by ``pdd.gateway.autoscale``, docs/SERVE.md "Autoscaling"). Pure: measured state in, a
decision out; no clock (the time since the last change is an input), sockets or torch.

Why a utilisation rule and not the planner. ``pdd plan`` (``pdd.sim.plan``) sizes a deployment
offline: for a recorded workload at a target rate it bisects P counts with one simulator run per
probe, over hardware profiles with prices. That is seconds to minutes of CPU per answer, needs a
recorded workload and a hardware profile that matches the instances, and answers "the cheapest mix
that meets the SLO at rate r", not "what to do now". A live loop must answer within its interval on
the gateway's CPU from what it measures, so this controller uses each role's measured utilisation
with hysteresis. The workload inputs the planner would take (arrival rate, prompt and output
lengths, hit rates, the WAN estimate) are carried in :class:`AutoscaleInputs` and logged with every
decision, so a decision can be replayed through ``pdd plan`` offline; they do not move the rule.

The rule, per role with bounds (``min_n`` <= n <= ``max_n``, ``n`` = its active instances):

1. While a change is under way (``pending``: an instance starting, or draining and not yet
   removed) or ``since_last_change_s`` < ``cooldown_s``: hold every role.
2. n < min: up one; n > max: down one (the bounds, whatever the load).
3. ``utilisation`` >= ``up_at`` and n < max: up one ("sustained": utilisation is the mean of the
   interval's samples, so a burst shorter than the interval moves it only by its share).
4. ``utilisation`` <= ``down_at`` and n > min: down one.
5. Otherwise hold.

No flapping: after a scale-up from n to n+1 the same load reads u*n/(n+1) >= ``up_at``/2, and after
a scale-down from n to n-1 it reads u*n/(n-1) <= 2*``down_at`` (n >= 2); the rule requires
``down_at`` < ``up_at``/2, so neither change alone can trigger the opposite one on the next
decision. At most one instance per role changes per decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

UP, DOWN, HOLD = "up", "down", "hold"


@dataclass(frozen=True)
class RoleLoad:
    """One role's measured state over the last interval."""

    role: str
    active: int  # active instances (draining ones are not counted)
    utilisation: float  # mean over the interval of in-flight requests / (active * max_running)


@dataclass(frozen=True)
class AutoscaleInputs:
    roles: tuple[RoleLoad, ...]
    since_last_change_s: float | None = None  # None: no change applied yet
    pending: bool = False  # a change still under way (starting, or draining and not removed)
    # workload rates, logged with the decision (for replay through ``pdd plan``); not used by the rule
    arrival_rps: float = 0.0
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None
    p_hit_rate: float | None = None
    md_hit_rate: float | None = None
    wan_gbps: float | None = None


@dataclass(frozen=True)
class AutoscaleRule:
    cooldown_s: float = 30.0
    min_n: Mapping[str, int] = field(default_factory=dict)  # role -> fewest active (default 1)
    max_n: Mapping[str, int] = field(default_factory=dict)  # role -> most active (default: no scale-up)
    up_at: float = 0.75
    down_at: float = 0.25

    def __post_init__(self):
        if not 0 < self.up_at <= 1:
            raise ValueError(f"up_at must be in (0, 1], got {self.up_at}")
        if not 0 <= self.down_at < self.up_at / 2:
            raise ValueError(f"down_at must be >= 0 and < up_at / 2 = {self.up_at / 2} (no flapping), got "
                             f"{self.down_at}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        for role, lo in self.min_n.items():
            if lo < 1:
                raise ValueError(f"min_n[{role}] must be >= 1 (never remove a role's last instance), got {lo}")
            if role in self.max_n and self.max_n[role] < lo:
                raise ValueError(f"max_n[{role}] = {self.max_n[role]} is below min_n[{role}] = {lo}")

    def bounds(self, role: str, active: int) -> tuple[int, int]:
        lo = max(1, int(self.min_n.get(role, 1)))
        return lo, max(lo, int(self.max_n.get(role, max(active, lo))))


@dataclass(frozen=True)
class RoleDecision:
    role: str
    action: str  # up | down | hold
    current: int
    target: int
    reason: str


@dataclass(frozen=True)
class AutoscaleDecision:
    roles: tuple[RoleDecision, ...]
    reason: str  # why everything holds (cool-down, pending) or "per role"

    @property
    def changes(self) -> tuple[RoleDecision, ...]:
        return tuple(r for r in self.roles if r.action != HOLD)

    def as_dict(self) -> dict:
        return {"reason": self.reason, "roles": [r.__dict__ for r in self.roles]}


def decide_mix(x: AutoscaleInputs, rule: AutoscaleRule) -> AutoscaleDecision:
    """The target mix for ``x`` under ``rule`` (module docstring)."""
    def hold_all(why: str) -> AutoscaleDecision:
        return AutoscaleDecision(tuple(RoleDecision(r.role, HOLD, r.active, r.active, why) for r in x.roles), why)

    if x.pending:
        return hold_all("a change is under way (an instance starting or draining)")
    if x.since_last_change_s is not None and x.since_last_change_s < rule.cooldown_s:
        return hold_all(f"cool-down: {x.since_last_change_s:.1f} s since the last change < {rule.cooldown_s:g} s")
    out = []
    for r in x.roles:
        lo, hi = rule.bounds(r.role, r.active)
        n, u = r.active, r.utilisation
        if n < lo:
            out.append(RoleDecision(r.role, UP, n, n + 1, f"{n} active < min {lo}"))
        elif n > hi:
            out.append(RoleDecision(r.role, DOWN, n, n - 1, f"{n} active > max {hi}"))
        elif u >= rule.up_at:
            if n < hi:
                out.append(RoleDecision(r.role, UP, n, n + 1, f"utilisation {u:.2f} >= {rule.up_at:g}"))
            else:
                out.append(RoleDecision(r.role, HOLD, n, n, f"utilisation {u:.2f} >= {rule.up_at:g} but at max {hi}"))
        elif u <= rule.down_at:
            if n > lo:
                out.append(RoleDecision(r.role, DOWN, n, n - 1, f"utilisation {u:.2f} <= {rule.down_at:g}"))
            else:
                out.append(RoleDecision(r.role, HOLD, n, n, f"utilisation {u:.2f} <= {rule.down_at:g} but at min {lo}"))
        else:
            out.append(RoleDecision(r.role, HOLD, n, n,
                                    f"utilisation {u:.2f} within ({rule.down_at:g}, {rule.up_at:g})"))
    return AutoscaleDecision(tuple(out), "per role")


__all__ = ["UP", "DOWN", "HOLD", "RoleLoad", "AutoscaleInputs", "AutoscaleRule", "RoleDecision",
           "AutoscaleDecision", "decide_mix"]
