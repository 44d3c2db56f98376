"""The gateway's first-mask check (``pdd.structured.check_start``) depends only on the grammar
text (over one model's tokenizer): a constrained request whose grammar was checked before builds
no matcher, whether the check passed or refused it; the refusal is the same each time."""

from __future__ import annotations

import pytest

import pdd.structured as structured
from pdd.engine.engine import load_tokenizer
from pdd.structured import GrammarError, Guide, check_start, grammar_for, ll_tokenizer


@pytest.fixture
def built(monkeypatch):
    """The grammars a matcher was built for, from here on."""
    got: list[str] = []
    real = structured._fresh_matcher

    def counting(lltok, grammar):
        got.append(grammar)
        return real(lltok, grammar)

    monkeypatch.setattr(structured, "_fresh_matcher", counting)
    structured._start_refusal.cache_clear()
    yield got
    structured._start_refusal.cache_clear()


def test_a_grammar_checked_before_builds_no_matcher(tiny_model, built):
    lt = ll_tokenizer(load_tokenizer(tiny_model), [1], 1024)
    ok, empty = grammar_for("regex", "[0-9]{3}"), grammar_for("grammar", "start: start")
    with pytest.raises(GrammarError) as first:
        Guide(lt, empty).check_start()
    built.clear()
    for _ in range(3):
        check_start(lt, ok)
        with pytest.raises(GrammarError) as again:
            check_start(lt, empty)
        assert str(again.value) == str(first.value)
    assert built == [ok, empty]
    lt2 = ll_tokenizer(load_tokenizer(tiny_model), [1, 2], 1024)  # another model's: checked on its own
    check_start(lt2, ok)
    assert built == [ok, empty, ok]
