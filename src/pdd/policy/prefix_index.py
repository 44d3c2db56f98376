"""The gateway's approximate view of one instance's prefix cache, for cache-aware routing without
asking the instance (as SGLang's cache-aware router keeps an approximate radix tree per worker).

Asking a main-decode instance in the other datacenter what its radix cache holds (``peek``) costs
a WAN round trip before the request's reservation can even be sent (docs/BENCH.md, routing: in
``cross_dc_pd`` that round trip ate the hit-rate gain). The gateway knows what it routed where:
each prompt routed to an instance is recorded as the chain of its whole pages (page ``i``'s key
hashes page ``i - 1``'s key and its tokens, so a key names a whole prefix, as a radix path
does), and a new prompt's hit is its longest prefix of recorded pages. At most ``capacity_pages``
keys are kept, least recently used out first, like the instance's own evictions. Approximate: a
prefix the instance evicted, or never received (a cut-off transfer), still counts until it ages
out here; a restarted instance starts over (:meth:`clear`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class PrefixIndex:
    """Whole-page prefixes of the prompts routed to one instance (no I/O, no clock)."""

    def __init__(self, page_size: int, capacity_pages: int):
        if page_size < 1 or capacity_pages < 1:
            raise ValueError(f"page_size ({page_size}) and capacity_pages ({capacity_pages}) must be >= 1")
        self.page_size, self.capacity = page_size, capacity_pages
        self._keys: OrderedDict[int, None] = OrderedDict()

    def _chain(self, prompt: list[int]):
        key = 0
        ps = self.page_size
        for i in range(len(prompt) // ps):
            key = hash((key, tuple(prompt[i * ps:(i + 1) * ps])))
            yield key

    def match(self, prompt: list[int]) -> int:
        """Tokens of ``prompt``'s longest whole-page prefix recorded here (a multiple of the page
        size); the matched keys count as used."""
        return self.match_keys(self._chain(prompt)) * self.page_size

    def insert(self, prompt: list[int]) -> None:
        """Record ``prompt``'s whole pages as held (most recently used), evicting the least
        recently used keys beyond ``capacity_pages``."""
        self.insert_keys(self._chain(prompt))

    def match_keys(self, keys: Iterable[Hashable]) -> int:
        """Pages of a prefix given as its pages' keys (each key naming the whole prefix up to its
        page, as :meth:`match`'s chain does) held here, from the first, up to the first key not
        held; the matched keys count as used. The simulator (``pdd.sim.cluster``) keys its pages
        by trace hash id and page within the block."""
        n = 0
        held, touch = self._keys, self._keys.move_to_end
        for key in keys:
            if key not in held:
                break
            touch(key)
            n += 1
        return n

    def insert_keys(self, keys: Iterable[Hashable]) -> None:
        """Record the pages named by ``keys`` (as :meth:`match_keys`) as held, most recently used,
        evicting the least recently used keys beyond ``capacity_pages``."""
        held, touch = self._keys, self._keys.move_to_end
        for key in keys:
            held[key] = None
            touch(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
