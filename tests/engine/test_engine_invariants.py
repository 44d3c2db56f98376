"""Random add / step / cancel / remove / release / import / flush sequences on a tight pool, with
the page and cache invariants checked after every call: each page's refcount equals its holders
(live sequences' page tables + the radix tree), the free list is exactly the pages at 0, the
pool's count of pages only the cache holds is exact, each
radix node's lock equals the live matches through it, a sequence's pages are distinct and cover its
computed tokens, and every sampled token equals a lone greedy run's (preemption, eviction, chunk
and page boundaries never change a token)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.engine import Engine, OutOfPages
from pdd.engine.kv_pool import PagesHeld
from pdd.engine.sequence import SeqStatus
from pdd.types import SamplingParams

PS = 4
BASE = list(range(40, 80))
# prompts at page boundaries (PS-1, PS, PS+1, 2PS, ...) sharing prefixes, and one apart
PROMPTS = [BASE[:3], BASE[:4], BASE[:5], BASE[:8], BASE[:9], BASE[:12], BASE[:13], BASE[:4] + [7, 8], [3] + BASE[:10]]
MAX_TOKENS = [1, 3, 6]


def _sp(k: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[k], ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model):
    roomy = Engine.from_pretrained(tiny_model, num_pages=64, page_size=PS)
    ref = {(i, k): roomy.generate([p], _sp(k), use_cache=False)[0]
           for i, p in enumerate(PROMPTS) for k in range(len(MAX_TOKENS))}
    return ref, roomy


def _nodes(radix):
    out, stack = [], [radix.root]
    while stack:
        for c in stack.pop().children.values():
            out.append(c)
            stack.append(c)
    return out


def check(eng, live: dict) -> None:
    pool = eng.pool
    want = [0] * pool.num_pages
    for s in live.values():
        assert s.status != SeqStatus.RELEASED
        assert len(set(s.page_table)) == len(s.page_table)
        assert len(s.page_table) * PS >= s.num_computed
        for p in s.page_table:
            want[p] += 1
    nodes = _nodes(eng.radix)
    for n in nodes:
        want[n.page] += 1
    assert want == [pool.refcount(p) for p in range(pool.num_pages)]
    assert sorted(pool._free) == [p for p in range(pool.num_pages) if pool.refcount(p) == 0]
    assert eng.radix.num_nodes == len(nodes)
    # the pages only the cache holds (what /metrics reports as pdd_kv_pages{state="cached"})
    assert pool.num_cached == sum(1 for n in nodes if pool.refcount(n.page) == 1)
    locks = {id(n): 0 for n in nodes}
    for s in live.values():
        m = s.prefix_match
        if m is not None and m.locked:
            assert s.page_table[: len(m.pages)] == m.pages
            n = m.node
            while n is not eng.radix.root:
                locks[id(n)] += 1
                n = n.parent
    assert all(n.lock == locks[id(n)] for n in nodes)
    assert all(live.get(sid) is s for sid, s in eng.seqs.items())
    assert set(eng._live) == {id(s) for s in live.values()}


def import_kv(src, eng, seq) -> int:
    """KV of prompt tokens [num_computed, prompt_len) computed on ``src`` and imported into
    ``seq``'s pages (as P -> RLD / MD); returns the first token."""
    s = src.new_sequence("src", seq.prompt_ids, SamplingParams(max_tokens=1, ignore_eos=True), use_cache=False)
    src.add(s)
    while src.has_work():
        src.step()
    first = seq.num_computed // PS
    k = seq.prompt_len - first * PS
    if k > 0:
        last = k % PS or PS
        eng.pool.import_pages(seq.page_table[first:first + -(-k // PS)],
                              src.pool.export_pages(s.page_table[first:], last_slots=last), last_slots=last)
    t0 = s.output_ids[0]
    src.release(s, cache=False)
    return t0


OPS = st.lists(st.tuples(st.sampled_from(["new", "new", "import", "step", "step", "step", "step", "cancel",
                                          "remove", "readd", "release", "flush"]),
                         st.integers(0, len(PROMPTS) - 1), st.integers(0, len(MAX_TOKENS) - 1), st.booleans()),
               min_size=1, max_size=50)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS, st.sampled_from([(12, 5, 2), (6, 3, 1), (16, 4, 3)]))
def test_pages_refcounts_and_locks_hold_after_every_call(tiny_model, engines, ops, limits):
    ref, src = engines
    num_pages = 10
    batch, chunk, running = limits
    eng = Engine.from_pretrained(tiny_model, num_pages=num_pages, page_size=PS, max_batch_tokens=batch,
                                 prefill_chunk_tokens=chunk, max_running=running)
    live, key, n = {}, {}, 0

    def on_event(ev):
        s = live[ev.seq_id]
        want = ref[key[ev.seq_id]]
        assert ev.position == s.num_outputs - 1 and s.output_ids == want[: s.num_outputs]
        if ev.finished:
            assert s.output_ids == want

    for op, a, b, flag in ops:
        if op in ("new", "import"):
            try:
                s = eng.new_sequence(n, PROMPTS[a], _sp(b), use_cache=flag or op == "import",
                                     min_uncached=0 if op == "import" and flag else 1)
            except OutOfPages:
                check(eng, live)
                continue
            live[n], key[n] = s, (a, b)
            if op == "import":
                t0 = import_kv(src, eng, s)
                eng.kv_imported(s, t0)
                assert t0 == ref[(a, b)][0]
                m = s.prompt_len // PS
                if m:  # MD caches the prompt's whole pages as soon as they are in
                    eng.radix.insert(s.token_ids[: m * PS], s.page_table[:m])
            if s.status != SeqStatus.FINISHED:
                eng.add(s)
            n += 1
        elif op == "step":
            try:
                for ev in eng.step():
                    on_event(ev)
            except PagesHeld:  # pages held outside the batch: release one of those holders
                sid = next(sid for sid, s in live.items() if sid not in eng.seqs or s.cancelled)
                eng.release(live.pop(sid), cache=flag)
            except OutOfPages as e:
                eng.release(live.pop(e.seq_id), cache=False)
        elif op == "cancel" and live:
            eng.cancel(live[sorted(live)[a % len(live)]])
        elif op == "remove" and eng.seqs:
            eng.remove(sorted(eng.seqs)[a % len(eng.seqs)])
        elif op == "readd":
            out = [sid for sid, s in live.items() if s.status == SeqStatus.WAITING and sid not in eng.seqs]
            if out:
                eng.add(live[out[a % len(out)]])
        elif op == "release" and live:
            s = live.pop(sorted(live)[a % len(live)])
            eng.release(s, cache=flag)
            eng.release(s, cache=flag)  # idempotent
        elif op == "flush":
            eng.flush_cache()
        check(eng, live)
    # what is left finishes (or was cancelled / taken out) and frees every page
    for sid, s in list(live.items()):
        if s.cancelled or s.status == SeqStatus.FINISHED or sid not in eng.seqs:
            eng.release(live.pop(sid))
    while eng.has_work():
        for ev in eng.step():
            on_event(ev)
            if ev.finished:
                eng.release(live.pop(ev.seq_id))
        check(eng, live)
    assert not live and not eng.seqs
    eng.flush_cache()
    assert eng.radix.num_nodes == 0 and eng.pool.num_free == num_pages
