"""Structured outputs on the engine: the grammar's mask at every position, across a token-id
handoff (a second sequence handed the first one's outputs) and a recovered attempt (outputs in
the prompt's tail), greedy and seeded-sampled, on the tiny random-weight model."""

from __future__ import annotations

import json
import re

import pytest

from pdd.engine.engine import load_tokenizer
from pdd.structured import GrammarError, Guide, grammar_for, ll_tokenizer
from pdd.types import FinishReason, SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def _sp(kind, value=None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 64)
    return SamplingParams(grammar=grammar_for(kind, value), structured={kind: value}, **kw)


def _text(eng, ids) -> str:
    eos = set(eng.eos_token_ids)
    return eng.tokenizer.decode([t for t in ids if t not in eos])


def _run_one(eng, prompt, sp, seq_id="s"):
    seq = eng.new_sequence(seq_id, prompt, sp, use_cache=False)
    eng.add(seq)
    while eng.has_work():
        eng.step()
    out, reason = list(seq.output_ids), seq.finish_reason
    eng.release(seq, cache=False)
    return out, reason


@pytest.mark.parametrize("kind,value,check", [
    ("json", SCHEMA, lambda t: set(json.loads(t)) == {"n", "ok"} and isinstance(json.loads(t)["n"], int)
     and isinstance(json.loads(t)["ok"], bool)),
    ("regex", r"[a-c]{3}-[0-9]{2}", lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t) is not None),
    ("choice", ["alpha", "beta", "gamma"], lambda t: t in ("alpha", "beta", "gamma")),
    ("grammar", 'start: "x" ("y" | "z")+ "!"', lambda t: re.fullmatch(r"x[yz]+!", t) is not None),
    ("json_object", None, lambda t: isinstance(json.loads(t), dict)),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_follows_the_grammar_and_ends_with_eos(make_engine, prompts, kind, value, check, temperature):
    eng = make_engine()
    sp = _sp(kind, value, temperature=temperature, seed=7)
    if kind == "json_object":  # random weights ramble inside an open object: bound its size
        sp = _sp("json", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                          "additionalProperties": False}, temperature=temperature, seed=7)
    out, reason = _run_one(eng, prompts[1], sp)
    assert reason == FinishReason.STOP and out[-1] in eng.eos_token_ids
    assert check(_text(eng, out)), _text(eng, out)
    # the unconstrained model says something else entirely
    free, _ = _run_one(eng, prompts[1], SamplingParams(max_tokens=len(out), temperature=temperature, seed=7))
    assert free != out


def test_handoff_and_recovery_continue_the_grammar_exactly(make_engine, prompts):
    """A sequence handed the first k outputs (MD after the token-id handoff) and one whose prompt
    holds them (a recovered attempt, ``output_offset``) sample what one sequence does alone."""
    eng = make_engine()
    sp = _sp("json", SCHEMA)
    prompt = prompts[3]
    ref, reason = _run_one(eng, prompt, sp)
    assert reason == FinishReason.STOP and len(ref) > 6
    for k in (1, 3, len(ref) - 2):
        md = eng.new_sequence("md", prompt, sp, use_cache=False)
        eng.append_tokens(md, ref[:k])
        eng.add(md)
        while eng.has_work():
            eng.step()
        assert md.output_ids == ref, k
        eng.release(md, cache=False)
        rec_sp = _sp("json", SCHEMA, output_offset=k)
        rec, _ = _run_one(eng, prompt + ref[:k], rec_sp, "rec")
        assert ref[:k] + rec == ref, k


def test_a_handed_over_token_the_grammar_rejects_fails_the_request(make_engine, prompts):
    """Never an output the grammar does not hold, ended as if it did: the sequence leaves the
    batch and the step reports it (``Engine.pop_failed``) for its owner to fail the request."""
    eng = make_engine()
    sp = _sp("regex", "[0-9]+")
    seq = eng.new_sequence("bad", prompts[0], sp, use_cache=False)
    other = eng.new_sequence("ok", prompts[1], _sp("regex", "[0-9]{3}"), use_cache=False)
    eng.append_tokens(seq, eng.tokenizer.encode("q", add_special_tokens=False).ids)
    eng.add(seq)
    eng.add(other)
    while eng.has_work():
        eng.step()
    (failed, why), = eng.pop_failed()
    assert failed is seq and seq.num_outputs == 1 and seq.finish_reason == FinishReason.ABORT
    assert why.startswith("structured output failed at output 1: ") and "doesn't satisfy the grammar" in why
    assert other.finish_reason == FinishReason.STOP and re.fullmatch("[0-9]{3}", _text(eng, other.output_ids))
    assert eng.pop_failed() == []
    eng.release(seq, cache=False)
    eng.release(other, cache=False)
    assert eng.pool.num_free == eng.pool.num_pages


def test_a_grammar_that_fails_at_run_time_fails_the_request(make_engine, prompts):
    """A grammar of 2,000 alternatives sharing a prefix compiles, and llguidance's parser refuses
    the row after it (``Current row has ... items; max is 2000``): the request fails with that,
    not "stop"."""
    eng = make_engine()
    sp = _sp("grammar", "start: " + " | ".join(json.dumps(f"7-{i}") for i in range(2000)))
    seq = eng.new_sequence("many", prompts[0], sp, use_cache=False)
    eng.add(seq)
    while eng.has_work():
        eng.step()
    (failed, why), = eng.pop_failed()
    assert failed is seq and "max is 2000" in why, why
    eng.release(seq, cache=False)


def test_many_choices_sharing_a_prefix_are_one_lexeme(make_engine, prompts):
    """3,000 choices of one prefix (a rule of one alternative each failed after the first token,
    as above): greedy output is one of them, whole, ended by EOS or its end."""
    eng = make_engine()
    choices = [f"7-{i}" for i in range(3000)]
    seq = eng.new_sequence("many", prompts[0], _sp("choice", choices), use_cache=False)
    eng.add(seq)
    while eng.has_work():
        eng.step()
    assert eng.pop_failed() == []
    assert _text(eng, seq.output_ids) in choices
    eng.release(seq, cache=False)


def test_a_grammar_that_does_not_compile_is_refused_holding_nothing(make_engine, prompts):
    eng = make_engine()
    free = eng.pool.num_free
    with pytest.raises(GrammarError):
        eng.new_sequence("x", prompts[0], SamplingParams(grammar='{"grammars": 5}'))
    assert eng.pool.num_free == free and not eng.seqs


def test_rows_without_a_grammar_are_untouched_beside_one_with(make_engine, prompts):
    eng = make_engine()
    plain = SamplingParams(max_tokens=12)
    (alone,) = eng.generate([prompts[0]], plain, use_cache=False)
    a = eng.new_sequence("a", prompts[0], plain, use_cache=False)
    b = eng.new_sequence("b", prompts[1], _sp("choice", ["yes", "no"]), use_cache=False)
    eng.add(a)
    eng.add(b)
    while eng.has_work():
        eng.step()
    assert a.output_ids == alone
    assert _text(eng, b.output_ids) in ("yes", "no")
    eng.release(a, cache=False)
    eng.release(b, cache=False)


def test_guide_mask_and_replay(tiny_model):
    tok = load_tokenizer(tiny_model)
    lt = ll_tokenizer(tok, [1], 1024)
    g = Guide(lt, grammar_for("choice", ["ab", "ac"]))
    ids = tok.encode("ab", add_special_tokens=False).ids
    bits = g.allowed([])
    allowed = [i for i in range(1024) if bits[i // 8] >> (i % 8) & 1]
    assert ids[0] in allowed and 1 not in allowed  # not yet accepting: no EOS
    bits = g.allowed(ids)
    assert [i for i in range(1024) if bits[i // 8] >> (i % 8) & 1] == [1] and g.complete
    with pytest.raises(ValueError):
        g.advance(ids[:1])


def test_the_batched_greedy_mask_picks_what_the_per_row_path_picks(tiny_model):
    """Greedy rows with only a grammar take one masked argmax over the batch; a row that asks
    for logprobs too goes through process_logits. Both pick the same ids, row by row."""
    import torch

    from pdd.engine.sampler import Sampler

    tok = load_tokenizer(tiny_model)
    lt = ll_tokenizer(tok, [1], 1024)
    g = grammar_for("json", SCHEMA)
    gen = torch.Generator().manual_seed(3)
    fast, slow = Sampler([1]), Sampler([1])
    hists_f = [([5, 6], 2) for _ in range(8)]
    hists_s = [([5, 6], 2) for _ in range(8)]
    gf, gs = [Guide(lt, g) for _ in range(8)], [Guide(lt, g) for _ in range(8)]
    for step in range(12):
        logits = torch.randn(8, 1024, generator=gen)
        a = fast.sample(logits, [SamplingParams(grammar=g)] * 8, [step] * 8, hists_f, gf)
        b = slow.sample(logits, [SamplingParams(grammar=g, logprobs=0)] * 8, [step] * 8, hists_s, gs)
        assert a == b, step
        for (h, _), t in zip(hists_f, a):
            h.append(t)
        for (h, _), t in zip(hists_s, b):
            h.append(t)
    assert fast.last_logprobs == [None] * 8 and all(x is not None for x in slow.last_logprobs)


def test_a_repeated_constraint_is_compiled_once_and_each_guide_starts_fresh(tiny_model):
    tok = load_tokenizer(tiny_model)
    lt = ll_tokenizer(tok, [1], 1024)
    g1 = grammar_for("choice", ["ab", "cd"])
    assert grammar_for("choice", ["ab", "cd"]) is g1  # the compiled text, kept
    a = Guide(lt, g1)
    a.advance(tok.encode("ab", add_special_tokens=False).ids)
    assert a.complete
    b = Guide(lt, g1)  # a matcher of its own, at the start
    assert not b.complete and b.consumed == 0


def test_a_special_tokens_text_as_a_literal_is_refused_and_its_id_form_works(make_engine, prompts):
    """llguidance's mask allowed the special token a literal spells (``"<|system|>"``: id 5 on
    the tiny checkpoint) and then refused it: the guide leaves out special tokens the matcher
    would refuse, so such a literal at the start allows no output (a 400 at the gateway), one
    later fails the request; ``<[5]>`` in Lark is the token itself."""
    eng = make_engine()
    lt = eng.structured_tokenizer()
    with pytest.raises(GrammarError, match="allows no output"):
        Guide(lt, grammar_for("choice", ["<|system|>"])).check_start()
    out, reason = _run_one(eng, prompts[0], _sp("grammar", 'start: <[5]> "ok"'))
    assert out[0] == 5 and reason == FinishReason.STOP and eng.tokenizer.decode(out[1:-1]) == "ok"
    seq = eng.new_sequence("late", prompts[0], _sp("choice", ["hi<|assistant|>"]), use_cache=False)
    eng.add(seq)
    while eng.has_work():
        eng.step()
    (failed, why), = eng.pop_failed()
    assert failed is seq and why.startswith("structured output failed at output ")
    assert 4 not in seq.output_ids and 0 not in seq.output_ids  # never a special token it refuses
    eng.release(seq, cache=False)



def test_warm_structured_builds_the_one_structured_tokenizer_off_the_calling_thread(make_engine):
    eng = make_engine()
    t = eng.warm_structured()
    t.join(30)
    assert not t.is_alive()
    built = eng.structured_tokenizer()
    assert eng.structured_tokenizer() is built  # one build a process, reused by every guide
    assert built.vocab_size == eng.model_cfg.vocab_size and built.eos_tokens == eng.eos_token_ids
