"""A stop string matches as soon as the text of the ids so far contains it, also when that text
ends in an incomplete UTF-8 character (decoded as U+FFFD) that the detokenizer holds back: a
token carrying a stop string's last characters and the first byte of the next character ends
the choice on that token (it matched one token late: the text was cut right, but
``usage.completion_tokens`` and the stream counted the token after). The trailing U+FFFD itself
never matches (the next token may complete it into another character), so a stop string holding
U+FFFD matches once its replacement character is final, one token later (as vLLM)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

from pdd.gateway.openai_run import Choice
from pdd.gateway.openai_text import Detokenizer, StopMatcher
from pdd.gateway.state import TokenOut

PROMPT = list(range(40, 80))
BODY = {"prompt": PROMPT, "temperature": 0.8, "seed": 5, "ignore_eos": True}

# a byte-level vocabulary with what real BPE vocabularies hold and the tiny checkpoint's lacks:
# tokens that end in the first bytes of a multi-byte character after whole ones (" \xe4" style)
PIECES = [b"a", b"b", b"c", b" ", b"ab", b"c\xe4", b"\xbd\xa0", b"\xe4\xbd", b"\xa0", b"\xc3", b"\xa9x",
          b"\xff", b"z\xc3", b"\xa9"]


class ByteTok:
    """A tokenizer whose ids are ``PIECES``: decode is their bytes as UTF-8, invalid or
    incomplete sequences replaced (as the tokenizers library's ByteLevel decoder)."""

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def _tok(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tiny_model}/tokenizer.json")


def _oracle(tok, ids: list[int], stop: str, include: bool) -> tuple[int, str]:
    """(tokens generated, text): the first prefix of ``ids`` whose decode, less its trailing
    U+FFFD unless it is the whole stream, contains ``stop``, cut there."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        seen = text if k == len(ids) else text.rstrip("\ufffd")
        if stop in seen:
            i = seen.index(stop)
            return k, seen[:i] + (stop if include else "")
    return len(ids), tok.decode(ids)


def _run(tok, ids: list[int], stop: str, include: bool = False) -> tuple[int, str]:
    opts = SimpleNamespace(min_tokens=0, include_stop=include)
    c = Choice(0, SimpleNamespace(sampling=SimpleNamespace(stop_token_ids=[])), opts, Detokenizer(tok),
               StopMatcher([stop], include))
    for pos, t in enumerate(ids):
        d = c.on_token(TokenOut(pos, t, "local", "length" if pos == len(ids) - 1 else None), set())
        if d.finish_reason is not None:
            break
    return c.ntok, "".join(c.text)


def test_stop_string_before_a_partial_character_ends_the_choice_on_its_token():
    tok = ByteTok()
    # "ab" + "c\xe4": the second token completes "bc" and starts a character the third completes
    assert _run(tok, [4, 5, 6], "bc") == (2, "a")
    assert _run(tok, [4, 5, 6], "bc", include=True) == (2, "abc")
    assert _run(tok, [4, 5, 6], "c\u4f60") == (3, "ab")  # "c你": decided by the third token


def test_a_replacement_character_the_next_token_completes_is_no_stop():
    tok = ByteTok()
    # "\xc3" then "\xa9x": "éx", no U+FFFD in the text; a stop "\ufffd" must not end it at "\xc3"
    assert _run(tok, [0, 9, 10, 2], "\ufffd") == (4, "a\u00e9xc")
    assert _run(tok, [0, 11, 2], "\ufffd") == (3, "a")  # "\xff" is invalid: final once "c" follows


def test_choice_stops_on_the_first_token_whose_decided_text_holds_the_stop_string(tiny_model):
    """Random ids, many of them partial characters, against the oracle: the tiny checkpoint's
    vocabulary (single bytes >= 0x80) and ``PIECES``."""
    tiny = _tok(tiny_model)
    vocab = tiny.get_vocab()
    high = [vocab[c] for c in vocab if len(c) == 1 and ord(c) >= 0xA1]  # ByteLevel symbols of bytes >= 0x80
    rng = random.Random(0)
    replacement_stops = 0
    for tok, draw in ((tiny, lambda: rng.choice(high) if rng.random() < 0.4 else rng.randrange(3, 1024)),
                      (ByteTok(), lambda: rng.randrange(len(PIECES)))):
        for _ in range(400):
            ids = [draw() for _ in range(rng.randint(2, 12))]
            k = rng.randint(1, len(ids))
            text = tok.decode(ids[:k])
            if not text:
                continue
            j = rng.randint(0, len(text) - 1)
            stop = text[j:j + rng.randint(1, 3)]
            replacement_stops += "\ufffd" in stop
            include = rng.random() < 0.3
            assert _run(tok, ids, stop, include) == _oracle(tok, ids, stop, include), (ids, stop, include)
    assert replacement_stops > 200


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_stop_string_ending_in_a_replacement_character_matches_once_it_is_final(api, tiny_model):
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

    # the token after decides that the U+FFFD stays one: the request ends on it, the text cut
    # before the stop string
    j = client.post("/v1/completions", json={**BODY, "max_tokens": 200, "stop": [stop]}).json()
    assert j["choices"][0]["text"] == text[:-3]
    assert (j["choices"][0]["finish_reason"], j["choices"][0]["stop_reason"]) == ("stop", stop)
    assert j["usage"]["completion_tokens"] == k + 1

    r = client.post("/v1/completions", json={**BODY, "max_tokens": 200, "stop": [stop], "stream": True,
                                             "include_stop_str_in_output": True})
    toks = [c for c in _sse(r) if c.get("choices")]
    assert [c["pdd"]["token_id"] for c in toks] == ids[:k + 1]  # none after the one deciding it
    assert "".join(c["choices"][0]["text"] for c in toks) == text
    assert toks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not orch.engine.seqs and not orch.seqs
