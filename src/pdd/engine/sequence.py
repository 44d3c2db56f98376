"""One request's state inside an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdd.types import FinishReason, SamplingParams


class SeqStatus(str, Enum):
    WAITING = "waiting"  # created (pages reserved), not added to the batch yet
    RUNNING = "running"  # in the engine's batch
    FINISHED = "finished"  # stopped (EOS / stop token / max_tokens); still holds its pages
    RELEASED = "released"  # pages returned (or handed to the radix cache)


@dataclass
class Sequence:
    """``token_ids`` = prompt + outputs. ``token_ids[:num_computed]`` have KV in ``page_table``
    pages; the engine computes ``token_ids[num_computed:]`` next (1 pending = decode, k > 1 =
    extend / prefill chunk) and samples once it reaches the end.

    ``page_table[i]`` holds tokens ``[i * page_size, (i + 1) * page_size)``; the sequence owns one
    ref per entry. ``num_cached_tokens`` = prompt tokens served from the prefix cache.
    """

    seq_id: object
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_computed: int = 0
    page_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival: int = 0
    can_sample: bool = True  # False while catching up on handed-over tokens without sampling
    prefix_match: object = None  # radix PrefixMatch holding the lock (engine-private)
    # prefill chunks run for this sequence: forward passes that computed some of its prompt
    prefill_chunks: int = 0
    # set (from any thread) when its request was aborted: the engine schedules none of its
    # tokens from the next step on; its owner still releases it (pages freed once, by release)
    cancelled: bool = False
    # structured outputs: the pdd.structured.Guide of ``sampling.grammar`` (engine-private; None
    # without a grammar), advanced over the outputs at each sampled position
    guide: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.RELEASED) and self.finish_reason is not None
