"""Paged KV storage with reference counts.

One tensor per instance, page-major so a page (or a layer range of a page) is contiguous:

    buffer: [num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]

Token ``p`` of a sequence lives in page ``page_table[p // page_size]`` at slot ``p % page_size``.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import ModelConfig, dtype_name, dtype_bytes
from .model import torch_dtype

LAYOUT = "page,layer,kv,slot,kv_head,head_dim"


class OutOfPages(RuntimeError):
    """Not enough free pages. ``needed`` and ``free`` are page counts."""

    def __init__(self, needed: int, free: int, seq_id=None):
        super().__init__(f"out of KV pages: need {needed}, {free} free" + (f" (seq {seq_id})" if seq_id is not None else ""))
        self.needed, self.free, self.seq_id = needed, free, seq_id


class PagesHeld(OutOfPages):
    """``Engine.step``: no running sequence can get a page, none can be preempted, but sequences
    outside the batch hold pages that will come back (KV on its way, a handoff, a finished
    sequence not yet released): the step waits for them instead of failing anyone. The engine
    thread retries shortly (``EngineWorker``); a wait past its limit fails the sequence as a
    plain ``OutOfPages`` would."""


class DoubleFree(RuntimeError):
    """decref of a page whose refcount is already 0."""


class KVPool:
    """Fixed pool of KV pages. Allocation and ref counting are O(pages) Python, no tensor ops."""

    def __init__(self, model_cfg: ModelConfig, num_pages: int, page_size: int, dtype="float32", device="cpu"):
        self.model_cfg = model_cfg
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.dtype_name = dtype_name(dtype)
        self.dtype = torch_dtype(self.dtype_name)
        self.device = torch.device(device)
        self.num_layers = model_cfg.num_hidden_layers
        self.num_kv_heads = model_cfg.num_key_value_heads
        self.head_dim = model_cfg.head_dim
        self.buffer = torch.zeros(
            (self.num_pages, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim),
            dtype=self.dtype, device=self.device,
        )
        self._ref = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
        # pages the prefix cache holds a ref on (cache_hold / cache_drop), and how many of them
        # only it holds: kept as refs change, so a metrics scrape reads one int (num_cached)
        self._cached = bytearray(self.num_pages)
        self._cache_only = 0

    # -- sizes (bytes) ---------------------------------------------------------------------
    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one layer of one page (K and V)."""
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype_name)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers."""
        return self.num_layers * self.layer_page_bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages only the prefix cache holds (no sequence does): in use, but evicted for the
        first allocation that needs them. ``num_used - num_cached`` pages are held by sequences."""
        return self._cache_only

    def refcount(self, page: int) -> int:
        return self._ref[page]

    # -- allocation ------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages (refcount 1 each). Raises :class:`OutOfPages` and takes none."""
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._ref[p] = 1
        return out

    def incref(self, pages) -> None:
        for p in pages:
            r = self._ref[p]
            if r <= 0:
                raise DoubleFree(f"incref of free page {p}")
            self._ref[p] = r + 1
            if r == 1 and self._cached[p]:
                self._cache_only -= 1

    def decref(self, pages) -> None:
        """Drop one ref per listed page; a page reaching 0 returns to the free list."""
        for p in pages:
            r = self._ref[p]
            if r <= 0:
                raise DoubleFree(f"decref of free page {p}")
            self._ref[p] = r - 1
            if r == 1:
                self._free.append(p)
            elif r == 2 and self._cached[p]:
                self._cache_only += 1

    def cache_hold(self, page: int) -> None:
        """The prefix cache takes its ref on ``page`` (a page in use: a sequence's it adopts)."""
        if self._cached[page]:
            raise DoubleFree(f"page {page} is in the prefix cache already")
        self.incref([page])
        self._cached[page] = 1

    def cache_drop(self, page: int) -> None:
        """The prefix cache drops its ref on ``page`` (evicted)."""
        if not self._cached[page]:
            raise DoubleFree(f"page {page} is not in the prefix cache")
        if self._ref[page] == 1:
            self._cache_only -= 1
        self._cached[page] = 0
        self.decref([page])

    def copy_stream(self):
        """A context in which reads of the buffer run off the compute stream: on CUDA a side
        stream of this pool's device (created on first use), so copying a finished layer's pages
        to the host waits for nothing the engine queued after it (the caller first waits for the
        layer's event, ``Engine.kv_listeners``); on CPU a no-op context."""
        import contextlib

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if getattr(self, "_copy_stream", None) is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self._copy_stream)

    # -- raw bytes -------------------------------------------------------------------------
    def _layers(self, layers) -> tuple[int, int]:
        if layers is None:
            return 0, self.num_layers
        l0, l1 = int(layers[0]), int(layers[1])
        if not (0 <= l0 < l1 <= self.num_layers):
            raise ValueError(f"bad layer range {layers}")
        return l0, l1

    def _index(self, pages):
        pages = [int(p) for p in pages]
        if pages and pages == list(range(pages[0], pages[0] + len(pages))):
            return slice(pages[0], pages[0] + len(pages))  # contiguous: view, no gather
        return torch.tensor(pages, dtype=torch.long, device=self.device)

    def slot_bytes(self, layers=None) -> int:
        """Bytes of one token slot of one page (K and V) over layers ``[l0, l1)``: the KV bytes
        per token that a transfer of those layers carries."""
        l0, l1 = self._layers(layers)
        return (l1 - l0) * self.layer_page_bytes // self.page_size

    def _last_slots(self, last_slots) -> int:
        if last_slots is None:
            return self.page_size
        k = int(last_slots)
        if not 1 <= k <= self.page_size:
            raise ValueError(f"last_slots must be in [1, {self.page_size}], got {last_slots}")
        return k

    def export_pages(self, pages, layers=None, last_slots: int | None = None) -> memoryview:
        """Raw bytes of ``pages`` (in the given order) for layers ``[l0, l1)``, layout
        ``[page, layer, kv, slot, head, dim]``: ``len(pages) * (l1 - l0) * layer_page_bytes``.

        ``last_slots``: only the first ``last_slots`` token slots of the *last* page are exported
        (the tail of a prompt that ends inside its page; the empty slots do not cross a link).
        Then the last page's bytes are ``last_slots * slot_bytes(layers)``, laid out ``[layer, kv,
        slot < last_slots, head, dim]`` after the whole pages. Raises ValueError for a bad layer
        range or ``last_slots`` outside ``[1, page_size]``."""
        l0, l1 = self._layers(layers)
        k = self._last_slots(last_slots)
        pages = [int(p) for p in pages]
        if k == self.page_size or not pages:
            t = self.buffer[self._index(pages), l0:l1]
            t = t.contiguous().cpu().view(torch.uint8).reshape(-1)
            return memoryview(t.numpy())
        whole = self.buffer[self._index(pages[:-1]), l0:l1].contiguous().cpu().view(torch.uint8).reshape(-1)
        tail = self.buffer[pages[-1], l0:l1, :, :k].contiguous().cpu().view(torch.uint8).reshape(-1)
        return memoryview(torch.cat([whole, tail]).numpy())

    def export_tokens(self, page_table, t0: int, t1: int, page_size: int, dtype=None, layers=None,
                      whole_last: bool = False) -> memoryview:
        """Token slots ``[t0, t1)`` of the sequence whose pages are ``page_table`` (this pool's
        page size), re-chunked into pages of ``page_size`` tokens and cast to ``dtype`` (default
        this pool's): the bytes :meth:`export_pages` of a pool of that page size and dtype would
        give for the same tokens. Layout: ``(t1 - t0) // page_size`` whole pages ``[page, layer,
        kv, slot, head, dim]``, then the partial last page's filled slots ``[layer, kv, slot < k,
        head, dim]``; ``whole_last``: that page is sent whole instead, its empty slots zero (the
        ``kv_whole_pages`` ablation). ``t0`` must be a multiple of ``page_size``. A cast to a
        narrower dtype rounds to nearest (torch ``.to``). Raises ValueError for a bad range."""
        l0, l1 = self._layers(layers)
        ps = int(page_size)
        if ps < 1 or t0 < 0 or t1 < t0 or t0 % ps:
            raise ValueError(f"export_tokens: bad token range [{t0}, {t1}) for pages of {ps}")
        if -(-t1 // self.page_size) > len(page_table):
            raise ValueError(f"export_tokens: tokens up to {t1} need more than the {len(page_table)} pages given")
        out_dtype = self.dtype if dtype is None else torch_dtype(dtype_name(dtype))
        pos = torch.arange(t0, t1, dtype=torch.long)
        pages = torch.tensor([int(p) for p in page_table], dtype=torch.long)[pos // self.page_size]
        # advanced indices on dims 0 and 3 (split by slices): the token axis comes first
        g = self.buffer[pages.to(self.device), l0:l1, :, (pos % self.page_size).to(self.device)]
        g = g.to(out_dtype).cpu()  # [T, layers, 2, heads, dim]
        n_tok = t1 - t0
        whole, k = divmod(n_tok, ps)
        if whole_last and k:
            g = torch.cat([g, g.new_zeros((ps - k,) + tuple(g.shape[1:]))])
            whole, k = whole + 1, 0
        parts = []
        if whole:
            parts.append(g[: whole * ps].reshape((whole, ps) + tuple(g.shape[1:])).permute(0, 2, 3, 1, 4, 5))
        if k:
            parts.append(g[whole * ps:].permute(1, 2, 0, 3, 4))
        if not parts:
            return memoryview(b"")
        flat = [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
        return memoryview((flat[0] if len(flat) == 1 else torch.cat(flat)).numpy())

    def import_pages(self, pages, data, layers=None, last_slots: int | None = None, src_dtype=None) -> None:
        """Write bytes produced by :meth:`export_pages` (same pages count, layer range and
        ``last_slots``) into ``pages``; the last page's slots from ``last_slots`` on are left as
        they are. ``src_dtype``: the elements of ``data`` (default this pool's), widened or
        narrowed to this pool's dtype on import (KV from a tier of another dtype). Raises
        ValueError when ``data`` has another length than that export's."""
        l0, l1 = self._layers(layers)
        k = self._last_slots(last_slots)
        n = len(pages)
        nl = l1 - l0
        src_t = self.dtype if src_dtype is None else torch_dtype(dtype_name(src_dtype))
        eb = src_t.itemsize
        whole = n if k == self.page_size else max(0, n - 1)
        elems_page = nl * 2 * self.page_size * self.num_kv_heads * self.head_dim
        elems_slot = nl * 2 * self.num_kv_heads * self.head_dim
        expected = (whole * elems_page + (n - whole) * k * elems_slot) * eb
        arr = np.frombuffer(data, dtype=np.uint8)
        if arr.size != expected:
            raise ValueError(f"import_pages: got {arr.size} bytes, expected {expected}")
        if n == 0:
            return
        src = torch.from_numpy(arr.copy()).view(src_t)
        split = whole * elems_page
        if whole:
            w = src[:split].view(whole, nl, 2, self.page_size, self.num_kv_heads, self.head_dim)
            self.buffer[self._index(pages[:whole]), l0:l1] = w.to(self.device, self.dtype, non_blocking=False)
        if whole < n:
            t = src[split:].view(nl, 2, k, self.num_kv_heads, self.head_dim)
            self.buffer[int(pages[-1]), l0:l1, :, :k] = t.to(self.device, self.dtype, non_blocking=False)

    def fingerprint(self) -> dict:
        """What two instances must agree on to exchange raw pages."""
        c = self.model_cfg
        return {
            "page_size": self.page_size,
            "dtype": self.dtype_name,
            "layout": LAYOUT,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "model": c.name,
            "model_shape": f"{c.model_type}-h{c.hidden_size}-l{c.num_hidden_layers}-v{c.vocab_size}",
        }
