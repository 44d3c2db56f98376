"""Fake P and MD / D connections for the real :class:`pdd.gateway.orchestrator.Orchestrator` whose
queues are bounded as an engine's are (``Engine.new_sequence``: ``TierBusy`` once ``places``
sequences need compute), so a gateway test sees where each choice of a request was placed and
whether a tier would refuse it, with no process and no engine.

A P's sequence needs compute until its prefill returns (its first token), an MD's until its last
token. Work finishes only once no new work reached any fake tier for ``QUIET`` loop turns
(:meth:`Tiers.quiet`): every choice that starts together is in its queue before any of them ends,
the worst case a bounded queue must hold, decided by the event loop's order, not by a clock.
Pipelines: P->MD (cross_dc_pd) and P->D (same_dc_pd); a P caches each prompt's whole pages after
its prefill and answers ``peek`` with them (cache-aware routing's affinity)."""

from __future__ import annotations

import asyncio

from pdd.transfer.messages import Tok
from pdd.transfer.peer import RemoteError

from tests.gateway.fake_peer import FakePeer

QUIET = 50  # loop turns with no new work before a fake tier finishes what it holds
PAGE_BYTES = 4096


class Tiers:
    """The fake tiers of one orchestrator: ``P(...)`` and ``MD(...)`` make its connections."""

    def __init__(self, orch, page_size: int):
        self.orch, self.page_size = orch, page_size
        self.arrivals = 0
        self.md: dict[str, MD] = {}

    async def quiet(self) -> None:
        """Return once no new work reached any fake tier for ``QUIET`` loop turns."""
        while True:
            seen = self.arrivals
            for _ in range(QUIET):
                await asyncio.sleep(0)
            if self.arrivals == seen:
                return


class Tier(FakePeer):
    """A bounded queue of ``places`` sequences: ``pending`` (tier rid -> prompt), the most it held
    at once (``peak``), the sequences it took (``took``) and refused (``refused``)."""

    def __init__(self, tiers: Tiers, name: str, places: int):
        super().__init__()
        self.tiers, self.name, self.places = tiers, name, places
        self.pending: dict[str, list[int]] = {}
        self.peak = self.took = self.refused = 0

    def admit(self, rid: str, prompt: list[int]) -> None:
        if len(self.pending) >= self.places:  # as Engine.new_sequence: the text starts with TierBusy
            self.refused += 1
            raise RemoteError(f"TierBusy: queue full: {len(self.pending)} sequences need compute, the limit is "
                              f"{self.places} (max_running + max_waiting)")
        self.pending[rid] = list(prompt)
        self.took += 1
        self.peak = max(self.peak, len(self.pending))
        self.tiers.arrivals += 1

    def forget(self, h: dict) -> None:
        if h.get("t") in ("abort", "drop"):
            self.pending.pop(h.get("rid"), None)

    def other(self, h: dict, mine: str):
        """Record the call ``h``; the reply to anything but this tier's ``mine`` call: a ``peek``
        answered from the cache (P's; D's in same_dc_pd, the gateway keeping an index of an MD
        across the WAN), anything else forgotten (``ok``); None for ``mine``."""
        self.sent.append(dict(h))
        if h["t"] == "peek":
            return {"t": "peek_ok", "hit_tokens": _hit(self, list(h["prompt_ids"]))}, b""
        if h["t"] != mine:
            self.forget(h)
            return {"t": "ok"}, b""
        return None

    async def send(self, h, payload=b""):
        self.sent.append(dict(h))
        self.forget(h)


def _hit(tier, prompt: list[int]) -> int:
    """The prompt tokens ``tier``'s cache holds: its whole pages, if cached."""
    ps = tier.tiers.page_size
    n = len(prompt) // ps * ps
    return n if n and tuple(prompt[:n]) in tier.cached else 0


def _cache(tier, prompt: list[int]) -> None:
    ps = tier.tiers.page_size
    if len(prompt) >= ps:
        tier.cached.add(tuple(prompt[: len(prompt) // ps * ps]))


class P(Tier):
    """Prefill: ``prefill`` returns the first token once the tiers are quiet; the KV goes to the
    MD the gateway's ``target`` names once both are known."""

    def __init__(self, tiers: Tiers, name: str, places: int):
        super().__init__(tiers, name, places)
        self.cached: set[tuple[int, ...]] = set()
        self.targets: dict[str, str] = {}  # rid -> MD, from the gateway's target
        self.done: dict[str, int] = {}  # rid -> max_tokens, prefilled

    def _ship(self, rid: str) -> None:
        if rid in self.targets and rid in self.done:
            self.tiers.md[self.targets.pop(rid)].kv_done(rid, self.done.pop(rid))

    async def call(self, h, payload=b"", timeout=None):
        other = self.other(h, "prefill")
        if other is not None:
            return other
        rid, prompt = h["rid"], list(h["prompt_ids"])
        self.admit(rid, prompt)
        hit = _hit(self, prompt)
        await self.tiers.quiet()
        if self.pending.pop(rid, None) is None:
            raise RemoteError(f"request {rid} was aborted")
        _cache(self, prompt)
        ps = self.tiers.page_size
        self.done[rid] = int(h["sampling"]["max_tokens"])
        self._ship(rid)
        return {"t": "prefill_ok", "rid": rid, "first_token": 7, "fin": None, "p_cached_tokens": hit,
                "n_pages": -(-len(prompt) // ps), "page_bytes": PAGE_BYTES}, b""

    async def send(self, h, payload=b""):
        await super().send(h, payload)
        if h["t"] == "target" and h.get("slot") == "md" and not h.get("cancelled"):
            self.targets[h["rid"]] = h["name"]
            self._ship(h["rid"])


class MD(Tier):
    """MD (or D): ``reserve`` takes a place; once P's KV is there, the first token and
    ``max_tokens - 1`` more go to the gateway when the tiers are quiet, and the place is freed."""

    def __init__(self, tiers: Tiers, name: str, places: int):
        super().__init__(tiers, name, places)
        tiers.md[name] = self
        self.cached: set[tuple[int, ...]] = set()

    async def call(self, h, payload=b"", timeout=None):
        other = self.other(h, "reserve")
        if other is not None:
            return other
        rid, prompt = h["rid"], list(h["prompt_ids"])
        self.admit(rid, prompt)
        ps = self.tiers.page_size
        return {"t": "reserve_ok", "rid": rid, "md_cached_tokens": 0, "md_cached_pages": 0,
                "n_pages": -(-len(prompt) // ps), "prompt_tokens": len(prompt), "page_size": ps,
                "page_bytes": PAGE_BYTES, "kv_dtype": "float32"}, b""

    def kv_done(self, rid: str, max_tokens: int) -> None:
        _cache(self, self.pending.get(rid, []))  # as MD's DRC: the prompt's whole pages, once they are here
        asyncio.get_running_loop().create_task(self._decode(rid, max_tokens))

    async def _decode(self, rid: str, max_tokens: int) -> None:
        await self.tiers.quiet()
        if self.pending.pop(rid, None) is None:
            return  # aborted meanwhile
        for pos in range(max_tokens):
            fin = "length" if pos == max_tokens - 1 else None
            await self.tiers.orch.on_tok(self, Tok(rid, pos, 7 + pos, fin, "md").wire(), b"")
