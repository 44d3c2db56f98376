"""The live WAN throughput estimate the pipeline and cut-off policies read.

MD measures each request's KV receive rate (bytes after the first frame over the time since it
arrived, ``roles.base.kv_rate_sample_gbps``) and reports it to the gateway. One sample can be far
off: frames that queued in a busy receiver's socket buffer arrive as a burst and read as a rate
many times the line's (seen live: 1.86 Gbit/s on a 0.05 Gbit/s line), and a flow sharing the line
with others reads as a fraction of it. The estimate is therefore the **median of the last
``window`` samples**, which ignores a minority of outliers on either side (a robust running
estimator, as used for RTT/bandwidth probing), instead of an EWMA that one outlier drags for many
samples.

On a lossy line the estimate is also capped at what a transfer's TCP connections can carry there
(``connections`` x ``pdd.policy.tcp_model.mathis_gbps``: one, or ``link.wan_connections`` when P
stripes a transfer over several), once the loss is
known: from the configured ``link.wan_loss_rate`` (:meth:`WanEstimate.for_line`, which then also
gives a first estimate before any sample, ``min(line, cap)``) or from a sender reporting it with a
sample (``add(gbps, loss_rate=)``). Without loss nothing changes: no cap, None before a sample.

Pure: no clock, no I/O; the runtime (``gateway.orchestrator``) and the simulator (``sim.cluster``)
hold one :class:`WanEstimate` each and feed it the same samples.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from pdd.policy.tcp_model import DEFAULT_MSS_BYTES, check_loss_rate, mathis_gbps

# MD reports a KV transfer's progress (``kv_progress``) on a frame's arrival at most this often, s
KV_PROGRESS_INTERVAL_S = 0.5

DEFAULT_WINDOW = 9  # samples; an odd count so the median is one sample


@dataclass
class WanEstimate:
    """Recent WAN throughput samples (Gbit/s) and their median, capped by the loss-limited rate.

    window: how many of the newest samples count (>= 1).
    line_gbps: the configured line rate (Gbit/s), the first estimate's upper bound; None: unknown.
    rtt_ms, mss_bytes: the line's round trip (ms) and TCP segment (bytes) of the loss cap.
    loss_rate: the line's packet loss probability in [0, 1) when known, else None (no cap).
    connections: connections one transfer is striped over (``link.wan_connections``, >= 1): the
        cap is that many connections' loss-limited rate.
    """

    window: int = DEFAULT_WINDOW
    samples: deque = field(default_factory=deque)
    line_gbps: float | None = None
    rtt_ms: float = 0.0
    mss_bytes: int = DEFAULT_MSS_BYTES
    loss_rate: float | None = None
    connections: int = 1

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.connections < 1:
            raise ValueError(f"connections must be >= 1, got {self.connections}")
        if self.loss_rate is not None:
            self.loss_rate = check_loss_rate(self.loss_rate, "loss_rate")

    @classmethod
    def for_line(cls, line_gbps: float, rtt_ms: float, loss_rate: float = 0.0,
                 mss_bytes: int = DEFAULT_MSS_BYTES, window: int = DEFAULT_WINDOW,
                 connections: int = 1) -> "WanEstimate":
        """The estimate of a configured line (``link.wan_gbps``, ``wan_rtt_ms``, ``wan_loss_rate``,
        ``wan_mss_bytes``, ``wan_connections``). Loss 0 is "no loss known": the same as
        ``WanEstimate(window)``."""
        return cls(window=window, line_gbps=line_gbps, rtt_ms=rtt_ms, mss_bytes=mss_bytes,
                   loss_rate=check_loss_rate(loss_rate, "loss_rate") or None, connections=connections)

    @property
    def cap_gbps(self) -> float | None:
        """``connections`` x one connection's loss-limited rate on this line, Gbit/s (Mathis et
        al. 1997), or None when no loss is known (or the RTT is 0)."""
        if not self.loss_rate:
            return None
        m = mathis_gbps(self.mss_bytes, self.rtt_ms, self.loss_rate)
        return None if m == math.inf else m * self.connections

    @property
    def gbps(self) -> float | None:
        """The estimate in Gbit/s: the median of the window, at most :attr:`cap_gbps`. Before the
        first sample: ``min(line_gbps, cap_gbps)`` when a loss is known, else None."""
        cap = self.cap_gbps
        if not self.samples:
            if cap is None:
                return None
            return cap if self.line_gbps is None else min(self.line_gbps, cap)
        med = statistics.median(self.samples)
        return med if cap is None else min(med, cap)

    def add(self, sample_gbps: float, loss_rate: float | None = None) -> float | None:
        """Fold one sample (Gbit/s) in and return the new estimate. ``loss_rate``: the loss the
        sender saw on that transfer, when it knows it (replaces the known loss; [0, 1), else
        ValueError naming it).

        Non-finite or non-positive samples carry no information about the line and are ignored.
        """
        if loss_rate is not None:
            self.loss_rate = check_loss_rate(loss_rate, "loss_rate")
        if not (sample_gbps > 0 and sample_gbps != float("inf")):
            return self.gbps
        self.samples.append(float(sample_gbps))
        while len(self.samples) > self.window:
            self.samples.popleft()
        return self.gbps


@dataclass
class RttEstimate:
    """A WAN peer's round trip, ms: the **minimum of the last ``window`` samples**.

    The gateway's samples are request/reply round trips through the line (MD's reservation,
    ``gateway.launch``): propagation plus whatever queued in front of them (a busy line's
    buffers, MD's event loop). The transfer-time model adds the line's propagation once and
    charges queueing to the goodput, so it wants the propagation part: BBR's windowed-minimum
    RTT filter (Cardwell, Cheng, Gunn, Hassas Yeganeh, Jacobson, "BBR: Congestion-Based
    Congestion Control", ACM Queue 14(5), 2016: ``RTprop = min(RTT samples over a window)``)
    is the estimator for it; queueing only ever adds to a sample, so the minimum is the least
    biased. A window (not all history) lets a lasting change of route show within ``window``
    samples. Pure, as :class:`WanEstimate`."""

    window: int = DEFAULT_WINDOW
    samples: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @property
    def ms(self) -> float | None:
        """The estimate (ms), None before a sample."""
        return min(self.samples) if self.samples else None

    def add(self, sample_ms: float) -> float | None:
        """Fold one round trip (ms) in; non-finite or negative samples are ignored."""
        if sample_ms >= 0 and sample_ms != float("inf"):
            self.samples.append(float(sample_ms))
            while len(self.samples) > self.window:
                self.samples.popleft()
        return self.ms


def transfer_seconds(nbytes: float, gbps: float, rtt_ms: float, backlog_bytes: float = 0.0) -> float:
    """Seconds from now until the receiver's first token is back:
    ``rtt + (backlog_bytes + nbytes) * 8 / (gbps * 1e9)`` (half a round trip for the KV to
    propagate, the other half for the token to come back; ``pdd.policy.pipeline.expected_wan_seconds``
    applies it to a request's missing KV). ``backlog_bytes``: bytes already queued to that peer
    ahead of this transfer (:func:`queued_bytes`), which cross the line first (FIFO: a shared line
    carries them before or beside these, either way the last byte leaves after all of them).
    A non-positive rate with bytes to send gives ``inf``."""
    rtt_s = max(0.0, rtt_ms) / 1000.0
    total = max(0.0, nbytes) + max(0.0, backlog_bytes)
    if total <= 0:
        return rtt_s
    if gbps <= 0:
        return math.inf
    return rtt_s + total * 8.0 / (gbps * 1e9)


def inflight_remaining_s(total_bytes: float, done_bytes: float, gbps: float, age_s: float,
                         report_interval_s: float = KV_PROGRESS_INTERVAL_S) -> float:
    """Seconds until the last of a transfer's ``total_bytes`` is delivered, from its receiver's
    last progress report (MD's ``kv_progress``): ``done_bytes`` had arrived ``age_s`` seconds ago,
    lately at ``gbps`` Gbit/s, so ``max(0, (total_bytes - done_bytes) * 8 / (gbps * 1e9) -
    min(age_s, report_interval_s))``. The receiver reports on a frame's arrival once
    ``report_interval_s`` passed since its previous report, so a report older than that says no
    frame came since: the age credits at most one interval (a stalled line's remaining time does
    not run down to 0). The transfer's own rate, not the goodput estimate of finished transfers:
    a line that slowed while it was under way shows in it at once. Nothing left: 0; bytes left at
    a non-positive rate: ``inf``."""
    left = max(0.0, total_bytes - max(0.0, done_bytes))
    if left <= 0:
        return 0.0
    if not gbps > 0:
        return math.inf
    return max(0.0, left * 8.0 / (gbps * 1e9) - min(max(0.0, age_s), max(0.0, report_interval_s)))


def progress_report(mark_s: float, mark_bytes: float, now_s: float, total_bytes: float,
                    interval_s: float = KV_PROGRESS_INTERVAL_S) -> tuple[float, float] | None:
    """A receiver's progress report of one transfer (MD's ``kv_progress``) on a frame's arrival at
    ``now_s``: ``total_bytes`` received so far; the previous report (or the first frame's arrival)
    was at ``mark_s`` with ``mark_bytes`` received (seconds on one clock, payload bytes). Due once
    ``interval_s`` seconds passed since the mark and bytes arrived since: ``(total_bytes, gbps)``
    with ``gbps = (total_bytes - mark_bytes) * 8 / (now_s - mark_s) / 1e9`` (the rate since the
    mark; the report is the next mark); else None. The runtime's MD
    (``roles.base.EngineInstance.kv_progress``) and the simulated one (``pdd.sim.cluster``) both
    report with it; :func:`inflight_remaining_s` reads the report."""
    dt = now_s - mark_s
    if dt <= 0 or dt < interval_s or total_bytes <= mark_bytes:
        return None
    return total_bytes, (total_bytes - mark_bytes) * 8 / dt / 1e9


def queued_bytes(planned_bytes, oldest_elapsed_s: float, gbps: float) -> float:
    """Bytes still queued to a peer, from the transfers in flight to it: their planned payload
    bytes (``planned_bytes``, an iterable) less what the line can have carried since the oldest
    of them started (``oldest_elapsed_s`` seconds ago at ``gbps`` Gbit/s), at least 0:
    ``max(0, sum(planned) - gbps * 1e9 / 8 * oldest_elapsed_s)``. A lower bound: the line carried
    at most that much of them (less when it idled, e.g. a layer-wise transfer waiting for its
    prefill). No transfer, or a non-positive rate, gives ``sum(planned)``."""
    total = float(sum(max(0, b) for b in planned_bytes))
    if total <= 0 or gbps <= 0:
        return total
    return max(0.0, total - gbps * 1e9 / 8.0 * max(0.0, oldest_elapsed_s))


def probe_due(now_s: float, last_sample_s: float | None, last_probe_s: float | None, interval_s: float) -> bool:
    """Whether a WAN peer's goodput estimate is stale and due a probe (``policy.wan_probe_interval_s``):
    neither a goodput sample (a KV receive rate) nor a probe in the last ``interval_s`` seconds
    (times in seconds on one clock; None: never). ``interval_s`` <= 0: probes are off, never due.
    An idle peer is then probed once per interval; one that receives transfers never is."""
    if interval_s <= 0:
        return False
    last = max((t for t in (last_sample_s, last_probe_s) if t is not None), default=None)
    return last is None or now_s - last >= interval_s


def probe_goodput_gbps(probe_bytes: int, payload_s: float, empty_s: float) -> float | None:
    """Goodput (Gbit/s) from a probe pair: a request/reply of ``probe_bytes`` payload took
    ``payload_s`` seconds, one without payload ``empty_s``; the difference is the payload's
    serialisation on the path, so ``probe_bytes * 8 / (payload_s - empty_s) / 1e9``. None when it
    tells nothing (no bytes, or a difference <= 0: the payload crossed no slower than the empty
    round trip, e.g. a jitter spike on the empty one)."""
    d = payload_s - empty_s
    if probe_bytes <= 0 or not d > 0:
        return None
    return probe_bytes * 8.0 / d / 1e9


WAN_ESTIMATE_SOURCES = ("live", "config")


@dataclass
class PeerWanEstimates:
    """One goodput and one RTT estimate **per WAN peer** (an MD instance across the WAN), with
    the configured line as the fallback.

    Goodput (Gbit/s): a :class:`WanEstimate` per peer (median of its last ``window`` KV receive
    rates, capped by the configured loss's Mathis rate; why a median and not an EWMA: the module
    docstring). RTT (ms): an :class:`RttEstimate` per peer (windowed minimum). A peer with no
    sample yet reads the configured figures (``line_gbps`` capped by the loss's rate, ``rtt_ms``).

    ``source``: ``"live"`` (the estimates decide) or ``"config"`` (every peer reads the configured
    figures whatever was measured: ``policy.wan_estimate: config``, the baseline); samples are
    kept either way, so /metrics shows what was measured.
    """

    line_gbps: float
    rtt_ms: float
    loss_rate: float = 0.0
    mss_bytes: int = DEFAULT_MSS_BYTES
    window: int = DEFAULT_WINDOW
    source: str = "live"
    connections: int = 1  # link.wan_connections: a transfer's connections (the loss cap is theirs)
    goodput: dict = field(default_factory=dict)  # peer -> WanEstimate
    rtt: dict = field(default_factory=dict)  # peer -> RttEstimate

    def __post_init__(self) -> None:
        if self.source not in WAN_ESTIMATE_SOURCES:
            raise ValueError(f"source must be one of {WAN_ESTIMATE_SOURCES}, got {self.source!r}")
        g = WanEstimate.for_line(self.line_gbps, self.rtt_ms, self.loss_rate, self.mss_bytes,
                                 connections=self.connections).gbps
        self._configured_gbps = self.line_gbps if g is None else g  # fixed: read on every routing

    def _goodput(self, peer: str) -> WanEstimate:
        if peer not in self.goodput:
            self.goodput[peer] = WanEstimate.for_line(self.line_gbps, self.rtt_ms, self.loss_rate, self.mss_bytes,
                                                      self.window, self.connections)
        return self.goodput[peer]

    def add_goodput(self, peer: str, gbps: float, loss_rate: float | None = None) -> float | None:
        """One KV receive rate (Gbit/s) of ``peer``; returns its measured estimate."""
        return self._goodput(peer).add(gbps, loss_rate)

    def add_rtt(self, peer: str, rtt_ms: float) -> float | None:
        """One round trip (ms) to ``peer``; returns its measured estimate."""
        return self.rtt.setdefault(peer, RttEstimate(self.window)).add(rtt_ms)

    def forget(self, peer: str) -> None:
        """Drop ``peer``'s estimates (it left the topology); a later sample starts afresh."""
        self.goodput.pop(peer, None)
        self.rtt.pop(peer, None)

    def configured_gbps(self) -> float:
        """The configured line rate, capped by one connection's Mathis rate at the configured loss."""
        return self._configured_gbps

    def gbps(self, peer: str | None) -> float:
        """The goodput the policies read for ``peer`` (Gbit/s): its live estimate once it has one
        (``source`` live), else the configured figure."""
        if self.source == "live" and peer is not None and peer in self.goodput:
            g = self.goodput[peer].gbps
            if g is not None:
                return g
        return self.configured_gbps()

    def rtt_ms_of(self, peer: str | None) -> float:
        """The round trip the policies read for ``peer`` (ms): live once sampled, else configured."""
        if self.source == "live" and peer is not None and peer in self.rtt:
            r = self.rtt[peer].ms
            if r is not None:
                return r
        return self.rtt_ms

    def transfer_s(self, peer: str | None, nbytes: float, backlog_bytes: float = 0.0) -> float:
        """Estimated seconds to move ``nbytes`` of KV to ``peer`` behind ``backlog_bytes`` already
        queued to it and get its first token back (:func:`transfer_seconds` at the peer's goodput
        and RTT)."""
        return transfer_seconds(nbytes, self.gbps(peer), self.rtt_ms_of(peer), backlog_bytes)

    def view(self) -> dict:
        """peer -> {"gbps", "rtt_ms" (what the policies read), "gbps_measured", "rtt_ms_measured"
        (None before a sample), "goodput_samples", "rtt_samples"}: /pdd/stats ``wan_peers``."""
        out = {}
        for peer in sorted(set(self.goodput) | set(self.rtt)):
            g, r = self.goodput.get(peer), self.rtt.get(peer)
            out[peer] = {"gbps": self.gbps(peer), "rtt_ms": self.rtt_ms_of(peer),
                         "gbps_measured": g.gbps if g is not None and g.samples else None,
                         "rtt_ms_measured": r.ms if r is not None else None,
                         "goodput_samples": len(g.samples) if g is not None else 0,
                         "rtt_samples": len(r.samples) if r is not None else 0}
        return out
