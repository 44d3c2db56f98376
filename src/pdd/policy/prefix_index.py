"""The gateway's approximate view of one instance's prefix cache, for cache-aware routing without
asking the instance (as SGLang's cache-aware router keeps an approximate radix tree per worker).

Asking a main-decode instance in the other datacenter what its radix cache holds (``peek``) costs
a WAN round trip before the request's reservation can even be sent (docs/BENCH.md, routing: in
``cross_dc_pd`` that round trip ate the hit-rate gain). The gateway knows what it routed where:
each prompt routed to an instance is recorded as the chain of its whole pages (page ``i``'s key
hashes page ``i - 1``'s key and its tokens, so a key names a whole prefix, as a radix path
does), and a new prompt's hit is its longest prefix of recorded pages. At most ``capacity_pages``
keys are kept, least recently used out first, like the instance's own evictions. A prompt's
pages count from its routing (its KV is on its way; a next turn routed meanwhile goes to the
same instance); a request whose KV will not arrive (a cut-off transfer) takes back the pages
only it was bringing (:meth:`dropped`), and pages whose KV did arrive (:meth:`landed`) stay
whatever becomes of other requests. Approximate: a prefix the instance evicted still counts
until it ages out here, and one evicted here is sent again; a restarted instance starts over
(:meth:`clear`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

LANDED = -1  # a page the instance is known to hold (its KV arrived, or it computed it)


class PrefixIndex:
    """Whole-page prefixes of the prompts routed to one instance (no I/O, no clock)."""

    def __init__(self, page_size: int, capacity_pages: int):
        if page_size < 1 or capacity_pages < 1:
            raise ValueError(f"page_size ({page_size}) and capacity_pages ({capacity_pages}) must be >= 1")
        self.page_size, self.capacity = page_size, capacity_pages
        # key -> LANDED once the instance is known to hold the page, else the number of routed
        # requests whose KV for it is still on its way (a page nobody's KV brought stays out)
        self._keys: OrderedDict[Hashable, int] = OrderedDict()

    def _chain(self, prompt: list[int]):
        key = 0
        ps = self.page_size
        for i in range(len(prompt) // ps):
            key = hash((key, tuple(prompt[i * ps:(i + 1) * ps])))
            yield key

    def page_keys(self, prompt: list[int]) -> tuple:
        """``prompt``'s whole pages as this index names them (one key per ``page_size`` tokens, each
        naming the prefix up to its page): what :meth:`record_keys`, :meth:`landed_keys` and
        :meth:`dropped_keys` take, and what a caller that settles a routed prompt later keeps
        instead of the prompt's tokens (a 16th of their number)."""
        return tuple(self._chain(prompt))

    def match(self, prompt: list[int]) -> int:
        """Tokens of ``prompt``'s longest whole-page prefix recorded here (a multiple of the page
        size), landed or on its way; the matched keys count as used."""
        return self.match_keys(self._chain(prompt)) * self.page_size

    def match_landed(self, prompt: list[int]) -> tuple[int, int]:
        """:meth:`match` and, of it, the tokens whose KV is known to be there, in one pass:
        ``(held, landed)`` tokens (multiples of the page size, ``landed <= held``). ``landed``
        counts the pages from the first up to the first still claimed (routed there, its KV on
        its way): what the instance's own cache can match now. A new request whose prefix
        ends in a claim reserves there once that claim's KV landed instead of shipping the
        claimed pages again (the gateway's ``reserve {after}``, the simulator's
        ``md_wait_claims``); what fits its TTFT budget is judged on the landed part."""
        held, landed = self.match_landed_keys(self._chain(prompt))
        return held * self.page_size, landed * self.page_size

    def insert(self, prompt: list[int], landed: bool = False) -> None:
        """Record ``prompt``'s whole pages as held (most recently used), evicting the least
        recently used keys beyond ``capacity_pages``: routed there (``landed`` False: its KV is
        on its way, :meth:`dropped` takes back what no other request's KV brings), or known to be
        there (``landed``: the instance computed or imported them)."""
        self.insert_keys(self._chain(prompt), landed)

    def record(self, prompt: list[int]) -> int:
        """:meth:`match` then :meth:`insert` (routed: on its way) in one pass over ``prompt``'s
        pages: the tokens held before, as a request routed here records its prompt."""
        return self.record_keys(self._chain(prompt)) * self.page_size

    def landed(self, prompt: list[int]) -> None:
        """The instance now holds ``prompt``'s pages (its KV arrived): a later :meth:`dropped` of
        another request routed with the same prefix keeps them. Pages no longer recorded stay out."""
        self.landed_keys(self._chain(prompt))

    def dropped(self, prompt: list[int]) -> None:
        """A request routed with ``prompt`` will not bring its KV (its transfer was cut off, the
        instance dropped it uncached): each of its pages is taken back unless it has landed or
        another routed request's KV is still bringing it."""
        self.dropped_keys(self._chain(prompt))

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

    def match_landed_keys(self, keys: Iterable[Hashable]) -> tuple[int, int]:
        """:meth:`match_landed` for pages named by ``keys`` (as :meth:`match_keys`): ``(held,
        landed)`` pages; the matched keys count as used."""
        n = landed = 0
        on_landed = True
        held, touch = self._keys, self._keys.move_to_end
        for key in keys:
            v = held.get(key)
            if v is None:
                break
            touch(key)
            n += 1
            if on_landed:
                if v == LANDED:
                    landed = n
                else:
                    on_landed = False
        return n, landed

    def insert_keys(self, keys: Iterable[Hashable], landed: bool = False) -> None:
        """:meth:`insert` for pages named by ``keys`` (as :meth:`match_keys`)."""
        held, touch = self._keys, self._keys.move_to_end
        for key in keys:
            v = held.get(key, 0)
            held[key] = LANDED if landed or v == LANDED else v + 1
            touch(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def record_keys(self, keys: Iterable[Hashable]) -> int:
        """:meth:`record` for pages named by ``keys``: the pages held before, from the first."""
        held, touch = self._keys, self._keys.move_to_end
        n, matching = 0, True
        for key in keys:
            v = held.get(key)
            if matching and v is not None:
                n += 1
            else:
                matching = False
            held[key] = LANDED if v == LANDED else (v or 0) + 1
            touch(key)
        while len(held) > self.capacity:
            held.popitem(last=False)
        return n

    def landed_keys(self, keys: Iterable[Hashable]) -> None:
        """:meth:`landed` for pages named by ``keys``."""
        held = self._keys
        for key in keys:
            if key in held:
                held[key] = LANDED

    def dropped_keys(self, keys: Iterable[Hashable]) -> None:
        """:meth:`dropped` for pages named by ``keys``."""
        held = self._keys
        for key in keys:
            v = held.get(key)
            if v is None or v == LANDED:
                continue
            if v <= 1:
                del held[key]
            else:
                held[key] = v - 1

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
