"""Sampler: penalties, min_p, min_tokens, logit_bias, logprobs, batch- and device-independence,
decision margins; SamplingParams round trip over the wire."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from pdd.engine.sampler import Sampler, decision_margin, process_logits, sample_row, uniform
from pdd.types import SamplingParams

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()


def _logits(seed: int, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3


def test_sampling_params_round_trip_through_msgpack():
    sp = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=2**63 + 5, ignore_eos=True,
                        stop_token_ids=[3, 4], min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.25,
                        repetition_penalty=1.3, min_tokens=2, logprobs=3, logit_bias={7: 2.5, 9: -100.0})
    wire = msgpack.unpackb(msgpack.packb(sp.to_dict()), strict_map_key=False)
    assert SamplingParams.from_dict(wire) == sp
    # an older peer's dict (no new keys) still works, and unknown keys are ignored
    assert SamplingParams.from_dict({"max_tokens": 3, "future_knob": 1}) == SamplingParams(max_tokens=3)


def test_repetition_presence_frequency_penalties():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0], dtype=torch.float32)
    hist = [0, 1, 3, 3, 1]  # prompt = [0, 1], outputs = [3, 3, 1]
    p = SamplingParams(repetition_penalty=2.0)
    y = process_logits(x, p, 3, hist, prompt_len=2)
    assert y.tolist() == [1.0, -4.0, 1.0, 0.25, 3.0]  # prompt and outputs; +: divide, -: multiply
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    y = process_logits(x, p, 3, hist, prompt_len=2)
    # outputs only: token 3 twice, token 1 once; prompt-only token 0 untouched
    assert y.tolist() == pytest.approx([2.0, -2.0 - 0.5 - 0.25, 1.0, 0.5 - 1.0 - 0.25, 3.0])
    # no penalty: bit-identical to the raw row
    assert torch.equal(process_logits(x, SamplingParams(), 3, hist, 2), x.double())


def test_min_tokens_masks_eos_and_stop_ids_then_releases_them():
    x = torch.tensor([0.0, 9.0, 0.0, 8.0, 0.0])
    p = SamplingParams(min_tokens=2, stop_token_ids=[3])
    s = Sampler(eos_token_ids=[1])
    assert s.sample(x[None], [p], [0]) == [0]  # 1 (eos) and 3 (stop id) masked: the first of the zeros
    assert s.sample(x[None], [p], [1]) == [0]
    assert s.sample(x[None], [p], [2]) == [1]  # min_tokens reached: eos is back
    greedy_plain = SamplingParams()
    assert s.sample(x[None], [greedy_plain], [0]) == [1]


def test_logit_bias_and_min_p_and_top_k():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    s = Sampler()
    assert s.sample(x[None], [SamplingParams(logit_bias={3: 100.0})], [0]) == [3]
    p = SamplingParams(temperature=1.0, min_p=0.25, seed=1)  # keeps p >= 0.125: tokens 0, 1, 2
    assert {sample_row(x, p, pos)[0] for pos in range(400)} == {0, 1, 2}
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=1)  # keeps p >= 0.25: tokens 0, 1
    assert {sample_row(x, p, pos)[0] for pos in range(400)} == {0, 1}
    p = SamplingParams(temperature=1.0, top_k=1, seed=1)
    assert {sample_row(x, p, pos)[0] for pos in range(50)} == {0}


def test_logprobs_are_raw_log_softmax_of_the_row():
    x = _logits(3)
    p = SamplingParams(temperature=0.5, top_k=5, seed=9, logprobs=4, presence_penalty=1.0)
    tok, lp = sample_row(x, p, 2, [1, 2, 3], 1)
    ref = torch.log_softmax(x.double(), 0)
    assert lp["lp"] == pytest.approx(float(ref[tok]), abs=1e-12)
    assert [i for i, _ in lp["top"]] == torch.topk(ref, 4).indices.tolist()
    assert all(v == pytest.approx(float(ref[i]), abs=1e-12) for i, v in lp["top"])
    s = Sampler()
    toks = s.sample(torch.stack([x, x]), [SamplingParams(logprobs=0), SamplingParams()], [0, 0])
    assert s.last_logprobs[0]["top"] == [] and s.last_logprobs[1] is None
    assert toks[0] == toks[1] == int(torch.argmax(x))


def test_a_row_samples_the_same_whatever_its_batch():
    rows = torch.stack([_logits(i) for i in range(6)])
    ps = [SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=100 + i, repetition_penalty=1.2,
                         frequency_penalty=0.3) for i in range(6)]
    hists = [([i, i + 1, i + 2, 5], 2) for i in range(6)]
    s = Sampler()
    together = s.sample(rows, ps, [4] * 6, hists)
    alone = [Sampler().sample(rows[i:i + 1], [ps[i]], [4], [hists[i]])[0] for i in range(6)]
    mixed = Sampler().sample(torch.cat([rows[:3], rows[:1]]), ps[:3] + [SamplingParams()], [4] * 4, hists[:3] + [([], 0)])
    assert together == alone and mixed[:3] == together[:3]


@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_cuda_rows_sample_like_cpu_rows():
    rows = torch.stack([_logits(i, 4096) for i in range(8)])
    ps = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=i, logprobs=5,
                         presence_penalty=0.5) for i in range(8)]
    hists = [([1, 2, 3, i], 1) for i in range(8)]
    a, b = Sampler(), Sampler()
    assert a.sample(rows, ps, list(range(8)), hists) == b.sample(rows.cuda(), ps, list(range(8)), hists)
    assert a.last_logprobs == b.last_logprobs


def test_seeded_draws_are_reproducible_and_counter_based():
    x = _logits(5)
    p = SamplingParams(temperature=1.0, seed=77)
    assert [sample_row(x, p, i)[0] for i in range(100)] == [sample_row(x, p, i)[0] for i in range(100)]
    # position i's draw does not depend on earlier positions having been drawn
    assert sample_row(x, p, 57)[0] == [sample_row(x, p, i)[0] for i in range(100)][57]
    assert uniform(-1, 3) == uniform((1 << 64) - 1, 3)  # negative seeds wrap like 64-bit


def test_decision_margin():
    x = torch.tensor([1.0, 1.0 + 1e-6, -3.0], dtype=torch.float64)
    kind, m = decision_margin(x, SamplingParams(), 0)
    assert kind == "logit_gap" and m == pytest.approx(1e-6, rel=1e-3)
    probs = torch.tensor([0.4, 0.35, 0.25], dtype=torch.float64)
    p = SamplingParams(temperature=1.0, seed=3)
    u = uniform(3, 0)
    kind, m = decision_margin(torch.log(probs), p, 0)
    cum = torch.cumsum(probs, 0)
    assert kind == "prob" and m == pytest.approx(min(abs(float(cum[0]) - u), abs(float(cum[1]) - u)), abs=1e-12)
    # a top_p exactly at a cumulative boundary is flagged as marginal
    _, m = decision_margin(torch.log(probs), SamplingParams(temperature=1.0, seed=3, top_p=0.75), 0)
    assert m < 1e-9
    assert not math.isnan(m)


@pytest.mark.parametrize("temperature", [5.0, 100.0, 1e300])
def test_a_large_temperature_samples_valid_tokens(temperature):
    """The API takes temperature in [0, 2] (OpenAI, vLLM 0.32), but a checkpoint's
    generation_config.json may set more (openai_defaults takes any value >= 0, as SGLang does):
    the sampler then draws valid ids, spread over the vocabulary, with finite logprobs and margins;
    a logit far ahead of the rest (1e4) neither overflows nor loses its lead below 1e300."""
    p = SamplingParams(temperature=temperature, seed=5, top_p=0.99, top_k=60, min_p=0.001, logprobs=2)
    x = _logits(11, vocab=64)
    toks = [sample_row(x, p, i) for i in range(400)]
    assert all(0 <= t < 64 and math.isfinite(lp["lp"]) for t, lp in toks)
    assert len({t for t, _ in toks}) > 30
    assert math.isfinite(decision_margin(x, p, 0)[1])
    x[7] = 1e4
    picked = {sample_row(x, p, i)[0] for i in range(100)}
    assert picked == ({7} if temperature < 1e300 else picked) and all(0 <= t < 64 for t in picked)
