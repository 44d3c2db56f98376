"""The OpenAI API layer over an in-process engine: parameters, stop strings, n, logprobs, chat,
and OpenAI-style 400s (no process topology; see tests/api/test_openai_parity.py for that)."""

from __future__ import annotations

import json
import random

import pytest

from pdd.gateway.openai_text import StopMatcher

PROMPT = list(range(40, 80))


def _sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _complete(client, **body):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 5, "ignore_eos": True, **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------- stops
def test_stop_matcher_fuzz_equals_truncating_the_whole_text():
    rng = random.Random(0)
    alphabet = "abc "
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.3
        m = StopMatcher(stops, include)
        out, hit, i = [], None, 0
        while i < len(text) and hit is None:
            k = rng.randint(0, 5)
            piece, hit = m.feed(text[i:i + k])
            out.append(piece)
            i += k
        if hit is None:
            out.append(m.flush())
        got = "".join(out)
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            _, pos, s = min(hits)  # the first to complete, then the earliest start
            assert hit == s and got == text[:pos] + (s if include else ""), (text, stops, got)
        else:
            assert hit is None and got == text


def test_stop_string_spanning_tokens_ends_the_request_everywhere(api):
    client, orch = api
    full = _complete(client, max_tokens=24)["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a few characters mid-text, usually across tokens
    expected = full[:full.index(stop)]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0.8, "seed": 5,
                                             "ignore_eos": True, "stop": [stop, "\x00never"], "stream": True})
    chunks = _sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected  # nothing of or after it
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    assert len(chunks) < 200 and orch.aborted  # the tiers were told to stop
    assert not orch.engine.seqs and not orch.seqs  # and nothing keeps decoding
    # non-streaming, with the stop string kept
    j = _complete(client, max_tokens=200, stop=stop, include_stop_str_in_output=True)
    assert j["choices"][0]["text"] == expected + stop and j["choices"][0]["finish_reason"] == "stop"
    assert j["usage"]["completion_tokens"] < 200


def test_stop_token_ids_min_tokens_and_length(api):
    client, _ = api
    full = _complete(client, max_tokens=12)
    ids = [t for t in _ids(client, max_tokens=12)]
    j = _complete(client, max_tokens=12, stop_token_ids=[ids[3]])
    first = ids.index(ids[3])
    assert j["choices"][0]["finish_reason"] == "stop" and j["choices"][0]["stop_reason"] == ids[3]
    assert j["usage"]["completion_tokens"] == first + 1
    # the stop token's own text is not in the output unless include_stop_str_in_output (as vLLM;
    # found by a new user): the text is that of the tokens before it
    assert j["choices"][0]["text"] == _complete(client, max_tokens=first)["choices"][0]["text"]
    k = _complete(client, max_tokens=12, stop_token_ids=[ids[3]], include_stop_str_in_output=True)
    assert k["choices"][0]["text"] == _complete(client, max_tokens=first + 1)["choices"][0]["text"]
    assert k["usage"]["completion_tokens"] == first + 1
    # min_tokens masks the stop id until 6 outputs exist: the sampled path changes, and it
    # stops only on or after the 6th token (or at max_tokens)
    j = _complete(client, max_tokens=12, stop_token_ids=[ids[3]], min_tokens=6)
    assert j["usage"]["completion_tokens"] >= 6
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 12



def test_stop_matcher_match_false_text_only_begins_a_stop_string():
    m = StopMatcher(["ab", "bc"])
    assert m.feed("xa", match=False) == ("x", None)  # "a" may begin "ab": held back
    assert m.feed("b", match=False) == ("a", None)  # "ab" ends in text fed with match=False: no stop
    assert m.feed("cd") == ("", "bc")  # "bc" begins there ("b", held back) and ends here: a stop


@pytest.mark.parametrize("stop,text,fin,ntok", [
    # greedy output: fifi|momi|sipo|vaba|unpo|xi|xiro|...; min_tokens 3 = fifi|momi|sipo
    ("sip", "fifimomisipovabaunpoxixiro\ufffd inqude zashkego", "length", 12),  # inside token 3: not a stop
    ("misi", "fifimomisipovabaunpoxixiro\ufffd inqude zashkego", "length", 12),  # ends in token 3
    ("pova", "fifimomisi", "stop", 4),  # begins in token 3, ends in token 4: a stop
    ("vab", "fifimomisipo", "stop", 4),  # in token 4
])
def test_stop_strings_end_only_after_min_tokens_tokens_as_vllm(api, stop, text, fin, ntok):
    """vLLM (v1) matches stop strings from the token after the min_tokens-th on, looking back into
    the earlier text: found by a compatibility pass, a stop string inside the min_tokens-th token
    ended the choice there."""
    client, _ = api
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "min_tokens": 3,
            "stop": stop}
    j = client.post("/v1/completions", json=body).json()
    c = j["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"], j["usage"]["completion_tokens"]) == (
        text, fin, stop if fin == "stop" else None, ntok)
    chunks = _sse(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == fin and len(chunks) == ntok

def _ids(client, **body) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 5, "ignore_eos": True, "stream": True,
            **body}
    return [c["pdd"]["token_id"] for c in _sse(client.post("/v1/completions", json=body)) if c.get("choices")]


# ------------------------------------------------------------------------------- sampling / n
def test_seeded_requests_repeat_and_seeds_differ(api):
    client, _ = api
    a = _complete(client, temperature=1.0, top_p=0.9, top_k=40, min_p=0.02, presence_penalty=0.4,
                  frequency_penalty=0.2, repetition_penalty=1.1)
    b = _complete(client, temperature=1.0, top_p=0.9, top_k=40, min_p=0.02, presence_penalty=0.4,
                  frequency_penalty=0.2, repetition_penalty=1.1)
    c = _complete(client, temperature=1.0, seed=6)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert c["choices"][0]["text"] != _complete(client, temperature=1.0, seed=5)["choices"][0]["text"]


def test_n_choices_are_siblings_with_seed_plus_i(api):
    client, orch = api
    j = _complete(client, n=3, temperature=1.0, seed=100, max_tokens=10)
    texts = [c["text"] for c in sorted(j["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in sorted(j["choices"], key=lambda c: c["index"])] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert [sp.seed for _, sp in orch.started[-3:]] == [100, 101, 102]
    for i in range(3):
        assert _complete(client, temperature=1.0, seed=100 + i, max_tokens=10)["choices"][0]["text"] == texts[i]
    assert j["usage"]["completion_tokens"] == 30 and j["usage"]["prompt_tokens"] == len(PROMPT)
    # streaming: chunks of both choices, each ending with its own finish_reason
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = _sse(r)
    fins = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]}
    assert fins == {0: "length", 1: "length"} and chunks[-1]["usage"]["completion_tokens"] == 10


def test_n_siblings_reuse_the_prompt_pages(api):
    client, orch = api
    prompt = list(range(100, 141))  # 41 tokens: 5 whole pages of 8
    r = client.post("/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 3, "temperature": 1.0})
    assert r.status_code == 200
    assert orch.states[f"t{orch._n}"].p_cached_tokens == 40  # the sibling hit 5 pages of the first


# ------------------------------------------------------------------------------------ logprobs
def test_completion_logprobs(api):
    client, _ = api
    j = _complete(client, logprobs=3, max_tokens=6)
    lp = j["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(v <= 0 for v in lp["token_logprobs"])
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and top[tok] == v and max(top.values()) >= v
    assert lp["text_offset"][0] == 0
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 0, "stream": True})
    for c in [c for c in _sse(r) if c.get("choices")]:
        assert len(c["choices"][0]["logprobs"]["tokens"]) == 1


def test_greedy_logprob_is_the_top_one(api):
    client, _ = api
    j = _complete(client, temperature=0, logprobs=2, max_tokens=5)
    lp = j["choices"][0]["logprobs"]
    for v, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert v == max(top.values())


# ------------------------------------------------------------------------------------------ chat
def test_chat_with_the_openai_client(api):
    from openai import OpenAI

    client, _ = api
    oa = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]
    r = oa.chat.completions.create(model="pdd-tiny", messages=msgs, max_completion_tokens=8, seed=3,
                                   logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.finish_reason == "length"
    assert len(ch.logprobs.content) == 8 and all(len(e.top_logprobs) == 2 for e in ch.logprobs.content)
    assert "".join(e.token for e in ch.logprobs.content).startswith(ch.message.content[:1])
    stream = oa.chat.completions.create(model="pdd-tiny", messages=msgs, max_completion_tokens=8, seed=3,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ch.message.content  # same seed, same text, streamed or not
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_prompt_is_the_rendered_template(api, tiny_model):
    from tokenizers import Tokenizer

    client, orch = api
    msgs = [{"role": "user", "content": "Hello"}]
    client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    assert orch.started[-1][0] == tok.encode("<|user|>\nHello</s>\n<|assistant|>\n", add_special_tokens=False).ids
    # no max_tokens: whatever the 512-token context leaves
    assert orch.started[-1][1].max_tokens == 1
    client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": None, "stop": ["\n"]})
    assert orch.started[-1][1].max_tokens == 512 - len(orch.started[-1][0])


# ----------------------------------------------------------------------------------------- 400s
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [5000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": list(range(10, 300)), "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
])
def test_bad_parameters_get_openai_400(api, path, body, param):
    client, orch = api
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}
    assert not orch.started  # rejected before any tier did work


def test_unknown_model_is_404_and_start_failure_503(api):
    client, orch = api
    r = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    orch.fail_next = True
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert "retry-after" not in r.headers  # a failure, not a wait


def test_no_instance_reachable_is_503_with_retry_after(api):
    """A new user froze the only P: 36 of 40 requests failed at once with 503 and no hint when to
    come back. The request did no work; the gateway retries the instance every
    liveness.reconnect_interval_s, so the 503 says to retry after that."""
    from pdd.gateway.orchestrator import NoInstance

    client, orch = api
    orch.fail_next = NoInstance("no prefill instance is reachable")
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert "no prefill instance is reachable" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_usage_cached_tokens_never_exceed_the_prompt():
    """Found by a new user: after md0 was killed mid-stream, the recovery's prefill (prompt +
    streamed tokens, 112 of them cached) was reported as cached_tokens 112 of a 14-token prompt."""
    from types import SimpleNamespace

    from pdd.gateway.api import _usage

    def gen(cached):
        st = SimpleNamespace(prompt_cached_tokens=cached)
        return SimpleNamespace(prompt_ids=[1] * 14, completion_tokens=lambda: 400, choices=[SimpleNamespace(st=st)])

    assert _usage(gen(112))["prompt_tokens_details"] == {"cached_tokens": 14}
    assert _usage(gen(8)) == {"prompt_tokens": 14, "completion_tokens": 400, "total_tokens": 414,
                              "prompt_tokens_details": {"cached_tokens": 8}}


def test_usage_cached_tokens_are_the_first_prefill_s_hit_after_a_recovery():
    """A request whose first prefill hit 8 of its 14 prompt tokens and whose new attempt (prompt +
    112 streamed tokens, after md0 was lost) hit 120 on its own earlier prefill reports the 8 its
    prompt found cached (every prompt token hit, 14, before); ``pdd.p_cached_tokens`` is the
    attempt's. Before P answers at all, 0."""
    from types import SimpleNamespace

    from pdd.gateway.api import _pdd_summary, _usage
    from pdd.gateway.state import ReqState
    from pdd.types import SamplingParams

    st = ReqState("r1", 14, SamplingParams(max_tokens=400), trid="r1", prompt_ids=[1] * 14)
    gen = SimpleNamespace(prompt_ids=[1] * 14, completion_tokens=lambda: 400, choices=[SimpleNamespace(st=st)])
    assert _usage(gen)["prompt_tokens_details"] == {"cached_tokens": 0}
    st.note_p_cached(8)
    st.attempt, st.base, st.trid = 1, 112, "r1.1"  # what a recovery sets for the new attempt
    st.note_p_cached(120)
    assert _usage(gen)["prompt_tokens_details"] == {"cached_tokens": 8}
    assert _pdd_summary(st)["p_cached_tokens"] == 120


def test_eos_text_is_left_out_unless_include_stop_str_in_output(api, tiny_model):
    """A choice ended by EOS does not show EOS's text even with ``skip_special_tokens: false``,
    unless ``include_stop_str_in_output`` (as vLLM; a new user saw ``</s>`` at the end)."""
    from pdd.engine.config import ModelConfig

    client, _ = api
    eos = ModelConfig.from_pretrained(tiny_model).eos_token_ids[0]
    body = {"prompt": PROMPT, "temperature": 0, "min_tokens": 3, "logit_bias": {str(eos): 100},
            "skip_special_tokens": False}
    before = client.post("/v1/completions", json={**body, "max_tokens": 3, "ignore_eos": True}).json()
    j = client.post("/v1/completions", json={**body, "max_tokens": 10}).json()
    # EOS is masked for the first min_tokens = 3 outputs, then the bias makes it the 4th
    assert j["choices"][0]["finish_reason"] == "stop" and j["usage"]["completion_tokens"] == 4, j
    assert j["choices"][0]["text"] == before["choices"][0]["text"]
    k = client.post("/v1/completions", json={**body, "max_tokens": 10, "include_stop_str_in_output": True}).json()
    assert k["choices"][0]["text"] != j["choices"][0]["text"] and k["choices"][0]["text"].startswith(j["choices"][0]["text"])


def test_gateway_knows_kv_bytes_per_token_before_any_reservation(tiny_model):
    """The first request's pipeline decision had ``kv_bytes_per_token: 0`` (learned only from MD's
    first reservation reply): a free WAN for the policy. It comes from the checkpoint now."""
    from pdd.config import ClusterConfig
    from pdd.engine.config import ModelConfig
    from pdd.gateway.orchestrator import Orchestrator
    from pdd.topology import layout

    cfg = ClusterConfig.model_validate({"model_path": tiny_model})
    o = Orchestrator(cfg, layout(cfg))
    assert o.kv_bytes_per_token == ModelConfig.from_pretrained(tiny_model).kv_bytes_per_token("float32") > 0
