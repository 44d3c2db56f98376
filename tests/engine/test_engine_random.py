"""Random interleavings of engine calls on a tight pool: outputs never change, every page is
freed exactly once."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.engine import Engine, OutOfPages
from pdd.types import SamplingParams

SP = SamplingParams(max_tokens=5, ignore_eos=True)
BASE = list(range(40, 70))
PROMPTS = [BASE[:9], BASE[:13], BASE[:16] + [7, 8], BASE + [9], [3] + BASE[:11], BASE[:4]]


@pytest.fixture(scope="module")
def ref_and_engine(tiny_model):
    ref = Engine.from_pretrained(tiny_model, num_pages=64, page_size=4)
    outs = [ref.generate([p], SP, use_cache=False)[0] for p in PROMPTS]
    eng = Engine.from_pretrained(tiny_model, num_pages=14, page_size=4, max_batch_tokens=12, prefill_chunk_tokens=6)
    return outs, eng


ops = st.lists(st.tuples(st.sampled_from(["new", "new", "step", "step", "step", "remove", "release"]),
                         st.integers(0, 5), st.booleans()), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_random_engine_ops(ref_and_engine, ops):
    ref, eng = ref_and_engine
    live, out_of_batch = {}, {}
    n = 0
    for op, a, flag in ops:
        if op == "new":
            try:
                s = eng.new_sequence(n, PROMPTS[a], SP, use_cache=flag)
            except OutOfPages:
                continue
            s.prompt_idx = a
            live[n] = s
            eng.add(s)
            n += 1
        elif op == "step":
            try:
                for ev in eng.step():
                    s = live[ev.seq_id]
                    assert ev.position == s.num_outputs - 1
                    assert s.output_ids == ref[s.prompt_idx][: s.num_outputs]  # cache reuse never changes tokens
            except OutOfPages as e:
                eng.release(eng.remove(e.seq_id), cache=flag)
                live.pop(e.seq_id)
        elif op == "remove" and live:
            sid = sorted(live)[a % len(live)]
            if sid in eng.seqs:
                out_of_batch[sid] = eng.remove(sid)
        elif op == "release" and live:
            sid = sorted(live)[a % len(live)]
            s = live.pop(sid)
            out_of_batch.pop(sid, None)
            if sid in eng.seqs:
                eng.remove(sid)
            eng.release(s, cache=flag)
            eng.release(s, cache=flag)  # idempotent
    for sid, s in list(live.items()):
        eng.release(s, cache=True)
    assert not eng.seqs
    eng.flush_cache()
    assert eng.radix.num_nodes == 0
    assert eng.pool.num_free == eng.pool.num_pages
