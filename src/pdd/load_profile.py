"""Load profiles: an offered rate that changes over time, and the arrival times it gives
(``pdd bench --load-profile ramp`` / ``--rate-schedule``, ``pdd sim run`` the same flags;
docs/BENCH.md "Load ramps and autoscaling"). Pure: numbers in, numbers out (numpy for the seeded
draws); the bench and the simulator share it.

A *rate schedule* is a list of points ``(t_s, rate_rps)`` with ``t_s`` strictly increasing from 0;
the rate is linear between consecutive points and the schedule ends at the last point.
``Lambda(t)`` = the integral of the rate from 0 to t (expected arrivals by t).

Arrivals are a non-homogeneous Poisson process with that rate, drawn by time rescaling
(Cinlar, "Introduction to Stochastic Processes", 1975, ch. 4): unit-rate exponential gaps
``e_1, e_2, ...`` from ``numpy.random.default_rng(seed)``, cumulative sums ``y_k``, and arrival k
at ``Lambda^-1(y_k)``; arrivals stop at the schedule's end (or after ``n_max``). The same seed
gives the same times.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Schedule = tuple[tuple[float, float], ...]

# ``ramp``: low for LOW s, rising linearly to the peak over RISE s, the peak for HOLD s, falling over
# FALL s, low again for LOW s
DEFAULT_RAMP_PHASES_S = (10.0, 20.0, 10.0, 20.0)

# The lowest constant request rate a command takes, req/s: one arrival per 1000 s on average. A
# run's arrivals span about n / rate, so below this even a handful of requests is hours of wall
# time (``--rate 1e-9`` passed "> 0" and never ended). It bounds pdd bench / pdd demo --rate,
# --ramp and --sweep-rate's rates, pdd sim run / pdd plan / pdd sim agentic / pdd workload agentic
# --rate, pdd sim validate --rate, and (as a factor) pdd sim run --scale-rate. A rate schedule
# (--rate-schedule, --load-profile ramp) is not bounded by it: it ends at its last point.
MIN_RATE_RPS = 1e-3


def slow_rate_problem(rate: float, factor: bool = False) -> str | None:
    """None unless ``rate`` is a number > 0 below :data:`MIN_RATE_RPS`; then why it is refused, to
    follow ``FLAG: ``. ``factor``: ``rate`` is a replay speed-up (--scale-rate), not req/s. NaN,
    inf and values <= 0 are left to the callers' own checks (and messages)."""
    if not 0 < rate < MIN_RATE_RPS:
        return None
    if factor:
        return (f"must be >= {MIN_RATE_RPS:g} (a replay at most {1 / MIN_RATE_RPS:g} times slower than the trace; "
                f"a slower one's run would not end), got {rate:g}")
    return (f"must be >= {MIN_RATE_RPS:g} req/s (one request per {1 / MIN_RATE_RPS:g} s on average; a lower "
            f"rate's run would take hours), got {rate:g}")


def check_schedule(points: Sequence[Sequence[float]], what: str = "--rate-schedule") -> Schedule:
    """``points`` as a schedule, or ValueError naming ``what``: at least two points, times from 0
    strictly increasing, rates finite and >= 0, some rate > 0."""
    pts = tuple((float(t), float(r)) for t, r in points)
    for t, r in pts:  # before the order checks: "must increase" / "must be at t=0" would read wrong for inf or NaN
        if not math.isfinite(t):
            raise ValueError(f"{what}: times must be finite seconds, got {t:g}")
        if not math.isfinite(r):
            raise ValueError(f"{what}: rates must be finite req/s, got {r:g} at t={t:g}")
    if len(pts) < 2:
        raise ValueError(f"{what}: needs at least two T:RATE points (the rate is linear between them), got {len(pts)}")
    if pts[0][0] != 0.0:
        raise ValueError(f"{what}: the first point must be at t=0, got t={pts[0][0]:g}")
    for (t0, _), (t1, _) in zip(pts, pts[1:]):
        if not t1 > t0:
            raise ValueError(f"{what}: times must increase strictly, got {t0:g} then {t1:g}")
    for t, r in pts:
        if r < 0:
            raise ValueError(f"{what}: rates must be >= 0 req/s, got {r:g} at t={t:g}")
    if not any(r > 0 for _, r in pts):
        raise ValueError(f"{what}: every rate is 0: nothing would arrive")
    return pts


def parse_rate_schedule(text: str, what: str = "--rate-schedule") -> Schedule:
    """``"0:0.5,20:4,40:0.5"`` -> ``((0.0, 0.5), (20.0, 4.0), (40.0, 0.5))`` (seconds, req/s);
    ValueError naming ``what`` for anything else (:func:`check_schedule`)."""
    if not str(text).strip():
        raise ValueError(f"{what}: empty; expected T:RATE points (seconds:req/s), comma-separated, e.g. 0:0.5,20:4,40:0.5")
    pts = []
    for item in str(text).split(","):
        t, sep, r = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            pts.append((float(t), float(r)))
        except ValueError:
            raise ValueError(f"{what}: expected T:RATE points (seconds:req/s), comma-separated, e.g. "
                             f"0:0.5,20:4,40:0.5; bad item {item.strip()!r}") from None
    return check_schedule(pts, what)


def ramp_schedule(low_rps: float, peak_rps: float, phases_s: Sequence[float] = DEFAULT_RAMP_PHASES_S) -> Schedule:
    """The ``ramp`` profile: low -> peak -> low. ``phases_s`` = (LOW, RISE, HOLD, FALL) seconds:
    ``low_rps`` for LOW, linear to ``peak_rps`` over RISE, ``peak_rps`` for HOLD, linear back over
    FALL, ``low_rps`` for LOW again. A zero-length phase is left out. ValueError if
    ``peak_rps`` <= 0, ``low_rps`` < 0 or > peak, or a phase < 0 or all zero."""
    if not peak_rps > 0:
        raise ValueError(f"--peak-rate: must be > 0 req/s, got {peak_rps}")
    if not 0 <= low_rps <= peak_rps:
        raise ValueError(f"--low-rate: must be in [0, peak rate {peak_rps:g}] req/s, got {low_rps}")
    if len(phases_s) != 4 or any(not (p >= 0 and math.isfinite(p)) for p in phases_s):
        raise ValueError(f"--phase-seconds: expected LOW:RISE:HOLD:FALL, each >= 0 s, got {list(phases_s)}")
    low, rise, hold, fall = (float(p) for p in phases_s)
    pts = [(0.0, low_rps)]
    t = 0.0
    for dur, rate in ((low, low_rps), (rise, peak_rps), (hold, peak_rps), (fall, low_rps), (low, low_rps)):
        if dur > 0:
            t += dur
            pts.append((t, rate))
    if len(pts) < 2:
        raise ValueError("--phase-seconds: all phases are 0 s")
    return check_schedule(pts, "ramp")


def parse_phases(text: str) -> tuple[float, float, float, float]:
    """``"10:20:10:20"`` -> (LOW, RISE, HOLD, FALL) seconds; ValueError naming --phase-seconds."""
    try:
        vals = tuple(float(x) for x in str(text).split(":"))
    except ValueError:
        vals = ()
    if len(vals) != 4 or any(not (v >= 0 and math.isfinite(v)) for v in vals):
        raise ValueError(f"--phase-seconds: expected LOW:RISE:HOLD:FALL seconds, each >= 0 (e.g. 10:20:10:20), "
                         f"got {text!r}")
    return vals  # type: ignore[return-value]


def schedule_from_flags(load_profile: str | None, rate_schedule: str | None, peak_rate: float | None,
                        low_rate: float | None, phase_seconds: str | None, rate: float,
                        ramp: str | None = None) -> Schedule | None:
    """The schedule ``pdd bench`` and ``pdd sim run`` take from their flags: ``--rate-schedule``,
    or ``--load-profile ramp`` (``--peak-rate``, default ``rate``; ``--low-rate``, default peak /
    4; ``--phase-seconds``, default :data:`DEFAULT_RAMP_PHASES_S`); None without either.
    ValueError naming the flag when a value is bad or flags conflict (``ramp``: bench's linear
    ``--ramp``, which excludes both)."""
    ramp_only = [f for f, v in (("--peak-rate", peak_rate), ("--low-rate", low_rate),
                                ("--phase-seconds", phase_seconds)) if v is not None]
    if load_profile and rate_schedule is not None:
        raise ValueError("--load-profile and --rate-schedule: give one (a ramp is a rate schedule)")
    if (load_profile or rate_schedule is not None) and ramp:
        raise ValueError("--ramp: not with --load-profile / --rate-schedule (give the whole schedule there)")
    if ramp_only and load_profile != "ramp":
        raise ValueError(f"{', '.join(ramp_only)}: only with --load-profile ramp")
    if rate_schedule is not None:  # "" is refused, not taken as no schedule
        return parse_rate_schedule(rate_schedule)
    if load_profile == "ramp":
        peak = peak_rate if peak_rate is not None else rate
        low = low_rate if low_rate is not None else peak / 4
        phases = parse_phases(phase_seconds) if phase_seconds is not None else DEFAULT_RAMP_PHASES_S
        return ramp_schedule(low, peak, phases)
    if load_profile is not None:
        raise ValueError(f"--load-profile: unknown profile {load_profile!r} (known: ramp)")
    return None


def duration_s(points: Schedule) -> float:
    return points[-1][0]


def rate_at(points: Schedule, t: float) -> float:
    """The schedule's rate at ``t`` seconds (req/s); 0 outside [0, end]."""
    if t < 0 or t > points[-1][0]:
        return 0.0
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if t <= t1:
            return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def expected_arrivals(points: Schedule, t: float | None = None) -> float:
    """``Lambda(t)``: expected arrivals from 0 to ``t`` (default: the schedule's end)."""
    t = points[-1][0] if t is None else min(max(t, 0.0), points[-1][0])
    total = 0.0
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if t <= t0:
            break
        s = min(t, t1) - t0
        total += r0 * s + (r1 - r0) / (t1 - t0) * s * s / 2
    return total


def invert(points: Schedule, y: float) -> float | None:
    """The ``t`` with ``Lambda(t) = y`` (the first such, seconds), None when ``y`` exceeds the
    schedule's total. Within a segment of rate ``r0 + a2 s`` (``a2 = (r1 - r0) / d``),
    ``r0 s + a2 s^2 / 2 = y`` gives ``s = 2y / (r0 + sqrt(r0^2 + 2 a2 y))`` (the root that is
    stable for rising, falling and flat rates)."""
    if y < 0:
        raise ValueError("y must be >= 0")
    acc = 0.0
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        d = t1 - t0
        seg = (r0 + r1) / 2 * d
        if y <= acc + seg and seg > 0:
            rem = y - acc
            a2 = (r1 - r0) / d
            disc = max(0.0, r0 * r0 + 2 * a2 * rem)
            den = r0 + math.sqrt(disc)
            s = 2 * rem / den if den > 0 else 0.0
            return t0 + min(max(s, 0.0), d)
        acc += seg
    return None


def schedule_arrivals(points: Schedule, n_max: int, seed: int = 0) -> list[float]:
    """Arrival times (s, increasing) of a Poisson process with the schedule's rate (module
    docstring): at most ``n_max``, only those within the schedule."""
    if n_max <= 0:
        return []
    e = np.random.default_rng(seed).standard_exponential(n_max)
    out = []
    for y in np.cumsum(e):
        t = invert(points, float(y))
        if t is None:
            break
        out.append(t)
    return out


def offered_series(points: Schedule, step_s: float = 1.0) -> tuple[list[float], list[float]]:
    """``(t_s, rate_rps)`` every ``step_s`` over the schedule and at its points (for plots)."""
    ts = sorted({*(p[0] for p in points), *np.arange(0.0, points[-1][0], step_s).tolist()})
    return ts, [rate_at(points, t) for t in ts]


def describe(points: Schedule) -> str:
    """The points as ``"0s:1, 10s:4, 20s:1"`` (seconds:req/s)."""
    return ", ".join(f"{t:g}s:{r:g}" for t, r in points)


def shape(points: Schedule) -> str:
    """The schedule's rates in turn, a held rate once, and its span: ``"1 -> 4 -> 1 req/s over
    70 s"`` (the ramp profile 0s:1, 10s:1, 30s:4, 40s:4, 60s:1, 70s:1), ``"2 req/s over 10 s"``.
    What a progress bar names beside the mean; :func:`describe` gives every point."""
    rates = [r for i, (_, r) in enumerate(points) if i == 0 or r != points[i - 1][1]]
    return f"{' -> '.join(f'{r:g}' for r in rates)} req/s over {duration_s(points):g} s"


__all__ = ["Schedule", "DEFAULT_RAMP_PHASES_S", "check_schedule", "parse_rate_schedule", "ramp_schedule", "parse_phases",
           "schedule_from_flags",
           "duration_s", "rate_at", "expected_arrivals", "invert", "schedule_arrivals", "offered_series", "describe", "shape"]
