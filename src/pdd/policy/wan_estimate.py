"""The live WAN throughput estimate the pipeline and cut-off policies read.

MD measures each request's KV receive rate (bytes after the first frame over the time since it
arrived, ``roles.base.kv_rate_sample_gbps``) and reports it to the gateway. One sample can be far
off: frames that queued in a busy receiver's socket buffer arrive as a burst and read as a rate
many times the line's (seen live: 1.86 Gbit/s on a 0.05 Gbit/s line), and a flow sharing the line
with others reads as a fraction of it. The estimate is therefore the **median of the last
``window`` samples**, which ignores a minority of outliers on either side (a robust running
estimator, as used for RTT/bandwidth probing), instead of an EWMA that one outlier drags for many
samples.

On a lossy line the estimate is also capped at what one TCP connection can carry there
(``pdd.policy.tcp_model.mathis_gbps``: a transfer goes over one connection), once the loss is
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

DEFAULT_WINDOW = 9  # samples; an odd count so the median is one sample


@dataclass
class WanEstimate:
    """Recent WAN throughput samples (Gbit/s) and their median, capped by the loss-limited rate.

    window: how many of the newest samples count (>= 1).
    line_gbps: the configured line rate (Gbit/s), the first estimate's upper bound; None: unknown.
    rtt_ms, mss_bytes: the line's round trip (ms) and TCP segment (bytes) of the loss cap.
    loss_rate: the line's packet loss probability in [0, 1) when known, else None (no cap).
    """

    window: int = DEFAULT_WINDOW
    samples: deque = field(default_factory=deque)
    line_gbps: float | None = None
    rtt_ms: float = 0.0
    mss_bytes: int = DEFAULT_MSS_BYTES
    loss_rate: float | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.loss_rate is not None:
            self.loss_rate = check_loss_rate(self.loss_rate, "loss_rate")

    @classmethod
    def for_line(cls, line_gbps: float, rtt_ms: float, loss_rate: float = 0.0,
                 mss_bytes: int = DEFAULT_MSS_BYTES, window: int = DEFAULT_WINDOW) -> "WanEstimate":
        """The estimate of a configured line (``link.wan_gbps``, ``wan_rtt_ms``, ``wan_loss_rate``,
        ``wan_mss_bytes``). Loss 0 is "no loss known": the same as ``WanEstimate(window)``."""
        return cls(window=window, line_gbps=line_gbps, rtt_ms=rtt_ms, mss_bytes=mss_bytes,
                   loss_rate=check_loss_rate(loss_rate, "loss_rate") or None)

    @property
    def cap_gbps(self) -> float | None:
        """One connection's loss-limited rate on this line, Gbit/s (Mathis et al. 1997), or None
        when no loss is known (or the RTT is 0)."""
        if not self.loss_rate:
            return None
        m = mathis_gbps(self.mss_bytes, self.rtt_ms, self.loss_rate)
        return None if m == math.inf else m

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
