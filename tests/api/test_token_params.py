"""vLLM's allowed_token_ids, bad_words and return_token_ids on the API layer (in-process engine):
their 400s name the field, and what they ask for is served, n > 1 included."""

from __future__ import annotations

import json

import pytest

from pdd.gateway.openai_schemas import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS

OK = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}


def _err(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name,value,words", [
    ("allowed_token_ids", [], "at least one token id"),
    ("allowed_token_ids", [5, 1024], "token id 1024 is outside the vocabulary [0, 1024)"),
    ("allowed_token_ids", [-1], "token id -1 is outside the vocabulary [0, 1024)"),
    ("allowed_token_ids", list(range(MAX_ALLOWED_TOKEN_IDS + 1)), f"at most {MAX_ALLOWED_TOKEN_IDS} allowed token ids"),
    ("allowed_token_ids", ["5"], "integer"),
    ("allowed_token_ids", [True], "integer"),
    ("allowed_token_ids", 5, "list"),
    ("bad_words", [""], "bad_words[0]: must not be empty or only white space"),
    ("bad_words", ["ok", "  "], "bad_words[1]: must not be empty or only white space"),
    ("bad_words", ["w"] * (MAX_BAD_WORDS + 1), f"at most {MAX_BAD_WORDS} bad words"),
    ("bad_words", ["x" * (MAX_BAD_WORD_CHARS + 1)], f"at most {MAX_BAD_WORD_CHARS} are allowed"),
    ("bad_words", [7], "string"),
    ("bad_words", "the", "list"),
    ("return_token_ids", "yes", "boolean"),
    ("return_token_ids", 1, "boolean"),
])
def test_bad_values_are_400_naming_the_field(api, path, name, value, words):
    client, orch = api
    body = OK if path == "/v1/completions" else CHAT
    err = _err(client.post(path, json={**body, name: value}), name)
    assert words in err["message"], err
    assert not orch.started


def test_a_lone_surrogate_bad_word_is_400(api):
    client, _ = api
    raw = json.dumps({**OK, "bad_words": ["a\ud800"]})
    err = _err(client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
               "bad_words")
    assert "lone surrogate" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_defaults_and_nulls_are_served_as_before(api, path):
    client, orch = api
    body = {**(OK if path == "/v1/completions" else CHAT), "temperature": 0}
    ref = client.post(path, json=body).json()
    r = client.post(path, json={**body, "allowed_token_ids": None, "bad_words": None, "return_token_ids": None})
    assert r.status_code == 200, r.text
    r2 = client.post(path, json={**body, "bad_words": [], "return_token_ids": False})
    for j in (r.json(), r2.json()):
        assert j["choices"] == ref["choices"]
        assert "prompt_token_ids" not in j and "token_ids" not in j["choices"][0]
    sp = orch.started[-1][1]
    assert sp.allowed_token_ids is None and sp.bad_words_token_ids == [] and sp.bad_words == []


def _completion_ids(client, **extra) -> list[int]:
    r = client.post("/v1/completions", json={**OK, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
                                             **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_allowed_token_ids_restrict_greedy_and_sampled_output(api):
    client, orch = api
    free = _completion_ids(client)
    assert _completion_ids(client, allowed_token_ids=[300]) == [300] * 12
    allowed = sorted(set(free[::2]))[:2] + [300]
    out = _completion_ids(client, allowed_token_ids=allowed)
    assert set(out) <= set(allowed) and out != free
    assert orch.started[-1][1].allowed_token_ids == allowed
    r = client.post("/v1/completions", json={**OK, "max_tokens": 16, "temperature": 1.0, "seed": 4, "n": 3,
                                             "allowed_token_ids": [11, 12], "return_token_ids": True})
    assert [set(c["token_ids"]) <= {11, 12} for c in r.json()["choices"]] == [True] * 3


def test_bad_words_tokenised_as_vllm_and_never_generated(api, tiny_model):
    from tokenizers import Tokenizer

    client, orch = api
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    client.post("/v1/completions", json={**OK, "bad_words": ["hello", " the"]})
    # "hello": [77, 501] and, with a leading space, [384, 501] (another first id, as many ids);
    # " the" is stripped: "the" [302, 74]; " the" [367] has fewer ids, so vLLM keeps only the first
    assert orch.started[-1][1].bad_words_token_ids == [[77, 501], [384, 501], [302, 74]]
    assert tok.encode("hello", add_special_tokens=False).ids == [77, 501]
    free = _completion_ids(client, max_tokens=24)
    # ban the pair the greedy output produces first: it never appears, the output up to it is the same
    a, b = free[3], free[4]
    word = tok.decode([a, b])
    assert tok.encode(word.lstrip(), add_special_tokens=False).ids == [a, b], word
    out = _completion_ids(client, max_tokens=24, bad_words=[word])
    assert out[:4] == free[:4] and out[4] != b
    assert all(out[i:i + 2] != [a, b] for i in range(len(out) - 1))
    single = _completion_ids(client, max_tokens=24, bad_words=[tok.decode([free[0]])])
    assert free[0] not in single


def test_return_token_ids_completion_places_as_vllm(api):
    client, _ = api
    r = client.post("/v1/completions", json={**OK, "max_tokens": 5, "temperature": 0, "n": 2, "return_token_ids": True,
                                             "prompt": [[5, 6, 7], [8, 9]]})
    j = r.json()
    assert [c["prompt_token_ids"] for c in j["choices"]] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    assert [len(c["token_ids"]) for c in j["choices"]] == [5] * 4
    assert "prompt_token_ids" not in j
    ref = client.post("/v1/completions", json={**OK, "max_tokens": 5, "temperature": 0, "prompt": [8, 9],
                                               "return_token_ids": True}).json()
    assert j["choices"][2]["token_ids"] == ref["choices"][0]["token_ids"]
    assert ref["choices"][0]["text"] == client.post("/detokenize", json={"tokens": ref["choices"][0]["token_ids"]}
                                                    ).json()["prompt"]


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_return_token_ids_streaming_completion_per_chunk(api):
    client, _ = api
    body = {**OK, "max_tokens": 4, "temperature": 0, "n": 2, "return_token_ids": True}
    full = client.post("/v1/completions", json=body).json()
    chunks = [c for c in _sse(client.post("/v1/completions", json={**body, "stream": True})) if c["choices"]]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == [5, 6, 7]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == full["choices"][i]["token_ids"]


def test_return_token_ids_chat_places_as_vllm(api):
    client, _ = api
    body = {**CHAT, "max_tokens": 4, "temperature": 0, "n": 2, "return_token_ids": True}
    j = client.post("/v1/chat/completions", json=body).json()
    prompt = client.post("/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    assert j["prompt_token_ids"] == prompt
    assert [len(c["token_ids"]) for c in j["choices"]] == [4, 4]
    assert "prompt_token_ids" not in j["choices"][0]
    chunks = _sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [c["prompt_token_ids"] for c in roles] == [prompt, prompt]
    for i in range(2):
        toks = [c["choices"][0]["token_ids"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert sum(toks, []) == j["choices"][i]["token_ids"]


# Masks that leave no allowed id: refused when the request alone shows it (400 naming the field),
# and served from the allowed ids when the outputs make it so (a multi-token bad word's ending).
HELLO = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "return_token_ids": True}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,param,message", [
    ({"allowed_token_ids": [1], "min_tokens": 5}, "min_tokens",
     "min_tokens (5): EOS and stop_token_ids are masked for the first 5 outputs, which leaves no id of "
     "allowed_token_ids (1)"),
    ({"allowed_token_ids": [77], "stop_token_ids": [77], "min_tokens": 5}, "min_tokens",
     "min_tokens (5): EOS and stop_token_ids are masked for the first 5 outputs, which leaves no id of "
     "allowed_token_ids (77)"),
    ({"allowed_token_ids": [1, 77], "stop_token_ids": [5], "bad_words": ["hello", "!"], "min_tokens": 1},
     None, None),  # "!" is [6]: 77 is left
    ({"allowed_token_ids": [1, 6], "bad_words": ["!"], "min_tokens": 2}, "min_tokens",
     "min_tokens (2): EOS and stop_token_ids are masked for the first 2 outputs, which leaves no id of "
     "allowed_token_ids (1, 6) that is not a single-token bad word"),
    ({"allowed_token_ids": [1], "bad_words": ["</s>"]}, "bad_words",
     "bad_words: every id of allowed_token_ids (1) is a single-token bad word, so no token could be generated"),
    ({"allowed_token_ids": [6, 6], "bad_words": ["!"], "temperature": 1, "seed": 2}, "bad_words",
     "bad_words: every id of allowed_token_ids (6) is a single-token bad word, so no token could be generated"),
    ({"stop_token_ids": list(range(2, 1024)), "bad_words": ["<s>"], "min_tokens": 1, "ignore_eos": True},
     "min_tokens", "min_tokens (1): EOS and stop_token_ids are masked for the first 1 outputs, which leaves no "
     "id of the vocabulary that is not a single-token bad word"),
])
def test_masks_leaving_no_allowed_id_are_400_naming_the_field(api, path, extra, param, message):
    client, orch = api
    body = HELLO if path == "/v1/completions" else {**CHAT, "temperature": 0, "max_tokens": 8}
    r = client.post(path, json={**body, **extra})
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert _err(r, param)["message"] == message
    assert not orch.started


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_bad_word_ending_that_masks_every_allowed_id_serves_allowed_ids(api, temperature):
    """"!!" is [6, 6]: after a first 6, the ending 6 is banned, which leaves no allowed id; the
    sampler drops that ban (docs/SERVE.md), never id 0 or a NaN draw."""
    client, _ = api
    r = client.post("/v1/completions", json={**HELLO, "temperature": temperature, "seed": 5,
                                             "allowed_token_ids": [6], "bad_words": ["!!"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [6] * 8


def test_a_special_token_s_text_as_a_bad_word_bans_that_token_as_vllm(api):
    """vLLM tokenises bad words with ``add_special_tokens=False``, which adds none but still reads a
    special token's text as that token: ``"</s>"`` is ``[1]``, EOS on the tiny checkpoint, so the
    request is never ended by EOS (docs/SERVE.md)."""
    client, orch = api
    r = client.post("/v1/completions", json={**HELLO, "max_tokens": 6, "bad_words": ["</s>"],
                                             "allowed_token_ids": [1, 300], "logit_bias": {"1": 100}})
    assert r.status_code == 200, r.text
    assert orch.started[-1][1].bad_words_token_ids == [[1]]
    ch = r.json()["choices"][0]
    assert (ch["token_ids"], ch["finish_reason"]) == ([300] * 6, "length")
