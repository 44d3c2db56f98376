"""Reduced-precision engines: same code path, KV pages half the size, argmax agrees with fp32
wherever fp32's top-2 margin is not tiny."""

from __future__ import annotations

import pytest
import torch

from pdd.engine.runner import RunItem
from pdd.types import SamplingParams


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_follows_fp32(make_engine, prompts, dtype):
    ref = make_engine(page_size=4)
    low = make_engine(page_size=4, dtype=dtype)
    assert low.pool.page_bytes * 2 == ref.pool.page_bytes
    assert low.pool.buffer.dtype == getattr(torch, dtype)
    outs = ref.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    checked = 0
    for p, o in zip(prompts, outs):
        ids = p + o
        per = []
        for eng in (ref, low):
            s = eng.new_sequence("t", ids, use_cache=False)
            (lg,) = eng.runner.forward([RunItem(ids, 0, len(ids), s.page_table)], all_logits=True)
            per.append(lg[len(p) - 1:].float().cpu())
            s.num_computed = len(ids)
            eng.release(s, cache=False)
        top = per[0].topk(2, dim=-1).values
        sure = (top[:, 0] - top[:, 1]) > 0.5
        assert torch.equal(per[0].argmax(-1)[sure], per[1].argmax(-1)[sure])
        checked += int(sure.sum())
    assert checked > 60
    # the low-precision engine decodes end to end (batched, paged)
    assert all(len(o) == 8 for o in low.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True)))
    for eng in (ref, low):
        eng.flush_cache()
        assert eng.pool.num_free == eng.pool.num_pages
