"""RadixCache: matching, locking, insert adoption, LRU eviction, exact page accounting."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.engine import KVPool, ModelConfig, RadixCache

CFG = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=2)
PS = 2


def _new(num_pages=64):
    pool = KVPool(CFG, num_pages, PS)
    return pool, RadixCache(pool)


def _cache_seq(pool, radix, tokens):
    """A sequence computing ``tokens`` from scratch, then releasing into the cache."""
    pages = pool.alloc(-(-len(tokens) // PS))
    present = radix.insert(tokens, pages[: len(tokens) // PS])
    pool.decref(pages)
    return present


def test_match_insert_evict_basic():
    pool, radix = _new()
    assert _cache_seq(pool, radix, [1, 2, 3, 4, 5]) == 0
    assert radix.num_nodes == 2 and pool.num_free == 62
    m = radix.match_prefix([1, 2, 3, 4, 9, 9])
    assert len(m.pages) == 2 and all(pool.refcount(p) == 2 for p in m.pages)
    assert radix.match_prefix([1, 2, 3], max_pages=0).pages == []
    m1 = radix.match_prefix([1, 2, 3, 4], max_pages=1)
    assert len(m1.pages) == 1
    assert radix.evict(10) == 0  # locked
    radix.unlock(m)
    radix.unlock(m)  # idempotent
    pool.decref(m.pages)
    assert radix.evict(10) == 1  # [3,4] evictable, [1,2] still locked by m1
    radix.unlock(m1)
    pool.decref(m1.pages)
    assert _cache_seq(pool, radix, [1, 2, 7, 7]) == 1
    st_ = radix.stats()
    assert st_["queried_tokens"] == 6 + 3 + 4 and st_["hit_tokens"] == 4 + 0 + 2
    radix.flush()
    assert radix.num_nodes == 0 and pool.num_free == pool.num_pages


def test_pages_only_the_cache_holds_are_counted_exactly():
    """``KVPool.num_cached``: the pages the tree alone holds (what an idle instance's prefix
    cache keeps, reclaimable), not those a sequence holds too (a match, or a sequence's own page
    the tree adopted while it still runs)."""
    pool, radix = _new()
    pages = pool.alloc(3)  # a sequence of 5 tokens: 2 whole pages + 1 partial
    radix.insert([1, 2, 3, 4, 5], pages[:2])
    assert (pool.num_used, pool.num_cached) == (3, 0)  # the sequence still holds all three
    pool.decref(pages)  # released: the tree alone holds its 2 whole pages
    assert (pool.num_used, pool.num_cached) == (2, 2)
    m = radix.match_prefix([1, 2, 3, 9])  # a new sequence shares the first page
    assert (pool.num_used, pool.num_cached) == (2, 1)
    radix.unlock(m)
    pool.decref(m.pages)
    assert pool.num_cached == 2
    assert radix.flush() == 2
    assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 0, 64)


def test_lru_order():
    pool, radix = _new()
    _cache_seq(pool, radix, [1, 1])
    _cache_seq(pool, radix, [2, 2])
    _cache_seq(pool, radix, [3, 3])
    m = radix.match_prefix([1, 1])  # touch [1,1]
    radix.unlock(m)
    pool.decref(m.pages)
    assert radix.evict(1) == 1
    assert radix.peek([2, 2]) == 0 and radix.peek([1, 1]) == 1 and radix.peek([3, 3]) == 1
    radix.flush()
    assert pool.num_free == pool.num_pages


ops = st.lists(
    st.one_of(
        st.tuples(st.just("seq"), st.lists(st.integers(0, 2), min_size=1, max_size=9), st.integers(0, 5)),
        st.tuples(st.just("release"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("evict"), st.integers(0, 6), st.just(None)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_ops_free_every_page_exactly_once(ops):
    """Model of the engine's protocol: match (lock + ref), alloc the rest, release (insert,
    unlock, decref). Refcounts must equal holders at every point; everything frees at the end."""
    pool, radix = _new(num_pages=48)
    live = []
    for op, a, b in ops:
        if op == "seq":
            m = radix.match_prefix(a, max_pages=b)
            need = -(-len(a) // PS) - len(m.pages)
            if need > pool.num_free:
                radix.evict(need - pool.num_free)
            if need > pool.num_free:
                radix.unlock(m)
                pool.decref(m.pages)
                continue
            live.append((a, m, m.pages + pool.alloc(need)))
        elif op == "release" and live:
            tokens, m, table = live.pop(a % len(live))
            if b:
                radix.insert(tokens, table[: len(tokens) // PS])
            radix.unlock(m)
            pool.decref(table)
        elif op == "evict":
            radix.evict(a)
        # invariant: refcount = (tree holds it) + number of live tables holding it
        tree_pages = []
        stack = [radix.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not radix.root:
                tree_pages.append(n.page)
        assert len(set(tree_pages)) == len(tree_pages) == radix.num_nodes
        expected = {}
        for p in tree_pages:
            expected[p] = expected.get(p, 0) + 1
        for _, _, table in live:
            for p in table:
                expected[p] = expected.get(p, 0) + 1
        for p in range(pool.num_pages):
            assert pool.refcount(p) == expected.get(p, 0)
        assert pool.num_free == pool.num_pages - len(expected)
        assert pool.num_cached == sum(1 for p in tree_pages if expected[p] == 1)  # only the tree holds them
    for tokens, m, table in live:
        radix.insert(tokens, table[: len(tokens) // PS])
        radix.unlock(m)
        pool.decref(table)
    radix.flush()
    assert radix.num_nodes == 0
    assert pool.num_free == pool.num_pages
