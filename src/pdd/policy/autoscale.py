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
from typing import Mapping, Sequence

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


# ---------------------------------------------------------------- the interval's measurements


@dataclass
class AutoscaleWindow:
    """What one interval measured, turned into :class:`AutoscaleInputs` the same way by the
    gateway (``pdd.gateway.autoscale``) and the simulator (``pdd.sim.autoscale``).

    ``sample(load)``: one load sample, ``{role: (busy, capacity)}`` with busy = requests in flight
    assigned to the role's active instances (from routing to the end of the request) and
    capacity = the sum of their ``max_running``; its utilisation is busy / capacity (0 with no
    capacity). ``arrived(prompt_tokens, max_tokens)``: one new request. ``inputs(...)``: the
    interval's means (utilisation rounded to 4 places, rates and token means to 4 and 2) with
    ``arrival_rps`` = arrivals / (``now_s`` - ``start_s``)."""

    roles: tuple[str, ...]
    start_s: float
    util: dict[str, list[float]] = field(default_factory=dict)
    arrivals: int = 0
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

    def __post_init__(self):
        for r in self.roles:
            self.util.setdefault(r, [])

    def sample(self, load: Mapping[str, tuple[int, int]]) -> None:
        for role in self.roles:
            busy, cap = load.get(role, (0, 0))
            self.util[role].append(busy / cap if cap else 0.0)

    def arrived(self, prompt_tokens: int, max_tokens: int | None) -> None:
        self.arrivals += 1
        self.prompt.append(int(prompt_tokens))
        if max_tokens is not None:
            self.output.append(int(max_tokens))

    def inputs(self, now_s: float, active: Mapping[str, int], last_change_s: float | None = None,
               pending: bool = False, p_hit_rate: float | None = None, md_hit_rate: float | None = None,
               wan_gbps: float | None = None) -> AutoscaleInputs:
        roles = tuple(RoleLoad(r, int(active.get(r, 0)),
                               round(sum(self.util[r]) / len(self.util[r]), 4) if self.util[r] else 0.0)
                      for r in self.roles)
        span = max(1e-9, now_s - self.start_s)
        return AutoscaleInputs(
            roles, since_last_change_s=None if last_change_s is None else round(now_s - last_change_s, 3),
            pending=pending, arrival_rps=round(self.arrivals / span, 4),
            prompt_tokens_mean=round(sum(self.prompt) / len(self.prompt), 2) if self.prompt else None,
            output_tokens_mean=round(sum(self.output) / len(self.output), 2) if self.output else None,
            p_hit_rate=p_hit_rate, md_hit_rate=md_hit_rate, wan_gbps=wan_gbps)


def pick_drain(candidates: Sequence[tuple], home_dc: str | None = None) -> str | None:
    """Which active instance of a role a scale-down drains. ``candidates`` = (name, requests in
    flight, started with the topology[, datacenter]) in the order the instances were listed;
    ``home_dc``: the datacenter the role's configured slots are in (main_decode: ``"B"`` in pdd
    and cross_dc_pd mode, :func:`role_home_dc`), None when unknown.

    An instance serving the role away from ``home_dc`` goes first: a relay decoder re-roled to
    main-decode duty in A (docs/SERVE.md "Re-role") is a fallback next to P, while the main
    decoder's place is datacenter B (../shared/PDD.md "The architecture": MD in datacenter B,
    chip B; docs/SERVE.md "Re-role": the relay decoder serves as MD in A "while traffic is mostly
    short or well-cached and the relay tier is idle"). So a scale-down never drains the last
    main decoder in B while one in A serves the role. Among the away ones (all of them when
    none is away): the fewest in flight, then one the loop added before one started with the
    topology, then the latest listed. None with fewer than two (a role's last active instance
    is never drained). A candidate without a datacenter counts as at home."""
    if len(candidates) < 2:
        return None
    order = {c[0]: i for i, c in enumerate(candidates)}
    away = [c for c in candidates if home_dc is not None and len(c) > 3 and c[3] != home_dc]
    return min(away or candidates, key=lambda c: (c[1], c[2], -order[c[0]]))[0]


def role_home_dc(slots: Sequence[tuple[str, str]], role: str) -> str | None:
    """The datacenter of ``role``'s configured slots: ``slots`` = (slot role, datacenter) of the
    config's layout (a re-roled relay decoder's slot role stays ``relay_decode``); None when the
    role has no slot or its slots are in more than one datacenter."""
    dcs = {dc for r, dc in slots if r == role}
    return next(iter(dcs)) if len(dcs) == 1 else None


# ---------------------------------------------------------------- the cost proxy

MEMBER_STATES = ("active", "draining")  # pdd.policy.membership.ACTIVE, DRAINING: an instance that holds its chips


def instance_seconds(initial: Mapping[str, tuple[str, str]], events: Sequence[Mapping], t0: float,
                     t1: float) -> dict:
    """Instance-seconds used over ``[t0, t1]`` (seconds, one clock): for every engine instance,
    the time it was a member (state ``active`` or ``draining``: serving, or finishing what it
    holds), summed. ``initial``: ``{name: (role, state at t0)}``; ``events``: membership changes
    ``{"time", "instance", "role", "to"}`` (``pdd.gateway.membership`` events, or the
    simulator's); events outside ``(t0, t1]`` are ignored, an instance not in ``initial`` starts
    out of service. Returns ``{"total", "by_role": {role: s}, "by_instance": {name: s},
    "timeline": {role: [[t, members], ...]}}`` (timeline times relative to ``t0``, one point at 0
    and one per change). Raises ValueError if ``t1 < t0``."""
    if t1 < t0:
        raise ValueError(f"t1 ({t1}) is before t0 ({t0})")
    state = {n: (role, st) for n, (role, st) in initial.items()}
    since = {n: t0 for n in state}
    used: dict[str, float] = {n: 0.0 for n in state}
    roles = sorted({r for r, _ in state.values()} | {str(e.get("role")) for e in events if e.get("role")})

    def count(role: str) -> int:
        return sum(1 for r, st in state.values() if r == role and st in MEMBER_STATES)

    timeline = {r: [[0.0, count(r)]] for r in roles}
    for e in sorted((e for e in events if t0 < float(e["time"]) <= t1), key=lambda e: float(e["time"])):
        name, t = str(e["instance"]), float(e["time"])
        role, old = state.get(name, (str(e.get("role")), "standby"))
        if old in MEMBER_STATES:
            used[name] = used.get(name, 0.0) + t - since[name]
        state[name], since[name] = (role, str(e["to"])), t
        used.setdefault(name, 0.0)
        timeline.setdefault(role, [[0.0, 0]]).append([round(t - t0, 3), count(role)])
    for name, (role, st) in state.items():
        if st in MEMBER_STATES:
            used[name] = used.get(name, 0.0) + t1 - since[name]
    by_role: dict[str, float] = {}
    for name, (role, _) in state.items():
        by_role[role] = by_role.get(role, 0.0) + used.get(name, 0.0)
    return {"total": sum(used.values()), "by_role": by_role, "by_instance": used, "timeline": timeline}


__all__ = ["UP", "DOWN", "HOLD", "RoleLoad", "AutoscaleInputs", "AutoscaleRule", "RoleDecision",
           "AutoscaleDecision", "decide_mix", "AutoscaleWindow", "pick_drain", "role_home_dc", "instance_seconds",
           "MEMBER_STATES"]
