"""Structured outputs through the official openai client on a live pdd topology (P -> RLD -> MD
over the WAN, the tiny model): greedy outputs under a ``response_format`` JSON schema and under a
forced tool_choice are valid JSON of the schema, finish by EOS, and equal the single engine's
under the same grammar, across the RLD -> MD token-id handoff (MD replays RLD's outputs into its
own matcher)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import handoff_topology

pytestmark = pytest.mark.slow

K = 8  # handoff_min_tokens: RLD samples outputs 0..K-1, MD from K on (once MD's KV is there)
MAX_TOKENS = 128  # the outputs below take 60 to 70 tokens of the tiny tokenizer, then EOS
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 9999},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": CITY}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                 "additionalProperties": False}}}]


def _valid(v, schema) -> bool:
    """``v`` (parsed JSON) against the keywords the schemas here use."""
    t = schema.get("type")
    if "enum" in schema and v not in schema["enum"]:
        return False
    if t == "object":
        props = schema.get("properties", {})
        return (isinstance(v, dict) and set(schema.get("required", [])) <= set(v)
                and (schema.get("additionalProperties", True) or set(v) <= set(props))
                and all(_valid(v[k], props[k]) for k in v if k in props))
    if t == "array":
        return (isinstance(v, list) and len(v) <= schema.get("maxItems", len(v))
                and all(_valid(x, schema.get("items", {})) for x in v))
    if t == "string":
        return isinstance(v, str) and len(v) <= schema.get("maxLength", len(v))
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)
                and schema.get("minimum", v) <= v <= schema.get("maximum", v))
    if t == "boolean":
        return isinstance(v, bool)
    return t is None


def test_validator():
    good = {"name": "ab", "n": 3, "ok": True, "tags": ["red"]}
    assert _valid(good, SCHEMA)
    for bad in ({**good, "n": -1}, {**good, "x": 1}, {**good, "tags": ["pink"]}, {**good, "ok": 1},
                {k: v for k, v in good.items() if k != "n"}, {**good, "name": "x" * 13}, [good]):
        assert not _valid(bad, SCHEMA), bad


@pytest.fixture(scope="module")
def pdd_topo(tiny_model, tmp_path_factory):
    # hermes: tools with tool_choice auto are parsed (the tiny checkpoint's family has no parser)
    with handoff_topology(tiny_model, tmp_path_factory.mktemp("logs"), K, tool_call_parser="hermes") as topo:
        yield topo


def _single_engine(model_dir: str, prompt: list[int], constraint) -> list[int]:
    """Greedy outputs of one in-process engine under ``constraint``'s grammar (EOS ends it)."""
    import torch

    from pdd.engine.engine import Engine
    from pdd.types import SamplingParams
    from tests.e2e.conftest import TEST_DEVICE

    torch.set_num_threads(1)
    eng = Engine.from_pretrained(model_dir, num_pages=1024, page_size=16, device=TEST_DEVICE)
    s = eng.new_sequence("ref", prompt, SamplingParams(max_tokens=MAX_TOKENS, grammar=constraint.grammar,
                                                      structured=constraint.structured), use_cache=False)
    eng.add(s)
    while eng.has_work():
        eng.step()
    return list(s.output_ids)


def _chat(topo, **kw) -> dict:
    """The raw JSON response (``token_ids`` and ``pdd`` are pdd's / vLLM's extensions)."""
    import httpx

    body = {"model": topo.cfg.served_model_name, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **kw}
    r = httpx.post(topo.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _handed_over(r: dict) -> None:
    per = r["pdd"].get("choices", [r["pdd"]])
    assert all(s["handoff_pos"] is not None and s["handoff_pos"] >= K for s in per), per


# n=2: the choices reach MD at their own handoff positions, so one grammar may complete a step
# before the other's (tests/engine/test_structured_rows.py holds that case exactly)
@pytest.mark.parametrize("n", [1, 2])
def test_response_format_json_schema_equals_the_single_engine_across_the_handoff(pdd_topo, tiny_model, n):
    from openai import OpenAI

    from pdd.gateway.openai_schemas import ChatCompletionRequest, structured_constraint

    msgs = [{"role": "user", "content": "Describe the weather as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = _chat(pdd_topo, messages=msgs, response_format=rf, n=n)
    assert len(r["choices"]) == n
    want = _single_engine(tiny_model, r["prompt_token_ids"], structured_constraint(
        ChatCompletionRequest.model_validate({"messages": msgs, "response_format": rf})))
    eos = json.load(open(f"{tiny_model}/config.json"))["eos_token_id"]
    assert want[-1] == eos and len(want) > K
    for c in r["choices"]:
        assert (c["token_ids"], c["finish_reason"]) == (want, "stop")
        assert _valid(json.loads(c["message"]["content"]), SCHEMA), c["message"]["content"]
    _handed_over(r)
    # the openai client's own parse of the same request
    oa = OpenAI(base_url=pdd_topo.url + "/v1", api_key="none")
    got = oa.chat.completions.create(model=pdd_topo.cfg.served_model_name, messages=msgs, response_format=rf,
                                     temperature=0, max_tokens=MAX_TOKENS)
    assert got.choices[0].message.content == r["choices"][0]["message"]["content"]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "forecast"}}, "required"])
def test_forced_tool_choice_calls_valid_json_across_the_handoff(pdd_topo, tiny_model, tool_choice):
    from pdd.gateway.openai_schemas import ChatCompletionRequest, structured_constraint

    msgs = [{"role": "user", "content": "Weather in Oslo for the week?"}]
    # one call (maxItems 1): random weights would repeat calls in the array up to max_tokens
    extra = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    r = _chat(pdd_topo, messages=msgs, **extra)
    c = structured_constraint(ChatCompletionRequest.model_validate({"messages": msgs, **extra}))
    want = _single_engine(tiny_model, r["prompt_token_ids"], c)
    for ch in r["choices"]:
        assert ch["token_ids"] == want
        calls = ch["message"]["tool_calls"]
        assert ch["message"]["content"] is None and calls, ch
        for call in calls:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            assert _valid(args, next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name))
        if tool_choice == "required":
            assert ch["finish_reason"] == "tool_calls"
        else:
            assert ch["finish_reason"] == "stop" and [x["function"]["name"] for x in calls] == ["forecast"]
    _handed_over(r)


# a hermes call forced by a regex (the tiny model writes no calls of its own): its arguments
# begin past K tokens, so MD generates them
HERMES_CALL = r'<tool_call>\{"name": "forecast", "arguments": \{"city": "[a-z]{3,8}", "days": [1-9]\}\}</tool_call>'


@pytest.mark.parametrize("how", ["named", "required", "parser"])
def test_a_call_streams_its_arguments_across_the_handoff(pdd_topo, how):
    """Streamed, a call's arguments come a piece per token, through the RLD -> MD handoff: a
    named function's, ``required``'s and a parser's (hermes, tool_choice auto); the openai
    client's accumulation is exactly the non-streamed call (greedy)."""
    from openai import OpenAI
    from openai.lib.streaming.chat import ChatCompletionStreamState

    msgs = [{"role": "user", "content": "Weather in Oslo for the week?"}]
    kw = {"model": pdd_topo.cfg.served_model_name, "messages": msgs, "tools": TOOLS, "temperature": 0,
          "max_tokens": MAX_TOKENS, "parallel_tool_calls": False}
    kw.update({"named": {"tool_choice": {"type": "function", "function": {"name": "forecast"}}},
               "required": {"tool_choice": "required"},
               "parser": {"extra_body": {"guided_regex": HERMES_CALL}}}[how])
    oa = OpenAI(base_url=pdd_topo.url + "/v1", api_key="none", max_retries=0)
    whole = oa.chat.completions.create(**kw).choices[0]
    state, items = ChatCompletionStreamState(input_tools=TOOLS), []
    for chunk in oa.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        items += [(tc.id, tc.function.name, tc.function.arguments)
                  for c in chunk.choices for tc in (c.delta.tool_calls or [])]
    got = state.current_completion_snapshot.choices[0]
    call, want = got.message.tool_calls[0], whole.message.tool_calls[0]
    assert (call.function.name, call.function.arguments, got.finish_reason, got.message.content or None) == (
        want.function.name, want.function.arguments, whole.finish_reason, whole.message.content) == (
        "forecast", want.function.arguments, "stop" if how == "named" else "tool_calls", None)
    # the first item has the id and name, each later one a piece of the arguments alone
    assert items[0][:2] == (call.id, "forecast") and all(i[:2] == (None, None) for i in items[1:])
    assert len(items) > (K if how == "named" else 3) and "".join(a for *_, a in items) == want.function.arguments
    assert _valid(json.loads(want.function.arguments), CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_fails_at_run_time_fails_the_request_naming_why(pdd_topo, stream):
    """A grammar of 2,000 alternatives sharing a prefix compiles, and llguidance's parser refuses
    the next row after the first token (``max is 2000``): the request ends with an error saying
    so, never a 200 with "stop" and output outside the grammar; every page is free after it."""
    import httpx

    body = {"model": pdd_topo.cfg.served_model_name, "prompt": [5, 6, 7, 8], "max_tokens": 16,
            "temperature": 0, "guided_grammar": "start: " + " | ".join(json.dumps(f"7-{i}") for i in range(2000)), "stream": stream}
    with httpx.Client(timeout=300) as c:
        if stream:
            with c.stream("POST", pdd_topo.url + "/v1/completions", json=body) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            assert r.status_code == 200
            errors = [json.loads(ln[6:])["error"] for ln in lines if ln.startswith('data: {"error"')]
            assert len(errors) == 1 and lines[-1] == "data: [DONE]", lines
            err = errors[0]
        else:
            r = c.post(pdd_topo.url + "/v1/completions", json=body)
            assert r.status_code == 400, r.text  # the request's own: the same one fails again
            err = r.json()["error"]
    assert "structured output failed at output 1: " in err["message"] and "max is 2000" in err["message"], err
    assert (err["type"], err["param"]) == ("invalid_request_error", "guided_grammar")  # the constraint's field
    assert pdd_topo.wait_idle(timeout_s=30), pdd_topo.last_busy
    assert pdd_topo.flush()["leaked_pages"] == 0


# {"a": {"a": ...}}: no end. Its only property is "a" and minProperties 1 requires it: what
# pdd.structured.endless_required does not read (a "required" "a" it refuses up front), so llguidance
# compiles it and the request fails at run time
SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "minProperties": 1, "additionalProperties": False}


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                         ("/v1/responses", False), ("/v1/responses", True)])
def test_an_unsatisfiable_schema_fails_as_the_requests_own_error_naming_no_internals(pdd_topo, path, stream):
    """A schema whose one property must be there and is the schema itself has no finite JSON
    text. A non-streamed answer's 400 named a tier's request id and instance; a streamed /v1/responses failed with
    ``server_error`` (the request's own error must read the same streamed or not)."""
    import httpx

    base = {"model": pdd_topo.cfg.served_model_name, "temperature": 0, "stream": stream}
    if path == "/v1/responses":
        body = {**base, "input": "JSON please", "max_output_tokens": 64,
                "text": {"format": {"type": "json_schema", "name": "self", "schema": SELF}}}
    else:
        body = {**base, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 64,
                "response_format": {"type": "json_schema", "json_schema": {"name": "self", "schema": SELF}}}
    with httpx.Client(timeout=300) as c:
        if stream:
            with c.stream("POST", pdd_topo.url + path, json=body) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]
            if path == "/v1/responses":
                last = events[-1]
                assert last["type"] == "response.failed", last
                err = last["response"]["error"]
            else:
                errors = [e["error"] for e in events if "error" in e]
                assert len(errors) == 1 and lines[-1] == "data: [DONE]", lines
                err = errors[0]
        else:
            r = c.post(pdd_topo.url + path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
    assert err["type" if "type" in err else "code"] == "invalid_request_error", err
    if "type" in err:  # the constraint's field (response.failed's error has code and message only)
        assert err["param"] == ("text" if path == "/v1/responses" else "response_format"), err
    assert err["message"].startswith("structured output failed at output "), err
    for internal in ("request ", "p0", "rld0", "md0", "trid", "attempt"):
        assert internal not in err["message"], err
    assert pdd_topo.wait_idle(timeout_s=30), pdd_topo.last_busy
