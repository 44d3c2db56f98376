"""Admission control at the gateway: what the system cannot take now gets HTTP 429 with
``Retry-After`` instead of a queue that grows until every request misses its SLO.

Three measured quantities, three limits (``ClusterConfig.limits``, docs/OVERLOAD.md):

- **requests in flight** (choices started and not yet ended) against ``max_inflight_requests``
  (default: the decode tier's batch slots plus its queues, ``(max_running + tier_max_waiting) x
  decode instances``: more than that can only wait on a tier);
- **prompt tokens queued for prefill** (admitted, P not yet done) against
  ``max_queued_prompt_tokens`` (default: P's KV pool in tokens, ``num_pages x page_size x P
  instances``), and
- **KV queued for the WAN** (pdd modes): planned KV bytes to datacenter B not yet reported sent,
  over the live WAN rate estimate, against ``max_wan_backlog_s`` (off by default);
- **expected prefill queue wait** = queued tokens (the new request's included) / P's measured
  prefill rate, against ``max_queue_wait_s``. The rate is tokens per *busy* second: each
  prefill completion adds its prompt tokens and the time since the later of its own admission and
  the previous completion (P was working on it all that time), so idle time never dilutes it
  (:class:`PrefillRate`).

With ``ttft_target_ms`` / ``tpot_target_ms`` set, the in-flight limit adapts to the latency the
requests actually get (AIMD, :func:`next_limit`): whatever saturates (a tier, the gateway's own
CPU, the WAN), an admitted request whose first token took longer than the target at the gateway
(or whose tokens came slower than the target) shrinks the limit, a fast one grows it. A fixed
limit cannot know where the bottleneck is; the latency it causes can be measured.

Behind these, every engine bounds its own queue (``Engine.new_sequence`` raises ``TierBusy``),
and a starting request may not fit a KV pool (``OutOfPages``); a request a tier refused either
way also becomes a 429 with ``Retry-After`` (:func:`refusal`), not a server error.

The decision (:func:`decide`) is a pure function of plain dataclasses (no clock, no sockets);
:class:`Admission` keeps the live state with ``time.monotonic`` and hands out :class:`Ticket`\\ s.
A request that finds nothing queued and nothing in flight is always admitted, however large, so
no request is refused forever; only a request with more choices than a tier's bounded queues
hold (:func:`choice_cap`, :func:`choice_refusal`) or more KV pages at once than a tier's pools
(:func:`kv_refusal`) could never be served, and the API refuses it with HTTP 400.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field

TIER_BUSY = "TierBusy"  # class name of pdd.engine.scheduler.TierBusy: the remote error text starts with it
OUT_OF_PAGES = "OutOfPages"  # class name of pdd.engine.kv_pool.OutOfPages (same convention)
# why an API request was answered 429 (pdd_gateway_rejected_total{reason}): admission's limits,
# the concurrency limit (pdd.gateway.api) and a tier's refusal while the request started (refusal())
REJECT_REASONS = ("inflight", "queued_tokens", "queue_wait", "wan_backlog", "concurrency", "tier_busy",
                  "out_of_pages")
RATE_WINDOW = 64  # prefill completions the rate estimate spans
SERVICE_EWMA = 0.1  # weight of the newest request duration in the mean service time
DECREASE = 0.85  # multiplicative decrease of the adaptive limit (TCP halves; a gentler step wastes less capacity)


@dataclass(frozen=True)
class AdmissionLimits:
    """Resolved limits; None = off. Tokens are prompt tokens, times seconds."""

    max_inflight: int | None
    max_queued_tokens: int | None
    max_wait_s: float | None
    retry_after_max_s: int = 30
    max_wan_backlog_s: float | None = None
    # choices one request may have at all (not a load limit: :func:`choice_cap`), and why
    max_choices: int | None = None
    max_choices_why: str = ""
    # prefills one request may run at once on P (:func:`prefill_cap`), and why
    max_prefills: int | None = None
    max_prefills_why: str = ""
    # the KV pools a request's pages pass, in its order: (tier, ((instance, num_pages, page_size), ...))
    # of the active instances (:func:`kv_pools`, :func:`kv_refusal`)
    kv_pools: tuple = ()


@dataclass(frozen=True)
class AdmissionState:
    """What the gateway measures now. ``prefill_tps``: P's prefill rate, prompt tokens per busy
    second (None until measured); ``service_s``: mean request duration (None until measured)."""

    inflight: int = 0
    queued_tokens: int = 0
    prefill_tps: float | None = None
    service_s: float | None = None
    wan_backlog_s: float | None = None  # planned KV bytes not yet delivered to MD / the live WAN rate


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str | None = None  # "inflight" | "queued_tokens" | "queue_wait" when refused
    retry_after_s: int = 0
    message: str = ""


def _retry(seconds: float | None, cap: int) -> int:
    """Retry-After: whole seconds, at least 1, at most ``cap``."""
    if seconds is None or not math.isfinite(seconds):
        return 1
    return int(min(cap, max(1, math.ceil(seconds))))


def inflight_message(in_use: int, slots: int, choices: int | None) -> str:
    """The 429 message of the in-flight limit, in the unit it counts: one slot per choice (a
    request with ``n=3`` takes 3 of ``max_inflight_requests``). ``in_use``: slots held by
    requests in flight; ``slots``: the limit in force (the adaptive one if smaller);
    ``choices``: what the refused request asked for, or None when it is not known (refused
    before its body was read: then not even one slot is free). Counts only, no units of time."""
    if choices is None:
        return (f"server overloaded: {in_use} of {slots} in-flight slots in use, none free "
                f"(each choice of a request takes one slot)")
    what = "choice" if choices == 1 else "choices"
    return (f"server overloaded: {choices} {what} requested, {in_use} of {slots} in-flight slots in use "
            f"(each choice of a request takes one slot)")


def prefill_tokens(n_requests: int, prompt_tokens: int) -> int:
    """Prompt tokens ``n_requests`` choices of one prompt put in P's queue: the prompt once, and one
    token for each further choice. Those start once choice 0's prefill has put the prompt's
    whole pages in P's prefix cache (pdd.gateway.openai_run), so each recomputes only the tail
    of its last page (at least one token)."""
    return prompt_tokens + (n_requests - 1) * min(1, prompt_tokens)


def decide(state: AdmissionState, limits: AdmissionLimits, n_requests: int, prompt_tokens: int) -> Decision:
    """Admit ``n_requests`` choices of a ``prompt_tokens``-token prompt, or refuse with the
    limit hit and a Retry-After estimate (seconds until enough of the queue has drained: queued
    tokens over the prefill rate, or the mean request duration for in-flight slots). In-flight
    slots count choices: ``state.inflight`` is the slots in use and the request needs
    ``n_requests`` more; the refusal's message says so (:func:`inflight_message`).

    Raises ``ValueError`` for ``n_requests < 1`` or ``prompt_tokens < 0``.
    """
    if n_requests < 1 or prompt_tokens < 0:
        raise ValueError("n_requests must be >= 1 and prompt_tokens >= 0")
    cap = limits.retry_after_max_s
    new_tokens = prefill_tokens(n_requests, prompt_tokens)
    if (limits.max_wan_backlog_s and state.inflight > 0 and state.wan_backlog_s is not None
            and state.wan_backlog_s > limits.max_wan_backlog_s):
        return Decision(False, "wan_backlog", _retry(state.wan_backlog_s - limits.max_wan_backlog_s, cap),
                        f"server overloaded: the WAN to datacenter B has {state.wan_backlog_s:.1f} s of KV queued "
                        f"(limit {limits.max_wan_backlog_s:g} s)")
    if limits.max_inflight and state.inflight > 0 and state.inflight + n_requests > limits.max_inflight:
        over = state.inflight + n_requests - limits.max_inflight
        wait = None if state.service_s is None else state.service_s * over / limits.max_inflight
        return Decision(False, "inflight", _retry(wait, cap), inflight_message(state.inflight, limits.max_inflight,
                                                                              n_requests))
    if state.queued_tokens > 0:
        total = state.queued_tokens + new_tokens
        rate = state.prefill_tps if state.prefill_tps and state.prefill_tps > 0 else None
        if limits.max_queued_tokens and total > limits.max_queued_tokens:
            wait = None if rate is None else (total - limits.max_queued_tokens) / rate
            return Decision(False, "queued_tokens", _retry(wait, cap),
                            f"server overloaded: {state.queued_tokens} prompt tokens queued for prefill and "
                            f"this request's {new_tokens} would exceed the limit of {limits.max_queued_tokens}")
        if limits.max_wait_s and rate is not None and total / rate > limits.max_wait_s:
            return Decision(False, "queue_wait", _retry(total / rate - limits.max_wait_s, cap),
                            f"server overloaded: the prefill queue would take {total / rate:.2f} s "
                            f"(limit {limits.max_wait_s:g} s at {rate:.0f} prompt tokens/s)")
    return Decision(True)


@dataclass(frozen=True)
class LimitState:
    """The adaptive in-flight limit. ``epoch`` counts decreases (a request admitted before the
    latest one cannot cause another); ``slow_start``: +1 per fast request until the first
    decrease, then +1/limit (one per limit's worth of fast requests)."""

    limit: float
    epoch: int = 0
    slow_start: bool = True


def next_limit(s: LimitState, ok: bool, admitted_epoch: int, at_limit: bool, lo: int, hi: int | None) -> LimitState:
    """AIMD step for one observed request (as TCP congestion control, on latency instead of loss).

    ``ok``: its latency met the target. A fast request grows the limit only if it was admitted
    ``at_limit`` (in flight >= half the limit: the limit mattered), so idle periods do not inflate
    it. A slow one shrinks it x DECREASE, once per epoch: requests admitted before the last
    decrease were admitted under the old limit and say nothing new. Bounds ``[lo, hi]`` (hi None:
    no upper bound). Pure.
    """
    if ok:
        if not at_limit:
            return s
        step = 1.0 if s.slow_start else 1.0 / max(1.0, s.limit)
        new = s.limit + step
        return LimitState(new if hi is None else min(float(hi), new), s.epoch, s.slow_start)
    if admitted_epoch != s.epoch:
        return s
    return LimitState(max(float(lo), s.limit * DECREASE), s.epoch + 1, False)


class PrefillRate:
    """P's prefill rate, prompt tokens per busy second, over the last ``window`` completions.

    ``completed(t, tokens, admitted_t)``: a request admitted at ``admitted_t`` finished its
    prefill at ``t``; it contributes ``tokens`` and the busy time ``t - max(admitted_t,
    previous completion)``. Those intervals never overlap, and each lies where at least one
    request was waiting for or in prefill. Times are seconds on any one clock.
    """

    def __init__(self, window: int = RATE_WINDOW):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.last_t: float | None = None

    def completed(self, t: float, tokens: int, admitted_t: float) -> None:
        start = admitted_t if self.last_t is None else max(admitted_t, self.last_t)
        self.samples.append((int(tokens), max(0.0, t - start)))
        self.last_t = t if self.last_t is None else max(self.last_t, t)

    @property
    def tokens_per_s(self) -> float | None:
        """None until the samples span some busy time (at least 8 completions and 50 ms)."""
        if len(self.samples) < 8:
            return None
        busy = sum(dt for _, dt in self.samples)
        return sum(k for k, _ in self.samples) / busy if busy >= 0.05 else None


def _queues(cfg, role: str, specs) -> tuple[int, str]:
    """The places of the bounded queues of instances ``specs`` of ``role`` together (each engine
    refuses a sequence beyond its ``max_running + tier_max_waiting``: ``TierBusy``), and the
    terms (``"the active relay_decode instances hold 6: rld0, rld1 (engine.max_running 2 +
    limits.tier_max_waiting 1 each)"``). Each instance's own engine block counts (``cfg.tiers``)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for sp in specs:
        groups.setdefault(cfg.bounded_queue(sp.name), []).append(sp.name)
    places = sum((run + wait) * len(names) for (run, wait), names in groups.items())
    terms = " + ".join(f"{', '.join(names)} (engine.max_running {run} + limits.tier_max_waiting {wait}"
                       f"{' each' if len(names) > 1 else ''})" for (run, wait), names in groups.items())
    return places, f"the active {role} instances hold {places}: {terms}"


def choice_cap(cfg, lay) -> tuple[int | None, str]:
    """The most choices (prompts x ``n``) one request may have however idle the system is, and
    why (:func:`_queues`'s terms); (None, "") when ``lay`` has no decoding instance.

    Every choice is routed on its own (``pdd.gateway.routing``) and holds a place of its
    decoding instance's bounded queue until it ends; a request's choices start together, so on
    an idle system they hold as many places at once. Routing counts the places it holds and
    sends a choice to a full instance only when all are, so a tier takes any request whose
    choices fit the sum of its *active* instances' queues (``lay``: ``Membership.serving_layout``,
    recomputed on every add, drain, remove or re-role), and refuses the excess of a larger one
    (``TierBusy``) on every try: the API refuses such a request up front (HTTP 400).

    The tiers counted, the smallest sum wins: colocated; in pdd mode RLD (every choice reserves
    a relay decoder), and MD unless every request is relayed at once (``policy.pipeline``'s zero
    TTFT budget: MD's refusal then only degrades a choice to RLD; a plan made on MD's reservation,
    a prompt MD's cache holds, fails when MD refuses it); MD or D in the other modes and in pdd
    mode without relay decoders. P counts apart (:func:`prefill_cap`)."""
    from pdd.policy.pipeline import relays_every_request
    from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_RELAY

    pol = cfg.policy
    if lay.by_role(ROLE_COLOCATED):
        roles = [ROLE_COLOCATED]
    elif cfg.mode == "pdd" and lay.by_role(ROLE_RELAY):
        md_in_a = any(sp.dc == "A" for sp in lay.by_role(ROLE_MAIN))
        relayed = relays_every_request(cfg.mode, pol.pipeline_ttft_budget_ms, pol.allow_p_rld, md_in_a)
        roles = [ROLE_RELAY] + ([] if relayed else [ROLE_MAIN])
    else:
        roles = [ROLE_MAIN]
    best: tuple[int | None, str] = (None, "")
    for role in roles:
        specs = lay.by_role(role)
        if specs:
            places, why = _queues(cfg, role, specs)
            if best[0] is None or places < best[0]:
                best = (places, why)
    return best


def prefill_cap(cfg, lay) -> tuple[int | None, str]:
    """The most prefills one request may run at once on P, and why (:func:`_queues`'s terms);
    (None, "") without prefill instances. A prefill holds a place of its P's bounded queue only
    until it returns (its first token sampled), and a prompt's first choice is prefilled before
    its other ``n - 1`` start (they hit its cached prefix): a request of ``prompts`` x ``n``
    choices runs at most ``prompts x max(1, n - 1)`` prefills at once (:func:`choice_refusal`),
    and routing spreads them over the active P instances as it does the choices."""
    from pdd.topology import ROLE_PREFILL

    specs = lay.by_role(ROLE_PREFILL)
    return _queues(cfg, ROLE_PREFILL, specs) if specs else (None, "")


def choice_refusal(lim: AdmissionLimits, prompts: int, n: int) -> str | None:
    """Why a request of ``prompts`` prompts x ``n`` choices each can never be served with limits
    ``lim`` (the message of its HTTP 400), or None when it fits: its choices must fit the
    decoding tier's queues (``prompts x n <= max_choices``) and the prefills it runs at once P's
    (``prompts x max(1, n - 1) <= max_prefills``; :func:`prefill_cap`)."""
    asked = prompts * n
    what, hint = (f"n ({n})", "lower n") if prompts == 1 else (f"{prompts} prompts x n ({n})",
                                                              "lower n or send fewer prompts" if n > 1
                                                              else "send fewer prompts")
    if lim.max_choices is not None and asked > lim.max_choices:
        return (f"{what}: {asked} choices requested; at most {lim.max_choices} choices per request are served "
                f"(each choice holds a place of an instance's queue on every tier it passes until it leaves that "
                f"tier; {lim.max_choices_why}); {hint}")
    prefills = prompts * max(1, n - 1)
    if lim.max_prefills is not None and prefills > lim.max_prefills:
        order = ("each prompt's first choice is prefilled first, then its other n - 1 together"
                 if n > 1 else "the prompts are prefilled together")
        return (f"{what}: {asked} choices requested, {prefills} of them prefilled at once ({order}); at most "
                f"{lim.max_prefills} prefills per request run at once (each holds a place of a prefill instance's "
                f"queue until it returns; {lim.max_prefills_why}); {hint}")
    return None


def kv_pools(cfg, lay) -> tuple:
    """The KV pools of layout ``lay``'s active instances that a request's pages pass, in its
    order: ``((tier, ((instance, num_pages, page_size), ...)), ...)``, each instance with its own
    engine block (``cfg.engine_for``): the colocated instances; else P, RLD (pdd mode) and MD / D.
    What :func:`kv_refusal` counts a request against."""
    from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY

    if lay.by_role(ROLE_COLOCATED):
        roles = [ROLE_COLOCATED]
    else:
        roles = [ROLE_PREFILL] + ([ROLE_RELAY] if cfg.mode == "pdd" else []) + [ROLE_MAIN]
    out = []
    for role in roles:
        specs = lay.by_role(role)
        if specs:
            engines = [(sp.name, cfg.engine_for(sp.name)) for sp in specs]
            out.append((role, tuple((name, e.num_pages, e.page_size) for name, e in engines)))
    return tuple(out)


def request_pages(tier: str, prompts: list[tuple[int, int]], n: int, page_size: int) -> int:
    """KV pages of ``page_size`` tokens a request's choices hold at once on an instance of
    ``tier`` (a :data:`pdd.config.TIERS` name): ``prompts`` is ``(prompt tokens, output tokens
    counted)`` per prompt, each prompt with ``n`` choices, all started together. Per prompt: on
    P its tokens, the ``n - 1`` later choices sharing the first's whole pages but the last
    (``min_uncached`` 1); on RLD a copy of prompt + first token per choice (no prefix cache);
    on MD / D / colocated prompt + output per choice, the prompt's whole pages shared."""
    ps, pages = page_size, 0
    for n_prompt, out in prompts:
        if tier == "prefill":
            pages += n * -(-n_prompt // ps) - (n - 1) * ((n_prompt - 1) // ps)
        elif tier == "relay_decode":
            pages += n * -(-(n_prompt + 1) // ps)
        else:
            pages += n * -(-(n_prompt + out) // ps) - (n - 1) * (n_prompt // ps)
    return pages


def short_pool(tier: str, prompts: list[tuple[int, int]], n: int, pools) -> tuple[str, int, int, int] | None:
    """The first pool of ``pools`` (``(instance, num_pages, page_size), ...``, one tier's active
    instances as :func:`kv_pools` lists them), smallest in tokens first, that cannot hold a
    request's choices at once on that one instance (:func:`request_pages` at its own page
    size): ``(instance, pages needed, num_pages, page_size)``, or None when every one holds
    them. Routing may send a request to any active instance of a tier, whatever its pool, so a
    request is held to the smallest: a tier block's pool larger than an instance's own
    (``tiers: {rld0: {engine: {num_pages: 32}}}``) does not count."""
    for name, pages, ps in sorted(pools, key=lambda p: p[1] * p[2]):
        need = request_pages(tier, prompts, n, ps)
        if need > pages:
            return name, need, pages, ps
    return None


def kv_hint(tier: str, n: int, out: int, param: str, prompts: int = 1, output_helps: bool = True) -> str:
    """What a request refused for its KV pages on ``tier`` (:func:`kv_refusal`) can change that
    lowers them: fewer ``prompts`` (a batch), a lower ``n`` (above 1), a lower ``param``
    (``max_tokens``, when ``out``, the most output tokens counted per choice, is above 1, the
    tier holds the output: not P nor RLD, and ``output_helps``: the pages fit with one output
    token a choice), else a shorter prompt. ``send fewer prompts, lower n or max_tokens``;
    ``lower max_tokens``; ``send a shorter prompt``."""
    holds = out > 1 and output_helps and tier not in ("prefill", "relay_decode")
    lower = (["n"] if n > 1 else []) + ([param] if holds else [])
    parts = (["send fewer prompts"] if prompts > 1 else []) + ([f"lower {' or '.join(lower)}"] if lower else [])
    if not parts:
        return "send a shorter prompt"
    return ", ".join(parts) if len(lower) > 1 else " or ".join(parts)


def kv_refusal(lim: AdmissionLimits, prompts: list[tuple[int, int]], n: int, param: str,
               asked: bool = True) -> str | None:
    """Why a request can never be served because its choices' KV pages cannot all be held at
    once by a tier it passes (the message of its HTTP 400, naming the pages and the pool), or
    None when they fit every tier of ``lim.kv_pools``. ``prompts``: ``(prompt tokens, output
    tokens counted)`` per prompt (see :func:`request_pages`), each with ``n`` choices;
    ``param``: the output-length field (``max_tokens``); ``asked``: False when the client set
    none (each choice counted with its first output token, which the message says). A batch's prompts and choices start
    together, each on its own, so a tier must hold them all at once: its active instances'
    pools together (a request over that fails with ``OutOfPages`` on every try, idle system
    or not). Page sizes may differ between instances: the smallest is counted, which needs the
    fewest tokens (page sizes are powers of two)."""
    for tier, pools in lim.kv_pools:
        ps = min(p for _, _, p in pools)
        need = request_pages(tier, prompts, n, ps)
        have = sum(pages * size for _, pages, size in pools) // ps
        if need <= have:
            continue
        what = f"n ({n})" if len(prompts) == 1 else f"{len(prompts)} prompts x n ({n})"
        fits_at_one = request_pages(tier, [(k, 1) for k, _ in prompts], n, ps) <= have  # lowering max_tokens helps
        hint = kv_hint(tier, n, max(out for _, out in prompts), param, len(prompts), fits_at_one)
        held = {"prefill": "each prompt's tokens while it is prefilled",
                "relay_decode": "a copy of each choice's prompt + its first token"}.get(
                    tier, f"each choice's prompt + {param if asked else 'its first output token'}, the prompt's "
                          "whole pages shared")
        terms = ", ".join(f"{name} (engine.num_pages {pages} of {size} tokens)" for name, pages, size in pools)
        return (f"{what}: {len(prompts) * n} choices need {need} KV pages of {ps} tokens at once on the {tier} "
                f"tier ({held}, page-rounded), more than its active instances' pools hold together ({have}: "
                f"{terms}); {hint}")
    return None


def resolve_limits(cfg, lay) -> AdmissionLimits:
    """``cfg.limits`` with its None defaults derived from the engines' sizes and instance counts
    of layout ``lay`` (see :class:`pdd.config.LimitsConfig`); 0 turns a limit off. With an
    elastic topology ``lay`` is the *active* members' (``Membership.serving_layout``: a draining
    instance takes no new request, a standby or removed one none at all, a re-roled relay decoder
    counts in its new role with its own engine block), and the gateway recomputes the limits on
    every membership change (:meth:`Admission.follow`)."""
    from pdd.topology import ROLE_COLOCATED, ROLE_MAIN, ROLE_PREFILL

    lim, e = cfg.limits, cfg.engine
    inflight = lim.max_inflight_requests
    if inflight is None:  # each tier its own engine block (cfg.tiers)
        inflight = sum(cfg.engine_for(s.name).max_running + lim.waiting(cfg.engine_for(s.name).max_running)
                       for s in lay.by_role(ROLE_MAIN) + lay.by_role(ROLE_COLOCATED)) or \
            (e.max_running + lim.waiting(e.max_running))
    queued = lim.max_queued_prompt_tokens
    if queued is None:
        queued = sum(cfg.engine_for(s.name).num_pages * cfg.engine_for(s.name).page_size
                     for s in lay.by_role(ROLE_PREFILL) + lay.by_role(ROLE_COLOCATED)) or e.num_pages * e.page_size
    return AdmissionLimits(inflight or None, queued or None, lim.max_queue_wait_s or None, lim.retry_after_max_s,
                           lim.max_wan_backlog_s or None, *choice_cap(cfg, lay), *prefill_cap(cfg, lay),
                           kv_pools(cfg, lay))


@dataclass
class Ticket:
    """One admitted request (its ``n`` choices); :meth:`Admission.prefilled` and
    :meth:`Admission.release` are idempotent per ticket."""

    n: int
    tokens: int
    admitted_t: float
    queued: bool = True
    released: bool = False
    epoch: int = 0  # adaptive limit's epoch at admission
    at_limit: bool = False  # in flight >= half the adaptive limit at admission
    first_t: float | None = None  # first token seen at the gateway
    arrived_t: float | None = None  # the request reached the gateway's HTTP app (before its body was parsed)


@dataclass
class Admission:
    """The gateway's live admission state (one per gateway process, event-loop thread only)."""

    limits: AdmissionLimits
    ttft_target_s: float | None = None  # adaptive limit on (either target set)
    tpot_target_s: float | None = None
    min_inflight: int = 2
    adaptive: LimitState | None = None
    inflight: int = 0
    queued_tokens: int = 0
    rate: PrefillRate = field(default_factory=PrefillRate)
    service_s: float | None = None
    admitted: int = 0
    rejected: dict = field(default_factory=dict)  # reason -> requests refused
    wan_backlog: object = None  # () -> seconds of KV queued for the WAN, or None (set by the gateway)

    def __post_init__(self):
        if (self.ttft_target_s or self.tpot_target_s) and self.adaptive is None:
            self.adaptive = LimitState(float(self.min_inflight))

    @classmethod
    def from_config(cls, cfg, lay) -> "Admission":
        lim = cfg.limits
        return cls(resolve_limits(cfg, lay), lim.ttft_target_ms / 1000 or None, lim.tpot_target_ms / 1000 or None,
                   lim.min_inflight_requests)

    def follow(self, limits: AdmissionLimits) -> None:
        """Take ``limits`` (recomputed by :func:`resolve_limits` after a membership change); the
        requests in flight and the adaptive limit's state stay (its upper bound is the new
        ``max_inflight``)."""
        self.limits = limits
        if self.adaptive is not None and limits.max_inflight is not None and self.adaptive.limit > limits.max_inflight:
            self.adaptive = dataclasses.replace(self.adaptive, limit=float(limits.max_inflight))

    def state(self) -> AdmissionState:
        wan = self.wan_backlog() if self.wan_backlog is not None and self.limits.max_wan_backlog_s else None
        return AdmissionState(self.inflight, self.queued_tokens, self.rate.tokens_per_s, self.service_s, wan)

    def effective_limits(self) -> AdmissionLimits:
        """The configured limits with the adaptive in-flight limit applied (the smaller wins)."""
        if self.adaptive is None:
            return self.limits
        cur = max(1, int(self.adaptive.limit))
        m = self.limits.max_inflight
        return dataclasses.replace(self.limits, max_inflight=cur if m is None else min(m, cur))

    def full(self) -> Decision | None:
        """The refusal every request would get now, whatever its size (in-flight limit reached),
        or None: lets the HTTP layer answer 429 before it reads and parses a body (so the
        message states the slots in use, not the choices the unread request wants)."""
        lim = self.effective_limits()
        if self.inflight > 0 and ((lim.max_inflight and self.inflight + 1 > lim.max_inflight)
                                  or lim.max_wan_backlog_s):
            d = decide(self.state(), lim, 1, 0)
            if not d.admit:
                self.reject(d.reason or "?")
                if d.reason == "inflight":  # the request's n is not known yet: state the slots only
                    d = dataclasses.replace(d, message=inflight_message(self.inflight, lim.max_inflight, None))
                return d
        return None

    def try_admit(self, n: int, prompt_tokens: int, arrived_t: float | None = None) -> tuple[Ticket | None, Decision]:
        """A ticket (and the decision), or None with the refusal. ``arrived_t``: when the request
        reached the gateway (``time.monotonic``); its TTFT for the adaptive limit counts from there,
        so time spent queued in front of admission (a saturated gateway) is seen too."""
        d = decide(self.state(), self.effective_limits(), n, prompt_tokens)
        if not d.admit:
            self.reject(d.reason or "?")
            return None, d
        self.inflight += n
        queued = prefill_tokens(n, prompt_tokens)
        self.queued_tokens += queued
        self.admitted += 1
        t = Ticket(n, queued, time.monotonic())
        t.arrived_t = arrived_t if arrived_t is not None else t.admitted_t
        if self.adaptive is not None:
            t.epoch, t.at_limit = self.adaptive.epoch, self.inflight >= self.adaptive.limit / 2
        return t, d

    def _observe(self, t: Ticket, ok: bool) -> None:
        if self.adaptive is not None:
            self.adaptive = next_limit(self.adaptive, ok, t.epoch, t.at_limit, self.min_inflight,
                                       self.limits.max_inflight)

    def first_token(self, t: Ticket) -> None:
        """The request's first token reached the gateway: its TTFT (from admission) feeds the
        adaptive limit."""
        if t.first_t is not None:
            return
        t.first_t = time.monotonic()
        if self.ttft_target_s:
            self._observe(t, t.first_t - (t.arrived_t or t.admitted_t) <= self.ttft_target_s)

    def finished(self, t: Ticket, tokens_per_choice: int) -> None:
        """A completed request's mean time per output token feeds the adaptive limit (a slow
        one shrinks it; growth comes from TTFT)."""
        if self.tpot_target_s and t.first_t is not None and tokens_per_choice > 1:
            tpot = (time.monotonic() - t.first_t) / (tokens_per_choice - 1)
            if tpot > self.tpot_target_s:
                self._observe(t, False)

    def reject(self, reason: str) -> None:
        """Count one API request answered 429 for ``reason`` (one of :data:`REJECT_REASONS`)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def prefilled(self, t: Ticket, measured: bool = True) -> None:
        """P has prefilled the ticket's prompt (every choice): it leaves the prefill queue and,
        with ``measured``, is a sample of P's rate."""
        if not t.queued:
            return
        t.queued = False
        self.queued_tokens = max(0, self.queued_tokens - t.tokens)
        if measured:
            self.rate.completed(time.monotonic(), t.tokens, t.admitted_t)

    def release(self, t: Ticket, completed: bool = False) -> None:
        """The request ended (however): its choices leave the in-flight count. ``completed``:
        it ran to its end, so its duration is a sample of the mean service time."""
        if t.released:
            return
        self.prefilled(t, measured=False)
        t.released = True
        self.inflight = max(0, self.inflight - t.n)
        if completed:
            dt = time.monotonic() - t.admitted_t
            self.service_s = dt if self.service_s is None else (1 - SERVICE_EWMA) * self.service_s + SERVICE_EWMA * dt

    def retry_hint(self) -> int:
        """Retry-After for a request a tier refused (TierBusy): the time one in-flight slot
        takes to free, from the mean request duration."""
        wait = None
        if self.service_s is not None and self.limits.max_inflight:
            wait = self.service_s / self.limits.max_inflight * max(1, self.inflight)
        return _retry(wait, self.limits.retry_after_max_s)

    def stats(self) -> dict:
        rate = self.rate.tokens_per_s
        return {"adaptive_limit": None if self.adaptive is None else round(self.adaptive.limit, 2),
                "inflight": self.inflight, "queued_prompt_tokens": self.queued_tokens,
                "prefill_tokens_per_s": None if rate is None else round(rate, 1),
                "mean_service_s": None if self.service_s is None else round(self.service_s, 3),
                "admitted": self.admitted, "rejected": dict(self.rejected),
                "limits": {"max_inflight_requests": self.limits.max_inflight,
                           "max_queued_prompt_tokens": self.limits.max_queued_tokens,
                           "max_queue_wait_s": self.limits.max_wait_s,
                           "max_choices_per_request": self.limits.max_choices,
                           "max_prefills_per_request": self.limits.max_prefills}}


def causes(exc: BaseException | None, limit: int = 8):
    """``exc``, then the exceptions it was raised from (``__cause__`` or ``__context__``), at
    most ``limit`` of them."""
    seen = 0
    while exc is not None and seen < limit:
        yield exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1


def refusal(exc: BaseException | None) -> str | None:
    """Whether ``exc`` (or an exception it was raised from) is a tier refusing *new* work for
    now, and which: "tier_busy" (its bounded queue is full: ``TierBusy``) or "out_of_pages" (its
    KV pool cannot hold the request's pages now: ``OutOfPages`` while the request was starting,
    i.e. before any of its tokens was produced). Local exceptions are matched by class name,
    remote ones by their text's first word (the RPC layer prefixes it). None otherwise."""
    for e in causes(exc):
        for name, reason in ((TIER_BUSY, "tier_busy"), (OUT_OF_PAGES, "out_of_pages")):
            if type(e).__name__ == name or str(e).startswith(name):
                return reason
    return None


def is_tier_busy(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a tier's bounded-queue refusal:
    a local ``TierBusy`` or a remote error whose text starts with ``TierBusy``."""
    return refusal(exc) == "tier_busy"
