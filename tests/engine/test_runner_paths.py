"""The runner's faster paths give what the plain ones did: RoPE as a roll with a sign-folded sin
(bit-equal to transformers' rotate_half form), additive masks (bit-equal to SDPA's own bool
conversion), and decodes of very different lengths attended in groups (the greedy tokens and,
to float noise, the logits of each sequence run alone)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pdd.engine import runner
from pdd.engine.model import apply_rope, signed_sin
from pdd.engine.runner import additive_mask, decode_groups
from pdd.types import SamplingParams


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_roll_is_bit_equal_to_rotate_half(device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 8, 64, generator=g).to(device, dtype)
    angles = torch.randn(37, 1, 32, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    assert torch.equal(apply_rope(x, cos, signed_sin(sin)), x * cos + _rotate_half(x) * sin)


def test_additive_mask_is_bit_equal_to_a_bool_mask(device):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 4, 16, generator=g).to(device) for _ in range(3))
    k, v = (torch.randn(3, 2, 40, 16, generator=g).to(device) for _ in range(2))
    allowed = (torch.arange(40)[None, :] < torch.tensor([40, 17, 5])[:, None])[:, None, None, :].to(device)
    mask = additive_mask(allowed, torch.float32)
    assert mask.dtype == torch.float32 and mask.unique().tolist() == [-math.inf, 0.0]
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


def test_decode_groups():
    pages = [100, 100, 3, 3, 3, 50]
    assert decode_groups(pages, 32) == [[0, 1], [5], [2, 3, 4]]
    assert decode_groups(pages, 60) == [[0, 1, 5], [2, 3, 4]]  # 50's group saves 50 pages < 60
    assert decode_groups(pages, 300) == [[0, 1, 2, 3, 4, 5]]  # one group: input order
    assert decode_groups(pages, math.inf) == [[0, 1, 2, 3, 4, 5]]
    assert decode_groups([7], 0) == [[0]]
    assert decode_groups([], 0) == []


def test_decodes_of_very_different_lengths_match_lone_runs(make_engine, device, monkeypatch):
    """4 long and 4 short prompts decode together (beside a prefill in the first step after the
    prompts): on CPU the decodes attend in two groups, and each sequence's greedy tokens equal its
    lone run's, its logits within float noise."""
    ps = 4
    eng = make_engine(num_pages=1024, page_size=ps, max_batch_tokens=4096, prefill_chunk_tokens=4096)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (600, 590, 610, 605, 20, 9, 14, 3)]
    late = torch.randint(10, 1000, (40,), generator=g).tolist()
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    eng.keep_logits = True
    lone = {}
    for i, p in enumerate(prompts + [late]):
        s = eng.new_sequence(("lone", i), p, sp, use_cache=False)
        eng.add(s)
        rows = []
        while eng.has_work():
            if eng.step():
                rows.append(eng.last_logits[s.seq_id])
        lone[i] = (s.output_ids, rows)
        eng.release(s, cache=False)

    groups = []
    built = runner.PagedAttention

    def spy(*a, **kw):
        pa = built(*a, **kw)
        groups.append(len(pa.dec))
        return pa

    monkeypatch.setattr(runner, "PagedAttention", spy)
    seqs = [eng.new_sequence(i, p, sp, use_cache=False) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.add(s)
    rows = {i: [] for i in range(len(prompts) + 1)}
    steps = 0
    while eng.has_work():
        if steps == 1:  # a prefill beside the decodes: the rows of each group are scattered
            s = eng.new_sequence(len(prompts), late, sp, use_cache=False)
            eng.add(s)
            seqs.append(s)
        for ev in eng.step():
            rows[ev.seq_id].append(eng.last_logits[ev.seq_id])
        steps += 1
    assert groups[1:3] == ([2, 2] if device == "cpu" else [1, 1])  # decodes + a prefill; decodes only
    for i, s in enumerate(seqs):
        assert s.output_ids == lone[i][0]
        for ours, alone in zip(rows[i], lone[i][1]):
            torch.testing.assert_close(ours, alone, atol=1e-4, rtol=0)
        eng.release(s, cache=False)
    assert eng.pool.num_free == eng.pool.num_pages
