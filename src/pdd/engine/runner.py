"""Runs one batch (mixed decodes, extends and prefill chunks) as ONE model forward call.

Each batch item contributes ``q_i`` new tokens on top of ``ctx_i`` tokens already in its pages.
New K/V are written into the item's pages, then every new token attends causally over
``[0, ctx_i + q_i)``. Decodes (q_i = 1) share padded SDPA calls, one per group of similar
lengths (:func:`decode_groups`; one group on CUDA), their K/V gathered from the pages; each extend /
prefill chunk gets its own SDPA call (fresh K/V used directly when ctx_i = 0). On a sliding-window layer
(``ModelConfig.sliding_window_layers``) a token at position ``p`` sees only keys at positions
``> p - sliding_window`` (transformers' ``sliding_window_overlay``); the pages stay allocated.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kv_pool import KVPool
from .model import LlamaModel

# cuDNN attention (chosen by default for bf16 on Hopper) rebuilds a graph for every new shape:
# ~35 ms per call here since shapes change every step; flash / mem-efficient take ~1 ms. Set on
# CUDA only: on CPU these are the only backends anyway, and entering the context costs more than
# a tiny model's attention.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed`` (bool), -inf elsewhere, in ``dtype``: what SDPA turns a bool mask into
    on every call (bit-equal results), made once per forward call instead of once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


# Decodes attend in groups of similar lengths, each padded to its longest (one SDPA call and two
# gathers per group and layer). A group is split off only where that saves at least this much
# padding (tokens x sequences), per device type: measured on CPU (``ragged`` shapes of
# scripts/engine_step_ab.py: 1.3x a step of 32 decodes at 128-2,048 tokens); elsewhere one group
# (not measured on CUDA, where a group's ~7 more kernel launches per layer outweigh the padding of
# a small model).
DECODE_SPLIT_MIN_TOKENS = {"cpu": 512}


def decode_groups(num_pages: list[int], min_saved_pages: float) -> list[list[int]]:
    """Indices of the decodes (``num_pages``: the pages each attends over) grouped for one padded
    attention call each. Longest first, a group starts where the page count halves (at most half
    the group's longest); a group that would save less than ``min_saved_pages`` of padding (its
    members x the drop from the group before) joins the group before. One group keeps the input
    order."""
    if not num_pages:
        return []
    groups: list[list[int]] = []
    for i in sorted(range(len(num_pages)), key=lambda i: -num_pages[i]):
        if groups and 2 * num_pages[i] > num_pages[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    merged = groups[:1]
    for g in groups[1:]:
        if len(g) * (num_pages[merged[-1][0]] - num_pages[g[0]]) < min_saved_pages:
            merged[-1] += g
        else:
            merged.append(g)
    return merged if len(merged) > 1 else [list(range(len(num_pages)))]


@dataclass
class RunItem:
    """Compute ``token_ids[start : start + num_tokens]`` of a sequence whose first ``start``
    tokens already have KV in ``page_table`` (which must cover ``start + num_tokens`` tokens)."""

    token_ids: list[int]
    start: int
    num_tokens: int
    page_table: list[int]
    want_logits: bool = True


class PagedAttention:
    """Attention backend for one forward call over a :class:`KVPool`."""

    def __init__(self, pool: KVPool, items: list[RunItem], positions: torch.Tensor, dtype: torch.dtype,
                 sliding_window: int | None = None, sliding_window_layers=(), on_layer=None):
        """``positions``: [T] int64 on the pool's device, the position of each new token in its
        sequence, item after item (the model's RoPE positions); ``dtype``: the queries' (masks are
        made in it)."""
        self.pool = pool
        self.dtype = dtype
        self.on_layer = on_layer  # on_layer(layer): that layer's new K/V are stored (queued, on CUDA)
        self.window = sliding_window
        self.window_layers = frozenset(sliding_window_layers) if sliding_window else frozenset()
        self._window_masks: dict = {}
        dev, ps = pool.device, pool.page_size
        page_idx: list[int] = []  # the page of each new token
        dec_rows, dec_pages, dec_lens = [], [], []
        self.extends = []  # (row0, n, start, page_table tensor or None)
        row = 0
        for it in items:
            end = it.start + it.num_tokens
            need = -(-end // ps)
            if len(it.page_table) < need:
                raise ValueError(f"page table covers {len(it.page_table)} pages, need {need}")
            if it.num_tokens == 1:
                page_idx.append(it.page_table[it.start // ps])
                dec_rows.append(row)
                dec_pages.append(it.page_table[:need])
                dec_lens.append(end)
            else:
                first = it.start // ps
                pages: list[int] = []
                for p in it.page_table[first:need]:  # a list op per page, not a Python step per token
                    pages += [p] * ps
                off = it.start - first * ps
                page_idx += pages[off:off + it.num_tokens]
                pt = torch.tensor(it.page_table[:need], dtype=torch.long, device=dev) if it.start > 0 else None
                self.extends.append((row, it.num_tokens, it.start, pt))
            row += it.num_tokens
        self.page_idx = torch.tensor(page_idx, dtype=torch.long, device=dev)
        self.slot_idx = positions % ps
        # decodes: one SDPA call per group of similar lengths, each padded to its group's longest
        self.dec = []  # (rows or None, flat page tables, mask, window mask or None) per group
        min_saved = DECODE_SPLIT_MIN_TOKENS.get(dev.type, math.inf) / ps
        for group in decode_groups([len(t) for t in dec_pages], min_saved):
            maxp = max(len(dec_pages[i]) for i in group)
            flat: list[int] = []  # the page tables, each padded to maxp pages with its first page (masked out)
            for i in group:
                flat += dec_pages[i]
                flat += dec_pages[i][:1] * (maxp - len(dec_pages[i]))
            lens = torch.tensor([dec_lens[i] for i in group], dtype=torch.long, device=dev)
            kpos = torch.arange(maxp * ps, device=dev)[None, :]
            seen = (kpos < lens[:, None])[:, None, None, :]
            window = None
            if self.window_layers:  # the query at position len-1 sees keys >= len - window
                window = additive_mask(seen & (kpos >= lens[:, None] - self.window)[:, None, None, :], dtype)
            # rows None: the batch is these decodes only, in order (no gather / scatter of rows)
            rows = None if len(group) == row else torch.tensor([dec_rows[i] for i in group], dtype=torch.long,
                                                                  device=dev)
            self.dec.append((rows, torch.tensor(flat, dtype=torch.long, device=dev),  # [B * maxp]
                             additive_mask(seen, dtype), window))  # [B, 1, 1, maxp * page_size]

    def _extend_mask(self, start: int, n: int, windowed: bool, device):
        """[n, start + n] additive mask: causal, and within the window when ``windowed``."""
        key = (start, n, windowed)
        if key not in self._window_masks:
            qpos = torch.arange(start, start + n, device=device)[:, None]
            kpos = torch.arange(start + n, device=device)[None, :]
            mask = kpos <= qpos
            if windowed:
                mask = mask & (kpos > qpos - self.window)
            self._window_masks[key] = additive_mask(mask, self.dtype)
        return self._window_masks[key]

    def _attend_decodes(self, layer: int, q: torch.Tensor, kv: torch.Tensor, group) -> torch.Tensor:
        """One group of decodes' attention over their pages: [B, H, D], decode after decode."""
        rows, flat, mask, window = group
        if layer in self.window_layers:
            mask = window
        b, (h, d), kvh = mask.shape[0], q.shape[1:], kv.shape[3]
        # index_select per K / V: contiguous result, no extra copy
        kk = torch.index_select(kv[:, 0], 0, flat).view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
        vv = torch.index_select(kv[:, 1], 0, flat).view(b, -1, kvh, d).transpose(1, 2)
        # the h / kvh query heads of a KV head (GQA: head i reads KV head i // (h / kvh)) as that
        # head's h / kvh query rows: the kernel reads each KV head's keys once, not once per
        # query head (1.5-2x faster on CPU at long contexts; float noise, ~1e-7, vs enable_gqa)
        qq = (q if rows is None else q[rows]).reshape(b, kvh, h // kvh, d)
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).reshape(b, h, d)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]."""
        kv = self.pool.buffer[:, layer]  # [P, 2, S, KVH, D] view
        kv[self.page_idx, :, self.slot_idx] = torch.stack((k, v), dim=1).to(kv.dtype)
        if self.on_layer is not None:
            self.on_layer(layer)
        if self.dec and self.dec[0][0] is None:  # decodes only, one group
            return self._attend_decodes(layer, q, kv, self.dec[0])
        out = torch.empty_like(q)
        for group in self.dec:
            out[group[0]] = self._attend_decodes(layer, q, kv, group)
        kvh, d = k.shape[1:]
        windowed_layer = layer in self.window_layers
        for row0, n, start, pt in self.extends:
            qq = q[row0:row0 + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            windowed = windowed_layer and start + n > self.window
            if pt is None:  # nothing cached: attend over the fresh K/V
                kk = k[row0:row0 + n].transpose(0, 1).unsqueeze(0)
                vv = v[row0:row0 + n].transpose(0, 1).unsqueeze(0)
                if windowed:
                    mask = self._extend_mask(0, n, True, q.device)
                    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
                else:
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            else:
                total = start + n
                kk = torch.index_select(kv[:, 0], 0, pt).view(-1, kvh, d)[:total].transpose(0, 1).unsqueeze(0)
                vv = torch.index_select(kv[:, 1], 0, pt).view(-1, kvh, d)[:total].transpose(0, 1).unsqueeze(0)
                mask = self._extend_mask(start, n, windowed, q.device)
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
            out[row0:row0 + n] = o.squeeze(0).transpose(0, 1)
        return out


class ModelRunner:
    """Owns the model and the pool; ``forward_calls`` counts model forward calls,
    ``tokens_computed`` the new tokens they processed."""

    def __init__(self, model: LlamaModel, pool: KVPool):
        self.model = model
        self.pool = pool
        self.forward_calls = 0
        self.tokens_computed = 0

    @torch.inference_mode()
    def forward(self, items: list[RunItem], all_logits: bool = False, on_layer=None):
        """Run ``items`` in one forward call.

        ``on_layer(layer)``: called on this thread as soon as layer ``layer``'s new K/V of every
        item are written into the pool (before that layer's attention; on CUDA the write is
        queued on the current stream, not finished: the callee records an event to wait on).

        Returns ``[N, vocab]`` float32 logits of the last token of each item with ``want_logits``
        (in item order), or, if ``all_logits``, a list with one ``[num_tokens_i, vocab]`` tensor
        per item.
        """
        if not items:
            raise ValueError("empty batch")
        dev = self.pool.device
        ids, pos, seq_lens = [], [], []
        for it in items:
            ids.extend(it.token_ids[it.start:it.start + it.num_tokens])
            pos.extend(range(it.start, it.start + it.num_tokens))
            seq_lens.extend([it.start + it.num_tokens] * it.num_tokens)
        if len(ids) != sum(it.num_tokens for it in items):
            raise ValueError("item asks for tokens past the end of token_ids")
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        cfg = self.model.cfg
        backend = PagedAttention(self.pool, items, positions, self.model.dtype, cfg.sliding_window,
                                 cfg.sliding_window_layers, on_layer)
        with sdpa_kernel(SDPA_BACKENDS) if dev.type == "cuda" else contextlib.nullcontext():
            hidden = self.model.hidden_states(input_ids, positions, backend, seq_lens)
        self.forward_calls += 1
        self.tokens_computed += len(ids)
        if all_logits:
            logits = self.model.logits(hidden)
            return list(torch.split(logits, [it.num_tokens for it in items]))
        rows, row = [], 0
        for it in items:
            row += it.num_tokens
            if it.want_logits:
                rows.append(row - 1)
        if not rows:
            return hidden.new_zeros((0, self.model.cfg.vocab_size), dtype=torch.float32)
        if len(rows) < row:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=dev)]
        return self.model.logits(hidden)
