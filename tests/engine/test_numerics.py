"""Engine numerics against the transformers implementation (the oracle), fp32."""

from __future__ import annotations

import torch

from pdd.engine.runner import RunItem
from pdd.types import SamplingParams


def _hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode_logits_match_transformers(hf_model, prompts, make_engine):
    eng = make_engine(page_size=4)
    for prompt in prompts:
        seq = eng.new_sequence("s", prompt, use_cache=False)
        n = len(prompt)
        # prefill: logits at every prompt position
        (lg,) = eng.runner.forward([RunItem(prompt, 0, n, seq.page_table)], all_logits=True)
        ref = _hf_logits(hf_model, prompt)
        torch.testing.assert_close(lg.cpu(), ref, atol=2e-4, rtol=1e-4)
        # a few decode steps on top of the paged KV
        ids = list(prompt)
        for _ in range(4):
            nxt = int(ref[-1].argmax())
            ids.append(nxt)
            seq.token_ids.append(nxt)
            eng._ensure_pages(seq, len(ids))
            out = eng.runner.forward([RunItem(ids, len(ids) - 1, 1, seq.page_table)])
            ref = _hf_logits(hf_model, ids)
            torch.testing.assert_close(out[0].cpu(), ref[-1], atol=2e-4, rtol=1e-4)
        seq.num_computed = len(ids)
        eng.release(seq, cache=False)
    assert eng.pool.num_free == eng.pool.num_pages


def test_greedy_30_tokens_equal_transformers(hf_model, prompts, make_engine):
    eng = make_engine(page_size=4, max_batch_tokens=64, prefill_chunk_tokens=16)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    outs = eng.generate(prompts, sp)  # all prompts batched together, chunked prefill
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            g = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30,
                                  do_sample=False, pad_token_id=1)
        assert out == g[0, len(prompt):].tolist()
    eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_pages
