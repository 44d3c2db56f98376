"""Pure scheduler: decodes first, FCFS chunked prefill within the token budget; no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdd.engine.scheduler import SchedulerConfig, SeqState, schedule


def _plan(states, **kw):
    return [(i.seq_id, i.start, i.num_tokens, i.sample) for i in schedule(states, SchedulerConfig(**kw)).items]


def test_decodes_first_then_fcfs_chunks():
    states = [
        SeqState("p1", num_tokens=100, num_computed=0, arrival=0),
        SeqState("d1", num_tokens=50, num_computed=49, arrival=1),
        SeqState("p2", num_tokens=30, num_computed=10, arrival=2),
        SeqState("d2", num_tokens=20, num_computed=19, arrival=3),
        SeqState("idle", num_tokens=20, num_computed=20, arrival=4),
    ]
    assert _plan(states, max_batch_tokens=64, prefill_chunk_tokens=40) == [
        ("d1", 49, 1, True), ("d2", 19, 1, True), ("p1", 0, 40, False), ("p2", 10, 20, True),
    ]
    # budget cuts the second prefill into a chunk; the chunk cap applies to each sequence
    assert _plan(states, max_batch_tokens=50, prefill_chunk_tokens=40) == [
        ("d1", 49, 1, True), ("d2", 19, 1, True), ("p1", 0, 40, False), ("p2", 10, 8, False),
    ]
    assert _plan(states, max_batch_tokens=1) == [("d1", 49, 1, True)]
    assert _plan(states, max_running_seqs=3) == [("d1", 49, 1, True), ("d2", 19, 1, True), ("p1", 0, 100, True)]
    assert _plan([SeqState("x", 5, 5)]) == []


def test_can_sample_false_is_respected():
    s = [SeqState("c", num_tokens=10, num_computed=4, can_sample=False), SeqState("d", 3, 2, 1, False)]
    assert _plan(s) == [("d", 2, 1, False), ("c", 4, 6, False)]


def test_extend_is_one_item_and_chunking_covers_all_tokens():
    s = SeqState("e", num_tokens=1000, num_computed=0)
    cfg = SchedulerConfig(max_batch_tokens=96, prefill_chunk_tokens=64)
    seen = 0
    while s.num_computed < s.num_tokens:
        (item,) = schedule([s], cfg).items
        assert item.start == s.num_computed and item.num_tokens <= 64
        s.num_computed += item.num_tokens
        seen += item.num_tokens
        assert item.sample == (s.num_computed == 1000)
    assert seen == 1000


def test_large_batch_plan():
    # its speed is measured by tests/engine/test_scheduler_bench.py (pytest-benchmark), not asserted here
    states = [SeqState(i, 1000, 999 if i % 2 else 0, i) for i in range(10000)]
    plan = schedule(states, SchedulerConfig(max_batch_tokens=8192, max_running_seqs=10000))
    assert plan.num_decodes == 5000 and plan.num_tokens == 8192


def test_scheduler_imports_no_torch():
    code = "import sys, pdd.engine.scheduler, pdd.engine.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_short_first_lets_a_short_prefill_beside_a_long_one_without_starving_it():
    cfg = SchedulerConfig(max_batch_tokens=512, max_running_seqs=8, prefill_chunk_tokens=512, prefill_order="short_first")
    long_ = SeqState("long", num_tokens=2200, num_computed=512, arrival=0)  # mid-prefill
    short = SeqState("short", num_tokens=830, num_computed=800, arrival=5)  # a 30-token turn
    mid = SeqState("mid", num_tokens=400, num_computed=0, arrival=3)
    dec = SeqState("d", num_tokens=60, num_computed=59, arrival=1)
    plan = schedule([long_, short, mid, dec], cfg)
    got = [(it.seq_id, it.start, it.num_tokens) for it in plan.items]
    # the decode, then the oldest capped at half the budget left (511 // 2 = 255: the others want
    # 30 + 400), then the others shortest first: the 30-token turn, then 226 tokens of "mid"
    assert got == [("d", 59, 1), ("long", 512, 255), ("short", 800, 30), ("mid", 0, 226)]
    assert plan.num_tokens == 512
    # fcfs: the long prompt takes what the decode leaves; the others wait
    fcfs = schedule([long_, short, mid, dec], SchedulerConfig(512, 8, 512))
    assert [(it.seq_id, it.num_tokens) for it in fcfs.items] == [("d", 1), ("long", 511)]
    # others wanting little: the oldest gets the rest of the budget, not just half
    plan = schedule([long_, short], cfg)
    assert [(it.seq_id, it.num_tokens) for it in plan.items] == [("long", 482), ("short", 30)]
    # alone, the oldest is never capped
    assert [(it.seq_id, it.num_tokens) for it in schedule([long_], cfg).items] == [("long", 512)]
    with pytest.raises(ValueError):
        SchedulerConfig(prefill_order="lifo")


def test_short_first_finishes_every_prefill():
    """Every sequence's prefill completes under short_first, the oldest advancing each step."""
    cfg = SchedulerConfig(max_batch_tokens=64, max_running_seqs=4, prefill_chunk_tokens=64, prefill_order="short_first")
    states = [SeqState(i, num_tokens=n, num_computed=0, arrival=i) for i, n in enumerate((500, 20, 90, 7, 300))]
    steps = 0
    while any(s.num_computed < s.num_tokens for s in states):
        plan = schedule(states, cfg)
        assert plan.num_tokens <= 64 and len(plan.items) <= 4
        oldest = min((s for s in states if s.num_computed < s.num_tokens), key=lambda s: s.arrival)
        assert oldest.seq_id in {it.seq_id for it in plan.items}  # it advances every step
        for it in plan.items:
            states[it.seq_id].num_computed += it.num_tokens
        steps += 1
    assert steps == -(-917 // 64)  # every step full until the end
