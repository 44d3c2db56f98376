"""A gateway request's phase (:class:`Phase`), held on the request and moved only by
:meth:`PhaseLog.to`, which checks each move against :data:`TRANSITIONS` and records it with its
time. Plain data, no I/O.

The life of one attempt (a recovery starts the next one at PREFILL)::

    queued -> prefill -> transfer -> rld_decode -> handoff -> md_decode -> done
                            |  (P->MD, P->D: MD streams)        ^
                            +-----------------------------------+
    colocated: queued -> prefill -> decode -> done
    any live phase -> recovery -> prefill (a new attempt) ; any phase -> done

prefill: P's prefill call has not returned. transfer: the KV is on its way to the decoder that
will finish the request (a relayed request's MD transfer, RLD decoding meanwhile; a P->MD
request's MD has not streamed yet). rld_decode: RLD streams and either MD holds the KV (the
handoff has not begun) or MD's leg was given up (RLD finishes). handoff: RLD was asked for its
ids (or MD took over from them), MD's stream is not live yet. md_decode: the client streams
from MD. recovery: an instance the attempt needed was lost; the next attempt is being started.

An illegal move is a logged error, or an ``AssertionError`` when :data:`STRICT` (tests set
``PDD_STRICT_PHASES=1``). A finished request (done) keeps its phase: late events (a reply
arriving after an abort) move nothing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from enum import Enum

log = logging.getLogger("pdd.gateway.orchestrator")

STRICT = os.environ.get("PDD_STRICT_PHASES", "") not in ("", "0")


class Phase(str, Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    RLD_DECODE = "rld_decode"
    HANDOFF = "handoff"
    MD_DECODE = "md_decode"
    DECODE = "decode"  # colocated: the one instance decodes
    RECOVERY = "recovery"
    DONE = "done"


P = Phase
# the phases a fault can be injected in (pdd.faults): a live attempt's, on the split tiers
INJECTABLE = (P.PREFILL, P.TRANSFER, P.RLD_DECODE, P.HANDOFF, P.MD_DECODE)
_LIVE = (P.PREFILL, P.TRANSFER, P.RLD_DECODE, P.HANDOFF, P.MD_DECODE, P.DECODE)

# phase -> the phases it may move to (every phase may also end: done)
TRANSITIONS: dict[Phase, frozenset] = {
    P.QUEUED: frozenset({P.PREFILL}),
    P.PREFILL: frozenset({P.TRANSFER, P.DECODE, P.RECOVERY}),
    # a relayed request's MD KV lands (rld_decode), its early handoff starts (handoff), or a
    # P->MD / P->RLD request's decoder streams its first token (md_decode / rld_decode)
    P.TRANSFER: frozenset({P.RLD_DECODE, P.HANDOFF, P.MD_DECODE, P.RECOVERY}),
    # MD's leg given up before RLD streamed: back to waiting for RLD's first token
    P.RLD_DECODE: frozenset({P.HANDOFF, P.TRANSFER, P.RECOVERY}),
    # MD's stream went live, or MD's leg was given up mid-handoff (RLD finishes)
    P.HANDOFF: frozenset({P.MD_DECODE, P.RLD_DECODE, P.TRANSFER, P.RECOVERY}),
    P.MD_DECODE: frozenset({P.RECOVERY}),
    P.DECODE: frozenset({P.RECOVERY}),
    P.RECOVERY: frozenset({P.PREFILL}),  # (a retried start stays in recovery: staying is no move)
    P.DONE: frozenset(),
}
for _p in Phase:
    if _p is not P.DONE:
        TRANSITIONS[_p] = TRANSITIONS[_p] | {P.DONE}


class IllegalTransition(AssertionError):
    """A phase move not in :data:`TRANSITIONS` (raised only when :data:`STRICT`)."""


@dataclass
class PhaseLog:
    """A request's held phase and its history ``[(phase, perf_counter seconds), ...]``; owned by
    the orchestrator's transitions (:meth:`to`)."""

    phase: Phase = Phase.QUEUED
    history: list = field(default_factory=lambda: [(Phase.QUEUED, time.perf_counter())])

    def to(self, new: Phase, rid: str = "?", why: str = "") -> bool:
        """Move to ``new``; True if the phase changed. Staying is a no-op (False), so is any move
        out of done. An illegal move is logged as an error (raises :class:`IllegalTransition`
        when :data:`STRICT`) and leaves the phase unchanged."""
        old = self.phase
        if new is old or old is P.DONE:
            return False
        if new not in TRANSITIONS[old]:
            msg = f"request {rid}: illegal phase transition {old.value} -> {new.value}" + (f" ({why})" if why else "")
            if STRICT:
                raise IllegalTransition(msg)
            log.error(msg)
            return False
        self.phase = new
        self.history.append((new, time.perf_counter()))
        return True

    @property
    def live(self) -> bool:
        """The attempt is running on the tiers (not queued, recovering or done)."""
        return self.phase in _LIVE
