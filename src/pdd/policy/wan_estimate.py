"""The live WAN throughput estimate the pipeline and cut-off policies read.

MD measures each request's KV receive rate (bytes after the first frame over the time since it
arrived, ``roles.base.kv_rate_sample_gbps``) and reports it to the gateway. One sample can be far
off: frames that queued in a busy receiver's socket buffer arrive as a burst and read as a rate
many times the line's (seen live: 1.86 Gbit/s on a 0.05 Gbit/s line), and a flow sharing the line
with others reads as a fraction of it. The estimate is therefore the **median of the last
``window`` samples**, which ignores a minority of outliers on either side (a robust running
estimator, as used for RTT/bandwidth probing), instead of an EWMA that one outlier drags for many
samples.

Pure: no clock, no I/O; the runtime (``gateway.orchestrator``) and the simulator (``sim.cluster``)
hold one :class:`WanEstimate` each and feed it the same samples.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

DEFAULT_WINDOW = 9  # samples; an odd count so the median is one sample


@dataclass
class WanEstimate:
    """Recent WAN throughput samples (Gbit/s) and their median.

    window: how many of the newest samples count (>= 1).
    """

    window: int = DEFAULT_WINDOW
    samples: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @property
    def gbps(self) -> float | None:
        """The estimate in Gbit/s (median of the window), or None before the first sample."""
        return statistics.median(self.samples) if self.samples else None

    def add(self, sample_gbps: float) -> float | None:
        """Fold one sample (Gbit/s) in and return the new estimate.

        Non-finite or non-positive samples carry no information about the line and are ignored.
        """
        if not (sample_gbps > 0 and sample_gbps != float("inf")):
            return self.gbps
        self.samples.append(float(sample_gbps))
        while len(self.samples) > self.window:
            self.samples.popleft()
        return self.gbps
