"""Prefix cache over whole KV pages.

A trie whose edges are ``page_size``-token chunks; every node owns one page (the tree holds one
ref on it). Partial last pages are never cached.

Ref protocol:
- ``match_prefix`` locks the matched path (not evictable) and increfs each matched page for the
  caller; the caller later ``unlock``\\ s the match and decrefs those pages (with the rest of its
  page table).
- ``insert`` adopts pages for chunks the tree lacks (``KVPool.cache_hold``: the tree's own ref);
  chunks already present keep the tree's page and the caller keeps (and later decrefs) its duplicate.
- ``evict`` drops the tree's ref of unlocked leaves, least recently used first (``KVPool.cache_drop``).

The pool counts the pages only the tree holds (``KVPool.num_cached``: reclaimable by eviction).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .kv_pool import KVPool


class _Node:
    __slots__ = ("key", "page", "parent", "children", "lock", "last_access")

    def __init__(self, key, page, parent):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, _Node] = {}
        self.lock = 0
        self.last_access = 0


@dataclass
class PrefixMatch:
    """Result of :meth:`RadixCache.match_prefix`: ``pages`` cover ``num_tokens`` prompt tokens."""

    pages: list[int] = field(default_factory=list)
    node: object = None  # deepest matched node (locked); None when nothing matched
    locked: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.page_size = pool.page_size
        self.root = _Node((), -1, None)
        self.num_nodes = 0  # == pages held by the tree
        self._clock = 0
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.num_queries = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _chunks(self, token_ids, max_pages=None):
        """Lazily yields the page keys (tuples of ``page_size`` token ids) of whole pages."""
        n = len(token_ids) // self.page_size
        if max_pages is not None:
            n = min(n, max(0, int(max_pages)))
        ps = self.page_size
        return (tuple(token_ids[i * ps:(i + 1) * ps]) for i in range(n))

    # -- lookup ------------------------------------------------------------------------------
    def peek(self, token_ids, max_pages=None) -> int:
        """Number of whole pages of ``token_ids`` the tree holds; no lock, no ref, no stats."""
        node, n = self.root, 0
        for key in self._chunks(token_ids, max_pages):
            node = node.children.get(key)
            if node is None:
                break
            n += 1
        return n

    def match_prefix(self, token_ids, max_pages=None) -> PrefixMatch:
        """Longest cached whole-page prefix (at most ``max_pages``). Locks it and increfs its
        pages for the caller. Stats count ``len(token_ids)`` queried tokens."""
        t = self._tick()
        node, pages = self.root, []
        for key in self._chunks(token_ids, max_pages):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_access = t
            pages.append(node.page)
        self.num_queries += 1
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(pages) * self.page_size
        m = PrefixMatch(pages=pages, node=node if pages else None)
        if pages:
            self.lock(m)
            self.pool.incref(pages)
        return m

    # -- locking -----------------------------------------------------------------------------
    def lock(self, match: PrefixMatch) -> None:
        if match.node is None or match.locked:
            return
        n = match.node
        while n is not self.root:
            n.lock += 1
            n = n.parent
        match.locked = True

    def unlock(self, match: PrefixMatch | None) -> None:
        """Undo the lock of a match; idempotent per match object. Does not decref pages."""
        if match is None or match.node is None or not match.locked:
            return
        n = match.node
        while n is not self.root:
            n.lock -= 1
            assert n.lock >= 0
            n = n.parent
        match.locked = False

    # -- insert ------------------------------------------------------------------------------
    def insert(self, token_ids, pages) -> int:
        """Cache the whole pages of ``token_ids`` (``pages[i]`` holds chunk ``i``; extra tokens
        past ``len(pages)`` pages are ignored). Returns how many chunks were already present."""
        t = self._tick()
        node, present = self.root, 0
        chunks = self._chunks(token_ids, len(pages))
        for i, key in enumerate(chunks):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, int(pages[i]), node)
                self.pool.cache_hold(child.page)
                node.children[key] = child
                self.num_nodes += 1
            else:
                present += 1
            child.last_access = t
            node = child
        return present

    # -- eviction ----------------------------------------------------------------------------
    def _evictable_leaves(self):
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root and n.lock == 0:
                out.append((n.last_access, id(n), n))
        return out

    def evict(self, n: int) -> int:
        """Remove up to ``n`` unlocked leaves (LRU first; parents become leaves in turn).
        Returns the number of nodes removed (each dropped the tree's ref on its page)."""
        if n <= 0:
            return 0
        heap = self._evictable_leaves()
        heapq.heapify(heap)
        done = 0
        while heap and done < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.pool.cache_drop(node.page)
            self.num_nodes -= 1
            done += 1
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return done

    def flush(self) -> int:
        """Evict every unlocked node. Returns nodes removed."""
        return self.evict(self.num_nodes)

    @property
    def evictable_pages(self) -> int:
        """Nodes not on any locked path (upper bound on what evict can remove)."""
        cnt, stack = 0, [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and n.lock == 0:
                cnt += 1
        return cnt

    def stats(self) -> dict:
        q = self.queried_tokens
        return {
            "nodes": self.num_nodes,
            "queries": self.num_queries,
            "queried_tokens": q,
            "hit_tokens": self.hit_tokens,
            "hit_rate": (self.hit_tokens / q) if q else 0.0,
        }
