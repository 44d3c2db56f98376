"""Sender-side pacing (token bucket), e.g. to emulate the in-datacenter fast path P -> RLD."""

from __future__ import annotations

import asyncio
from typing import Optional

__all__ = ["Pacer", "gbps_to_bytes_per_s"]


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Gbit/s (10^9 bit/s) -> bytes/s."""
    return gbps * 1e9 / 8.0


class Pacer:
    """Token bucket: ``await pacer.wait(n)`` returns when ``n`` bytes may go out at ``rate_gbps``.

    ``rate_gbps``: Gbit/s; ``None`` or ``<= 0`` disables pacing. ``burst_bytes``: bucket depth
    (bytes that may leave back to back after an idle period). Concurrent waiters are served in
    call order (each takes its tokens at call time, then sleeps off its debt).
    """

    def __init__(self, rate_gbps: Optional[float], burst_bytes: int = 256 << 10):
        self.burst_bytes = int(burst_bytes)
        self._tokens = float(self.burst_bytes)
        self._t: Optional[float] = None
        self.rate_gbps: Optional[float] = None
        self.set_rate(rate_gbps)

    def set_rate(self, rate_gbps: Optional[float]) -> None:
        """Change the rate (Gbit/s) for bytes not yet admitted."""
        self.rate_gbps = rate_gbps if rate_gbps and rate_gbps > 0 else None

    async def wait(self, nbytes: int) -> None:
        if self.rate_gbps is None:
            return
        rate = gbps_to_bytes_per_s(self.rate_gbps)
        now = asyncio.get_running_loop().time()
        if self._t is not None:
            self._tokens = min(float(self.burst_bytes), self._tokens + (now - self._t) * rate)
        self._t = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / rate)
