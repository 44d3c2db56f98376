"""allowed_token_ids and bad_words in the sampler (vLLM's semantics): masked logits give exactly
the expected token, greedy and sampled, and rows that use neither stay on the batched argmax."""

from __future__ import annotations

import pytest
import torch

from pdd.engine.sampler import Sampler, banned_ids, needs_processing, process_logits, sample_one
from pdd.types import SamplingParams

ROW = torch.tensor([0.5, 4.0, 3.0, 2.0, 1.0, -1.0])  # argmax 1, then 2, 3, 4, 0, 5


def test_allowed_token_ids_greedy_takes_the_best_allowed_id():
    assert sample_one(ROW, SamplingParams(allowed_token_ids=[0, 3, 5]), 0) == 3
    assert sample_one(ROW, SamplingParams(allowed_token_ids=[5]), 0) == 5
    assert sample_one(ROW, SamplingParams(allowed_token_ids=[1, 2]), 0) == 1
    x = process_logits(ROW, SamplingParams(allowed_token_ids=[0, 3]), 0)
    assert x.tolist() == [0.5, float("-inf"), float("-inf"), 2.0, float("-inf"), float("-inf")]


def test_allowed_token_ids_random_sampling_draws_only_allowed_ids():
    for top_k in (-1, 5):  # a top_k wider than the allowed set keeps only allowed ids
        p = SamplingParams(temperature=1.0, seed=3, top_k=top_k, allowed_token_ids=[0, 4])
        draws = {sample_one(ROW, p, pos) for pos in range(400)}
        assert draws == {0, 4}


def test_allowed_token_ids_with_logit_bias_and_min_tokens():
    # bias raises 0 above 3 inside the allowed set; min_tokens masks the stop id 3
    assert sample_one(ROW, SamplingParams(allowed_token_ids=[0, 3], logit_bias={0: 2.0}), 0) == 0
    p = SamplingParams(allowed_token_ids=[0, 3], stop_token_ids=[3], min_tokens=2)
    assert sample_one(ROW, p, 0) == 0 and sample_one(ROW, p, 2) == 3


def test_banned_ids_follows_the_outputs_only():
    words = [[2], [7, 8, 1], [9, 1]]
    assert banned_ids(words, None) == [2]
    assert banned_ids(words, [7, 8], prompt_len=0) == [2, 1]
    assert banned_ids(words, [7, 8], prompt_len=1) == [2]  # 7 is the prompt's: a word starts in the outputs
    assert banned_ids(words, [5, 9], prompt_len=1) == [2, 1]
    assert banned_ids(words, [5, 9, 4], prompt_len=1) == [2]


def test_bad_words_single_token_always_masked_multi_token_after_its_prefix():
    p = SamplingParams(bad_words_token_ids=[[1], [3, 2]])
    assert sample_one(ROW, p, 0, history=[4, 4], prompt_len=2) == 2  # 1 banned, 2 allowed
    assert sample_one(ROW, p, 1, history=[4, 4, 3], prompt_len=2) == 3  # after 3: 2 banned too
    # the prefix 3 in the prompt does not count (vLLM: the outputs so far)
    assert sample_one(ROW, p, 0, history=[4, 3], prompt_len=2) == 2


def test_bad_words_after_a_handoff_see_the_outputs_another_tier_sampled():
    """MD's sequence holds the prompt then the outputs RLD sampled (prompt_len: the prompt's);
    a recovered attempt's prompt ends with the outputs an earlier attempt streamed
    (prompt_len - output_offset, as Engine.step passes it)."""
    p = SamplingParams(bad_words_token_ids=[[4, 3, 1]])
    s = Sampler([5])
    logits = torch.stack([ROW, ROW])
    hist = [0, 0, 4, 3]  # prompt [0, 0], outputs [4, 3]
    assert s.sample(logits, [p, SamplingParams()], [2, 2], [(hist, 2), (hist, 2)]) == [2, 1]
    assert s.sample(logits, [p, p], [2, 2], [(hist, 2), (hist, 4)]) == [2, 1]


def test_rows_without_the_masks_stay_on_the_batched_argmax():
    plain = SamplingParams()
    assert not needs_processing(plain, 0)
    assert needs_processing(SamplingParams(allowed_token_ids=[1]), 0)
    assert needs_processing(SamplingParams(bad_words_token_ids=[[1]]), 0)
    s = Sampler([5])
    logits = torch.stack([ROW, ROW, ROW])
    out = s.sample(logits, [plain, SamplingParams(allowed_token_ids=[4]), SamplingParams(bad_words_token_ids=[[1]])],
                   [0, 0, 0], [([], 0)] * 3)
    assert out == [1, 4, 2]


def test_the_masks_travel_in_the_wire_dict_only_when_set():
    p = SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[1], [7, 8]], bad_words=["x"])
    q = SamplingParams.from_dict(p.to_dict())
    assert (q.allowed_token_ids, q.bad_words_token_ids, q.bad_words) == ([3, 4], [[1], [7, 8]], ["x"])
    d = SamplingParams().to_dict()
    assert not {"allowed_token_ids", "bad_words_token_ids", "bad_words"} & set(d)
    assert SamplingParams.from_dict(d).allowed_token_ids is None


def test_mixed_requests_decode_in_one_batch_and_only_masked_rows_leave_the_argmax(make_engine, prompts,
                                                                                   monkeypatch):
    """A plain request and masked ones in the same engine decode together: every step samples all
    three rows, and only the masked rows go through the per-row (CPU) path."""
    import pdd.engine.sampler as sampler

    eng = make_engine(page_size=4)
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    (free,) = eng.generate([prompts[1]], plain)
    sps = [plain, SamplingParams(max_tokens=6, ignore_eos=True, allowed_token_ids=[free[0], 300]),
           SamplingParams(max_tokens=6, ignore_eos=True, bad_words_token_ids=[[free[0]]])]
    seqs = [eng.new_sequence(f"m{i}", prompts[1], sp, use_cache=False) for i, sp in enumerate(sps)]
    for s in seqs:
        eng.add(s)
    rows = []
    real = sampler.sample_row
    monkeypatch.setattr(sampler, "sample_row", lambda row, p, *a, **k: (rows.append(p), real(row, p, *a, **k))[1])
    per_step = []
    while eng.has_work():
        per_step.append(len(eng.step()))
    assert per_step[-6:] == [3] * 6  # the decode steps: one batch of all three
    assert all(p is not plain for p in rows) and len(rows) == 12
    outs = [list(s.output_ids) for s in seqs]
    assert outs[0] == free and set(outs[1]) <= {free[0], 300} and free[0] not in outs[2]


# When the other masks leave none of a row's ids (vLLM would argmax an all -inf row: id 0, or
# softmax it to NaN), the sampler falls back (docs/SERVE.md): the multi-token bad-word endings are
# dropped first, then the single-token bad words and the min_tokens mask; never an id outside
# allowed_token_ids, never an all -inf row.
def _all_positions(p: SamplingParams, eos=(1,), n: int = 8, history_of=None) -> list[int]:
    return [sample_one(ROW, p, pos, history=history_of(pos) if history_of else None, eos_ids=eos)
            for pos in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masking_every_allowed_id_falls_back_to_the_allowed_ids(temperature):
    # EOS 1 is the only allowed id and min_tokens masks it: 1, never id 0 (greedy) or NaN (sampled)
    p = SamplingParams(temperature=temperature, seed=3, allowed_token_ids=[1], min_tokens=5)
    assert _all_positions(p) == [1] * 8
    p = SamplingParams(temperature=temperature, seed=3, allowed_token_ids=[5], stop_token_ids=[5], min_tokens=5)
    assert _all_positions(p) == [5] * 8
    x = process_logits(ROW, p, 0, eos_ids=(1,))
    assert x.tolist() == [float("-inf")] * 5 + [-1.0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_single_token_bad_words_masking_every_allowed_id_fall_back(temperature):
    p = SamplingParams(temperature=temperature, seed=3, allowed_token_ids=[1], bad_words_token_ids=[[1]])
    assert _all_positions(p) == [1] * 8
    p = SamplingParams(temperature=temperature, seed=3, allowed_token_ids=[0, 4],
                       bad_words_token_ids=[[0], [4]], logit_bias={0: 5.0})
    assert set(_all_positions(p)) <= {0, 4}
    if temperature == 0.0:
        assert _all_positions(p) == [0] * 8  # the bias still applies to the fallback row


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_multi_token_ending_is_dropped_before_the_static_masks(temperature):
    # allowed {3, 5}; min_tokens masks the stop id 5; after output 4, bad word [4, 3] bans 3:
    # the dynamic ban goes first, so 3 (min_tokens still honoured), not 5
    p = SamplingParams(temperature=temperature, seed=3, allowed_token_ids=[3, 5], stop_token_ids=[5],
                       min_tokens=4, bad_words_token_ids=[[4, 3]])
    assert _all_positions(p, n=3, history_of=lambda pos: [0, 4]) == [3, 3, 3]
    x = process_logits(ROW, p, 0, history=[0, 4], prompt_len=1)
    assert x.tolist() == [float("-inf")] * 3 + [2.0] + [float("-inf")] * 2


def test_a_batch_with_an_impossible_row_keeps_the_others_exact():
    s = Sampler([1])
    logits = torch.stack([ROW, ROW, ROW])
    sps = [SamplingParams(), SamplingParams(allowed_token_ids=[1], min_tokens=5),
           SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[1], bad_words_token_ids=[[1]])]
    assert s.sample(logits, sps, [0, 0, 0], [([], 0)] * 3) == [1, 1, 1]
    sps[0] = SamplingParams(allowed_token_ids=[2, 1], min_tokens=5)  # not impossible: 2
    assert s.sample(logits, sps, [0, 0, 0], [([], 0)] * 3) == [2, 1, 1]
