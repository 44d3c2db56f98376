"""A recovered request (prompt + streamed outputs prefilled again, ``output_offset``) samples
exactly what the unfaulted request samples: draws, min_tokens and penalties count the streamed
tokens as outputs (gateway.orchestrator recovery)."""

from __future__ import annotations

import dataclasses

import pytest

from pdd.types import SamplingParams

SAMPLED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.7,
                         frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=12)


def test_recovered_attempt_continues_the_same_draws(make_engine, prompts):
    eng = make_engine(page_size=4)
    prompt = prompts[2]
    (whole,) = eng.generate([prompt], SAMPLED)
    assert len(whole) == 16  # min_tokens 12 masks EOS, so the comparison covers >= 12 positions
    naive_differs = []
    for k in (1, 3, 5, 8, 11):
        resumed = dataclasses.replace(SAMPLED, max_tokens=16 - k, output_offset=k)
        (rest,) = eng.generate([prompt + whole[:k]], resumed)
        assert whole[:k] + rest == whole, k
        # without the offset the draws and penalties restart from output 0
        (naive,) = eng.generate([prompt + whole[:k]], dataclasses.replace(SAMPLED, max_tokens=16 - k))
        naive_differs.append(whole[:k] + naive != whole)
    assert any(naive_differs)  # so the offset is what makes the continuation equal


def test_offset_survives_the_wire_dict():
    p = dataclasses.replace(SAMPLED, output_offset=7)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_recovered_attempt_keeps_allowed_token_ids_and_bad_words(make_engine, prompts):
    """A recovery's attempt (prompt + streamed outputs, output_offset) bans a multi-token bad word
    whose first token the lost attempt streamed: the streamed tokens are outputs for bad_words too."""
    eng = make_engine(page_size=4)
    prompt = prompts[2]
    base = SamplingParams(max_tokens=12, ignore_eos=True)
    (free,) = eng.generate([prompt], base)
    word = [free[3], free[4]]  # a word the unmasked output makes at outputs 3-4
    banned = dataclasses.replace(base, bad_words_token_ids=[word], allowed_token_ids=sorted(set(free) | {1, 2, 3}))
    (whole,) = eng.generate([prompt], SamplingParams.from_dict(banned.to_dict()))
    assert whole[:4] == free[:4] and whole[4] != free[4]
    assert all(whole[i:i + 2] != word for i in range(11))
    assert set(whole) <= set(banned.allowed_token_ids)
    resumed = dataclasses.replace(banned, max_tokens=8, output_offset=4)  # the lost attempt streamed 4
    (rest,) = eng.generate([prompt + whole[:4]], SamplingParams.from_dict(resumed.to_dict()))
    assert whole[:4] + rest == whole
    # without the offset the streamed free[3] is prompt, the word's start unseen: it is produced
    (naive,) = eng.generate([prompt + whole[:4]], dataclasses.replace(banned, max_tokens=8))
    assert naive[0] == free[4]
