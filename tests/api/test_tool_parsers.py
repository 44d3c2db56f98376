"""pdd.gateway.tool_parsers: tool calls parsed out of generated text (vLLM's hermes, llama3_json
and mistral formats), whole and streamed."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.gateway.tool_parsers import (PARSERS, CallDelta, CallMode, Emit, ForcedStream, Parsed, ToolCall, ToolStream,
                                      accumulate, family_default, merge, new_call_id, new_mistral_id, parse,
                                      parse_forced)


def _ids():
    n = itertools.count()
    return lambda: f"id{next(n)}"


def P(parser, text):
    return parse(parser, text, _ids())


W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
W_ARGS = '{"city": "Paris", "unit": "c"}'


# ---------------------------------------------------------------- hermes
def test_hermes_one_call():
    assert P("hermes", f"<tool_call>\n{W}\n</tool_call>") == Parsed(None, (ToolCall("id0", "get_weather", W_ARGS),))


def test_hermes_text_before_the_call_is_content():
    assert P("hermes", f"Let me check.\n<tool_call>{W}</tool_call>") == Parsed(
        "Let me check.\n", (ToolCall("id0", "get_weather", W_ARGS),))


def test_hermes_several_calls_text_between_and_after_dropped():
    t = f'<tool_call>{W}</tool_call>\n<tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>\nbye'
    assert P("hermes", t) == Parsed(None, (ToolCall("id0", "get_weather", W_ARGS), ToolCall("id1", "f", "{}")))


def test_hermes_last_call_unclosed_is_parsed():
    assert P("hermes", f"<tool_call>{W}") == Parsed(None, (ToolCall("id0", "get_weather", W_ARGS),))


def test_hermes_arguments_keep_non_ascii_and_absent_arguments_are_empty():
    assert P("hermes", '<tool_call>{"name": "é", "arguments": {"q": "café 東京"}}</tool_call>').calls == (
        ToolCall("id0", "é", '{"q": "café 東京"}'),)
    assert P("hermes", '<tool_call>{"name": "now"}</tool_call>').calls == (ToolCall("id0", "now", "{}"),)


@pytest.mark.parametrize("text", [
    "no call here",
    "",
    "<tool_call>{not json}</tool_call>",
    f"<tool_call>{W}</tool_call><tool_call>{{bad</tool_call>",  # one bad call: all content (vLLM)
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    "<tool_call>[1, 2]</tool_call>",
    "<tool_call>",
    "text <tool_call>{\"name\": \"f\"",  # cut off mid-call (max_tokens)
])
def test_hermes_unparsable_is_all_content(text):
    assert P("hermes", text) == Parsed(text)


# ---------------------------------------------------------------- llama3_json
def test_llama3_json_parameters():
    t = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    assert P("llama3_json", t) == Parsed(None, (ToolCall("id0", "get_weather", W_ARGS),))


def test_llama3_json_python_tag_arguments_and_several_calls():
    t = '<|python_tag|>{"name": "a", "arguments": {"x": 1}} ; {"name": "b", "parameters": {}}\n'
    assert P("llama3_json", t) == Parsed(None, (ToolCall("id0", "a", '{"x": 1}'), ToolCall("id1", "b", "{}")))


@pytest.mark.parametrize("text", [
    "Sure, here it is: " + W,  # text first: no call (as vLLM's streaming parser)
    " " + W,
    W + " and more",
    W + ";",
    '{"name": "a", "parameters": {}, "arguments": {}}',
    '{"x": 1}',
    "{",
    "<|python_tag|>",
    "plain",
    "",
])
def test_llama3_json_unparsable_is_all_content(text):
    assert P("llama3_json", text) == Parsed(text)


# ---------------------------------------------------------------- mistral
def test_mistral_calls():
    t = 'ok [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert P("mistral", t) == Parsed("ok ", (ToolCall("id0", "a", '{"x": 1}'), ToolCall("id1", "b", "{}")))


@pytest.mark.parametrize("text,calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [("get_weather", '{"city": "Paris"}')]),
    ('ok [TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b-2[ARGS]{} ', [("a", '{"x": 1}'), ("b-2", "{}")]),
    ('[TOOL_CALLS]a[CALL_ID]Ab3dE6gh9[ARGS]{"x": [1, 2]}', [("a", '{"x": [1, 2]}')]),  # v13
    ('[TOOL_CALLS]a{"x": 1}[TOOL_CALLS] b {}', [("a", '{"x": 1}'), ("b", "{}")]),  # special tokens decoded away
    ('[TOOL_CALLS]a[ARGS]"{\\"x\\": 1}"', [("a", '{"x": 1}')]),  # arguments written as a JSON string
])
def test_mistral_v11_calls(text, calls):
    """Tokenizer v11+ (Mistral Small 3.1+, Devstral, Magistral): a [TOOL_CALLS] marker before each
    call, ``name[ARGS]{...}``."""
    got = P("mistral", text)
    assert [(c.name, c.arguments) for c in got.calls] == calls
    assert got.content == (text[:text.index("[TOOL_CALLS]")] or None)


@pytest.mark.parametrize("text", ["[TOOL_CALLS]", "[TOOL_CALLS][]", "[TOOL_CALLS][{\"name\": ", "x [TOOL_CALLS]1",
                                  "[TOOL_CALLS]a[ARGS]", "[TOOL_CALLS]a[ARGS]{\"x\": ", "[TOOL_CALLS]a b[ARGS]{}",
                                  "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS]a[ARGS][1]", "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]",
                                  "[TOOL_CALLS]" + "f" * 65 + "[ARGS]{}", "[TOOL_CALLS]a[ARGS]{} tail"])
def test_mistral_unparsable_is_all_content(text):
    assert P("mistral", text) == Parsed(text)


# ---------------------------------------------------------------- ids, openai shape, families
def test_ids_shapes():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_mistral_id())
    assert re.fullmatch(r"call_[0-9a-f]{24}", parse("hermes", f"<tool_call>{W}</tool_call>").calls[0].id)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parse("mistral", f"[TOOL_CALLS][{W}]").calls[0].id)


def test_to_openai():
    assert ToolCall("call_1", "f", "{}").to_openai() == {"id": "call_1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("model_type,tokens,want", [
    ("qwen2", {"<tool_call>", "</tool_call>"}, "hermes"),
    ("qwen3", {"<tool_call>"}, "hermes"),
    ("qwen2", set(), None),
    ("llama", {"<|python_tag|>", "<|eot_id|>"}, "llama3_json"),
    ("llama", {"<s>"}, None),  # Llama 2 / pdd's own tiny checkpoints
    ("mistral", {"<s>", "</s>"}, None),  # Mistral-7B v0.1: no tool calls
    ("mistral", {"[TOOL_CALLS]"}, "mistral"),
    (None, {"<tool_call>"}, None),
])
def test_family_default(model_type, tokens, want):
    assert family_default(model_type, tokens) == want


def test_unknown_parser_is_key_error():
    with pytest.raises(KeyError):
        parse("pythonic", "x")
    with pytest.raises(KeyError):
        ToolStream("pythonic")


# ---------------------------------------------------------------- streaming == whole
def _stream(parser, pieces):
    """(the content of each feed, the content finish sends, the calls), checking the calls all
    come at the end."""
    s = ToolStream(parser, _ids())
    fed = [s.feed(p) for p in pieces]
    assert all(e.calls == () for e in fed)
    end = s.finish()
    content, calls = accumulate([*fed, end])
    assert s.called == bool(calls) and content == "".join(e.content for e in fed) + end.content
    return [e.content for e in fed], end.content, calls


def _split(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


SAMPLES = [
    f"Let me check.\n<tool_call>\n{W}\n</tool_call>",
    f"<tool_call>{W}</tool_call><tool_call>{W}</tool_call>",
    "a < b <tool_ and <tool_call>{bad}</tool_call> tail",
    "text that ends with <tool_c",
    '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
    "<|python_tag|>" + W,
    "<|python_tag",
    "{ not a call",
    'intro [TOOL_CALLS][{"name": "a", "arguments": {}}]',
    "[TOOL_CALLS nope",
    "plain text, no calls at all",
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.sampled_from(PARSERS), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_equals_whole(text, parser, cuts):
    out, rest, calls = _stream(parser, _split(text, cuts))
    whole = P(parser, text)
    assert "".join(out) + rest == (whole.content or "")
    assert calls == whole.calls


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<>/_{}[]\":;, toolcaTOLCAS|pythng\n", max_size=60), st.sampled_from(PARSERS),
       st.lists(st.integers(0, 60), max_size=8))
def test_streamed_equals_whole_any_text(text, parser, cuts):
    out, rest, calls = _stream(parser, _split(text, cuts))
    whole = P(parser, text)
    assert "".join(out) + rest == (whole.content or "")
    assert calls == whole.calls


def test_stream_holds_only_a_possible_marker():
    assert _stream("hermes", ["Hi <tool", "_x more", " <tool_call>{", '"name": "f"}']) == (
        ["Hi ", "<tool_x more", " ", ""], "", (ToolCall("id0", "f", "{}"),))


def test_stream_llama_text_is_content_at_once():
    assert _stream("llama3_json", ["Hello", " there"]) == (["Hello", " there"], "", ())
    assert _stream("llama3_json", ["<|py", 'thon_tag|>{"name": "f"}']) == (["", ""], "", (ToolCall("id0", "f", "{}"),))


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4),
       st.text(min_size=1, max_size=8))
def test_hermes_round_trips_any_arguments(args, name):
    t = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
    (call,) = P("hermes", t).calls
    assert (call.name, json.loads(call.arguments)) == (name, args)


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"y\\": Infinity}"}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": -Infinity}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'),  # a float's inf
    ("llama3_json", '{"name": "f", "parameters": {"x": [-1E999]}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": "\\ud800"}}]'),
])
def test_calls_no_response_could_carry_are_content(parser, text):
    """A lone surrogate (a ``\\ud800`` escape: the non-streamed response could not be encoded,
    a 500) or NaN / Infinity (no JSON for a client's parser) makes the text no call: content."""
    p = parse(parser, text)
    assert (p.content, p.calls) == (text, ())
    ts = ToolStream(parser)
    assert accumulate([*(ts.feed(ch) for ch in text), ts.finish()]) == (text, ())


# ---------------------------------------------------------------- stream items
def test_call_delta_openai_shapes_and_merge():
    assert CallDelta(0, '{"a', "call_1", "f").to_openai() == {"index": 0, "id": "call_1", "type": "function",
                                                             "function": {"name": "f", "arguments": '{"a'}}
    assert CallDelta(1, "x").to_openai() == {"index": 1, "function": {"arguments": "x"}}
    assert merge((CallDelta(0, "{", "i", "f"), CallDelta(0, "}"), CallDelta(1, "", "j", "g"), CallDelta(1, "{}"))) == (
        CallDelta(0, "{}", "i", "f"), CallDelta(1, "{}", "j", "g"))
    assert Emit("a", (CallDelta(0, "{", "i", "f"),)) + Emit("b", (CallDelta(0, "}"),)) == Emit(
        "ab", (CallDelta(0, "{}", "i", "f"),))


def test_accumulate_is_the_openai_clients_join():
    assert accumulate([Emit("hi "), Emit("", (CallDelta(0, "", "i", "f"),)), Emit("", (CallDelta(0, '{"a": 1'),)),
                       Emit("", (CallDelta(0, "}"), CallDelta(1, "{}", "j", "g")))]) == (
        "hi ", (ToolCall("i", "f", '{"a": 1}'), ToolCall("j", "g", "{}")))
    with pytest.raises(ValueError):
        accumulate([Emit("", (CallDelta(0, "x"),))])


# ---------------------------------------------------------------- forced tool_choice, streamed == whole
def _forced(function, pieces, parallel=True):
    s = CallMode(forced=True, function=function, parallel=parallel).stream(_ids())
    fed = [s.feed(p) for p in pieces]
    end = s.finish()
    return fed, end, s.called


def _whole_forced(function, text, parallel=True):
    p = CallMode(forced=True, function=function, parallel=parallel).parse(text, _ids())
    return (p.content or "", p.calls)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.sampled_from(['{"city": "Paris", "unit": "c"}', "", "{", '{"q": "café 東京\\n"}']),
                 st.text(max_size=40)),
       st.lists(st.integers(0, 60), max_size=10))
def test_forced_named_streams_the_arguments_as_they_come(text, cuts):
    """A named function's text is its arguments: each delta is a piece of them, the first with
    the call's id and name; accumulated, exactly the non-streamed call, whatever the split."""
    pieces = _split(text, cuts)
    fed, end, called = _forced("get_weather", pieces)
    assert called and accumulate([*fed, end]) == _whole_forced("get_weather", text)
    assert all(e.content == "" for e in [*fed, end])
    # the first feed carries the call's first item, each later one its own piece (if any)
    first = (fed or [end])[0].calls[0]
    assert (first.index, first.id, first.name) == (0, "id0", "get_weather")
    assert [e.calls for e in fed[1:]] == [((CallDelta(0, p),) if p else ()) for p in pieces[1:]]
    assert end == (Emit("", (CallDelta(0, "", "id0", "get_weather"),)) if not pieces else Emit())


def test_forced_named_with_parallel_false_and_no_text():
    fed, end, called = _forced("f", ['{"a"', ": 1}"], parallel=False)
    assert [e.calls for e in fed] == [(CallDelta(0, '{"a"', "id0", "f"),), (CallDelta(0, ": 1}"),)]
    fed, end, called = _forced("f", [])
    assert (fed, end, called) == ([], Emit("", (CallDelta(0, "", "id0", "f"),)), True)


REQUIRED = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.sampled_from([REQUIRED, REQUIRED[:20], "[]", "", '[{"name": "a"}]']),
                 st.text(alphabet='[]{}":, nameparts1', max_size=40)),
       st.booleans(), st.lists(st.integers(0, 80), max_size=10))
def test_forced_required_streamed_equals_whole(text, parallel, cuts):
    """``"required"``: the calls (or, for no array of calls, the text as content) at the end."""
    fed, end, called = _forced(None, _split(text, cuts), parallel)
    assert all(e == Emit() for e in fed)
    whole = _whole_forced(None, text, parallel)
    assert accumulate([*fed, end]) == whole and called == bool(whole[1])
    assert parse_forced(None, text).calls or end == Emit(text)
