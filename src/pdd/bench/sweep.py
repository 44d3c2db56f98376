"""Request-rate sweep for SLA goodput: which rate to try next (pure), and the answer.

**SLA goodput** of a mode = the highest request rate (req/s) among the rates tried at which
>= 90% of the requests met the SLO (:mod:`pdd.bench.slo`); None when no rate tried did.

The search is a pure function of the points measured so far (:func:`next_rate`), so it is
tested without a server. Two plans:

- fixed (``--sweep-rate 1,2,4,8``): the rates in increasing order; with ``stop_on_fail`` (the
  default) the sweep stops at the first rate that misses the SLA (higher rates of an open-loop
  replay only queue more).
- auto (``--sweep-rate auto``): start at ``start_rps``; multiply by ``factor`` while the SLA holds,
  divide while it does not (until ``min_rps``); once a passing rate lies below a failing one,
  bisect that bracket (arithmetic midpoint) ``bisect_steps`` times. Never more than
  ``max_points`` points, never above ``max_rps``.

Every point replays whole conversations of the same workload (:func:`session_subset`) with
their arrival times stretched or compressed to the rate (:func:`at_rate`); with a time bound
(:func:`point_requests`) a point keeps only as many requests as arrive within ``max_arrival_s``
at that rate (so low rates do not take minutes), never fewer than ``min_requests``. Whole
conversations, not the first requests: the start of a multi-turn trace is mostly first turns
(cold prompts), so its first requests have a far lower prefix hit rate than the workload
(agentic, 200 requests: the first 20 have ~40% ideal hits, the workload ~90%), and a point
made of them measures a different workload than the run at the offered rate.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Sequence

from pdd.load_profile import slow_rate_problem
from pdd.bench.slo import SLA_ATTAINMENT
from pdd.workload.replay import session_key

Point = tuple[float, float]  # (rate_rps, slo_attainment 0..1)


@dataclass(frozen=True)
class SweepPlan:
    """How the sweep picks rates (see the module docstring). Rates in req/s."""

    rates: tuple[float, ...] | None = None  # fixed plan; None = auto
    start_rps: float = 2.0
    factor: float = 2.0
    max_points: int = 4
    bisect_steps: int = 2
    min_rps: float = 0.05
    max_rps: float = 256.0
    threshold: float = SLA_ATTAINMENT
    stop_on_fail: bool = True

    def __post_init__(self) -> None:
        if self.rates is not None and (not self.rates or any(r <= 0 for r in self.rates)):
            raise ValueError("fixed sweep rates must be > 0")
        if self.factor <= 1 or self.start_rps <= 0 or self.max_points < 1 or self.bisect_steps < 0:
            raise ValueError("need factor > 1, start_rps > 0, max_points >= 1, bisect_steps >= 0")

    @property
    def kind(self) -> str:
        return "auto" if self.rates is None else "fixed"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind
        return d


def parse_sweep(spec: str | None, start_rps: float = 2.0, **kw) -> SweepPlan | None:
    """``None``/"" /"none"/"off" -> None; "auto" -> an auto plan starting at ``start_rps``;
    "1,2,4" -> a fixed plan (each rate finite and at least :data:`pdd.load_profile.MIN_RATE_RPS`).
    ``kw`` sets other :class:`SweepPlan` fields. ValueError naming --sweep-rate otherwise."""
    if spec is None or spec.strip().lower() in ("", "none", "off", "no"):
        return None
    if spec.strip().lower() == "auto":
        return SweepPlan(start_rps=start_rps, **kw)
    try:
        rates = tuple(sorted({float(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--sweep-rate: expected 'auto' or comma-separated rates, got {spec!r}") from None
    if not rates:  # ',': SweepPlan's own "fixed sweep rates must be > 0" named no flag
        raise ValueError(f"--sweep-rate: expected 'auto', 'none' or comma-separated rates, got {spec!r}")
    bad = [r for r in rates if not 0 < r < math.inf]  # NaN fails too
    if bad:
        raise ValueError(f"--sweep-rate: rates must be finite and > 0 req/s, got {bad[0]} in {spec!r}")
    slow = next(filter(None, map(slow_rate_problem, rates)), None)
    if slow:  # a point keeps at least --sweep-min-requests: 8 at 1e-9 req/s never ended
        raise ValueError(f"--sweep-rate: each rate {slow} in {spec!r}")
    return SweepPlan(rates=rates, start_rps=start_rps, **kw)


def _tried(history: Sequence[Point], rate: float) -> bool:
    return any(abs(r - rate) <= 1e-9 * max(1.0, rate) for r, _ in history)


def next_rate(plan: SweepPlan, history: Sequence[Point]) -> float | None:
    """The next rate to measure after ``history`` (points in the order measured), or None: done."""
    thr = plan.threshold
    if len(history) >= plan.max_points and plan.rates is None:
        return None
    if plan.rates is not None:
        if plan.stop_on_fail and any(a < thr for _, a in history):
            return None
        for r in plan.rates:
            if not _tried(history, r):
                return r
        return None
    if not history:
        return min(plan.start_rps, plan.max_rps)
    passes = [r for r, a in history if a >= thr]
    fails = [r for r, a in history if a < thr]
    if not fails:
        nxt = max(passes) * plan.factor
        return nxt if nxt <= plan.max_rps * (1 + 1e-9) and not _tried(history, nxt) else None
    hi = min(fails)
    below = [r for r in passes if r < hi]
    if not below:
        nxt = hi / plan.factor
        return nxt if nxt >= plan.min_rps * (1 - 1e-9) and not _tried(history, nxt) else None
    lo = max(below)
    # bisection steps already taken: points measured since the first moment a pass lay below a fail
    first = next(i for i in range(len(history)) if _bracketed(history[: i + 1], thr))
    if len(history) - 1 - first >= plan.bisect_steps:
        return None
    mid = round((lo + hi) / 2, 6)
    if hi - lo <= 0.02 * hi or _tried(history, mid):
        return None
    return mid


def _bracketed(points: Sequence[Point], thr: float) -> bool:
    fails = [r for r, a in points if a < thr]
    return bool(fails) and any(r < min(fails) for r, a in points if a >= thr)


def plan_rates(plan: SweepPlan, measure) -> list[Point]:
    """Run the search: ``measure(rate) -> slo_attainment`` until :func:`next_rate` says done."""
    history: list[Point] = []
    while (rate := next_rate(plan, history)) is not None:
        history.append((rate, float(measure(rate))))
    return history


def sla_goodput(history: Sequence[Point], threshold: float = SLA_ATTAINMENT) -> float | None:
    """The highest rate whose attainment is >= ``threshold`` (None when none is)."""
    ok = [r for r, a in history if a is not None and a >= threshold]
    return max(ok) if ok else None


def mean_rate(arrivals_s: Sequence[float]) -> float | None:
    """(n - 1) / span of arrival times (req/s), as the trace scaling defines it; None if undefined."""
    if len(arrivals_s) < 2:
        return None
    span = max(arrivals_s) - min(arrivals_s)
    return (len(arrivals_s) - 1) / span if span > 0 else None


def at_rate(requests: Sequence, rate_rps: float) -> list:
    """Copies of ``requests`` (ReplayRequest-like dataclasses with ``arrival_s``) with arrivals
    scaled so that their mean rate is ``rate_rps``; the pattern (gaps' proportions) is kept.
    Requests that all arrive at once are spread evenly at ``rate_rps``."""
    if rate_rps <= 0:
        raise ValueError("rate must be > 0")
    if not requests:
        return []
    t0 = min(r.arrival_s for r in requests)
    cur = mean_rate([r.arrival_s for r in requests])
    if cur is None:
        return [dataclasses.replace(r, arrival_s=i / rate_rps) for i, r in enumerate(requests)]
    f = cur / rate_rps
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * f) for r in requests]


def session_subset(requests: Sequence, n: int | None) -> list:
    """``n`` requests of ``requests`` made of whole conversations, in trace order.

    Conversations (:func:`pdd.workload.replay.session_key` of each request's ``trace_record``) are
    taken in the order of a hash of their key (deterministic, independent of where they start in
    the trace) until ``n`` requests are reached; the last one taken may lose its latest turns to
    make exactly ``n``. A sample of whole conversations keeps the workload's multi-turn prefix
    reuse (its hit-rate mix), unlike the first ``n`` requests. ``n`` None or >= len: all.
    Raises ValueError if ``n`` < 0.
    """
    if n is not None and n < 0:
        raise ValueError("n must be >= 0")
    if n is None or n >= len(requests):
        return list(requests)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        rec = getattr(r, "trace_record", None) or {}
        groups.setdefault(session_key(rec, getattr(r, "idx", i)), []).append(i)
    keep: list[int] = []
    for key in sorted(groups, key=lambda k: (zlib.crc32(k.encode()), k)):
        if len(keep) >= n:
            break
        keep.extend(groups[key][: n - len(keep)])
    return [requests[i] for i in sorted(keep)]


def point_requests(requests: Sequence, rate_rps: float, max_arrival_s: float | None = None,
                   min_requests: int = 8) -> list:
    """The requests of one sweep point: ``n`` requests of whole conversations
    (:func:`session_subset`) at ``rate_rps`` (:func:`at_rate`),
    ``n = min(len, max(min_requests, floor(rate x max_arrival_s) + 1))`` so the arrivals span at
    most ``max_arrival_s`` seconds (None: all of them)."""
    return at_rate(session_subset(requests, point_size(len(requests), rate_rps, max_arrival_s, min_requests)),
                   rate_rps)


def point_size(available: int, rate_rps: float, max_arrival_s: float | None = None, min_requests: int = 8) -> int:
    """Requests of one sweep point: ``min(available, max(min_requests, floor(rate x max_arrival_s)
    + 1))``, so that its arrivals span at most ``max_arrival_s`` seconds (None: all available)."""
    if max_arrival_s is None:
        return available
    return min(available, max(min_requests, int(rate_rps * max_arrival_s + 1e-9) + 1))


def parse_ramp(spec: str | None) -> tuple[float, float] | None:
    """``"1:8"`` -> ``(1.0, 8.0)`` (req/s, start and end rate of a load ramp; ``"8:1"`` a ramp
    down, as supported: :func:`ramp_arrivals`); None/"" -> None.
    Raises ValueError naming the flag for anything else (rates must be finite and at least
    :data:`pdd.load_profile.MIN_RATE_RPS`)."""
    if spec is None or not spec.strip():
        return None
    try:
        a, b = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--ramp: expected START:END in req/s (e.g. 1:8), got {spec!r}") from None
    if not (0 < a < math.inf and 0 < b < math.inf):  # NaN and inf parse as floats
        raise ValueError(f"--ramp: rates must be finite and > 0, got {spec!r}")
    slow = slow_rate_problem(min(a, b))
    if slow:  # the ramp's arrivals at 1e-9 req/s spanned centuries
        raise ValueError(f"--ramp: each rate {slow} in {spec!r}")
    return a, b


def ramp_arrivals(requests: Sequence, start_rps: float, end_rps: float) -> list:
    """Copies of ``requests`` whose arrival rate rises (or falls) linearly from ``start_rps`` to
    ``end_rps`` over the requests, keeping the trace's pattern of gaps.

    Request i sits at fraction ``u_i = (a_i - a_0) / (a_last - a_0)`` of the original arrivals
    (``i / (n - 1)`` when they all arrive at once). With ``n`` requests and the rate at fraction
    ``u`` being ``r(u) = start + (end - start) u``, reaching ``u`` takes
    ``t(u) = n / (end - start) * ln(r(u) / start)`` s (``n u / start`` when the rates are equal),
    so the instantaneous rate is ``r(u)`` req/s.
    """
    if start_rps <= 0 or end_rps <= 0:
        raise ValueError("ramp rates must be > 0")
    n = len(requests)
    if n == 0:
        return []
    import math

    t0 = min(r.arrival_s for r in requests)
    span = max(r.arrival_s for r in requests) - t0
    out = []
    for i, r in enumerate(requests):
        u = (r.arrival_s - t0) / span if span > 0 else (i / (n - 1) if n > 1 else 0.0)
        if abs(end_rps - start_rps) <= 1e-12:
            t = n * u / start_rps
        else:
            t = n / (end_rps - start_rps) * math.log((start_rps + (end_rps - start_rps) * u) / start_rps)
        out.append(dataclasses.replace(r, arrival_s=t))
    return out
