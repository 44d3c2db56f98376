"""A stop string matches as soon as the text of the ids so far contains it, also when that text
ends in an incomplete UTF-8 character (decoded as U+FFFD) that the detokenizer holds back: the
choice ends on the token that completes the stop string. It matched one token late: the text
was cut right, but ``usage.completion_tokens`` and the stream counted the token after."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

from pdd.gateway.openai_run import Choice
from pdd.gateway.openai_text import Detokenizer, StopMatcher
from pdd.gateway.state import TokenOut

PROMPT = list(range(40, 80))
BODY = {"prompt": PROMPT, "temperature": 0.8, "seed": 5, "ignore_eos": True}


def _tok(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tiny_model}/tokenizer.json")


def _oracle(tok, ids: list[int], stop: str, include: bool) -> tuple[int, str]:
    """(tokens generated, text): the first prefix of ``ids`` whose decode contains ``stop``, cut there."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if stop in text:
            i = text.index(stop)
            return k, text[:i] + (stop if include else "")
    return len(ids), tok.decode(ids)


def test_choice_stops_on_the_token_whose_decode_holds_the_stop_string(tiny_model):
    """Random ids, many of them single bytes >= 0x80 (partial characters), against the oracle."""
    tok = _tok(tiny_model)
    vocab = tok.get_vocab()
    high = [vocab[c] for c in vocab if len(c) == 1 and ord(c) >= 0xA1]  # ByteLevel symbols of bytes >= 0x80
    rng = random.Random(0)
    replacement_stops = 0
    for _ in range(400):
        ids = [rng.choice(high) if rng.random() < 0.4 else rng.randrange(3, 1024) for _ in range(rng.randint(2, 12))]
        k = rng.randint(1, len(ids))
        text = tok.decode(ids[:k])
        if not text:
            continue
        j = rng.randint(0, len(text) - 1)
        stop = text[j:j + rng.randint(1, 3)]
        replacement_stops += "\ufffd" in stop
        include = rng.random() < 0.3
        opts = SimpleNamespace(min_tokens=0, include_stop=include)
        c = Choice(0, SimpleNamespace(sampling=SimpleNamespace(stop_token_ids=[])), opts, Detokenizer(tok),
                   StopMatcher([stop], include))
        for pos, t in enumerate(ids):
            d = c.on_token(TokenOut(pos, t, "local", "length" if pos == len(ids) - 1 else None), set())
            if d.finish_reason is not None:
                break
        assert (c.ntok, "".join(c.text)) == _oracle(tok, ids, stop, include), (ids, stop, include)
    assert replacement_stops > 100


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_stop_string_ending_in_a_partial_character_ends_the_request_on_its_token(api, tiny_model):
    client, orch = api
    tok = _tok(tiny_model)
    r = client.post("/v1/completions", json={**BODY, "max_tokens": 40, "stream": True})
    ids = [c["pdd"]["token_id"] for c in _sse(r) if c.get("choices")]
    # the first token whose text so far ends in U+FFFD: the detokenizer holds it back
    k = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("\ufffd"))
    text = tok.decode(ids[:k])
    stop = text[-3:]
    assert stop.endswith("\ufffd") and stop not in tok.decode(ids[:k - 1])
    assert k < len(ids) and tok.decode(ids[:k + 1]).startswith(text)  # a real replacement character

    j = client.post("/v1/completions", json={**BODY, "max_tokens": 200, "stop": [stop]}).json()
    assert j["choices"][0]["text"] == text[:-3]
    assert (j["choices"][0]["finish_reason"], j["choices"][0]["stop_reason"]) == ("stop", stop)
    assert j["usage"]["completion_tokens"] == k

    r = client.post("/v1/completions", json={**BODY, "max_tokens": 200, "stop": [stop], "stream": True,
                                             "include_stop_str_in_output": True})
    toks = [c for c in _sse(r) if c.get("choices")]
    assert [c["pdd"]["token_id"] for c in toks] == ids[:k]  # no token after the one completing it
    assert "".join(c["choices"][0]["text"] for c in toks) == text
    assert toks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not orch.engine.seqs and not orch.seqs
