"""Send order on the shared WAN line (DESIGN.md "WAN sharing"; PDD report "Dual-path transfer").

Connections between datacenters are few, pooled and persistent, so how the one line is
shared between requests is decided by our frame scheduler, not by TCP: each time the line
can take a frame, :func:`pick_next` names the transfer that sends it.

- "fifo": the oldest enqueued transfer first (lowest ``enqueued_seq``).
- "srf": shortest remaining first (fewest ``remaining_bytes``; ties by ``enqueued_seq``):
  high-hit requests' tiny increments do not wait behind a low-hit request's GBs, which cuts
  the TTFT tail (the report's tail is made of low-hit requests whose transfer takes 1-20 s).
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
