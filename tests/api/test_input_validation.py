"""Bad input (issue 5, item 5) on the API layer over an in-process engine: each case gets an
OpenAI-style 4xx before any tier does work, and the server keeps serving after it. The limits
here: max_input_len 400 < max_model_len 512 (the ``api`` fixture)."""

from __future__ import annotations

import json
import typing

import pydantic
import pytest

OK = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}


def _err(r, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not ...:
        assert err["param"] == param
    if code is not ...:
        assert err["code"] == code
    return err


def _still_serving(client) -> None:
    r = client.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("n_prompt,max_tokens", [(401, 1), (401, 16), (450, 50)])
def test_prompt_just_over_max_input_len_but_inside_the_context_is_400(api, n_prompt, max_tokens):
    client, orch = api
    assert n_prompt + max_tokens <= 512  # fits the context window: only max_input_len refuses it
    r = client.post("/v1/completions", json={"prompt": list(range(10, 10 + n_prompt)), "max_tokens": max_tokens})
    err = _err(r, 400, "prompt", "context_length_exceeded")
    assert f"{n_prompt} tokens" in err["message"] and "400" in err["message"]
    assert not orch.started  # before any tier did work
    r = client.post("/v1/completions", json={"prompt": list(range(10, 410)), "max_tokens": 1})  # exactly 400
    assert r.status_code == 200


@pytest.mark.parametrize("limit", [{"max_completion_tokens": 4}, {"max_tokens": 4}, {}])
def test_chat_prompt_just_over_max_input_len_is_400(api, tiny_model, limit):
    """param is ``messages`` however the output length is given (with max_tokens or none it was
    ``prompt``, a field chat does not have)."""
    from tokenizers import Tokenizer

    client, orch = api
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    def n_tokens(k):
        words = " ".join(["hello"] * k)
        return words, len(tok.encode(f"<|user|>\n{words}</s>\n<|assistant|>\n", add_special_tokens=False).ids)

    k = 1
    while n_tokens(k)[1] <= 400:
        k += 1
    words, n = n_tokens(k)  # the shortest such chat: a few tokens over max_input_len
    assert 400 < n < 420, n
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": words}], **limit})
    _err(r, 400, "messages", "context_length_exceeded")
    assert not orch.started


@pytest.mark.parametrize("limit", [{"max_completion_tokens": 4}, {"max_tokens": 4}, {"max_tokens": None}, {}])
def test_a_prompt_past_the_context_window_too_is_refused_for_max_input_len_in_the_same_words(api, limit):
    """Found by a new user: with no max_tokens, a prompt past the context window (512 here) was
    "N prompt tokens leave no room in the context window", with it "... is longer than the
    maximum input length": the over-long prompt is named first either way."""
    client, orch = api
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 600}],
                                                  **limit})
    msg = _err(r, 400, "messages", "context_length_exceeded")["message"]
    assert msg.startswith("messages (as a prompt): ") and msg.endswith(
        " tokens is longer than the maximum input length 400"), msg
    if "max_completion_tokens" not in limit:
        r = client.post("/v1/completions", json={"prompt": list(range(10, 610)), **limit})
        assert _err(r, 400, "prompt", "context_length_exceeded")["message"] == (
            "prompt: 600 tokens is longer than the maximum input length 400")
    assert not orch.started


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "x", "n": "two"}, "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stream": "yes please"}, "stream"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [""], "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),  # lax parsing would read true as 1
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "seed": False}, "seed"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),  # an integer for completions
    ({"prompt": "x", "temperature": True}, "temperature"),  # lax parsing sampled at 1.0
    ({"prompt": "x", "top_p": True}, "top_p"),
    ({"prompt": "x", "frequency_penalty": False}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": True}, "repetition_penalty"),
])
def test_wrong_types_and_empty_prompts_are_400_then_still_serving(api, body, param):
    client, orch = api
    _err(client.post("/v1/completions", json=body), 400, param)
    assert not orch.started
    _still_serving(client)


@pytest.mark.parametrize("body", [
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "ten"},
])
def test_chat_wrong_types_are_400(api, body):
    client, orch = api
    _err(client.post("/v1/chat/completions", json=body), 400)
    assert not orch.started


@pytest.mark.parametrize("messages,param,message", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role", "messages[0].role: 'wizard' is not one of"),
    ([{"role": "user"}], "messages[0].content", "messages[0].content: required for role 'user'"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}], "messages[1].content",
     "messages[1].content: required for role 'user'"),
])
def test_chat_roles_and_missing_content_are_400_naming_the_message(api, messages, param, message):
    client, orch = api
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    _err(r, 400, param)
    assert r.json()["error"]["message"].startswith(message), r.json()
    assert not orch.started
    _still_serving(client)


def test_chat_max_tokens_true_is_400_and_an_assistant_turn_needs_content_or_tool_calls(api):
    """An assistant turn with neither content nor tool_calls was served (its content rendered
    empty); OpenAI's API refuses it: content is required unless tool_calls is given."""
    client, orch = api
    _err(client.post("/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "x"}], "max_tokens": True}), 400, "max_tokens")
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "y"}], "max_tokens": 2})
    assert _err(r, 400, "messages[1].content")["message"] == \
        "messages[1].content: required for role 'assistant' unless tool_calls is given"
    assert not orch.started
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [
    b"{not json",
    b'{"prompt": "abc", "max_tokens": 2',  # truncated
    b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 2}',  # invalid UTF-8 bytes
    b'\xc3\x28',
    b'[1, 2, 3]',  # JSON, but not an object
    b'',
])
def test_malformed_bodies_are_400_then_still_serving(api, raw):
    client, orch = api
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _err(r, 400)
    assert not orch.started
    _still_serving(client)


def test_lone_surrogate_in_text_is_400(api):
    client, orch = api
    r = client.post("/v1/completions", content=b'{"prompt": "hi \\ud800", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    _err(r, 400, "prompt")
    assert not orch.started


def test_100_mb_body_is_413_unread_then_still_serving(api):
    from pdd.gateway.api import MAX_BODY_BYTES

    client, orch = api
    body = b'{"prompt": "' + b"a" * (100 << 20) + b'"}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = _err(r, 413, None, "body_too_large")
    assert str(len(body)) in err["message"] and str(MAX_BODY_BYTES) in err["message"]
    # the body was not read: the connection closes, or a client still sending it waits in vain
    # (found by a new user: the 408s closed, this 413 did not)
    assert r.headers.get("connection") == "close"
    del body
    _still_serving(client)


def test_chunked_body_over_the_limit_is_413_without_content_length(api):
    """No Content-Length (chunked transfer): read up to the limit, then refused."""
    from pdd.gateway.api import MAX_BODY_BYTES

    client, orch = api
    chunk = b"a" * (1 << 20)

    def gen():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // len(chunk) + 8):
            yield chunk
        yield b'"}'

    r = client.post("/v1/completions", content=gen(), headers={"content-type": "application/json"})
    _err(r, 413, None, "body_too_large")
    assert r.headers.get("connection") == "close"  # the rest of the body was not read
    assert not orch.started
    # a small chunked body is served as usual
    r = client.post("/v1/completions", content=iter([b'{"prompt": [5, 6, 7], ', b'"max_tokens": 2}']),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_refusal_before_the_body_is_read_closes_the_connection_and_others_do_not(api):
    """Content-Encoding gzip is refused (415) before the body is read: ``Connection: close`` as the
    413 and 408 have it; a refusal after the whole body was read (400) keeps the connection."""
    client, orch = api
    r = client.post("/v1/completions", content=b"\x1f\x8b" + b"x" * 1000,
                    headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415 and r.headers.get("connection") == "close", r.headers
    r = client.post("/v1/completions", json={"prompt": 12})
    assert r.status_code == 400 and "connection" not in r.headers, r.headers
    r = client.post("/v1/completions", json=OK)
    assert r.status_code == 200 and "connection" not in r.headers, r.headers


def test_unknown_model_404_then_still_serving(api):
    client, orch = api
    r = client.post("/v1/completions", json={**OK, "model": "no-such-model"})
    _err(r, 404, "model", "model_not_found")
    assert not orch.started
    _still_serving(client)


def test_a_refusal_echoes_a_huge_value_bounded(api):
    """The model name, a bad batch item or logit_bias key is echoed cut to 120 characters and its
    length (``pdd.text.shown``), not whole."""
    client, orch = api
    r = client.post("/v1/completions", json={**OK, "model": "m" * 100_000})
    assert _err(r, 404, "model", "model_not_found")["message"] == (
        f"model '{'m' * 119}... (100000 characters) does not exist; this server serves 'pdd-tiny'")
    r = client.post("/v1/completions", json={**OK, "prompt": ["a", ["z"] * 50_000]})
    assert _err(r, 400, "prompt")["message"] == (
        "prompt[1]: a batch of texts must hold strings only (prompt[0] is a string), got "
        f"{repr(['z'] * 50)[:120]}... (50000 items)")
    r = client.post("/v1/completions", json={**OK, "logit_bias": {"k" * 100_000: 1}})
    assert _err(r, 400, "logit_bias")["message"] == (
        f"logit_bias: key '{'k' * 119}... (100000 characters) is not a token id")
    assert not orch.started


def test_a_refusal_of_a_long_wrong_typed_value_keeps_its_tail(api):
    """Found in user testing: these messages were cut whole at 200 characters (``[:200]``), so a
    long value lost the message's closing words and never said it had been cut; the value is
    now cut by ``shown`` (120 characters, then its full length)."""
    client, orch = api
    long = "x" * 1000
    cut = f"'{'x' * 119}... (1000 characters)"
    cases = [
        ("/v1/completions", {**OK, "max_tokens": long}, "max_tokens", f"max_tokens: must be an integer, got a string {cut}"),
        ("/v1/completions", {**OK, "stop": {"a": long}}, "stop",
         f"stop: must be a string or a list of strings, got dict {{'a': {cut[:120 - 6]}... (1 items)"),
        ("/v1/completions", {**OK, "stop": ["a", {"b": long}]}, "stop",
         f"stop[1]: must be a string, got dict {{'b': {cut[:120 - 6]}... (1 items)"),
        ("/v1/completions", {**OK, "prompt": {"p": long}}, "prompt",
         "prompt: must be a text, a list of token ids, a list of texts or a list of token-id lists, got dict "
         f"{{'p': {cut[:120 - 6]}... (1 items)"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"c": long}}], "max_tokens": 2},
         "messages[0].content", f"messages[0].content: must be a string or a list of content parts, got dict "
                                f"{{'c': {cut[:120 - 6]}... (1 items)"),
        ("/v1/chat/completions", {"messages": [{"role": [long], "content": "hi"}], "max_tokens": 2},
         "messages[0].role", f"messages[0].role: must be a string, got list [{cut[:120 - 1]}... (1 items)"),
        ("/v1/chat/completions", {"messages": [{"role": long, "content": "hi"}], "max_tokens": 2},
         "messages[0].role", f"messages[0].role: {cut} is not one of assistant, developer, function, system, tool, "
                             "user"),
    ]
    for path, body, param, message in cases:
        assert _err(client.post(path, json=body), 400, param)["message"] == message
    assert not orch.started


def test_n_two_never_hangs_and_n_over_the_limit_is_400(api):
    client, orch = api
    r = client.post("/v1/completions", json={**OK, "n": 2, "max_tokens": 3})
    assert r.status_code == 200 and sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 6
    _err(client.post("/v1/completions", json={**OK, "n": 17}), 400, "n")


def test_prompt_shorter_than_one_page_completes(api):
    client, orch = api
    r = client.post("/v1/completions", json={"prompt": [42], "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("extra,param,what", [
    ({"stop_token_ids": [5] * 500_000}, "stop_token_ids", "1024"),  # a 3 MB body: once a 503 (wire header)
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "1024"),
    ({"stop": ["zz"] * 100_000}, "stop", "64"),  # once 27 s of event-loop time when streamed
    ({"stop": [f"s{i}" for i in range(65)]}, "stop", "64"),
    ({"stop": "x" * 1025}, "stop", "1024"),
    ({"stop": ["a", "y" * 5000]}, "stop", "1024"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias", "1024"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_oversized_stop_lists_and_logit_bias_are_400_then_still_serving(api, extra, param, what, path):
    client, orch = api
    body = ({"prompt": [5, 6, 7]} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = client.post(path, json={**body, "max_tokens": 2, "stream": True, **extra})
    err = _err(r, 400, param)
    assert param in err["message"] and f"at most {what}" in err["message"]
    assert not orch.started
    _still_serving(client)


def test_stop_lists_and_logit_bias_at_their_bounds_are_served(api):
    client, _ = api
    r = client.post("/v1/completions", json={**OK, "stop": [f"\x00{i}" for i in range(64)], "stop_token_ids":
                                             [1023] * 1024, "logit_bias": {str(i): 0.5 for i in range(1024)}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={**OK, "stop": "\x00" * 1024})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_400(api, path):
    """As vLLM: ``stream_options`` only with ``stream: true``."""
    client, orch = api
    body = ({"prompt": [5, 6, 7]} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = client.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
    _err(r, 400, "stream_options")
    assert not orch.started
    r = client.post(path, json={**body, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200


def test_completion_max_tokens_null_means_the_rest_of_the_context(api):
    """As vLLM: an explicit ``max_tokens: null`` generates up to the context window (512 here);
    an omitted one is OpenAI's default, 16."""
    client, _ = api
    r = client.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 512 - 300
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("field", ["top_k", "seed"])
def test_integers_past_int64_are_400_naming_the_field(api, field):
    """Found by a new user: top_k = 2**64 passed validation and failed later as a 503 (the
    instance protocol's msgpack carries 64-bit integers); bounded at int64 as vLLM bounds seed."""
    client, orch = api
    for v in (1 << 64, 10 ** 30):
        _err(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: v}), 400, field)
    assert not orch.started
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: (1 << 63) - 1})
    assert r.status_code == 200, r.text
    _still_serving(client)


def test_chat_template_kwargs_cannot_break_rendering():
    """Found by a new user: chat_template_kwargs {"self": 1} collided with jinja's render(self, ...)
    and came back as a 500. The context is now one dict; a template that fails in Python on the
    values it was given is a ChatTemplateError (HTTP 400), not a traceback."""
    from pdd.gateway.openai_chat import ChatTemplate, ChatTemplateError

    msgs = [{"role": "user", "content": "hi"}]
    ct = ChatTemplate("{{ messages[0]['content'] }}|{{ self }}|{{ add_generation_prompt }}", {})
    out = ct.render(msgs, chat_template_kwargs={"self": 1})  # jinja's own `self` wins inside the template
    assert out.startswith("hi|") and out.endswith("|True")
    # reserved names stay the request's own
    ct2 = ChatTemplate("{{ messages[0]['content'] }}|{{ add_generation_prompt }}", {})
    assert ct2.render(msgs, chat_template_kwargs={"messages": [], "add_generation_prompt": False}) == "hi|True"
    bad = ChatTemplate("{{ messages | length + x }}", {})
    with pytest.raises(ChatTemplateError, match="TypeError"):
        bad.render(msgs, chat_template_kwargs={"x": "a"})


def test_missing_and_malformed_bodies_name_what_is_wrong(api):
    client, orch = api
    r = client.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    err = _err(r, 400, "prompt")
    assert "missing" in err["message"]
    err = _err(client.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"}),
               400, "messages")
    err = _err(client.post("/v1/completions", content=b'{"prompt": "x",, "max_tokens": 2}',
                           headers={"content-type": "application/json"}), 400, None)
    assert "not valid JSON at character" in err["message"]
    assert not orch.started


def test_choices_no_kv_pool_could_hold_are_400_up_front(tiny_model):
    """Found by a new user: n=16 choices of 3,000 tokens each were accepted and failed with 503
    OutOfPages after seconds of work (a decoder does not preempt). Here instances hold 64 pages of
    16 tokens: 16 choices of 1 + 100 tokens need 16 x 7 = 112 pages; 8 need 56 and are served."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.config import ClusterConfig
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=16))
    cfg = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"num_pages": 64, "max_model_len": 512, "max_input_len": 400}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    with TestClient(app) as client:
        err = _err(client.post("/v1/completions", json={"prompt": [5], "n": 16, "max_tokens": 100}), 400, "n")
        assert err["message"] == ("n (16) choices of prompt (1 tokens) + max_tokens (100) need 112 KV pages of 16 "
                                  "tokens at once on the main_decode tier, more than an instance's pool (64 pages): "
                                  "lower n or max_tokens")
        assert not orch.started
        r = client.post("/v1/completions", json={"prompt": [5], "n": 8, "max_tokens": 100})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8


@pytest.mark.parametrize("stream", [False, True])
def test_no_max_tokens_on_a_small_pool_gets_the_pool_not_a_failure_part_way(tiny_model, stream):
    """Found by a new user: ``engine: {num_pages: 32}`` (512 tokens of pool) kept the default
    context window (4,096), so a request with no max_tokens was admitted for the rest of it and
    failed part-way with OutOfPages (a stream: 200, some tokens, then an error event). The window
    is now the pool's tokens: here 8 pages of 16 tokens, a chat prompt of 8 gets 120 tokens."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=8, page_size=16))
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"num_pages": 8, "page_size": 16}})
    assert (cfg.engine.max_model_len, cfg.engine.max_input_len) == (128, 128)
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body)  # no max_tokens: the rest of the context
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert not [e for e in events if "error" in e], r.text
            assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
            usage = events[-1]["usage"]
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (8, 120)  # the chat template's 8


@pytest.mark.parametrize("mode,pages,n_prompt,n,max_tokens,message", [
    ("colocated", 64, 1, 16, 100, "n (16) choices of prompt (1 tokens) + max_tokens (100) need 112 KV pages of 16 "
     "tokens at once on the colocated tier, more than an instance's pool (64 pages): lower n or max_tokens"),
    # RLD holds a copy of the prompt + first token per choice: max_tokens does not count there
    ("pdd", 64, 300, 4, 50, "n (4) choices of prompt (300 tokens) + its first output token need 76 KV pages of 16 "
     "tokens at once on the relay_decode tier, more than an instance's pool (64 pages): lower n"),
    ("colocated", 32, 399, 16, 1, "n (16) choices of prompt (399 tokens) + max_tokens (1) need 40 KV pages of 16 "
     "tokens at once on the colocated tier, more than an instance's pool (32 pages): lower n"),
    # 40 pages with one output token a choice: no max_tokens fits 32, so only n is advised
    ("colocated", 32, 399, 16, 5, "n (16) choices of prompt (399 tokens) + max_tokens (5) need 56 KV pages of 16 "
     "tokens at once on the colocated tier, more than an instance's pool (32 pages): lower n"),
    ("colocated", 64, 399, 16, 40, "n (16) choices of prompt (399 tokens) + max_tokens (40) need 88 KV pages of 16 "
     "tokens at once on the colocated tier, more than an instance's pool (64 pages): lower n or max_tokens"),
])
def test_the_kv_refusal_of_one_prompt_names_the_tier_and_only_what_helps(tiny_model, mode, pages, n_prompt, n,
                                                                        max_tokens, message):
    """Found by a new user: the refusal named no tier and said "lower n or max_tokens" with
    max_tokens 1, or on RLD, where the output does not count. Pages of 16 tokens."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=16))
    cfg = ClusterConfig.model_validate({"mode": mode, "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"num_pages": pages, "max_model_len": 512, "max_input_len": 400}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    body = {"prompt": list(range(10, 10 + n_prompt)), "n": n, "max_tokens": max_tokens}
    with TestClient(app) as client:
        assert _err(client.post("/v1/completions", json=body), 400, "n")["message"] == message
        assert not orch.started


@pytest.mark.parametrize("tiers,pool", [
    ({"rld0": {"engine": {"num_pages": 32}}, "rld1": {"engine": {"num_pages": 32}}}, "an instance's pool (32 pages)"),
    ({"rld0": {"engine": {"num_pages": 32}}},
     "instance rld0's pool (32 pages; any active relay_decode instance may serve it)"),
])
def test_choices_are_held_to_the_smallest_instance_pool_not_the_tier_blocks(tiny_model, tiers, pool):
    """Found in review: the check held a prompt's n choices to the tier block's pool (64 pages)
    though each RLD's own block (tiers.rld0) held 32: prompt 300 + n 3 (57 pages on RLD, 64
    together) was admitted, two of its choices landed on one RLD (3 choices, 2 RLDs) and it
    failed with a 429 "OutOfPages: need 19, 13 free" that no retry could cure (reproduced on
    pdd serve). Routing may pick any active RLD, so the smallest pool counts."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=16))
    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "instances": {"prefill": 1, "relay_decode": 2, "main_decode": 1},
                                        "engine": {"num_pages": 64, "page_size": 16}, "tiers": tiers})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    with TestClient(app) as client:
        body = {"prompt": list(range(10, 310)), "n": 3, "max_tokens": 20}
        assert _err(client.post("/v1/completions", json=body), 400, "n")["message"] == (
            "n (3) choices of prompt (300 tokens) + its first output token need 57 KV pages of 16 tokens at once on "
            f"the relay_decode tier, more than {pool}: lower n")
        assert not orch.started
        r = client.post("/v1/completions", json={"prompt": list(range(10, 210)), "n": 2, "max_tokens": 20})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2  # 2 x 13 pages fit 32


def test_the_kv_refusal_without_max_tokens_counts_the_first_token(tiny_model):
    """Found by a new user: chat with n 4 and no max_tokens was told "+ max_tokens (29) need 18
    pages" (29: the rest of the window, never sent; the pages counted one output token). Chat:
    completions' max_tokens defaults to 16, which counts."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=16))
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"num_pages": 32, "max_model_len": 512, "max_input_len": 400}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    import re

    with TestClient(app) as client:
        body = {"messages": [{"role": "user", "content": "hello world " * 60}], "n": 16}
        got = _err(client.post("/v1/chat/completions", json=body), 400, "n")["message"]
        m = re.fullmatch(r"n \(16\) choices of prompt \((\d+) tokens\) \+ its first output token need (\d+) KV pages of "
                         r"16 tokens at once on the colocated tier, more than an instance's pool \(32 pages\): lower n",
                         got)
        assert m, got
        n_prompt = int(m[1])  # the pages count one output token a choice, the prompt's whole pages shared
        assert int(m[2]) == 16 * -(-(n_prompt + 1) // 16) - 15 * (n_prompt // 16) > 32
        # completions' max_tokens defaults to 16, which the pages count: said so (a user's re-check)
        got = _err(client.post("/v1/completions", json={"prompt": list(range(10, 409)), "n": 16}), 400, "n")
        assert got["message"] == ("n (16) choices of prompt (399 tokens) + max_tokens (16, its default when not sent) "
                                  "need 56 KV pages of 16 tokens at once on the colocated tier, more than an "
                                  "instance's pool (32 pages): lower n")
        assert not orch.started


def test_a_requests_own_chat_template_is_refused(api):
    """As vLLM without --trust-request-chat-template (a new user saw it silently ignored)."""
    client, orch = api
    for tpl in ("{{ 1/0 }}", "{% for %}", "{{ messages }}"):
        _err(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "chat_template": tpl, "max_tokens": 2}), 400, "chat_template")
    assert not orch.started


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"temperature": float("nan")}, "temperature"),
    ("/v1/chat/completions", {"top_p": float("inf")}, "top_p"),
    ("/v1/completions", {"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ("/v1/completions", {"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt_logprobs": 2}, "prompt_logprobs"),  # was 200 with none (ignored)
    ("/v1/chat/completions", {"prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": 401}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_non_finite_floats_and_unsupported_options_are_400_naming_them(api, path, extra, param):
    """NaN / infinity (JSON's non-standard literals, which Python's parser accepts) get "finite
    number", not a misleading range message; options the server cannot honour are refused, not
    silently ignored."""
    import json

    client, orch = api
    body = dict(OK) if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = json.dumps({**body, **extra})  # allow_nan: NaN / Infinity literals
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = _err(r, 400)
    assert param in (err["param"] or "") + err["message"], err
    if "nan" in raw.lower() or "infinity" in raw.lower():
        assert "finite" in err["message"], err
    assert not orch.started
    _still_serving(client)


REFUSED_VLLM = [
    # guided_json, structured_outputs, ... are served (test_structured_outputs.py); other backends are not
    ("guided_decoding_backend", "xgrammar"),
    ("guided_decoding_backend", "outlines"), ("guided_decoding_backend", "guidance:disable-any-whitespace"),
    ("use_beam_search", True), ("length_penalty", 0.5), ("length_penalty", True),
    ("logits_processors", ["my.module:Proc"]), ("return_tokens_as_token_ids", True),
    ("spaces_between_special_tokens", False), ("priority", 1), ("priority", False), ("cache_salt", "tenant-a"),
    # OpenAI's audio output (found by a new user: a 200 with text only)
    ("modalities", ["text", "audio"]), ("modalities", "audio"), ("audio", {"voice": "alloy", "format": "wav"}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name,value", REFUSED_VLLM)
def test_vllm_parameters_pdd_cannot_honour_are_400_naming_them(api, path, name, value):
    """A new user's guided_json, bad_words, use_beam_search, ... were silently ignored (200 with
    output that did not do what was asked); each is refused with a value that asks for something."""
    client, _ = api
    _unhonoured_refused(api, path, name, value)
    _still_serving(client)


def _unhonoured_refused(api, path: str, name: str, value) -> dict:
    """Post ``name: value`` on ``path``; assert the 400 naming ``name`` (check_unhonoured's words)
    and that nothing started. Returns the valid body the parameter was added to."""
    client, orch = api
    body = dict(OK) if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    err = _err(client.post(path, json={**body, name: value}), 400, name)
    assert err["message"].startswith(f"{name} is not supported: pdd does not support "), err
    assert err["message"].endswith(f"; leave {name} out"), err
    assert not orch.started
    return body


REFUSED_SGLANG = [
    ("stop_regex", "\\d"),
    ("stop_regex", ["a+"]), ("custom_logit_processor", "{}"), ("lora_path", "adapter-a"),
    ("return_hidden_states", True), ("return_hidden_states", "last"),
]


@pytest.mark.parametrize("path,name,value", [(p, n, v) for p in ("/v1/completions", "/v1/chat/completions")
                                             for n, v in REFUSED_SGLANG]
                         + [("/v1/chat/completions", "input_ids", [5, 6, 7])])
def test_sglang_parameters_pdd_cannot_honour_are_400_naming_them(api, path, name, value):
    """Found by a compatibility pass: SGLang's stop_regex, LoRA adapters, ... were silently ignored (200 with output that did not do what
    was asked, or chat's input_ids: another prompt than the one sent)."""
    client, _ = api
    body = _unhonoured_refused(api, path, name, value)
    r = client.post(path, json={**body, name: None, **({name: False} if name == "return_hidden_states" else {})})
    assert r.status_code == 200, r.text  # its default (what SGLang's client may send) is served


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sglang_no_stop_trim_keeps_the_stop_string_as_include_stop_str_in_output(api, path):
    client, _ = api
    body = (dict(OK) if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(max_tokens=12, temperature=0, ignore_eos=True)
    text = (lambda j: j["choices"][0]["text"] if "text" in j["choices"][0] else j["choices"][0]["message"]["content"])
    full = text(client.post(path, json=body).json())
    stop = full[3:5]
    want = full[:full.index(stop) + 2]
    assert text(client.post(path, json={**body, "stop": stop, "no_stop_trim": True}).json()) == want
    assert text(client.post(path, json={**body, "stop": stop, "include_stop_str_in_output": True}).json()) == want
    assert text(client.post(path, json={**body, "stop": stop, "no_stop_trim": None}).json()) == want[:-2]

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_parameters_at_their_defaults_and_unknown_fields_are_accepted(api, path):
    """What vLLM's and the openai client may send for a parameter not asked for is served, and a
    field unknown to pdd and vLLM stays ignored (as vLLM)."""
    client, orch = api
    body = dict(OK) if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    defaults = {name: None for name, _ in REFUSED_VLLM}
    defaults.update({"guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
                     "guided_whitespace_pattern": None, "structured_outputs": None,
                     "response_format": {"type": "text"}})
    defaults.update({"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "logits_processors": [],
                     "return_tokens_as_token_ids": False, "return_token_ids": False,
                     "spaces_between_special_tokens": True, "priority": 0, "modalities": ["text"],
                     "no_such_field": {"x": 1}})
    r = client.post(path, json={**body, **defaults})
    assert r.status_code == 200, r.text
    r = client.post(path, json={**body, "length_penalty": 1, "logits_processors": None, "guided_json": None})
    assert r.status_code == 200, r.text
    assert len(orch.started) == 2


def test_truncate_prompt_tokens_keeps_the_last_k_tokens(api):
    """vLLM's left truncation: the prompt's last k tokens are served (usage counts them); -1 keeps
    the last max_input_len (400 here), so an over-long prompt is served instead of refused."""
    client, _ = api
    r = client.post("/v1/completions", json={**OK, "prompt": list(range(10, 60)), "truncate_prompt_tokens": 7})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 7
    r = client.post("/v1/completions", json={**OK, "prompt": list(range(10, 460)), "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 400
    ref = client.post("/v1/completions", json={**OK, "prompt": list(range(53, 60)), "temperature": 0})
    cut = client.post("/v1/completions", json={**OK, "prompt": list(range(10, 60)), "truncate_prompt_tokens": 7,
                                               "temperature": 0})
    assert cut.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_a_text_too_long_to_fit_is_truncated_with_truncate_prompt_tokens_up_to_its_own_limit(api):
    """Found by a new user: a text of more than max_input_len x 64 characters (25,600 here) was
    refused "cannot fit the maximum input length" before tokenizing, although
    truncate_prompt_tokens keeps a prompt's last tokens instead of refusing it. With it set, a
    text is tokenized up to MAX_TRUNCATED_PROMPT_CHARS (1,048,576) and cut; past that, a 400
    naming the limit."""
    from pdd.gateway.api import MAX_TRUNCATED_PROMPT_CHARS

    client, orch = api
    long = "hello world " * 10_000  # 120,000 characters
    assert _err(client.post("/v1/completions", json={**OK, "prompt": long}), 400, "prompt",
                "context_length_exceeded")["message"] == (
        "prompt: 120000 characters cannot fit the maximum input length of 400 tokens")
    r = client.post("/v1/completions", json={**OK, "prompt": long, "truncate_prompt_tokens": 100})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100
    r = client.post("/v1/completions", json={**OK, "prompt": ["a", long], "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2 + 400, r.text  # "a" and its BOS
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}], "max_tokens": 2,
                                                  "truncate_prompt_tokens": 50})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text
    too_long = "a" * (MAX_TRUNCATED_PROMPT_CHARS + 1)
    assert _err(client.post("/v1/completions", json={**OK, "prompt": too_long, "truncate_prompt_tokens": 100}),
                400, "prompt", "context_length_exceeded")["message"] == (
        "prompt: 1048577 characters is more than a prompt with truncate_prompt_tokens may have (1048576 characters)")
    n = len(orch.started)
    assert _err(client.post("/v1/completions", json={**OK, "prompt": too_long, "truncate_prompt_tokens": 0}),
                400, "truncate_prompt_tokens")["message"].startswith("truncate_prompt_tokens: 0 would leave no prompt")
    assert len(orch.started) == n


@pytest.mark.parametrize("prompt", [[True, False], [5, True], [[5, 6], [7, False]], [5.0, 6.0]])
def test_token_id_prompts_must_be_json_integers(api, prompt):
    """Booleans (and floats) are not token ids: lax parsing served [true, false] as ids 1 and 0."""
    client, orch = api
    err = _err(client.post("/v1/completions", json={**OK, "prompt": prompt}), 400)
    assert "prompt" in (err["param"] or "") + err["message"], err
    assert "token ids must be integers" in err["message"], err
    assert not orch.started
    _still_serving(client)


@pytest.mark.parametrize("prompt,message", [
    (["a", 5], "prompt[1]: a batch of texts must hold strings only (prompt[0] is a string), got 5"),
    (["a", None], "prompt[1]: a batch of texts must hold strings only (prompt[0] is a string), got None"),
    ([5, "a"], "prompt[1]: token ids must be integers, got 'a'"),
    ([[1, 2], ["x"]], "prompt[1][0]: token ids must be integers, got 'x'"),
    ([[1, 2], 3], "prompt[1]: a batch of token-id lists must hold lists only (prompt[0] is a list), got 3"),
    ([[1, 2], []], "prompt[1]: must not be empty"),
    ([[1, 2], [3, 10 ** 6]], "prompt[1]: token id 1000000 is outside the vocabulary [0, 1024)"),
])
def test_a_malformed_prompt_item_is_named_by_its_index(api, prompt, message):
    """A list prompt that breaks its kind (texts, token ids, token-id lists) at one item names
    that item, as a batch's empty text did (``prompt[1]: must not be empty``): param ``prompt``."""
    client, orch = api
    err = _err(client.post("/v1/completions", json={**OK, "prompt": prompt}), 400, "prompt")
    assert err["message"] == message
    assert not orch.started
    _still_serving(client)


@pytest.mark.parametrize("messages,param,message", [
    ([{"role": "user", "content": "hi"}, 5], "messages[1]",
     "messages[1]: must be an object with a role and content, got int"),
    (["x"], "messages[0]", "messages[0]: must be an object with a role and content, got str"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 5}], "messages[1].content",
     "messages[1].content: must be a string or a list of content parts, got int 5"),
])
def test_a_malformed_chat_message_is_named_by_its_index(api, messages, param, message):
    client, orch = api
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert _err(r, 400, param)["message"] == message
    assert not orch.started


def test_stop_token_ids_must_be_json_integers(api):
    client, orch = api
    err = _err(client.post("/v1/completions", json={**OK, "stop_token_ids": [True]}), 400)
    assert "stop_token_ids" in (err["param"] or "") + err["message"], err
    assert not orch.started


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"n": None, "stream": None, "echo": None, "ignore_eos": None, "min_tokens": None,
                         "skip_special_tokens": None, "include_stop_str_in_output": None}),
    ("/v1/chat/completions", {"n": None, "stream": None, "logprobs": None, "echo": None,
                              "add_generation_prompt": None, "continue_final_message": None,
                              "add_special_tokens": None}),
])
def test_explicit_null_means_the_default(api, path, extra):
    """Found by a new user: the official client sends ``null`` for a parameter passed as None
    (``n=None``), and those were 400 "Input should be a valid integer". As vLLM: the default."""
    client, _ = api
    body = ({"prompt": [5, 6, 7], "max_tokens": 2} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 200, r.text
    j = r.json()
    assert len(j["choices"]) == 1 and j["usage"]["completion_tokens"] <= 2


def test_choices_without_an_output_length_are_not_refused_for_the_whole_context(tiny_model):
    """Found by a new user: chat with ``n: 9`` and no ``max_tokens`` was refused because the pool
    check assumed every choice runs to the end of the context. vLLM admits it; so does the check
    now (one output token per choice counted), while an explicit ``max_tokens`` is still checked."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.config import ModelConfig
    from pdd.engine.engine import Engine
    from pdd.config import ClusterConfig
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    eos = ModelConfig.from_pretrained(tiny_model).eos_token_ids[0]
    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=16))
    cfg = ClusterConfig.model_validate({"model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"num_pages": 64, "max_model_len": 512, "max_input_len": 400}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    with TestClient(app) as client:
        stop_at_once = {"logit_bias": {str(eos): 100}}  # every choice ends with its first token
        r = client.post("/v1/completions", json={"prompt": [5], "n": 16, "max_tokens": None, **stop_at_once})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 16
        err = _err(client.post("/v1/completions", json={"prompt": [5], "n": 16, "max_tokens": 100}), 400, "n")
        assert "112 KV pages" in err["message"]


@pytest.mark.parametrize("mode,refused", [("pdd", True), ("cross_dc_pd", False)])
def test_n_choices_past_rlds_pool_are_400_naming_n_in_pdd_mode(tiny_model, mode, refused):
    """RLD keeps its own copy of the prompt per choice (no prefix cache): a new user's n=16 on a
    3,000-token prompt (16 x 188 pages > RLD's 2,048) got 429 'server overloaded: ... OutOfPages'
    on an idle server, a refusal no retry could cure. pdd mode now counts RLD's copies up front:
    400 naming n. Modes without RLD keep the shared-prefix bound (the request is served)."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.config import ClusterConfig
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    eng = Engine.from_pretrained(tiny_model, num_pages=256, page_size=8)
    orch = EngineOrch(eng)
    cfg = ClusterConfig.model_validate({"mode": mode, "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400, "num_pages": 100,
                                                   "page_size": 16}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    body = {"prompt": list(range(10, 310)), "n": 8, "max_tokens": 2, "temperature": 0}  # 8 x 19 pages > 100
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        if refused:
            _err(r, 400, "n")
            assert "lower n" in r.json()["error"]["message"] and not orch.started
        else:
            assert r.status_code == 200 and len(r.json()["choices"]) == 8
        assert client.post("/v1/completions", json={**body, "n": 4}).status_code == 200  # 4 x 19 fits


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_past_the_pool_together_is_400_and_one_that_fits_is_served(tiny_model, stream):
    """A new user's batch of prompts that each fit the KV pool alone but not together got 429
    'OutOfPages' on an idle server on every try. Here the colocated instance holds 63 pages of 16
    tokens: 9 prompts of 100 tokens + max_tokens 12 need 9 x 7 = 63 and are served; max_tokens 13
    needs 9 x 8 = 72: a 400 up front naming the pages and the pool. 3 prompts x n 15 need
    3 x (15 x 7 - 14 x 6) = 63 (the prompt's 6 whole pages shared); n 16 needs 66."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=512, page_size=16))
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"num_pages": 63, "page_size": 16, "max_model_len": 512,
                                                   "max_input_len": 400}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    prompts = [list(range(10 + i, 110 + i)) for i in range(9)]
    body = {"prompt": prompts, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": stream}
    pool = "more than its active instances' pools hold together (63: c0 (engine.num_pages 63 of 16 tokens))"
    with TestClient(app) as client:
        err = _err(client.post("/v1/completions", json={**body, "max_tokens": 13}), 400, "prompt")
        assert err["message"] == (
            "9 prompts x n (1): 9 choices need 72 KV pages of 16 tokens at once on the colocated tier (each "
            f"choice's prompt + max_tokens, the prompt's whole pages shared, page-rounded), {pool}; send fewer "
            "prompts or lower max_tokens")  # n is 1: lowering it cannot help
        # max_tokens null: each choice counted with its first output token, which the message says
        err = _err(client.post("/v1/completions", json={**body, "prompt": prompts + [prompts[0]], "max_tokens": None}),
                   400, "prompt")
        assert err["message"] == (
            "10 prompts x n (1): 10 choices need 70 KV pages of 16 tokens at once on the colocated tier (each "
            f"choice's prompt + its first output token, the prompt's whole pages shared, page-rounded), {pool}; "
            "send fewer prompts")
        err = _err(client.post("/v1/completions", json={**body, "prompt": prompts[:3], "n": 16}), 400, "n")
        assert err["message"].startswith("3 prompts x n (16): 48 choices need 66 KV pages of 16 tokens")
        assert not orch.started
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(orch.started) == 9
        r = client.post("/v1/completions", json={**body, "prompt": prompts[:3], "n": 15})
        assert r.status_code == 200, r.text
        assert len(orch.started) == 9 + 45


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": 5}, "prompt", "prompt: must be a text, a list of token ids, a list of texts or a list of "
                              "token-id lists, got int 5"),
    ({"prompt": None}, "prompt", "prompt: must be a text, a list of token ids, a list of texts or a list of "
                                 "token-id lists, got NoneType None"),
    ({"prompt": "ab\ud800c"}, "prompt", "prompt: not valid Unicode text (a lone surrogate at character 2)"),
    # in a batch: param is the text's own path, as the message (and chat's messages[i].content) says
    ({"prompt": ["ok", "a\ud800"]}, "prompt[1]", "prompt[1]: not valid Unicode text (a lone surrogate at character 1)"),
    ({"prompt": "hi", "stop": ["ok", "\udc00"]}, "stop",
     "stop string 1 is not valid Unicode text (a lone surrogate at character 0)"),
])
def test_a_prompt_or_stop_that_is_no_text_says_so(api, body, param, message):
    """A prompt of another type named the union's first branch ('prompt.str: Input should be a
    valid string'); a lone surrogate (JSON can escape one, UTF-8 cannot hold it) in a prompt
    showed the tokenizer's internals ('TextInputSequence must be str') and one in a stop string
    was accepted. Each is a 400 saying what is wrong, where."""
    client, orch = api
    r = client.post("/v1/completions", content=json.dumps({**OK, **body}), headers={"content-type": "application/json"})
    err = _err(r, 400, param)
    assert err["message"].endswith(message), err
    assert not orch.started


def test_a_stop_of_another_type_and_a_lone_surrogate_in_a_message_say_where(api):
    """``"stop": 5`` said 'stop.str: Input should be a valid string'; a lone surrogate in a chat
    message was reported at its position in the rendered prompt ('messages: ... character 10')."""
    client, orch = api
    r = client.post("/v1/completions", json={**OK, "stop": 5})
    assert _err(r, 400, "stop")["message"].endswith("must be a string or a list of strings, got int 5")
    r = client.post("/v1/completions", json={**OK, "stop": ["a", None]})
    assert _err(r, 400, "stop")["message"] == "stop[1]: must be a string, got NoneType None"
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "a\ud800"}],
                       "max_tokens": 2})
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert _err(r, 400, "messages[1].content")["message"] == \
        "messages[1].content: not valid Unicode text (a lone surrogate at character 1)"
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], "max_tokens": 2})
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert _err(r, 400, "messages[0].content[0].text")["message"] == \
        "messages[0].content[0].text: not valid Unicode text (a lone surrogate at character 0)"
    assert not orch.started


_HI = {"role": "user", "content": "hi"}
_CALLED = {"role": "assistant", "tool_calls": [TOOL_CALL]}
_NONE = {"tool_choice": "none"}


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize("path,body,param,at", [
    # a message's other strings: each was served (200); the template renders them
    ("/v1/chat/completions", {"messages": [_HI, {"role": "user", "content": "x", "name": "a\ud800"}]},
     "messages[1].name", 1),
    ("/v1/chat/completions", {"messages": [_HI], "user": "\ud800"}, "user", 0),
    ("/v1/chat/completions", {"messages": [_HI, _HI, {"role": "assistant", "tool_calls": [{**TOOL_CALL, "id": "c\ud800"}]}]},
     "messages[2].tool_calls[0].id", 1),
    ("/v1/chat/completions", {"messages": [_HI, _HI, _CALLED, {"role": "tool", "tool_call_id": "ca\udfff", "content": "x"}]},
     "messages[3].tool_call_id", 2),
    ("/v1/chat/completions", {"messages": [_HI, {"role": "assistant", "tool_calls": [
        {**TOOL_CALL, "function": {"name": "g", "arguments": "{\"a\": \"\ud800\"}"}}]}]},
     "messages[1].tool_calls[0].function.arguments", 7),
    ("/v1/chat/completions", {"messages": [_HI, {"role": "assistant", "content": "x", "reasoning_content": "\ud800"}]},
     "messages[1].reasoning_content", 0),
    ("/v1/chat/completions", {"messages": [_HI], "chat_template_kwargs": {"x": ["ok", "\ud800"]}},
     "chat_template_kwargs.x[1]", 0),
    ("/v1/chat/completions", {"messages": [_HI], "documents": [{"text": "\ud800"}]}, "documents[0].text", 0),
    ("/v1/chat/completions", {"messages": [_HI], "tools": [_tool(description="d\ud800")], **_NONE},
     "tools[0].function.description", 1),
    ("/v1/chat/completions", {"messages": [_HI], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n\ud800", "schema": {}}}}, "response_format.json_schema.name", 1),
    ("/v1/completions", {"prompt": "hi", "user": "u\ud800"}, "user", 1),
    # /tokenize renders messages (with tools and chat_template_kwargs) as chat does
    ("/tokenize", {"messages": [_HI], "chat_template_kwargs": {"k": "\ud800"}}, "chat_template_kwargs.k", 0),
    ("/tokenize", {"messages": [_HI, {"role": "user", "content": "x", "name": "\ud800"}]}, "messages[1].name", 0),
])
def test_a_lone_surrogate_in_any_field_is_a_400_naming_its_path(api, path, body, param, at):
    """A lone surrogate (JSON's \\ud800: no UTF-8 text) in these fields was served, 200, or
    (rendered by a template that shows it) refused at its position in the prompt, naming
    ``messages``; each is the 400 the other text fields get, ``param`` its exact path."""
    client, orch = api
    r = client.post(path, content=json.dumps({"max_tokens": 2, **body}), headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": f"{param}: not valid Unicode text (a lone surrogate at character {at})",
        "type": "invalid_request_error", "param": param, "code": None}})
    assert not orch.started


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": [_HI]}), ("/v1/completions", OK)])
def test_a_lone_surrogate_in_model_is_a_400_not_a_404_echoing_it(api, path, body):
    client, orch = api
    r = client.post(path, content=json.dumps({**body, "model": "pdd\udc00"}), headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]) == (400, {
        "message": "model: not valid Unicode text (a lone surrogate at character 3)",
        "type": "invalid_request_error", "param": "model", "code": None})
    assert not orch.started


@pytest.mark.parametrize("body,param,message", [
    # raw in the request: the field's path (it was Python's codec's words or llguidance's
    # "unexpected end of hex escape", param the field)
    ({"guided_regex": "a\ud800"}, "guided_regex", "guided_regex: not valid Unicode text (a lone surrogate at character 1)"),
    ({"guided_grammar": 'start: "\ud800"'}, "guided_grammar",
     "guided_grammar: not valid Unicode text (a lone surrogate at character 8)"),
    ({"regex": "\ud800"}, "regex", "regex: not valid Unicode text (a lone surrogate at character 0)"),
    ({"ebnf": 'root ::= "\ud800"'}, "ebnf", "ebnf: not valid Unicode text (a lone surrogate at character 10)"),
    ({"guided_json": {"enum": ["\ud800"]}}, "guided_json.enum[0]",
     "guided_json.enum[0]: not valid Unicode text (a lone surrogate at character 0)"),
    ({"guided_choice": ["a", "b\ud800"]}, "guided_choice[1]",
     "guided_choice[1]: not valid Unicode text (a lone surrogate at character 1)"),
    ({"structured_outputs": {"regex": "\ud800"}}, "structured_outputs.regex",
     "structured_outputs.regex: not valid Unicode text (a lone surrogate at character 0)"),
    ({"guided_json": {}, "guided_whitespace_pattern": " \ud800"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern: not valid Unicode text (a lone surrogate at character 1)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"k\ud800": {}}}}}}, "response_format.json_schema.schema.properties",
     "response_format.json_schema.schema.properties key 'k\\ud800': not valid Unicode text (a lone surrogate at "
     "character 1)"),
    # escaped in a schema's JSON text: the compiler's check names the schema's path
    ({"json_schema": '{"enum": ["ok", "a\\ud800"]}'}, "json_schema",
     "json_schema: the schema's enum[1] is not valid Unicode text (a lone surrogate at character 1)"),
    ({"guided_json": '{"properties": {"\\udfff": {}}}'}, "guided_json",
     "guided_json: the schema's properties key '\\udfff' is not valid Unicode text (a lone surrogate at character 0)"),
    ({"structured_outputs": {"json": '{"enum": ["\\ud800"]}'}}, "structured_outputs",
     "structured_outputs.json: the schema's enum[0] is not valid Unicode text (a lone surrogate at character 0)"),
])
def test_a_lone_surrogate_in_a_constraint_is_a_400_in_the_same_words(api, body, param, message):
    client, orch = api
    r = client.post("/v1/completions", content=json.dumps({**OK, **body}), headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]) == (400, {"message": message, "type": "invalid_request_error",
                                                        "param": param, "code": None})
    assert not orch.started


@pytest.mark.parametrize("tool_choice", ["none", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_lone_surrogate_in_a_tool_s_parameters_is_a_400_naming_its_path(api, tool_choice):
    """A forced call compiled it: "the tools' parameters: unexpected end of hex escape", param
    ``tools``; with tool_choice none it was served."""
    client, orch = api
    body = {"messages": [_HI], "max_tokens": 2, "tool_choice": tool_choice,
            "tools": [_tool(parameters={"type": "object", "properties": {"a": {"description": "x\ud800"}}})]}
    r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    param = "tools[0].function.parameters.properties.a.description"
    assert (r.status_code, r.json()["error"]) == (400, {
        "message": f"{param}: not valid Unicode text (a lone surrogate at character 1)",
        "type": "invalid_request_error", "param": param, "code": None})
    assert not orch.started


@pytest.mark.parametrize("body,offset", [(b'{"prompt": "\xff\xfe", "max_tokens": 2}', 12), (b"\xff\xfe\x00", 0)])
def test_a_body_that_is_not_utf8_is_400_naming_the_byte(api, body, offset):
    """Found by a new user: such a body got FastAPI's bare "There was an error parsing the body"."""
    client, orch = api
    err = _err(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400, None)
    assert err["message"] == (f"request body is not valid JSON: it is not UTF-8 text (byte 0x{body[offset]:02x} "
                              f"at offset {offset}); send JSON encoded as UTF-8")
    assert not orch.started


def test_a_chat_over_the_input_limit_names_messages(api):
    """Found by a new user: a chat prompt over the limit said ``prompt: ...`` while its param was
    ``messages`` (a chat request has no ``prompt``)."""
    client, orch = api
    err = _err(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 5000}],
                                                          "max_tokens": 2}), 400, "messages")
    assert err["message"].startswith("messages (as a prompt): ") and "longer than the maximum input length" in \
        err["message"], err
    assert not orch.started


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature", "temperature: must be a number, got true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_p": False}, "min_p",
     "min_p: must be a number, got false"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens: must be an integer, got true"),
])
def test_a_boolean_for_a_number_parameter_is_named(api, path, body, param, message):
    client, orch = api
    assert _err(client.post(path, json=body), 400, param)["message"] == message
    assert not orch.started


@pytest.mark.parametrize("raw,kind", [(b"null", "null"), (b"[]", "an array"), (b'"x"', "a string"), (b"5", "a number"),
                                      (b"true", "a boolean")])
def test_a_body_that_is_not_an_object_says_so(api, raw, kind):
    """It said 'Input should be a valid dictionary or object to extract fields from'."""
    client, orch = api
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert _err(r, 400, None)["message"] == f"request body must be a JSON object, got {kind}"
    assert not orch.started


CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {**OK, "n": "2"}, "n", "n: must be an integer, got a string '2'"),
    ("/v1/completions", {**OK, "max_tokens": "5"}, "max_tokens", "max_tokens: must be an integer, got a string '5'"),
    ("/v1/completions", {**OK, "seed": "7"}, "seed", "seed: must be an integer, got a string '7'"),
    ("/v1/completions", {**OK, "logprobs": "1"}, "logprobs", "logprobs: must be an integer, got a string '1'"),
    ("/v1/completions", {**OK, "stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    ("/v1/completions", {**OK, "stream": "true"}, "stream", "stream: Input should be a valid boolean"),
    ("/v1/completions", {**OK, "stream": 1}, "stream", "stream: Input should be a valid boolean"),
    ("/v1/completions", {**OK, "echo": "false"}, "echo", "echo: Input should be a valid boolean"),
    ("/v1/completions", {**OK, "ignore_eos": 0}, "ignore_eos", "ignore_eos: Input should be a valid boolean"),
    ("/v1/completions", {**OK, "temperature": "0.5"}, "temperature", "temperature: Input should be a valid number"),
    ("/v1/completions", {**OK, "top_p": "1"}, "top_p", "top_p: Input should be a valid number"),
    ("/v1/completions", {**OK, "logit_bias": {"5": "10"}}, "logit_bias", "logit_bias.5: Input should be a valid number"),
    ("/v1/completions", {**OK, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     "stream_options.include_usage: Input should be a valid boolean"),
    ("/v1/chat/completions", {**CHAT, "n": "2"}, "n", "n: must be an integer, got a string '2'"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, "max_tokens", "max_tokens: must be an integer, got a string '5'"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "5"}, "max_completion_tokens",
     "max_completion_tokens: must be an integer, got a string '5'"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs", "logprobs: Input should be a valid boolean"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": "2", "logprobs": True}, "top_logprobs",
     "top_logprobs: must be an integer, got a string '2'"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": "1"}, "presence_penalty",
     "presence_penalty: Input should be a valid number"),
    ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "parallel_tool_calls: Input should be a valid boolean"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens",
     "add_special_tokens: Input should be a valid boolean"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs",
     "return_token_strs: Input should be a valid boolean"),
])
def test_a_string_for_a_number_or_boolean_parameter_is_400_naming_it(api, path, body, param, message):
    """Found by a new user: pydantic's lax mode served ``"n": "2"``, ``"stream": "yes"`` and
    ``"max_tokens": "5"`` with 200 (as 2, true and 5), where OpenAI answers 400."""
    client, orch = api
    assert _err(client.post(path, json=body), 400, param)["message"] == message
    assert not orch.started


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**OK, "temperature": 1, "top_p": 1, "presence_penalty": 0, "logit_bias": {"5": 1}}),
    ("/v1/completions", {**OK, "max_tokens": 2.0, "n": 1.0}),  # a number without a fraction, as before (and vLLM)
    ("/v1/chat/completions", {**CHAT, "temperature": 0, "min_p": 0, "repetition_penalty": 1}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.0, "stream": False, "logprobs": False}),
])
def test_an_integer_for_a_number_parameter_is_still_served(api, path, body):
    client, _ = api
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,why", [
    (b"\xff\xfe", "byte 0xff at offset 0"),  # a UTF-16 (LE) byte-order mark alone
    (b"\xfe\xff", "byte 0xfe at offset 0"),  # UTF-16 BE's
    ('{"prompt": [5, 6, 7], "max_tokens": 2}'.encode("utf-16"), "byte 0xff at offset 0"),  # with its BOM
    ('{"prompt": [5, 6, 7], "max_tokens": 2}'.encode("utf-32"), "byte 0xff at offset 0"),
    ('{"prompt": [5, 6, 7], "max_tokens": 2}'.encode("utf-16-be"), "byte 0x00 at offset 0: it reads as UTF-16-BE"),
    ('{"prompt": [5, 6, 7], "max_tokens": 2}'.encode("utf-16-le"), "byte 0x00 at offset 1: it reads as UTF-16-LE"),
    ('{"prompt": [5, 6, 7], "max_tokens": 2}'.encode("utf-32-le"), "byte 0x00 at offset 1: it reads as UTF-32-LE"),
], ids=["utf16-bom-alone", "utf16be-bom-alone", "utf16-with-bom", "utf32-with-bom", "utf16be", "utf16le", "utf32le"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_with_a_utf16_or_utf32_bom_or_encoding_is_not_utf8(api, path, body, why):
    """Found by a new user: ``b"\\xff\\xfe"`` got "request body is not valid JSON at character 0:
    Expecting value" (``json.loads`` on the bytes read it as UTF-16, which made it empty) instead
    of the not-UTF-8 message other bytes get; ASCII JSON in UTF-16 without a BOM (valid UTF-8
    bytes) and JSON in UTF-16 or UTF-32 with one were read in that encoding and served."""
    client, orch = api
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert _err(r, 400, None)["message"] == (f"request body is not valid JSON: it is not UTF-8 text ({why}); "
                                             f"send JSON encoded as UTF-8")
    assert not orch.started
    _still_serving(client)


def test_a_utf8_bom_is_ignored_and_a_non_json_content_type_keeps_its_415(api):
    """RFC 8259 section 8.1: a sender MUST NOT add a byte-order mark, a parser MAY ignore one; the
    gateway ignores a UTF-8 one (as ``json.loads`` does). A body that is not UTF-8 sent as a form
    is not read as JSON at all: it keeps the 415 that says so."""
    client, orch = api
    r = client.post("/v1/completions", content=b"\xef\xbb\xbf" + json.dumps(OK).encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = client.post("/v1/completions", content=b"\xef\xbb\xbf\xef\xbb\xbf{}",  # a second one is text, not JSON
                    headers={"content-type": "application/json"})
    assert _err(r, 400, None)["message"].startswith("request body is not valid JSON at character 0: ")
    r = client.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/x-www-form-urlencoded"})
    assert _err(r, 415, None)["message"].startswith("Unsupported Media Type: ")
    r = client.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/vnd.x+json"})
    assert _err(r, 400, None)["message"].startswith("request body is not valid JSON: it is not UTF-8 text (byte 0xff")


USER = {"role": "user", "content": "What is the weather in Oslo?"}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}


@pytest.mark.parametrize("bad,param,message", [
    # tool: the call it answers and its result
    ({"role": "tool", "content": "21"}, "messages[2].tool_call_id",
     "messages[2].tool_call_id: required for role 'tool'"),
    ({"role": "tool", "content": "21", "tool_call_id": None}, "messages[2].tool_call_id",
     "messages[2].tool_call_id: required for role 'tool'"),
    ({"role": "tool", "content": "21", "tool_call_id": 7}, "messages[2].tool_call_id",
     "messages[2].tool_call_id: Input should be a valid string"),
    ({"role": "tool", "tool_call_id": "call_1"}, "messages[2].content", "messages[2].content: required for role 'tool'"),
    ({"role": "tool", "tool_call_id": "call_1", "content": {"temp": 21}}, "messages[2].content",
     "messages[2].content: must be a string or a list of content parts, got dict {'temp': 21}"),
    # assistant: content or tool_calls, each well formed
    ({"role": "assistant"}, "messages[2].content",
     "messages[2].content: required for role 'assistant' unless tool_calls is given"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages[2].tool_calls",
     "messages[2].tool_calls: List should have at least 1 item after validation, not 0"),
    ({"role": "assistant", "tool_calls": TOOL_CALL}, "messages[2].tool_calls",
     "messages[2].tool_calls: Input should be a valid list"),
    ({"role": "assistant", "tool_calls": [{k: v for k, v in TOOL_CALL.items() if k != "id"}]},
     "messages[2].tool_calls[0].id", "messages[2].tool_calls[0].id: required"),
    ({"role": "assistant", "tool_calls": [{**TOOL_CALL, "id": None}]}, "messages[2].tool_calls[0].id",
     "messages[2].tool_calls[0].id: Input should be a valid string"),
    ({"role": "assistant", "tool_calls": [{**TOOL_CALL, "type": "code"}]}, "messages[2].tool_calls[0].type",
     "messages[2].tool_calls[0].type: Input should be 'function'"),
    ({"role": "assistant", "tool_calls": [{**TOOL_CALL, "function": {"name": "get_weather"}}]},
     "messages[2].tool_calls[0].function.arguments", "messages[2].tool_calls[0].function.arguments: required"),
    ({"role": "assistant", "content": 3}, "messages[2].content",
     "messages[2].content: must be a string or a list of content parts, got int 3"),
    # system, developer, user: content of the right type
    ({"role": "system"}, "messages[2].content", "messages[2].content: required for role 'system'"),
    ({"role": "developer", "content": True}, "messages[2].content",
     "messages[2].content: must be a string or a list of content parts, got bool True"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[2].content[0].text",
     "messages[2].content[0].text: a text content part needs a string 'text'"),
    ({"role": "user", "content": [7]}, "messages[2].content[0]",
     "messages[2].content[0]: content part of type 'int' is not supported (text only)"),
    ({"role": "user", "content": "x", "name": 5}, "messages[2].name", "messages[2].name: Input should be a valid string"),
    # function (OpenAI's older tool result): its name
    ({"role": "function", "content": "21"}, "messages[2].name", "messages[2].name: required for role 'function'"),
    # the role itself
    ({"role": "robot", "content": "x"}, "messages[2].role",
     "messages[2].role: 'robot' is not one of assistant, developer, function, system, tool, user"),
    ({"content": "x"}, "messages[2].role", "messages[2].role: required"),
    ({"role": ["user"], "content": "x"}, "messages[2].role", "messages[2].role: must be a string, got list ['user']"),
    ("x", "messages[2]", "messages[2]: must be an object with a role and content, got str"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_messages_are_validated_as_openai_does_naming_the_field(api, path, bad, param, message):
    """Found by a new user: a tool message without tool_call_id got 200 (OpenAI: 400). Each
    message must have the shape its role requires; the 400 names the field (param
    ``messages[2].tool_call_id``), before any tier does work; /tokenize renders chat as the chat
    endpoint does and checks it the same way."""
    client, orch = api
    r = client.post(path, json={"messages": [USER, ASSISTANT_CALL, bad], "max_tokens": 2})
    assert _err(r, 400, param, None)["message"] == message
    assert not orch.started
    _still_serving(client)


@pytest.mark.parametrize("message", [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}], "name": "ann"},
    {"role": "assistant", "content": "It is sunny.", "tool_calls": None},
    {"role": "assistant", "content": None, "tool_calls": [{**TOOL_CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "function", "name": "get_weather", "content": "21"},
])
def test_chat_messages_of_each_role_are_served(api, message):
    client, orch = api
    msgs = [USER, ASSISTANT_CALL, message]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 and len(orch.started) == 1
    r = client.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200 and r.json()["count"] == len(orch.started[0][0])


DEEP = ("request body is nested too deeply: JSON arrays and objects may nest at most 512 levels deep")


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
@pytest.mark.parametrize("depth", [513, 1000, 100_000])
@pytest.mark.parametrize("kind", ["arrays", "objects"])
def test_a_body_nested_too_deeply_is_400_naming_the_limit(api, path, field, depth, kind):
    """Found by a new user: ``{"messages": [[[[...]]]]}`` 100,000 deep got "There was an error
    parsing the body" (Python's parser hit its recursion limit)."""
    client, orch = api
    inner = "[" * depth + "]" * depth if kind == "arrays" else '{"a":' * depth + "1" + "}" * depth
    r = client.post(path, content=f'{{"{field}": {inner}}}', headers={"content-type": "application/json"})
    assert _err(r, 400, None, None)["message"] == DEEP
    assert not orch.started
    _still_serving(client)


def test_nesting_up_to_the_limit_and_brackets_in_strings_are_not_refused_for_depth(api):
    """511 levels inside the body object (512 in all) reach the parameter checks; brackets inside
    strings are text, not nesting."""
    client, orch = api
    r = client.post("/v1/chat/completions", content='{"messages": ' + "[" * 511 + "]" * 511 + "}",
                    headers={"content-type": "application/json"})
    assert _err(r, 400, "messages[0]")["message"] == "messages[0]: must be an object with a role and content, got list"
    r = client.post("/v1/completions", json={**OK, "stop": ["[{" * 500, '\\"[' * 300]})  # 1600 brackets, as text
    assert r.status_code == 200, r.text


I64 = "[-9223372036854775808, 9223372036854775807]"


@pytest.mark.parametrize("path,field,value,message", [
    ("/v1/completions", "seed", "1e30", f"seed: must be an integer in {I64}, got 1e+30"),
    ("/v1/completions", "seed", "-1e30", f"seed: must be an integer in {I64}, got -1e+30"),
    ("/v1/completions", "seed", "9.3e18", f"seed: must be an integer in {I64}, got 9.3e+18"),
    ("/v1/completions", "max_tokens", "1e30", "max_tokens: must be an integer in [1, 9223372036854775807], got 1e+30"),
    ("/v1/completions", "n", "1e30", "n: must be an integer in [1, 16], got 1e+30"),
    ("/v1/completions", "top_k", "-1e30", "top_k: must be an integer in [-1, 9223372036854775807], got -1e+30"),
    ("/v1/completions", "min_tokens", "1e30", "min_tokens: must be an integer in [0, 9223372036854775807], got 1e+30"),
    ("/v1/completions", "logprobs", "1e30", "logprobs: must be an integer in [0, 20], got 1e+30"),
    ("/v1/completions", "best_of", "1e30", "best_of: must be an integer in [1, 9223372036854775807], got 1e+30"),
    ("/v1/completions", "truncate_prompt_tokens", "1e30",
     "truncate_prompt_tokens: must be an integer in [-1, 9223372036854775807], got 1e+30"),
    ("/tokenize", "truncate_prompt_tokens", "1e30",
     "truncate_prompt_tokens: must be an integer in [-1, 9223372036854775807], got 1e+30"),
    ("/v1/chat/completions", "max_completion_tokens", "1e30",
     "max_completion_tokens: must be an integer in [1, 9223372036854775807], got 1e+30"),
    ("/v1/chat/completions", "top_logprobs", "1e30", "top_logprobs: must be an integer in [0, 20], got 1e+30"),
    ("/v1/chat/completions", "seed", "1e30", f"seed: must be an integer in {I64}, got 1e+30"),
])
def test_an_integer_parameter_too_large_as_a_float_names_its_range(api, path, field, value, message):
    """Found by a new user: ``"seed": 1e30`` said "Unable to parse input string as an integer,
    exceeded maximum size" (the number is no string); every integer parameter said the same."""
    client, orch = api
    head = '"prompt": "x"' if path == "/v1/completions" else '"messages": [{"role": "user", "content": "x"}]'
    r = client.post(path, content=f'{{{head}, "{field}": {value}}}', headers={"content-type": "application/json"})
    assert _err(r, 400, field)["message"] == message
    assert not orch.started
    r = client.post("/v1/completions", json={**OK, "seed": 1e3})  # a float that is an integer: still served
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"prompt": "a", "max_tokens": %s}'),
    ("/v1/completions", '{"prompt": [5, 6, -%s], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "seed": %s}'),
    ("/tokenize", '{"prompt": "a", "x": [%s]}'),
])
def test_an_integer_past_the_digit_limit_is_400_naming_the_limit(api, path, body):
    """Found by a new user: ``"max_tokens": 999...`` of 5000 digits got "There was an error
    parsing the body" (Python's int() refuses more than 4300 digits while parsing)."""
    client, orch = api
    r = client.post(path, content=body % ("9" * 5000), headers={"content-type": "application/json"})
    assert _err(r, 400, None, None)["message"] == (
        "request body has a number with too many digits (5000): a JSON integer may have at most 4300 digits")
    assert not orch.started
    _still_serving(client)


def test_digits_in_strings_floats_and_4300_digit_integers_are_not_refused_for_digits(api):
    from pdd.gateway.openai_schemas import too_many_digits

    client, orch = api
    r = client.post("/v1/completions", content='{"prompt": "a", "user": "%s", "max_tokens": 2}' % ("7" * 5000),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", content='{"prompt": "a", "max_tokens": %s}' % ("9" * 4300),
                    headers={"content-type": "application/json"})
    assert _err(r, 400, "max_tokens", "context_length_exceeded")["message"].endswith(
        ") exceeds the context window of 512 tokens")  # parsed: a range error, not a parse error
    assert too_many_digits(b'{"a": "%s", "b": 1.%s, "c": %se5, "d": -%s}' % ((b"9" * 5000,) * 3 + (b"9" * 4300,))) \
        is None
    assert too_many_digits(b'{"a": [0, %s]}' % (b"1" * 4301)) == (
        "request body has a number with too many digits (4301): a JSON integer may have at most 4300 digits")


def test_the_context_refusal_says_when_max_tokens_is_completions_default(tiny_model):
    """Found by a new user: a 250-token prompt with no max_tokens on a 256-token window was told
    "+ max_tokens (16) exceeds the context window", a max_tokens never sent (completions' default)."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app
    from tests.api.conftest import EngineOrch

    orch = EngineOrch(Engine.from_pretrained(tiny_model, num_pages=64, page_size=16))
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 256}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    prompt = list(range(10, 260))
    with TestClient(app) as client:
        for extra, said in (({}, "16, its default when not sent"), ({"max_tokens": 16}, "16")):
            r = client.post("/v1/completions", json={"prompt": prompt, **extra})
            assert _err(r, 400, "max_tokens", "context_length_exceeded")["message"] == (
                f"prompt (250 tokens) + max_tokens ({said}) exceeds the context window of 256 tokens")
        assert not orch.started


@pytest.mark.parametrize("coding", ["gzip", "br, gzip"])
def test_a_compressed_body_is_415_naming_its_content_encoding(api, coding):
    """A gzip body (``Content-Encoding: gzip``) was read as JSON text and refused as "not UTF-8
    (byte 0x8b at offset 1)", gzip's magic number, which does not say what to change: the
    gateway takes no content coding, and says so with 415 (RFC 9110 section 15.5.16). An
    ``identity`` coding is the body as sent."""
    import gzip

    client, orch = api
    r = client.post("/v1/completions", content=gzip.compress(json.dumps(OK).encode()),
                    headers={"content-type": "application/json", "content-encoding": coding})
    assert _err(r, 415, None)["message"] == (f"Unsupported Media Type: Content-Encoding {coding!r} is not supported; "
                                             "send the request body uncompressed")
    assert not orch.started
    r = client.post("/v1/completions", content=json.dumps(OK).encode(),
                    headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text


def _no_bad(v: str) -> str:
    if v == "bad":
        raise ValueError("bad one")
    return v


class _Unions(pydantic.BaseModel):
    """Union fields as pydantic names their branches in an error's loc (``str``,
    ``dict[any,any]``, ``function-after[...]``, a model's class name, ``constrained-str``)."""

    class Inner(pydantic.BaseModel):
        a: int

    x: int | list[int] | None = None
    y: pydantic.StrictStr | dict | None = None
    z: typing.Annotated[str, pydantic.AfterValidator(_no_bad)] | int | None = None
    w: list[int | str] | None = None
    v: Inner | str | None = None
    u: typing.Annotated[str, pydantic.Field(max_length=2)] | float | None = None


@pytest.mark.parametrize("body,loc,message", [
    # every branch refused the value's type: one message naming the types, no branch's name
    ({"x": "a"}, ["x"], "must be an integer or an array, got 'a'"),
    ({"y": 5}, ["y"], "must be a string or an object, got 5"),
    ({"z": [1]}, ["z"], "must be a string or an integer, got [1]"),
    ({"w": [None]}, ["w", 0], "must be an integer or a string, got None"),
    # a branch took the type and refused something inside it: that branch's error, without its name
    ({"x": [1, "a"]}, ["x", 1], "Input should be a valid integer, unable to parse string as an integer"),
    ({"z": "bad"}, ["z"], "Value error, bad one"),
    ({"v": {"a": "q"}}, ["v", "a"], "Input should be a valid integer, unable to parse string as an integer"),
    ({"u": "abc"}, ["u"], "String should have at most 2 characters"),
])
def test_a_union_fields_error_names_no_pydantic_branch(body, loc, message):
    """Before, ``tool_choice: 5`` was "tool_choice.str: Input should be a valid string": the loc
    of pydantic's first union branch, in the message a client reads."""
    from pdd.gateway.openai_schemas import first_error

    with pytest.raises(pydantic.ValidationError) as e:
        _Unions.model_validate(body)
    got = first_error(e.value.errors())
    assert (list(got["loc"]), got["msg"]) == (loc, message)


def test_a_plain_error_is_the_first_as_pydantic_gives_it():
    """Two fields' errors (not a union's branches) are left as they are: the first."""
    from pdd.gateway.openai_schemas import first_error

    errs = [{"loc": ("messages", 0, "role"), "msg": "Field required", "type": "missing", "input": {}},
            {"loc": ("messages", 0, "content"), "msg": "Field required", "type": "missing", "input": {}}]
    assert first_error(errs) == errs[0]
    # two keys of a dict (capitalised as a model's class name would be): not a union's branches
    errs = [{"loc": ("logit_bias", "A", "x"), "msg": "bad", "type": "float_type", "input": "x"},
            {"loc": ("logit_bias", "B", "y"), "msg": "bad", "type": "float_type", "input": "y"}]
    assert first_error(errs) == errs[0]
    assert first_error([]) == {}


def _unions(schema, path=()) -> list[tuple]:
    """The paths of the union schemas in a pydantic core schema (``union`` / ``tagged-union``)."""
    out = []
    if isinstance(schema, dict):
        if schema.get("type") in ("union", "tagged-union"):
            out.append(path)
        for k, v in schema.items():
            out += _unions(v, (*path, k))
    elif isinstance(schema, (list, tuple)):
        for i, v in enumerate(schema):
            out += _unions(v, (*path, i))
    return out


@pytest.mark.parametrize("model,fields", [
    ("CompletionRequest", {"stop", "prompt"}), ("ChatCompletionRequest", {"stop"}), ("TokenizeRequest", set()),
    ("DetokenizeRequest", set()), ("ResponsesRequest", set())])
def test_the_served_bodies_only_unions_are_refused_by_their_own_validators_first(model, fields):
    """first_error's union-branch reading (its loc-tag shape rule) is a safety net: the served
    request bodies' only union fields are ``stop`` and completions' ``prompt``, whose
    ``mode="before"`` validators refuse every value a branch would (a 400 in their own words),
    so no branch's loc reaches a client from them. A new union field shows up here: give it a
    validator of its own (or a type that is no union) rather than lean on the tag rule."""
    from pdd.gateway import openai_responses, openai_schemas

    cls = getattr(openai_schemas, model, None) or getattr(openai_responses, model)
    paths = _unions(cls.__pydantic_core_schema__)
    got = {next(p[i + 1] for i in range(len(p) - 1) if p[i] == "fields") for p in paths}
    assert got == fields
    for name in fields:
        assert any(d.info.mode == "before" and name in d.info.fields
                   for d in cls.__pydantic_decorators__.field_validators.values()), name


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "hi", "stop": 5}, "stop", "must be a string or a list of strings, got int 5"),
    ({"prompt": "hi", "stop": ["a", 5]}, "stop", "stop[1]: must be a string, got int 5"),
    ({"prompt": 5}, "prompt", "prompt: must be a text, a list of token ids, a list of texts or a list of token-id "
                              "lists, got int 5"),
    ({"prompt": [1, "a"]}, "prompt", "prompt[1]: token ids must be integers, got 'a'"),
    ({"prompt": [[1], 2]}, "prompt", "prompt[1]: a batch of token-id lists must hold lists only"),
])
def test_the_union_fields_refusals_are_their_validators(body, param, words):
    """(the validators of the test above, through pydantic: no branch name in loc)"""
    from pdd.gateway.openai_schemas import CompletionRequest

    with pytest.raises(pydantic.ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", **body})
    (err,) = e.value.errors()
    assert err["loc"] == (param,) and words in err["msg"], err
