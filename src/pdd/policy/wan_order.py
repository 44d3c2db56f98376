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

Still, about one BDP (plus the frame being written) is committed ahead of any transfer that
starts while a large one streams: ~40 ms of a 0.05 Gbit/s line at 20 ms RTT. So P keeps two
persistent connections to each WAN target, two *lanes* (:func:`wan_lane`): small transfers
(a high-hit request's increment, on its TTFT's critical path) take the express lane, and
the line's per-connection fairness (TCP's, and the emulator's chunk-by-chunk sharing; the
report: "TCP's fairness lets the WAN flows share the line") interleaves them with the bulk
lane's transfer instead of queueing them behind what it committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

WAN_ORDERS = ("fifo", "srf")
WAN_LANES = ("bulk", "express")  # what wan_lane returns


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
    bdp = bdp_bytes(line_gbps, rtt_ms, bdp_factor)
    if bdp_factor == 0:
        return None
    return max(int(floor_bytes), int(bdp_factor * bdp))


def bdp_bytes(line_gbps: float, rtt_ms: float, bdp_factor: float = 1.0) -> float:
    """One bandwidth-delay product of the line, bytes: ``line_gbps`` Gbit/s x ``rtt_ms``. Raises
    ValueError for a negative ``bdp_factor`` (the caller's multiple of it), rate or RTT."""
    if bdp_factor < 0 or line_gbps < 0 or rtt_ms < 0:
        raise ValueError("bdp_factor, line_gbps and rtt_ms must be >= 0")
    return line_gbps * 1e9 / 8.0 * rtt_ms / 1000.0


def express_max_bytes(line_gbps: float, rtt_ms: float, bdp_factor: float) -> int:
    """Largest transfer (bytes) that takes the express lane: ``bdp_factor`` bandwidth-delay
    products of the line (``line_gbps`` Gbit/s x ``rtt_ms``); 0 when ``bdp_factor`` is 0 (one
    lane). At the default line (0.05 Gbit/s, 20 ms) and factor 2: 250 kB, ~40 ms of the line.
    Raises ValueError for a negative factor, rate or RTT."""
    return int(bdp_factor * bdp_bytes(line_gbps, rtt_ms, bdp_factor))


def wan_lane(transfer_bytes: int, max_express_bytes: int) -> str:
    """The lane (a persistent connection of its own) a WAN transfer of ``transfer_bytes``
    payload bytes takes: ``"express"`` when it is at most ``max_express_bytes``
    (:func:`express_max_bytes`; 0 disables the lane), else ``"bulk"``.

    A small transfer queued behind a large one on the same connection waits for what that
    connection already committed (its socket buffer and frame, ~1 BDP, :func:`send_buffer_bytes`)
    whatever the send order; on a connection of its own it shares the line with it from its
    first byte. Measured on the emulated line (0.05 Gbit/s, 20 ms RTT, a 2 MiB transfer 100 ms
    ahead; docs/LINK.md "Two lanes"): a one-page (32 KiB) increment's time to arrive went from
    53 to 23-30 ms, the large transfer's from 353 to 357-363 ms."""
    if max_express_bytes > 0 and 0 <= transfer_bytes <= max_express_bytes:
        return "express"
    return "bulk"
