"""The gateway's autoscaling loop in the simulator (``pdd sim run --autoscale md=2``; docs/SIM.md
"Autoscaling"): the same pure code as ``pdd serve --autoscale`` (``pdd.gateway.autoscale``) on the
same inputs, measured the same way over simulated time.

- Every ``sample_s`` the loop samples each scaled role: busy = requests in flight assigned to the
  role's active instances (from routing to the end of the request, as the gateway's
  ``inflight``), capacity = the sum of their ``max_running`` (the tier's decode cap
  ``max_running_<role>`` when set, else the instance's ``max_running_seqs``), and the requests that arrived since
  the last sample (their prompt and output lengths); every ``interval_s`` it builds
  :class:`pdd.policy.autoscale.AutoscaleInputs` with :class:`pdd.policy.autoscale.AutoscaleWindow`
  and decides with :func:`pdd.policy.autoscale.decide_mix` under the rule the gateway builds from
  the same :class:`pdd.config.AutoscaleConfig`. ``p_hit_rate`` / ``md_hit_rate``: token-weighted
  over the requests that finished in the interval (logged, not used by the rule); ``wan_gbps``:
  the simulated gateway's live WAN estimate.
- up: the role's first free slot (standby or removed) becomes active after ``start_s`` (the
  simulated start of its process; a change is pending meanwhile, as while the gateway starts
  one); down: the active instance :func:`pdd.policy.autoscale.pick_drain` picks, given each
  instance's datacenter and its role's as the gateway gives them (the simulator re-roles no
  relay decoder, so every candidate is in its role's datacenter), is drained (no new request is
  routed there) and removed once nothing is in flight or held there; its prefix
  cache is dropped (a later add starts cold).
- Every change is a membership event (``time``, ``op``, ``instance``, ``role``, ``from``, ``to``)
  and every decision a record (``time``, ``inputs``, ``decision``, ``applied``) as on the gateway's
  ``GET /pdd/autoscale``; :meth:`SimAutoscaler.summary` gives instance-seconds
  (:func:`pdd.policy.autoscale.instance_seconds`) and the decision counts.

The simulator is built with each scaled role's ``max`` instances; those beyond its initial count
start in standby (:func:`autoscaled_sim`). Only the roles of the P/RLD/MD tiers are scaled
(``prefill``, ``relay_decode``, ``main_decode``).
"""

from __future__ import annotations

from pdd.policy.autoscale import (DOWN, UP, AutoscaleRule, AutoscaleWindow, decide_mix, instance_seconds, pick_drain,
                                  role_home_dc)
from pdd.sim.prefix_cache import PrefixCache
from pdd.sim.sim_config import SIM_ROLE

TIER_ROLE = {"P": "prefill", "RLD": "relay_decode", "MD": "main_decode", "D": "decode", "C": "colocated"}
SHORT = {"p": "prefill", "rld": "relay_decode", "md": "main_decode"}  # --autoscale md=3
COUNT_FIELD = {"prefill": "n_p", "relay_decode": "n_rld", "main_decode": "n_md"}
ACTIVE, STANDBY, DRAINING, REMOVED = "active", "standby", "draining", "removed"


def rule_of(acfg) -> AutoscaleRule:
    """The rule the gateway's :class:`pdd.gateway.autoscale.Autoscaler` builds from ``acfg``."""
    return AutoscaleRule(cooldown_s=acfg.cooldown_s, min_n=dict(acfg.min), max_n=dict(acfg.max),
                         up_at=acfg.up_at, down_at=acfg.down_at)


def autoscaled_sim(cfg, acfg, start_s: float = 0.0):
    """A :class:`pdd.sim.cluster.ClusterSim` of ``cfg`` with room for ``acfg.max`` instances of each
    scaled role (the extra ones in standby) and a :class:`SimAutoscaler` installed. Raises
    ValueError for a role the mode has not, a role the simulator does not scale, or ``max`` below
    the configured count."""
    from pdd.sim.cluster import ClusterSim

    roles = sorted(set(acfg.max) | set(acfg.min))
    tiers = cfg.tiers()
    initial = {}
    grow = {}
    for role in roles:
        if role not in SIM_ROLE:
            raise ValueError(f"--autoscale: the simulator scales {', '.join(SIM_ROLE)}, not {role}")
        if SIM_ROLE[role] not in tiers:
            raise ValueError(f"--autoscale: the {cfg.mode} mode has no {role} tier")
        n = tiers[SIM_ROLE[role]][0]
        hi = int(acfg.max.get(role, n))
        if hi < n:
            raise ValueError(f"--autoscale: max {role} = {hi} is below its {n} configured instance(s)")
        initial[role] = n
        grow[COUNT_FIELD[role]] = hi
    sim = ClusterSim(cfg.replace(**grow))
    SimAutoscaler(sim, acfg, initial, start_s)
    return sim


class SimAutoscaler:
    """The loop on one :class:`pdd.sim.cluster.ClusterSim` (module docstring); installs itself as
    ``sim.autoscaler`` (the simulator then routes to its active instances only)."""

    def __init__(self, sim, acfg, initial: dict[str, int], start_s: float = 0.0):
        self.sim, self.acfg, self.start_s = sim, acfg, float(start_s)
        self.rule = rule_of(acfg)
        self.roles = sorted(initial)
        self.state: dict[str, str] = {}
        self.role_of: dict[str, str] = {}
        self.from_config: dict[str, bool] = {}
        # each tier's datacenter (its chip side: a -> A, b -> B) and the slots' (role, datacenter),
        # what pdd.policy.autoscale.pick_drain reads as the gateway's layout
        self.dc = {t: side.upper() for t, (_, side) in sim.cfg.tiers().items()}
        self.slots = [(role, self.dc[SIM_ROLE[role]]) for role in self.roles]
        for role in self.roles:
            for i, inst in enumerate(sim.tiers[SIM_ROLE[role]]):
                self.state[inst.name] = ACTIVE if i < initial[role] else STANDBY
                self.role_of[inst.name] = role
                self.from_config[inst.name] = i < initial[role]
        # every instance, for instance-seconds (the unscaled tiers stay active throughout)
        self.initial = {i.name: (TIER_ROLE.get(t, t), self.state.get(i.name, ACTIVE))
                        for t, insts in sim.tiers.items() for i in insts}
        self.events: list[dict] = []
        self.decisions: list[dict] = []
        self.applied = {"up": 0, "down": 0, "errors": 0}
        self.last_change: float | None = None
        self.starting: set[str] = set()
        self._next = 0
        self._live: set = set()
        self._finished: list = []
        sim.autoscaler = self

    # ------------------------------------------------------------------ what routing sees
    def routable(self, tier: str) -> list:
        """The tier's instances the gateway routes to: all of an unscaled tier, the active ones of
        a scaled tier."""
        return [i for i in self.sim.tiers[tier] if self.state.get(i.name, ACTIVE) == ACTIVE]

    def _insts(self, role: str, state: str = ACTIVE) -> list:
        return [i for i in self.sim.tiers[SIM_ROLE[role]] if self.state[i.name] == state]

    def _cap(self, inst) -> int:
        return max(1, int(inst.slot_cap or inst.max_running))

    # ------------------------------------------------------------------ measuring
    def _arrivals(self) -> None:
        now, reqs = self.sim.env.now, self._order
        while self._next < len(reqs) and reqs[self._next].arrival <= now:
            r = reqs[self._next]
            self._next += 1
            self._live.add(r)
            self.window.arrived(r.prompt, r.out_len)

    def _assigned(self) -> dict[str, int]:
        """Requests in flight per instance name (arrived, not finished), as the gateway's inflight."""
        out: dict[str, int] = {}
        for r in list(self._live):
            if r.finished:
                self._live.discard(r)
                self._finished.append(r)
                continue
            for inst in {r.p, r.rld, r.md, r.d}:
                if inst is not None:
                    out[inst.name] = out.get(inst.name, 0) + 1
        return out

    def sample(self) -> None:
        self._arrivals()
        busy = self._assigned()
        self.window.sample({role: (sum(busy.get(i.name, 0) for i in self._insts(role)),
                                   sum(self._cap(i) for i in self._insts(role))) for role in self.roles})
        for role in self.roles:  # drained instances go once nothing is in flight or held there
            for inst in self._insts(role, DRAINING):
                if (not busy.get(inst.name) and not inst.seqs and not inst.waiting and not inst.slots
                        and not inst.routed and inst.private == 0 and (inst.cache is None or not inst.cache.locks)):
                    if inst.cache is not None:
                        inst.cache = PrefixCache(inst.cache.capacity_blocks)
                    self._set(inst.name, REMOVED, "remove")

    def inputs(self):
        done, self._finished = self._finished, []
        tot = sum(r.prompt for r in done)
        md = [r for r in done if r.md is not None]
        pending = bool(self.starting) or any(self._insts(r, DRAINING) for r in self.roles)
        return self.window.inputs(
            self.sim.env.now, {r: len(self._insts(r)) for r in self.roles}, self.last_change, pending,
            round(sum(r.p_hit for r in done) / tot, 4) if tot else None,
            round(sum(r.md_hit for r in md) / max(1, sum(r.prompt for r in md)), 4) if md else None,
            self.sim.wan_gbps_live)

    # ------------------------------------------------------------------ deciding and applying
    def _set(self, name: str, to: str, op: str) -> None:
        ev = {"time": round(self.sim.env.now, 6), "op": op, "instance": name, "role": self.role_of[name],
              "from": self.state[name], "to": to}
        self.state[name] = to
        self.events.append(ev)

    def _activate(self, name: str) -> None:
        self.starting.discard(name)
        self._set(name, ACTIVE, "add")

    def step(self) -> dict:
        x = self.inputs()
        self.window = AutoscaleWindow(tuple(self.roles), self.sim.env.now)
        d = decide_mix(x, self.rule)
        rec = {"time": round(self.sim.env.now, 6), "inputs": _inputs_dict(x), "decision": d.as_dict(), "applied": []}
        for rd in d.changes:
            now = self.sim.env.now
            if rd.action == UP:
                free = [i.name for i in self.sim.tiers[SIM_ROLE[rd.role]] if self.state[i.name] in (STANDBY, REMOVED)]
                if not free:
                    self.applied["errors"] += 1
                    rec["applied"].append({"role": rd.role, "op": "add", "error": f"every {rd.role} slot is a member"})
                    self.last_change = now
                    continue
                name = free[0]
                self.starting.add(name)
                if self.start_s > 0:
                    self.sim.after(self.start_s, self._activate, name)
                else:
                    self._activate(name)
                rec["applied"].append({"role": rd.role, "op": "add", "instance": name})
            elif rd.action == DOWN:
                busy = self._assigned()
                dc = self.dc[SIM_ROLE[rd.role]]  # a simulated tier's instances share its datacenter
                name = pick_drain([(i.name, busy.get(i.name, 0), self.from_config[i.name], dc)
                                   for i in self._insts(rd.role)], role_home_dc(self.slots, rd.role))
                if name is None:
                    self.applied["errors"] += 1
                    rec["applied"].append({"role": rd.role, "op": "drain",
                                           "error": f"no {rd.role} instance can be drained"})
                    self.last_change = now
                    continue
                self._set(name, DRAINING, "drain")
                rec["applied"].append({"role": rd.role, "op": "drain", "instance": name, "remove_when_idle": True})
            self.applied[rd.action] += 1
            self.last_change = now
        self.decisions.append(rec)
        return rec

    def _done(self) -> bool:
        return self._next >= len(self._order) and not self._live and all(r.finished for r in self._order)

    def run(self):
        """The SimPy process: sample every ``sample_s``, decide every ``interval_s``, until every
        request has finished (then the simulation can end)."""
        env = self.sim.env
        self._order = sorted(self.sim.reqs, key=lambda r: r.arrival)
        self.window = AutoscaleWindow(tuple(self.roles), env.now)
        sample_s = min(self.acfg.sample_s, self.acfg.interval_s)
        while True:
            deadline = env.now + self.acfg.interval_s
            while env.now < deadline - 1e-9:
                self.sample()
                if self._done() or env.peek() == float("inf"):
                    return
                yield env.timeout(sample_s)
            self.sample()
            if self._done() or env.peek() == float("inf"):  # all finished, or nothing else can happen
                return
            self.step()

    # ------------------------------------------------------------------ results
    def summary(self, t1: float | None = None) -> dict:
        """Instance-seconds of the scaled roles over [0, ``t1``] (default: the end of the run),
        the decision counts and the log (``events``, ``decisions``)."""
        t1 = self.sim.env.now if t1 is None else t1
        used = instance_seconds(self.initial, self.events, 0.0, t1)
        ups = sum(1 for d in self.decisions for a in d["applied"] if a["op"] == "add" and "error" not in a)
        downs = sum(1 for d in self.decisions for a in d["applied"] if a["op"] == "drain" and "error" not in a)
        return {"roles": self.roles, "window_s": round(t1, 6),
                "instance_seconds": round(used["total"], 6),
                "instance_seconds_by_role": {r: round(v, 6) for r, v in sorted(used["by_role"].items())},
                "mean_instances": round(used["total"] / t1, 4) if t1 > 0 else None,
                "scale_ups": ups, "scale_downs": downs, "errors": self.applied["errors"],
                "timeline": used["timeline"], "events": list(self.events), "decisions": list(self.decisions)}


def fixed_summary(sim, t1: float) -> dict:
    """Instance-seconds of a simulation without the loop over [0, ``t1``]: every instance, all along."""
    initial = {i.name: (TIER_ROLE.get(t, t), ACTIVE) for t, insts in sim.tiers.items() for i in insts}
    used = instance_seconds(initial, [], 0.0, t1)
    return {"window_s": round(t1, 6), "instance_seconds": round(used["total"], 6),
            "instance_seconds_by_role": {r: round(v, 6) for r, v in sorted(used["by_role"].items())},
            "mean_instances": round(used["total"] / t1, 4) if t1 > 0 else None, "scale_ups": 0, "scale_downs": 0}


def parse_role_counts(text: str, flag: str = "--autoscale") -> dict[str, int]:
    """``"md=3,rld=2"`` -> ``{"main_decode": 3, "relay_decode": 2}`` (p, rld, md or the config's
    role names, each role once, N at most ``MAX_INSTANCES``); ValueError naming ``flag`` otherwise (a
    bad item, a role given twice in either spelling)."""
    from pdd.sim.sim_config import MAX_INSTANCES

    out: dict[str, int] = {}
    given: dict[str, str] = {}
    for item in str(text).split(","):
        k, eq, v = item.strip().partition("=")
        role = SHORT.get(k.strip(), k.strip())
        try:
            n = int(v)
        except ValueError:
            n = -1
        if not eq or role not in SIM_ROLE or n < 1:
            raise ValueError(f"{flag}: expected ROLE=N with ROLE one of p, rld, md (or prefill, relay_decode, "
                             f"main_decode) and N >= 1, e.g. md=3, got {item.strip()!r}")
        if n > MAX_INSTANCES:
            raise ValueError(f"{flag}: {item.strip()!r}: at most {MAX_INSTANCES:,} instances of one tier")
        if role in out:
            raise ValueError(f"{flag}: {role} given twice ({given[role]!r} and {item.strip()!r}); give each role once")
        out[role] = n
        given[role] = item.strip()
    return out


def retime(records, arrivals_s) -> list[dict]:
    """The first ``len(arrivals_s)`` records with their timestamps set to the arrivals (s -> ms)."""
    return [dict(r, timestamp=t * 1000.0) for r, t in zip(records, arrivals_s)]


def _inputs_dict(x) -> dict:
    d = {k: v for k, v in x.__dict__.items() if k != "roles"}
    d["roles"] = [r.__dict__ for r in x.roles]
    return d


__all__ = ["SIM_ROLE", "SimAutoscaler", "autoscaled_sim", "rule_of", "fixed_summary", "parse_role_counts", "retime"]
