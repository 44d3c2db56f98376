"""Throughput of a lossy, shared WAN line: TCP's loss-limited rate and cross traffic's share.

The link emulator (``pdd.transfer.link``) schedules every chunk with these functions, and the
policies and tests read the same numbers, so what the emulated line does and what is expected of
it come from one place.

- **Loss-limited rate of one TCP connection** (Mathis, Semke, Mahdavi, Ott, "The Macroscopic
  Behavior of the TCP Congestion Avoidance Algorithm", ACM SIGCOMM CCR 27(3), 1997)::

      BW <= (MSS / RTT) * C / sqrt(p),   C = sqrt(3/2)

  MSS in bytes, RTT in seconds, p the packet loss probability: a connection in congestion
  avoidance halves its window once per 1/p packets, and its mean window is C/sqrt(p) segments.
  ``p = 0`` (or RTT 0) sets no limit (``inf``).
- **Cross traffic**: other flows on the same line, at a rate the schedule gives (Gbit/s from a
  time on, piecewise constant). They do not back off (an aggregate of many flows, as TCP's
  fairness leaves one flow's share of a busy line nearly constant), so the line's rate left to
  pdd's connections is ``line - cross``, never below :data:`MIN_SHARE` of the line.

Pure: no clock, no I/O. Times are seconds on whatever clock the caller uses; rates Gbit/s
(10^9 bit/s); sizes bytes.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

__all__ = [
    "MATHIS_C", "MIN_SHARE", "DEFAULT_MSS_BYTES", "MIN_LINK_GBPS", "MAX_LINE_DELAY_MS", "mathis_gbps", "check_loss_rate",
    "slow_line_problem", "check_schedule",
    "parse_cross_traffic", "cross_gbps_at", "available_gbps", "serialize_end", "chunk_times",
    "transfer_seconds",
]

MATHIS_C = math.sqrt(1.5)  # Mathis et al. 1997: periodic loss, one ACK per segment
MIN_SHARE = 0.01  # cross traffic never takes more than 99% of the line (the line would stall)
DEFAULT_MSS_BYTES = 1460  # Ethernet MTU 1500 less 40 bytes of IPv4 + TCP headers

Schedule = tuple[tuple[float, float], ...]  # ((t_s, gbps), ...), t_s strictly increasing
# The lowest line rate the link emulator and the config take, Gbit/s: 1 kbit/s, at which one
# 64 KiB chunk is serialised in 524 s. Below it a chunk's time overflows: at a subnormal
# 1e-312 Gbit/s a byte takes 8 / (gbps * 1e9) = 8e303 s and a chunk inf.
MIN_LINK_GBPS = 1e-6
# The longest line delay (RTT, jitter) the link emulator and the config take, ms: a minute, far
# past any terrestrial or satellite path (GEO ~600 ms). A larger one (1e12 ms) passed ">= 0" and
# held every byte on the line past every timeout.
MAX_LINE_DELAY_MS = 60_000.0


def slow_line_problem(gbps: float, field: str = "gbps") -> str | None:
    """None unless ``gbps`` is a number > 0 below :data:`MIN_LINK_GBPS`; then the message that
    refuses it, naming ``field`` ("" for none: a config field's location names it). NaN, inf and
    values <= 0 are left to the callers' own checks."""
    if not 0 < gbps < MIN_LINK_GBPS:
        return None
    return (f"{f'{field} ' if field else ''}must be >= {MIN_LINK_GBPS:g} Gbit/s (1 kbit/s: a 64 KiB chunk then "
            f"takes 524 s; below it a chunk's time overflows), got {gbps!r}")


def check_loss_rate(loss_rate: float, field: str = "loss_rate") -> float:
    """``loss_rate`` as a float in [0, 1); raises ValueError naming ``field`` otherwise (NaN too)."""
    p = float(loss_rate)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{field} must be in [0, 1), got {loss_rate!r}")
    return p


def mathis_gbps(mss_bytes: float, rtt_ms: float, loss_rate: float) -> float:
    """One TCP connection's loss-limited throughput, Gbit/s: ``MSS*8/RTT * C/sqrt(p) / 1e9``.

    ``mss_bytes`` > 0, ``rtt_ms`` >= 0 (ms), ``loss_rate`` in [0, 1). ``inf`` when ``loss_rate``
    or ``rtt_ms`` is 0 (no loss-driven limit). Raises ValueError naming the bad argument.
    """
    p = check_loss_rate(loss_rate)
    if not (mss_bytes > 0):
        raise ValueError(f"mss_bytes must be > 0, got {mss_bytes!r}")
    if not (rtt_ms >= 0):
        raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms!r}")
    if p == 0.0 or rtt_ms == 0:
        return math.inf
    return mss_bytes * 8.0 / (rtt_ms / 1000.0) * MATHIS_C / math.sqrt(p) / 1e9


def check_schedule(points: Iterable[Sequence[float]], field: str = "cross_traffic",
                   line_gbps: float | None = None) -> Schedule:
    """A cross-traffic schedule ``[(t_s, gbps), ...]`` validated: ``t_s`` >= 0 and strictly
    increasing, ``gbps`` >= 0 and finite, and below ``line_gbps`` when given. Returns it as a tuple
    of float pairs. Raises ValueError naming ``field`` (when not empty) and the bad point."""
    field = f"{field}: " if field else ""
    out: list[tuple[float, float]] = []
    for pt in points:
        try:
            t, g = (float(x) for x in pt)
        except (TypeError, ValueError):
            raise ValueError(f"{field}each point is (seconds, Gbit/s), got {pt!r}") from None
        if not math.isfinite(t):  # "must be >= 0" would read wrong for inf
            raise ValueError(f"{field}time must be a finite number of seconds, got {t!r}")
        if t < 0:
            raise ValueError(f"{field}time must be >= 0 s, got {t!r}")
        if not math.isfinite(g):
            raise ValueError(f"{field}Gbit/s must be a finite number, got {g!r} at {t:g} s")
        if g < 0:
            raise ValueError(f"{field}Gbit/s must be >= 0, got {g!r} at {t:g} s")
        if out and t <= out[-1][0]:
            raise ValueError(f"{field}times must increase, got {t:g} s after {out[-1][0]:g} s")
        if line_gbps is not None and g >= line_gbps:
            raise ValueError(f"{field}{g:g} Gbit/s at {t:g} s must be below the line's {line_gbps:g} Gbit/s")
        out.append((t, g))
    return tuple(out)


def parse_cross_traffic(text: str, field: str = "--cross-traffic") -> Schedule:
    """``"0:0.5,10:2.0"`` (seconds:Gbit/s, comma-separated) -> ``((0.0, 0.5), (10.0, 2.0))``.
    Raises ValueError naming ``field`` (bad syntax, an empty item such as ``0:0.5,,10:2.0`` or a
    trailing comma, named by its position from 1; negative rate, times not increasing)."""
    pts = []
    parts = str(text).split(",")
    if not any(p.strip() for p in parts):
        raise ValueError(f"{field}: no seconds:Gbit/s point in {text!r}")
    for i, part in enumerate(parts, 1):
        part = part.strip()
        if not part:  # was skipped: the schedule ran without whatever the user meant there
            raise ValueError(f"{field}: item {i} of {text!r} is empty; give seconds:Gbit/s points separated by "
                             f"single commas")
        t, sep, g = part.partition(":")
        if not sep:
            raise ValueError(f"{field}: expected seconds:Gbit/s, got {part!r}")
        try:
            pts.append((float(t), float(g)))
        except ValueError:
            raise ValueError(f"{field}: expected seconds:Gbit/s numbers, got {part!r}") from None
    return check_schedule(pts, field)


def cross_gbps_at(schedule: Schedule, t: float) -> float:
    """Cross traffic at time ``t``: the rate of the last point at or before ``t`` (0 before the first)."""
    g = 0.0
    for ts, gs in schedule:
        if ts > t:
            break
        g = gs
    return g


def available_gbps(line_gbps: float, cross_gbps: float) -> float:
    """The line's rate left to pdd's connections: ``max(line - cross, MIN_SHARE * line)``, Gbit/s."""
    return max(line_gbps - cross_gbps, MIN_SHARE * line_gbps)


def serialize_end(start_s: float, nbytes: int, line_gbps: float, schedule: Schedule = ()) -> float:
    """When ``nbytes`` put on the line at ``start_s`` are serialised: at :func:`available_gbps`,
    integrated over the schedule's pieces (a chunk that spans a change goes at each rate in turn).
    ``start_s`` on the schedule's clock (seconds)."""
    bits = nbytes * 8.0
    t = start_s
    i = 0
    while i < len(schedule) and schedule[i][0] <= t:
        i += 1
    while True:
        rate = available_gbps(line_gbps, schedule[i - 1][1] if i > 0 else 0.0) * 1e9
        seg_end = schedule[i][0] if i < len(schedule) else math.inf
        if t + bits / rate <= seg_end:
            return t + bits / rate
        bits -= (seg_end - t) * rate
        t = seg_end
        i += 1


def chunk_times(now: float, nbytes: int, line_free: float, flow_free: float, line_gbps: float,
                schedule: Schedule = (), conn_gbps: float = math.inf) -> tuple[float, float, float]:
    """The emulator's rule for one chunk of one connection: ``(line_start, line_end, end)``.

    The chunk takes the line after what was admitted before it (``line_start = max(now,
    line_free)``, ``line_end`` by :func:`serialize_end`), and its connection cannot go faster
    than ``conn_gbps`` (its loss-limited rate): ``end = max(line_end, max(now, flow_free) +
    nbytes*8/conn)``. The line is free for others from ``line_end``; the connection's next chunk
    cannot end before ``end + its own time``. One connection alone thus moves N bytes in
    ``N / min(available, conn_gbps)`` seconds of schedule.
    """
    line_start = line_free if line_free > now else now
    line_end = serialize_end(line_start, nbytes, line_gbps, schedule)
    end = line_end
    if conn_gbps != math.inf:
        own = (flow_free if flow_free > now else now) + nbytes * 8.0 / (conn_gbps * 1e9)
        if own > end:
            end = own
    return line_start, line_end, end


def transfer_seconds(nbytes: int, line_gbps: float, cross_gbps: float = 0.0, conn_gbps: float = math.inf,
                     connections: int = 1) -> float:
    """Serialisation time of ``nbytes`` over ``connections`` parallel connections at steady
    state: ``nbytes*8 / min(available_gbps(line, cross), connections * conn_gbps)`` seconds
    (propagation not included)."""
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections!r}")
    rate = min(available_gbps(line_gbps, cross_gbps), connections * conn_gbps)
    return nbytes * 8.0 / (rate * 1e9)
