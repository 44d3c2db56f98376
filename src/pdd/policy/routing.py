"""Instance choice (PDD report, "Routing": a load-balancing router; P and MD lifecycles are
decoupled so each side scales independently).

Policies, over candidate instances of one tier (P, RLD or MD):

- "round_robin": ``rr_counter % len(cands)``.
- "load": least loaded: minimum of ``(running + queued, pages_used / pages_total, index)``.
- "cache_aware": longest prefix held, balanced by load. With ``load = running + queued`` and
  ``min_load`` the least load among candidates, the eligible set is
  ``E = {c : load(c) <= min_load + load_slack}`` (no instance is chosen while it is more than
  ``load_slack`` requests busier than the idlest one). Within E the score is, lexicographically,
  ``(prefix_hit_tokens, -load, -pages_used / pages_total, -index)`` and the maximum wins:
  the most reusable prefix, ties broken by load, then KV occupancy, then first listed.
  Instances whose KV pool is full (pages_used >= pages_total) are eligible only when all are.
  With ``prompt_tokens`` > 0 and ``min_hit_frac`` > 0, a best hit below
  ``min_hit_frac * prompt_tokens`` is not worth the affinity: the least loaded eligible
  instance is chosen instead (as SGLang's cache-aware router does with its cache threshold).
- "cache_aware" with WAN estimates (every candidate has ``transfer_s``: the estimated seconds to
  move the prompt's KV that instance lacks over its WAN path, ``bytes / its goodput + its RTT``,
  ``pdd.policy.wan_estimate.PeerWanEstimates.transfer_s``): the same eligible set E, and within
  it the minimum of ``(transfer_s + load_cost_s * load, -prefix_hit_tokens, load,
  pages_used / pages_total, index)`` wins. The transfer time already weighs the hit (only the
  missing pages cross) by the line that path has now, so an MD whose estimate dropped loses to
  one with a shorter hit over a faster path; with equal estimates it is the longest hit, as
  above. ``load_cost_s`` prices one request in flight in seconds (what keeps a small shared
  prefix from drawing every request to one instance); the ``min_hit_frac`` fall-back does not
  apply (it would ignore the line exactly for the cold prompts that need it most).

A load cap (``load_cap`` > 0; the MD tier's ``policy.md_load_cap``): a candidate whose
``running + queued`` has reached ``load_cap`` requests is, like a ``full`` one, chosen only when
every candidate's has; the policy picks among the others. On MD it is the decode batch that
still meets the TPOT SLO (``pdd.sim.experiments.slo_batch``: the largest batch whose roofline
decode step at the workload's context per sequence is within ``slo_tpot_s``): the cache-aware
slack alone lets the MD holding the most requested prefixes run ``load_slack`` sequences above
the idlest, past that batch, so every sequence there misses its TPOT while other MDs idle (the
cost-table's H100 PCIe + H200 PDD fleet, docs/SIM.md "cost-table").

Whatever the policy, a candidate whose bounded queue is ``full`` (the sequences the router
placed there that may still need compute reach its ``max_running + tier_max_waiting``: the
engine would refuse another with ``TierBusy``) is chosen only when every candidate is full; the
policy picks among the others. So the choices of one request spread over a tier's instances
once the one they favour (its cache holds their prompt) is full, and a tier refuses a request
only when all of its instances are full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ROUTING_POLICIES = ("cache_aware", "load", "round_robin")
# cache-aware routing's defaults, one source for the gateway (``policy.load_slack``,
# ``policy.md_load_slack``) and the simulator (``SimConfig``), whose results stand for the
# runtime's: the load slack in requests on P, RLD and colocated instances; on MD (decoders hold
# tens of sequences, and a prefix hit there saves its KV's WAN transfer); the share of the prompt
# below which a hit is not worth the affinity (a shared system-prompt block alone would pull all
# traffic to one instance)
LOAD_SLACK = 8
MD_LOAD_SLACK = 64
MIN_HIT_FRAC = 0.5


@dataclass(frozen=True)
class InstanceLoad:
    name: str
    running: int = 0
    queued: int = 0
    pages_used: int = 0
    pages_total: int = 1
    prefix_hit_tokens: int = 0
    # estimated seconds to move the KV this instance lacks over its WAN path (None: not across a
    # WAN, or no estimates: the hit-and-load rule)
    transfer_s: float | None = None
    # its bounded queue holds as many sequences as the router placed there that may still need
    # compute (max_running + tier_max_waiting): another would be refused (TierBusy)
    full: bool = False


def _util(c: InstanceLoad) -> float:
    return c.pages_used / c.pages_total if c.pages_total > 0 else 1.0


def choose_instance(
    cands: Sequence[InstanceLoad],
    policy: str = "cache_aware",
    rr_counter: int = 0,
    load_slack: int = LOAD_SLACK,
    prompt_tokens: int = 0,
    min_hit_frac: float = 0.0,
    load_cost_s: float = 0.0,
    load_cap: int = 0,
) -> int:
    """Index of the chosen candidate (into ``cands``); a ``full`` candidate, or one whose
    ``running + queued`` (requests) is at least ``load_cap`` (> 0; 0: no cap), only when all are
    (module docstring). Raises ValueError if ``cands`` is empty or ``policy`` is unknown."""
    n = len(cands)
    if n == 0:
        raise ValueError("no candidate instances")
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; expected one of {ROUTING_POLICIES}")
    room = [i for i in range(n) if not cands[i].full] or list(range(n))
    if load_cap > 0:
        room = [i for i in room if cands[i].running + cands[i].queued < load_cap] or room
    if policy == "round_robin":
        return room[rr_counter % len(room)]
    if policy == "load":
        return min(room, key=lambda i: (cands[i].running + cands[i].queued, _util(cands[i]), i))
    idx = [i for i in room if cands[i].pages_used < cands[i].pages_total] or room
    loads = {i: cands[i].running + cands[i].queued for i in idx}
    min_load = min(loads.values())
    elig = [i for i in idx if loads[i] <= min_load + load_slack]
    if all(cands[i].transfer_s is not None for i in elig):
        return min(elig, key=lambda i: (cands[i].transfer_s + load_cost_s * loads[i], -cands[i].prefix_hit_tokens,
                                        loads[i], _util(cands[i]), i))
    best = max(elig, key=lambda i: (cands[i].prefix_hit_tokens, -loads[i], -_util(cands[i]), -i))
    if prompt_tokens > 0 and cands[best].prefix_hit_tokens < min_hit_frac * prompt_tokens:
        return min(elig, key=lambda i: (loads[i], _util(cands[i]), i))
    return best
