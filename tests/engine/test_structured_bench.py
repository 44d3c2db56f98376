"""Structured-output sampling speed, measured (pytest-benchmark), never asserted: one
``Sampler.sample`` over 32 greedy rows of the tiny model's 1,024-id vocabulary, plain (the
batched argmax), with a JSON-schema grammar (the batched masked argmax) and with the grammar
and logprobs (each row through ``process_logits``), side by side in one report. Each round
starts fresh guides over the same 12 steps of random logits."""

import pytest
import torch

from pdd.engine.engine import load_tokenizer
from pdd.engine.sampler import Sampler
from pdd.structured import Guide, grammar_for, ll_tokenizer
from pdd.types import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
ROWS, STEPS = 32, 12


@pytest.mark.parametrize("rows", ["plain", "grammar", "grammar+logprobs"])
def test_structured_sampling_speed(benchmark, tiny_model, rows):
    tok = load_tokenizer(tiny_model)
    lt = ll_tokenizer(tok, [1], 1024)
    g = grammar_for("json", SCHEMA)
    sp = {"plain": SamplingParams(), "grammar": SamplingParams(grammar=g),
          "grammar+logprobs": SamplingParams(grammar=g, logprobs=0)}[rows]
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(ROWS, 1024, generator=gen) for _ in range(STEPS)]
    sampler = Sampler([1])

    def setup():
        hists = [([5, 6], 2) for _ in range(ROWS)]
        guides = [Guide(lt, g) for _ in range(ROWS)] if sp.grammar else None
        return (hists, guides), {}

    def run(hists, guides):
        for step in range(STEPS):
            for (h, _), t in zip(hists, sampler.sample(logits[step], [sp] * ROWS, [step] * ROWS, hists, guides)):
                h.append(t)
        return hists

    hists = benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
    assert all(len(h) == 2 + STEPS for h, _ in hists)
