"""An aborted request's prefill stops at the next chunk boundary (``Engine.cancel``): no chunk of
it is scheduled after the one in flight, the other sequences run on, and its pages come back
exactly once when its owner releases it. ``prefill_chunks`` counts chunks per sequence and per
engine."""

from __future__ import annotations

from pdd.types import SamplingParams

SP = SamplingParams(max_tokens=1, ignore_eos=True)
CHUNK = 8


def test_cancel_between_chunks_runs_none_after_and_frees_once(make_engine):
    eng = make_engine(num_pages=64, page_size=4, prefill_chunk_tokens=CHUNK, max_batch_tokens=2 * CHUNK)
    total = eng.pool.num_free
    long_ = eng.new_sequence("long", list(range(5, 5 + 10 * CHUNK)), SP, use_cache=False)  # 10 chunks
    other = eng.new_sequence("other", list(range(200, 200 + 3 * CHUNK)), SP, use_cache=False)  # 3 chunks
    eng.add(long_)
    eng.add(other)
    eng.step()
    eng.step()
    assert (long_.prefill_chunks, other.prefill_chunks, eng.prefill_chunks) == (2, 2, 4)
    eng.cancel(long_)  # at a chunk boundary
    calls = eng.runner.forward_calls
    events = []
    while eng.has_work():
        events += eng.step()
    assert long_.prefill_chunks == 2 and long_.num_computed == 2 * CHUNK  # nothing of it ran after
    assert other.prefill_chunks == 3 and [e.seq_id for e in events] == ["other"]  # the other ran on
    assert eng.runner.forward_calls == calls + 1 and eng.prefill_chunks == 5
    eng.release(other, cache=False)
    eng.release(long_, cache=False)
    eng.release(long_, cache=False)  # idempotent: freed once
    assert eng.pool.num_free == total
    assert not eng.has_work() and eng.step() == []


def test_a_cancelled_sequence_alone_leaves_the_engine_idle(make_engine):
    eng = make_engine(num_pages=64, page_size=4, prefill_chunk_tokens=CHUNK, max_batch_tokens=CHUNK)
    s = eng.new_sequence("s", list(range(5, 5 + 4 * CHUNK)), SP, use_cache=False)
    eng.add(s)
    eng.step()
    eng.cancel(s)
    assert not eng.has_work() and eng.step() == [] and s.prefill_chunks == 1
    assert eng.pending_seqs() == 1  # still held until its owner releases it
    eng.release(s, cache=False)
    assert eng.pending_seqs() == 0 and eng.pool.num_free == eng.pool.num_pages
