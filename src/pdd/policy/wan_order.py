"""Send order on the shared WAN line (DESIGN.md "WAN sharing"; PDD report "Dual-path transfer").

Connections between datacenters are few, pooled and persistent, so how the one line is
shared between requests is decided by our frame scheduler, not by TCP: each time the line
can take a frame, :func:`pick_next` names the transfer that sends it.

- "fifo": the oldest enqueued transfer first (lowest ``enqueued_seq``).
- "srf": shortest remaining first (fewest ``remaining_bytes``; ties by ``enqueued_seq``):
  high-hit requests' tiny increments do not wait behind a low-hit request's GBs, which cuts
  the TTFT tail (the report's tail is made of low-hit requests whose transfer takes 1-20 s).

The order only decides among bytes not yet handed to the kernel. What the sender's socket
already holds goes out first whatever the order, so the sender caps its socket's send buffer
(:func:`send_buffer_bytes`): about one bandwidth-delay product of the line, enough to keep it
busy, little enough that a small transfer never waits behind MBs committed earlier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

WAN_ORDERS = ("fifo", "srf")


@dataclass(frozen=True)
class TransferView:
    rid: str
    remaining_bytes: int
    enqueued_seq: int


def pick_next(transfers: Sequence[TransferView], policy: str) -> int:
    """Index into ``transfers`` of the transfer to serve next. Raises ValueError if empty."""
    if not transfers:
        raise ValueError("no transfers to pick from")
    if policy == "fifo":
        return min(range(len(transfers)), key=lambda i: (transfers[i].enqueued_seq, i))
    if policy == "srf":
        return min(
            range(len(transfers)),
            key=lambda i: (transfers[i].remaining_bytes, transfers[i].enqueued_seq, i),
        )
    raise ValueError(f"unknown WAN order {policy!r}; expected one of {WAN_ORDERS}")


MIN_SEND_BUFFER_BYTES = 64 << 10


def send_buffer_bytes(line_gbps: float, rtt_ms: float, bdp_factor: float,
                      floor_bytes: int = MIN_SEND_BUFFER_BYTES) -> int | None:
    """Kernel send buffer (bytes) of a WAN KV connection: ``bdp_factor`` bandwidth-delay products
    of the line (``line_gbps`` Gbit/s x ``rtt_ms``), at least ``floor_bytes``; None when
    ``bdp_factor`` is 0 (leave the OS default: autotuned up to ``net.ipv4.tcp_wmem``'s maximum,
    4 MiB here, i.e. 0.67 s of a 0.05 Gbit/s line that a tiny increment waits behind).

    One BDP is what TCP needs in flight to fill the line (a smaller buffer would cap the rate),
    so the sender commits about one round trip of data beyond the send-order policy. Raises
    ValueError for a negative factor, rate or RTT."""
    if bdp_factor < 0 or line_gbps < 0 or rtt_ms < 0:
        raise ValueError("bdp_factor, line_gbps and rtt_ms must be >= 0")
    if bdp_factor == 0:
        return None
    bdp = line_gbps * 1e9 / 8.0 * rtt_ms / 1000.0
    return max(int(floor_bytes), int(bdp_factor * bdp))
