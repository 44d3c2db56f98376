"""pdd.policy.prefix_index: the gateway's approximate record of a remote instance's prefixes."""
import pytest

from pdd.policy.prefix_index import PrefixIndex


def test_longest_whole_page_prefix_of_what_was_inserted():
    ix = PrefixIndex(page_size=4, capacity_pages=100)
    a = list(range(10))  # 2 whole pages + 2 tokens
    assert ix.match(a) == 0
    ix.insert(a)
    assert len(ix) == 2
    assert ix.match(a) == 8
    assert ix.match(a[:8] + [99, 98, 97, 96]) == 8  # same 2 pages, a different third
    assert ix.match(a[:5]) == 4
    assert ix.match([0, 1, 2, 99] + a[4:]) == 0  # page 2 equal but under another page 1: no prefix
    assert ix.match([]) == 0


def test_least_recently_used_pages_leave_first():
    ix = PrefixIndex(page_size=2, capacity_pages=4)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ix.insert(a)
    ix.insert(b)
    assert ix.match(a) == 4  # a used again: b is now the oldest
    ix.insert([9, 10])
    assert len(ix) == 4
    assert ix.match(a) == 4 and ix.match([9, 10]) == 2
    assert ix.match(b) == 0  # b's first page went
    ix.clear()
    assert ix.match(a) == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="page_size"):
        PrefixIndex(0, 10)
    with pytest.raises(ValueError, match="capacity_pages"):
        PrefixIndex(16, 0)


def test_keys_of_the_caller_name_pages_as_the_token_chain_does():
    """match_keys / insert_keys: the simulator names a page by (trace hash id, page in block);
    a key names its whole prefix, so matching stops at the first page not held, and the same
    LRU bound applies."""
    ix = PrefixIndex(page_size=16, capacity_pages=3)
    ix.insert_keys([("a", 0), ("a", 1)])
    assert ix.match_keys([("a", 0), ("a", 1), ("b", 0)]) == 2
    assert ix.match_keys([("b", 0), ("a", 1)]) == 0  # page 2 held, page 1 not: no prefix
    assert ix.match_keys(iter([])) == 0
    ix.insert_keys([("c", 0), ("c", 1)])  # 4 keys > 3: the least recently used, ("a", 0), leaves
    assert len(ix) == 3 and ix.match_keys([("a", 0)]) == 0 and ix.match_keys([("c", 0), ("c", 1)]) == 2
    tokens = list(range(40))
    ix.insert(tokens)  # the token API is the same index: two whole pages recorded
    assert ix.match(tokens) == 32 and len(ix) == 3


def test_a_dropped_prompt_leaves_unless_landed_or_still_on_its_way():
    """insert (routed: on its way) / landed / dropped: a page leaves on a drop only when no other
    routed request's KV is bringing it and it never landed; an insert with ``landed`` (MD
    computed the pages: an output it decoded) counts as landed."""
    ix = PrefixIndex(page_size=2, capacity_pages=100)
    a, b = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    ix.insert(a)
    ix.insert(b)
    ix.dropped(a)
    assert ix.match(b) == 6  # b's KV still brings pages 1-2
    ix.dropped(b)
    assert ix.match(b) == 0 and len(ix) == 0
    ix.insert(a)
    ix.landed(a)
    ix.insert(b)
    ix.dropped(b)
    assert ix.match(b) == 4  # a's pages landed: only b's third page left
    ix.dropped(a)  # a drop after its landing takes nothing
    assert ix.match(a) == 4
    ix.insert([9, 9, 8, 8], landed=True)
    ix.dropped([9, 9, 8, 8])
    assert ix.match([9, 9, 8, 8]) == 4
    ix.landed([7, 7])  # never recorded: stays out
    ix.dropped([6, 6])
    assert ix.match([7, 7]) == 0 and len(ix) == 4


def test_record_is_match_then_insert():
    """record / record_keys: the pages held before, then the prompt recorded as on its way, in one
    pass: the same held count, counts and LRU order as match followed by insert."""
    a, b = PrefixIndex(page_size=2, capacity_pages=5), PrefixIndex(page_size=2, capacity_pages=5)
    steps = [[1, 2, 3, 4], [1, 2, 9, 9, 3, 4], [5, 6], [1, 2, 3, 4, 7, 8]]
    for i, p in enumerate(steps):
        if i == 2:
            a.landed([1, 2, 3, 4])
            b.landed([1, 2, 3, 4])
        held = a.match(p)
        a.insert(p)
        assert b.record(p) == held
        assert list(b._keys.items()) == list(a._keys.items())


def test_match_landed_splits_the_hit_into_landed_and_claimed():
    """match_landed / match_landed_keys: the held prefix (landed or claimed) and, of it, the pages
    from the first up to the first still claimed (KV on its way): what MD's own cache can match
    now. Matching touches the keys (LRU) as match does."""
    ix = PrefixIndex(page_size=4, capacity_pages=100)
    turn1, turn2 = list(range(12)), list(range(20))  # 3 and 5 whole pages
    ix.insert(turn1)  # routed: a claim
    assert ix.match_landed(turn2) == (12, 0)
    ix.landed(turn1)
    assert ix.match_landed(turn2) == (12, 12)
    ix.insert(turn2)  # the next turn routed: its two new pages are claims
    assert ix.match_landed(turn2 + [99]) == (20, 12)
    assert ix.match_landed(list(range(8))) == (8, 8)
    assert ix.match_landed([7] + turn2[1:]) == (0, 0)
    keys = ix.page_keys(turn2)
    assert ix.match_landed_keys(keys) == (5, 3) and ix.match_keys(keys) == 5
    ix.landed_keys([keys[4]])  # a landed page after a claimed one does not extend the landed prefix
    assert ix.match_landed_keys(keys) == (5, 3)
    ix.dropped(turn2)  # its claims taken back; the landed pages stay
    assert ix.match_landed(turn2) == (12, 12)
