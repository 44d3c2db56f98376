"""Pure batch formation (continuous batching with chunked prefill). No torch, no clock.

The engine and the cluster simulator both call :func:`schedule` on plain :class:`SeqState`
records. Policy, in order:

1. **Decodes first**: every sequence with exactly 1 pending token (``num_tokens - num_computed
   == 1``), in arrival order, 1 token each.
2. **Extends / prefill chunks**: each gets ``min(pending, prefill_chunk_tokens, tokens left in
   the budget)`` tokens; a sequence whose pending tokens do not all fit is cut into a chunk and
   continues in later steps (chunked prefill). Order (``prefill_order``):

   - ``"fcfs"``: by arrival. A long prompt then takes the whole budget for several steps and a
     short one behind it waits for all of them (a 2,200-token prompt: 5 steps of 512 tokens).
   - ``"short_first"``: the oldest sequence first, but with at most what the others leave it
     and never less than half the budget; then the others, fewest pending tokens first (ties by
     arrival). A one-page turn of an agentic session is prefilled in the next step beside a long
     prompt's chunk, and the long prompt still advances by >= half the budget every step, so
     nothing starves. (vLLM's chunked prefill has the same aim with
     ``--max-num-partial-prefills`` / ``--long-prefill-token-threshold``.)

Limits: at most ``max_batch_tokens`` new tokens and ``max_running_seqs`` sequences per batch.
A plan item samples (``sample=True``) when it reaches the end of the sequence's token ids and
the sequence allows sampling. Cost: O(n log n) in the number of states (one sort).
"""

from __future__ import annotations

from dataclasses import dataclass, field


PREFILL_ORDERS = ("fcfs", "short_first")


@dataclass
class SchedulerConfig:
    max_batch_tokens: int = 2048  # new tokens per forward call
    max_running_seqs: int = 256  # sequences per forward call
    prefill_chunk_tokens: int = 512  # at most this many tokens of one sequence per call (k > 1)
    prefill_order: str = "fcfs"  # "fcfs" | "short_first" (module docstring)

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.max_running_seqs < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError("scheduler limits must be >= 1")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")


class TierBusy(RuntimeError):
    """An engine's bounded queue is full: it holds ``limit`` sequences that still need compute
    (``max_running_seqs`` that one batch runs plus ``max_waiting`` queued) and refuses another.

    Raised by ``Engine.new_sequence`` before it takes anything. Across an RPC call the remote
    error text starts with the class name (``TierBusy: ...``): the gateway turns a request a tier
    refused this way into HTTP 429 (``pdd.gateway.admission.is_tier_busy``).
    """

    def __init__(self, pending: int, limit: int, seq_id=None):
        super().__init__(f"queue full: {pending} sequences need compute, the limit is {limit} "
                         f"(max_running + max_waiting)")
        self.pending, self.limit, self.seq_id = pending, limit, seq_id


@dataclass
class SeqState:
    """What the scheduler needs to know about one sequence."""

    seq_id: object
    num_tokens: int  # len(token_ids): prompt + outputs so far
    num_computed: int  # tokens whose KV is already in pages
    arrival: int = 0  # order of arrival (smaller first); ties keep input order
    can_sample: bool = True  # False: compute KV for pending tokens but do not sample (catch-up)

    @property
    def pending(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass
class PlanItem:
    """Compute tokens ``[start, start + num_tokens)`` of ``seq_id``; sample after the last if ``sample``."""

    seq_id: object
    start: int
    num_tokens: int
    sample: bool


@dataclass
class BatchPlan:
    items: list[PlanItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def num_decodes(self) -> int:
        return sum(1 for i in self.items if i.num_tokens == 1)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)


def schedule(states, cfg: SchedulerConfig) -> BatchPlan:
    """Form one batch from ``states`` (any iterable of :class:`SeqState`-like objects)."""
    order = sorted((s for s in states if s.num_tokens > s.num_computed), key=lambda s: s.arrival)
    budget = cfg.max_batch_tokens
    slots = cfg.max_running_seqs
    items: list[PlanItem] = []
    rest = []
    for s in order:
        if s.num_tokens - s.num_computed == 1:
            if budget <= 0 or slots <= 0:
                break
            items.append(PlanItem(s.seq_id, s.num_computed, 1, getattr(s, "can_sample", True)))
            budget -= 1
            slots -= 1
        else:
            rest.append(s)
    first_cap = budget
    if cfg.prefill_order == "short_first" and len(rest) > 1:
        oldest, others = rest[0], sorted(rest[1:], key=lambda s: (s.num_tokens - s.num_computed, s.arrival))
        wanted = sum(min(s.num_tokens - s.num_computed, cfg.prefill_chunk_tokens) for s in others[: slots - 1])
        first_cap = max(budget // 2, budget - wanted, 1)
        rest = [oldest, *others]
    for k, s in enumerate(rest):
        if budget <= 0 or slots <= 0:
            break
        n = min(s.num_tokens - s.num_computed, cfg.prefill_chunk_tokens, budget, first_cap if k == 0 else budget)
        end = s.num_computed + n
        items.append(PlanItem(s.seq_id, s.num_computed, n, end == s.num_tokens and getattr(s, "can_sample", True)))
        budget -= n
        slots -= 1
    return BatchPlan(items)
