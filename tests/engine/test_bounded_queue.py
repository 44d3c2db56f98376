"""The engine's bounded queue: ``max_running_seqs + max_waiting`` sequences that still need
compute at most; one more raises TierBusy holding nothing, and finished / released sequences
make room again."""

from __future__ import annotations

import pytest

from pdd.engine.engine import Engine
from pdd.engine.scheduler import TierBusy
from pdd.types import SamplingParams


def test_new_sequence_beyond_the_queue_raises_tier_busy_and_takes_nothing(tiny_model):
    eng = Engine.from_pretrained(tiny_model, num_pages=64, page_size=8, max_running_seqs=2, max_waiting=1)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    seqs = [eng.new_sequence(f"s{i}", [10 + i, 11, 12], sp) for i in range(3)]
    assert eng.pending_seqs() == 3
    free = eng.pool.num_free
    with pytest.raises(TierBusy) as ei:
        eng.new_sequence("s3", [1, 2, 3], sp)
    assert (ei.value.pending, ei.value.limit, ei.value.seq_id) == (3, 3, "s3")
    assert str(ei.value).startswith("queue full: 3 sequences need compute, the limit is 3")
    assert eng.pool.num_free == free  # refused before any page was taken
    # run one to its end: a finished sequence (pages still held) no longer counts
    eng.add(seqs[0])
    while not seqs[0].is_finished:
        eng.step()
    assert eng.pending_seqs() == 2
    s3 = eng.new_sequence("s3", [1, 2, 3], sp)
    with pytest.raises(TierBusy):
        eng.new_sequence("s4", [1, 2, 3], sp)
    eng.release(seqs[1], cache=False)  # released: room again
    eng.release(seqs[1], cache=False)  # idempotent, counted once
    eng.new_sequence("s4", [1, 2, 3], sp)
    assert eng.pending_seqs() == 3
    for s in (seqs[0], seqs[2], s3):
        eng.release(s, cache=False)


def test_unbounded_by_default(tiny_model):
    eng = Engine.from_pretrained(tiny_model, num_pages=256, page_size=8, max_running_seqs=1)
    seqs = [eng.new_sequence(i, [5, 6, 7]) for i in range(20)]
    assert eng.max_waiting is None and eng.pending_seqs() == 20
    for s in seqs:
        eng.release(s, cache=False)
    assert eng.pending_seqs() == 0 and eng.pool.num_free == eng.pool.num_pages
