"""A simulated instance's prefix cache over the trace's 512-token blocks: LRU over unlocked
blocks, children evicted before their parents."""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    """Blocks of the trace's prefix hashes; LRU over unlocked blocks (parents kept fresher)."""

    __slots__ = ("lru", "locks", "capacity_blocks")

    def __init__(self, capacity_blocks: int):
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.locks: dict[int, int] = {}
        self.capacity_blocks = capacity_blocks

    def __len__(self) -> int:
        return len(self.lru)

    def match(self, blocks) -> int:
        lru = self.lru
        k = 0
        for b in blocks:
            if b in lru:
                k += 1
            else:
                break
        return k

    def touch(self, blocks) -> None:
        lru = self.lru
        for b in reversed(blocks):
            if b in lru:
                lru.move_to_end(b)

    def lock(self, blocks) -> None:
        lk = self.locks
        for b in blocks:
            lk[b] = lk.get(b, 0) + 1

    def unlock(self, blocks) -> None:
        lk = self.locks
        for b in blocks:
            c = lk[b] - 1
            if c:
                lk[b] = c
            else:
                del lk[b]

    def insert(self, blocks) -> int:
        lru = self.lru
        added = 0
        for b in reversed(blocks):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
                added += 1
        # reversed insertion put parents last (freshest): LRU evicts children first
        return added

    def evict(self, n: int) -> int:
        if n <= 0:
            return 0
        victims = []
        lk = self.locks
        for b in self.lru:
            if b not in lk:
                victims.append(b)
                if len(victims) >= n:
                    break
        for b in victims:
            del self.lru[b]
        return len(victims)
