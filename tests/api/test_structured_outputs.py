"""Structured outputs in the HTTP API: ``response_format``, vLLM's ``structured_outputs`` and its
older ``guided_*`` extras become one compiled constraint (``SamplingParams.grammar`` and
``.structured`` on every choice); every bad one is a 400 naming its field, before any tier works.
The tool_choice side (forced calls) is in test_tool_calls.py."""

from __future__ import annotations

import pytest

from pdd.gateway.openai_schemas import (ApiError, ChatCompletionRequest, CompletionRequest, constraint_chars, constraint_key, constraint_summary,
                                        constraint_requested,
                                        structured_constraint, tool_schema)
from pdd.structured import grammar_for

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
MSGS = [{"role": "user", "content": "weather?"}]
CMPL = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
CHAT = {"messages": MSGS, "max_tokens": 2, "ignore_eos": True}


def _chat(**kw):
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def _cmpl(**kw):
    return CompletionRequest.model_validate({"prompt": "x", **kw})


@pytest.mark.parametrize("extra,param,kind,value", [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     "response_format", "json", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", "json", SCHEMA),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, "structured_outputs", "json", '{"type": "integer"}'),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, "structured_outputs", "regex", "[a-z]{3}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs", "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "structured_outputs", "grammar", 'root ::= "a" | "b"'),
    ({"structured_outputs": {"json_object": True, "regex": None, "disable_fallback": True}}, "structured_outputs",
     "json_object", True),
    ({"guided_json": SCHEMA}, "guided_json", "json", SCHEMA),
    ({"guided_regex": "\\d+"}, "guided_regex", "regex", "\\d+"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "choice", ["a", "b"]),
    ({"guided_grammar": 'start: "x"'}, "guided_grammar", "grammar", 'start: "x"'),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "guidance"}, "guided_json", "json", SCHEMA),
    # SGLang's
    ({"regex": "[a-z]+"}, "regex", "regex", "[a-z]+"),
    ({"ebnf": 'root ::= "a" | "b"'}, "ebnf", "grammar", 'root ::= "a" | "b"'),
    ({"json_schema": '{"type": "object"}'}, "json_schema", "json", '{"type": "object"}'),
])
@pytest.mark.parametrize("make", [_chat, _cmpl])
def test_each_form_is_one_compiled_constraint(make, extra, param, kind, value):
    c = structured_constraint(make(**extra))
    assert (c.param, c.kind, c.value, c.structured) == (param, kind, value, {kind: value})
    assert c.grammar == grammar_for(kind, None if kind == "json_object" else value)


@pytest.mark.parametrize("extra,param,kind,value,ws", [
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ \n]*"}, "guided_json", "json", SCHEMA, "[ \n]*"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ?"}}, "structured_outputs", "json_object",
     True, " ?"),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " "}, "response_format",
     "json_object", True, " "),
])
def test_a_whitespace_pattern_lays_out_json(extra, param, kind, value, ws):
    """vLLM 0.11's guided_whitespace_pattern is its structured_outputs.whitespace_pattern."""
    c = structured_constraint(_chat(**extra))
    assert (c.param, c.kind, c.value, c.structured) == (param, kind, value, {kind: value, "whitespace_pattern": ws})
    assert c.grammar == grammar_for(kind, None if kind == "json_object" else value, whitespace_pattern=ws)
    assert c.grammar != grammar_for(kind, None if kind == "json_object" else value)


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "text"}}, {"response_format": None},
                                   {"structured_outputs": None, "guided_json": None},
                                   {"guided_decoding_backend": "auto"}])
def test_no_constraint(extra):
    assert structured_constraint(_chat(**extra)) is None
    assert structured_constraint(_cmpl(**extra)) is None


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time"}}]
EMPTY = {"type": "object", "properties": {}}


def test_tool_schema_named_is_the_functions_parameters_and_required_an_array_of_calls():
    assert tool_schema({"type": "function", "function": {"name": "get_weather"}}, TOOLS) == CITY
    assert tool_schema({"type": "function", "function": {"name": "get_time"}}, TOOLS) == EMPTY
    want = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": CITY},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]}, "parameters": EMPTY},
         "required": ["name", "parameters"], "additionalProperties": False}]}}
    assert tool_schema("required", TOOLS) == want
    assert tool_schema("required", TOOLS, parallel=False) == {**want, "maxItems": 1}
    for tc in (None, "none", "auto"):
        assert tool_schema(tc, TOOLS) is None


def test_tool_schema_gathers_defs_without_changing_the_tools():
    import copy

    p = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": p}},
             {"type": "function", "function": {"name": "stay", "parameters": copy.deepcopy(p)}}]
    before = copy.deepcopy(tools)
    s = tool_schema("required", tools)
    assert s["$defs"] == {"Place": {"type": "string"}}
    assert s["items"]["anyOf"][0]["properties"]["parameters"] == {"type": "object",
                                                                  "properties": {"at": {"$ref": "#/$defs/Place"}}}
    assert tools == before
    grammar_for("json", s)  # compiles: the refs resolve at the top
    tools[1]["function"]["parameters"]["$defs"]["Place"] = {"type": "integer"}
    with pytest.raises(ApiError) as e:
        tool_schema("required", tools)
    assert (e.value.param, e.value.message) == (
        "tools", "tools[1].function.parameters.$defs.Place: another tool defines 'Place' differently; one schema "
                 "per name is supported")


SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # {"a": {"a": ...: no end
BAD = [
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format",
     "response_format.type: must be one of 'text', 'json_object', 'json_schema', got 'structural_tag'"),
    ({"response_format": {"json_schema": {"name": "w", "schema": SCHEMA}}}, "response_format",
     "response_format.type: must be one of 'text', 'json_object', 'json_schema', got None"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format.json_schema: required for type 'json_schema': an object with name and schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
     "response_format.json_schema.name: required, a non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, "response_format",
     "response_format.json_schema.schema: required, a JSON schema object, got None"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": "yes"}}},
     "response_format", "response_format.json_schema.strict: must be a boolean, got 'yes'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema: Invalid type: nonsense"),
    # over the size limit: param the schema the message names (it was response_format)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"enum": ["e" * 40_000]}}}},
     "response_format.json_schema.schema",
     "response_format.json_schema.schema: the constraint is 40,014 characters; at most 32,768 are compiled"),
    ({"structured_outputs": "json"}, "structured_outputs",
     "structured_outputs: must be an object with one of json, regex, choice, grammar, json_object, got str 'json'"),
    ({"structured_outputs": {}}, "structured_outputs",
     "structured_outputs: must give one constraint, one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs: only one kind of constraint can be used, got regex, choice"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs",
     "structured_outputs.jsn: unknown key (constraints: json, regex, choice, grammar, json_object)"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs",
     "structured_outputs.disable_any_whitespace: True is not supported: pdd's structured outputs (llguidance) "
     "honour only its default; leave disable_any_whitespace out"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs",
     "structured_outputs: a whitespace pattern lays out JSON output, and structured_outputs gives a regex "
     "constraint"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": 3}}, "structured_outputs",
     "structured_outputs.whitespace_pattern: must be a non-empty string (a regex), got 3"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern: a whitespace pattern lays out JSON output, and the request has no JSON constraint"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ "}, "guided_whitespace_pattern",
     'guided_whitespace_pattern: invalid regex "[ " (in regex): regex parse error: unclosed character class'),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern",
     "guided_whitespace_pattern: structured_outputs.whitespace_pattern gives one already"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs",
     "structured_outputs.json_object: must be true, got 'yes'"),
    # no output can satisfy them: refused before any tier works (they ended at once with "stop")
    ({"guided_grammar": "start: start"}, "guided_grammar",
     "guided_grammar: the constraint allows no output: no token can begin it"),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex",
     "guided_regex: the constraint allows no output: no token can begin it"),
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
     "guided_json", "guided_json: the constraint allows no output: no token can begin it"),
    # no finite JSON text: llguidance compiles them and the request failed only after prefill, at
    # run time ("Too many items"); refused up front, naming the property
    ({"guided_json": SELF}, "guided_json",
     "guided_json: no finite JSON value satisfies the schema: required property 'a' can hold no finite value: its "
     "schema requires a value of the same schema again, without end"),
    ({"structured_outputs": {"json": {"$ref": "#/$defs/N", "$defs": {"N": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}, "required": ["next"]}}}}},
     "structured_outputs",
     "structured_outputs.json: no finite JSON value satisfies the schema: required property 'next' can hold no "
     "finite value: its schema requires a value of the same schema again, without end"),
    ({"guided_json": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}, "guided_json",
     "guided_json: no finite JSON value satisfies the schema: an array of minItems 1 whose items can hold no "
     "finite value: their schema requires a value of the same schema again, without end"),
    # bounded: a longer one could overflow llguidance's recursion (it killed the gateway)
    ({"guided_regex": "a" * 32769}, "guided_regex",
     "guided_regex: the constraint is 32,769 characters; at most 32,768 are compiled"),
    ({"guided_choice": ["x" * 40] * 800}, "guided_choice",
     "guided_choice: the constraint is 35,200 characters; at most 32,768 are compiled"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs",
     'structured_outputs.regex: invalid regex "[a-z" (in regex): regex parse error: unclosed character class'),
    ({"structured_outputs": {"json": "{x"}}, "structured_outputs",
     "structured_outputs.json: the JSON schema is not JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    ({"structured_outputs": {"grammar": "start: %%%"}}, "structured_outputs",
     "structured_outputs.grammar: 1(9): lexer error"),
    ({"guided_choice": []}, "guided_choice",
     "guided_choice: choices must be a non-empty list of non-empty strings"),
    ({"guided_json": 5}, "guided_json", "guided_json: a JSON schema must be an object, not int"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_choice: only one structured-output constraint can be used in a request, and guided_regex gives "
     "one already"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "structured_outputs: only one structured-output constraint can be used in a request, and response_format "
     "gives one already"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json",
     "guided_json: only one structured-output constraint can be used in a request, and structured_outputs gives "
     "one already"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern: a whitespace pattern lays out JSON output, and guided_regex gives a regex "
     "constraint"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "guided_decoding_backend is not supported: pdd does not support structured-output backends other than "
     "llguidance (vLLM's 'guidance'; 'auto' picks it); leave guided_decoding_backend out"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,param,message", BAD)
def test_every_bad_constraint_is_a_400_naming_its_field_and_why(api, path, extra, param, message):
    client, orch = api
    body = CMPL if path == "/v1/completions" else CHAT
    r = client.post(path, json={**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["message"], err["code"]) == ("invalid_request_error", param, message, None)
    assert not orch.started


def test_a_chat_response_format_with_no_finite_value_is_a_400_before_any_tier_works(api):
    client, orch = api
    r = client.post("/v1/chat/completions", json={**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "self", "schema": SELF}}})
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "response_format.json_schema.schema: no finite JSON value satisfies the schema: required "
                   "property 'a' can hold no finite value: its schema requires a value of the same schema again, "
                   "without end", "type": "invalid_request_error", "param": "response_format.json_schema.schema",
        "code": None}})
    assert not orch.started


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a string satisfies it
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},  # check_start's
])
def test_a_recursive_schema_with_a_finite_value_is_not_refused_as_endless(schema):
    from pdd.structured import endless_required

    assert endless_required(schema) is None


@pytest.mark.parametrize("extra,param,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_tme"}}}, "tool_choice",
     "tool_choice: function 'get_tme' is not one of the tools ('get_weather', 'get_time')"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice 'required' forces a tool call, which is a constraint of its own: it cannot be combined with "
     "response_format; send one or the other"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "guided_regex": "a"}, "tool_choice",
     "tool_choice {'type': 'function', 'function': {'name': 'get_weather'}} forces a tool call, which is a "
     "constraint of its own: it cannot be combined with guided_regex; send one or the other"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters", "tools[0].function.parameters: must be a JSON schema object, got 3"),
    ({"tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools", "the tools' parameters: Invalid type: nonsense"),
])
def test_bad_forced_tool_choice_is_a_400(api, extra, param, message):
    client, orch = api
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["message"]) == (param, message)
    assert not orch.started


def test_completions_every_choice_and_prompt_carries_the_grammar(api):
    client, orch = api
    r = client.post("/v1/completions", json={**CMPL, "prompt": [[5, 6, 7], [8, 9]], "n": 2,
                                             "structured_outputs": {"regex": "[a-z]+"}})
    assert r.status_code == 200, r.text
    assert len(orch.started) == 4
    g = grammar_for("regex", "[a-z]+")
    assert [(sp.grammar, sp.structured) for _, sp in orch.started] == [(g, {"regex": "[a-z]+"})] * 4
    assert len({sp.seed for _, sp in orch.started}) == 4  # still a seed a choice


def test_chat_response_format_json_schema_reaches_every_choice(api):
    client, orch = api
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.post("/v1/chat/completions", json={**CHAT, "n": 3, "response_format": rf})
    assert r.status_code == 200, r.text
    g = grammar_for("json", SCHEMA)
    assert [(sp.grammar, sp.structured) for _, sp in orch.started] == [(g, {"json": SCHEMA})] * 3


def test_a_request_without_a_constraint_has_no_grammar(api):
    client, orch = api
    assert client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}).status_code == 200
    assert client.post("/v1/completions", json=CMPL).status_code == 200
    assert [(sp.grammar, sp.structured) for _, sp in orch.started] == [(None, None)] * 2
    assert "grammar" not in orch.started[0][1].to_dict()


def test_a_request_without_a_constraint_does_not_wait_for_the_grammar_compiler(api):
    """The compiler is one thread: a plain request sent while it compiles other clients' grammars
    waited behind them (a plain 1-token request took 3 s beside four clients sending 25 KB
    grammars). With the compiler held busy, requests without a constraint are served; one with a
    constraint waits for it."""
    import threading

    from pdd.structured import compiler

    client, orch = api
    release = threading.Event()
    busy = compiler().submit(release.wait, 60)  # the compiler's one thread, held until released
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert client.post("/v1/completions", json=CMPL).status_code == 200
        assert client.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}).status_code == 200
        r = client.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "none"})
        assert r.status_code == 200, r.text
        assert [(sp.grammar, sp.structured) for _, sp in orch.started] == [(None, None)] * 3
        assert not busy.done()
    finally:
        release.set()
    busy.result(60)
    assert client.post("/v1/completions", json={**CMPL, "guided_regex": "a"}).status_code == 200


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "text"}}, {"response_format": None},
                                   {"structured_outputs": None, "guided_json": None},
                                   {"guided_decoding_backend": "auto"}, {"tool_choice": "auto"},
                                   {"tool_choice": "none"}, {"tool_choice": None}])
def test_constraint_requested_is_false_only_where_there_is_none(extra):
    """A request the gateway serves without the compiler (constraint_requested False) has no
    constraint; each form that gives one is requested."""
    assert not constraint_requested(_chat(**extra)) and structured_constraint(_chat(**extra)) is None
    for form in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a"}},
                 {"guided_regex": "a"}, {"regex": "a"}, {"ebnf": 'root ::= "a"'}, {"json_schema": "{}"},
                 {"guided_whitespace_pattern": " "}, {"tool_choice": "required"},
                 {"tool_choice": {"type": "function", "function": {"name": "f"}}}):
        assert constraint_requested(_chat(**form)), form


def test_constraint_chars_counts_the_constraint_text_a_request_sends():
    """What orders the compile queue (pdd.structured.compile_cost_s): a string's length, another
    value's JSON, the tools' JSON when tool_choice forces a call; 0 without a constraint."""
    import json

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert constraint_chars(_chat()) == 0
    assert constraint_chars(_chat(tools=tools, tool_choice="auto")) == 0
    assert constraint_chars(_cmpl(guided_regex="[a-z]{1,3}")) == 10
    assert constraint_chars(_cmpl(guided_grammar='root ::= "a"')) == 12
    assert constraint_chars(_chat(response_format={"type": "json_object"})) == len('{"type": "json_object"}')
    assert constraint_chars(_chat(structured_outputs={"choice": ["a", "b"]})) == len('{"choice": ["a", "b"]}')
    assert constraint_chars(_chat(guided_json={"type": "object"}, guided_whitespace_pattern=" ")) == len('{"type": "object"}') + 1
    assert constraint_chars(_chat(tools=tools, tool_choice="required")) == len(json.dumps(tools))


def test_constraint_key_is_equal_for_equal_constraints_only():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert constraint_key(_chat()) is None and constraint_key(_chat(tools=tools, tool_choice="auto")) is None
    assert constraint_key(_cmpl(guided_regex="a+", max_tokens=3)) == constraint_key(_cmpl(guided_regex="a+"))
    assert constraint_key(_cmpl(guided_regex="a+")) != constraint_key(_cmpl(guided_regex="a*"))
    assert constraint_key(_cmpl(guided_regex="a+")) != constraint_key(_cmpl(regex="a+"))  # the field counts
    assert (constraint_key(_chat(guided_json={"a": 1, "b": 2})) == constraint_key(_chat(guided_json={"b": 2, "a": 1})))
    assert constraint_key(_chat(tools=tools, tool_choice="required")) != constraint_key(
        _chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}))


def test_constraint_summary_is_the_key_and_the_chars_at_once():
    """The gateway's compile queue reads both from one walk of the fields (constraint_summary)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body in (_chat(), _chat(tools=tools, tool_choice="auto"), _cmpl(guided_regex="[a-z]{1,3}"),
                 _chat(guided_json={"type": "object"}, guided_whitespace_pattern=" "),
                 _chat(tools=tools, tool_choice="required")):
        assert constraint_summary(body) == (constraint_key(body), constraint_chars(body))
    assert constraint_summary(_chat()) == (None, 0)
    assert constraint_summary(_cmpl(guided_regex="[a-z]{1,3}"))[1] == 10


@pytest.mark.parametrize("backend", ["auto", "guidance", None])
def test_a_backend_name_that_asks_for_llguidance_is_served(api, backend):
    """vLLM 0.11 ignores guided_decoding_backend (the backend is the server's); pdd compiles with
    llguidance, vLLM's "guidance": those names ask for what is done ("xgrammar" is a 400, BAD)."""
    client, orch = api
    r = client.post("/v1/completions", json={**CMPL, "guided_regex": "[a-z]+", "guided_decoding_backend": backend})
    assert r.status_code == 200, r.text
    assert orch.started[0][1].structured == {"regex": "[a-z]+"}


def test_parse_forced_and_its_stream():
    from pdd.gateway.tool_parsers import CallDelta, CallMode, Emit, ForcedStream, Parsed, ToolCall, parse_forced

    ids = iter(f"call_{i}" for i in range(100)).__next__
    assert parse_forced("f", '{"a": 1}', ids) == Parsed(None, (ToolCall("call_0", "f", '{"a": 1}'),))
    text = '[{"name": "f", "parameters": {"a": "é"}}, {"name": "g", "parameters": null}, {"name": "h"}]'
    assert parse_forced(None, text, ids) == Parsed(None, (ToolCall("call_1", "f", '{"a": "é"}'),
                                                          ToolCall("call_2", "g", "{}"), ToolCall("call_3", "h", "{}")))
    for bad in ('[{"name": "f"', "[]", '{"name": "f"}', '[{"parameters": {}}]'):  # no call made
        assert parse_forced(None, bad, ids) == Parsed(bad)
    # made once its name and its arguments' start are read: cut after, its arguments so far
    assert parse_forced(None, '[{"name": "f", "parameters": {"a": ', ids) == Parsed(
        None, (ToolCall("call_4", "f", '{"a": '),))
    s = ForcedStream(None, ids)
    assert [s.feed(x) for x in ('[{"name": ', '"f"}]')] == [Emit(), Emit("", (CallDelta(0, "{}", "call_5", "f"),))]
    assert s.finish() == Emit()
    s = ForcedStream(None, ids)
    s.feed('[{"na')
    assert s.finish() == Emit('[{"na', ())
    named, required = CallMode(forced=True, function="f"), CallMode(forced=True)
    assert [named.finish_reason(f) for f in ("stop", "length")] == ["stop", "length"]
    assert [required.finish_reason(f) for f in ("stop", "length")] == ["tool_calls", "length"]
    assert CallMode(parser="hermes").finish_reason("stop") == "tool_calls"
    assert CallMode(forced=True, parallel=False).parse(text, ids).calls == (ToolCall("call_6", "f", '{"a": "é"}'),)


def test_a_deep_grammar_compiles_on_the_large_stack_instead_of_killing_the_process(tmp_path):
    """A chain of 3,000 Lark rules (77 KB, past the size cap) overflowed an 8 MiB thread stack in
    llguidance's compiler (SIGSEGV: the gateway died). On ``pdd.structured.compiler``'s thread it
    compiles; run in a process of its own, so a regression fails this test, not the suite."""
    import subprocess
    import sys

    code = ("from pdd.structured import _grammar_for, on_compiler\n"
            "g = 'start: r0\\n' + ''.join(f'r{i}: \"a{i}\" r{i+1} | \"b\"\\n' for i in range(3000)) + 'r3000: \"z\"\\n'\n"
            "assert len(g) > 32768\n"
            "print(len(on_compiler(_grammar_for, 'grammar', g, None)) > 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "True"), r.stderr[-2000:]


def _big_tools(n_props: int) -> list[dict]:
    props = {f"p{i}": {"type": "string"} for i in range(n_props)}
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]


_BIG = "e" * 40_000


@pytest.mark.parametrize("body", [
    _cmpl(guided_grammar="root ::= " + " | ".join(f'"x{i}"' for i in range(6000))),
    _cmpl(guided_regex=_BIG), _cmpl(guided_choice=[_BIG]), _cmpl(guided_json={"enum": [_BIG]}),
    _cmpl(structured_outputs={"regex": _BIG}),
    _chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [_BIG]}}}),
    _chat(tools=_big_tools(2000), tool_choice="required"),
    _chat(tools=_big_tools(2000), tool_choice={"type": "function", "function": {"name": "f"}}),
    _cmpl(guided_regex="w", guided_whitespace_pattern=_BIG),
    # refused by the checks before the size: the same refusal
    _cmpl(guided_regex=_BIG, guided_grammar="root ::= \"a\""),
    _chat(tools=_big_tools(2000), tool_choice="required", response_format={"type": "json_object"}),
    # with a whitespace pattern: refused before its regex compiles (it queued for the compiler)
    _cmpl(guided_json={"enum": [_BIG]}, guided_whitespace_pattern="[ ]?"),
    _chat(structured_outputs={"json": {"enum": [_BIG]}, "whitespace_pattern": "[ ]?"}),
    _cmpl(guided_regex=_BIG, guided_whitespace_pattern=" "),  # the pattern's own refusal first, as it was
    _cmpl(guided_json={"enum": [_BIG]}, guided_whitespace_pattern=" " * 40_000),  # the pattern's size first
    _cmpl(guided_json={"enum": [_BIG]}, guided_whitespace_pattern=" ", guided_regex="a"),  # two constraints first
    _cmpl(guided_whitespace_pattern=" "),
])
def test_check_constraint_size_refuses_as_the_compile_does_without_compiling(body, monkeypatch):
    """What the gateway checks before queueing for the compiler: the same 400 (message and
    param) structured_constraint gives, with nothing compiled."""
    import pdd.structured as st
    from pdd.gateway.openai_schemas import check_constraint_size

    with pytest.raises(ApiError) as want:
        structured_constraint(body)
    monkeypatch.setattr(st, "on_compiler", lambda *a, **kw: pytest.fail("compiled"))
    with pytest.raises(ApiError) as got:
        check_constraint_size(body)
    assert (got.value.message, got.value.param) == (want.value.message, want.value.param)


@pytest.mark.parametrize("body", [
    _cmpl(guided_regex="[a-z]+"), _chat(tools=_big_tools(3), tool_choice="required"), _cmpl(prompt="x"),
    _cmpl(guided_json={"enum": ["e"]}, guided_whitespace_pattern="[ "),  # the pattern's regex: compiled
])
def test_check_constraint_size_passes_what_it_cannot_refuse_without_compiling(body, monkeypatch):
    import copy

    import pdd.structured as st
    from pdd.gateway.openai_schemas import check_constraint_size

    tools = copy.deepcopy(getattr(body, "tools", None))
    monkeypatch.setattr(st, "on_compiler", lambda *a, **kw: pytest.fail("compiled"))
    assert check_constraint_size(body) is None
    assert getattr(body, "tools", None) == tools


def test_an_oversized_constraint_is_refused_before_its_whitespace_patterns_regex_compiles():
    """Both wrong, the pattern's regex (known only by compiling it) and the constraint's size
    (known before the compile queue): the size's 400, from the gateway's check and the compile
    alike, so the gateway refuses it without queueing for the compiler. A pattern that does not
    compile beside a constraint within the limit is its own 400, as it was."""
    from pdd.gateway.openai_schemas import check_constraint_size

    body = _cmpl(guided_json={"enum": [_BIG]}, guided_whitespace_pattern="[ ")
    want = ("guided_json: the constraint is 40,016 characters; at most 32,768 are compiled", "guided_json")
    for check in (structured_constraint, check_constraint_size):
        with pytest.raises(ApiError) as ex:
            check(body)
        assert (ex.value.message, ex.value.param) == want
    with pytest.raises(ApiError) as ex:
        structured_constraint(_cmpl(guided_json={"enum": ["e"]}, guided_whitespace_pattern="[ "))
    assert ex.value.param == "guided_whitespace_pattern" and "invalid regex" in ex.value.message


@pytest.mark.parametrize("kind,value,ws,message", [
    ("regex", "a\ud800", None, "not valid Unicode text (a lone surrogate at character 1)"),
    ("grammar", 'start: "\udfff"', None, "not valid Unicode text (a lone surrogate at character 8)"),
    ("choice", ["a", "b\ud800"], None, "choice 1 is not valid Unicode text (a lone surrogate at character 1)"),
    ("json", {"enum": ["ok", "\ud800"]}, None, "the schema's enum[1] is not valid Unicode text (a lone surrogate at "
                                               "character 0)"),
    ("json", '{"properties": {"k\\ud800": {}}}', None,
     "the schema's properties key 'k\\ud800' is not valid Unicode text (a lone surrogate at character 1)"),
    ("json", {}, " \ud800", "the whitespace pattern is not valid Unicode text (a lone surrogate at character 1)"),
])
def test_grammar_for_refuses_a_lone_surrogate_in_the_words_of_the_api(kind, value, ws, message):
    """Python's codec ("'utf-8' codec can't encode character") or llguidance ("unexpected end of
    hex escape") was the reason; a schema's JSON text's own \\ud800 escapes are found too."""
    from pdd.structured import GrammarError, grammar_for

    with pytest.raises(GrammarError) as e:
        grammar_for(kind, value, whitespace_pattern=ws)
    assert str(e.value) == message
