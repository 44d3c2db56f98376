"""Two structured-output rows in one engine step where one grammar is complete and the other
is not (what MD meets when a request's n choices were handed over at different positions)."""

from __future__ import annotations

from pdd.structured import grammar_for
from pdd.types import FinishReason, SamplingParams


def test_a_complete_and_an_open_grammar_in_one_step(make_engine):
    eng = make_engine()
    prompt = eng.tokenizer.encode("hello").ids
    seqs = [eng.new_sequence(f"s{i}", prompt, SamplingParams(max_tokens=32, grammar=grammar_for(kind, v)),
                             use_cache=False)
            for i, (kind, v) in enumerate([("choice", ["a"]), ("regex", "[a-z]{20}")])]
    for s in seqs:
        eng.add(s)
    while eng.has_work():
        eng.step()
    assert [s.finish_reason for s in seqs] == [FinishReason.STOP, FinishReason.STOP]
