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
    f"<tool_call>{{bad</tool_call><tool_call>{W}</tool_call>",  # malformed before any call: all content
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
    '{"x": 1}',
    '{"arguments": {}}',  # no name
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
                                  "[TOOL_CALLS]a[ARGS]", "[TOOL_CALLS]a b[ARGS]{}",
                                  "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS]a[ARGS][1]",
                                  "[TOOL_CALLS]" + "f" * 65 + "[ARGS]{}"])
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


# ---------------------------------------------------------------- committed calls (the relaxed rules)
@pytest.mark.parametrize("parser,text,content,calls", [
    # a call is made once its name and the start of its arguments are read: text after it that
    # breaks the format ends it (its arguments cut there) or is dropped
    ("hermes", f"<tool_call>{W}</tool_call><tool_call>{{bad</tool_call>", None, [("get_weather", W_ARGS)]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1, </tool_call>', None, [("f", '{"x": 1, ')]),
    ("hermes", f'<tool_call>{{"name": "f", "arguments": {{"x": NaN}}}}</tool_call><tool_call>{W}</tool_call>',
     None, [("f", '{"x": '), ("get_weather", W_ARGS)]),  # the next block is read after a broken one
    ("hermes", 'hi <tool_call>{"name": "f", "arguments": {"a": [1, {"b": "c"}]', "hi ", [("f", '{"a": [1, {"b": "c"}]')]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "f"}', None, [("f", '{"x": 1}')]),  # name after
    ("hermes", '<tool_call>{"name": "f", "arguments": null}', None, [("f", "{}")]),
    ("hermes", '<tool_call>{"name":"f","arguments":{"x" :1}}', None, [("f", '{"x" :1}')]),  # as written
    ("llama3_json", W + " and more", None, [("get_weather", W_ARGS)]),
    ("llama3_json", W + ";", None, [("get_weather", W_ARGS)]),
    ("llama3_json", '{"name": "a", "parameters": {}, "arguments": {"x": 1}}', None, [("a", "{}")]),  # the first
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": ', None, [("a", '{"x": ')]),
    ("mistral", "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]", None, [("a", "{}")]),
    ("mistral", "[TOOL_CALLS]a[ARGS]{} tail", None, [("a", "{}")]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": tru}[TOOL_CALLS]b[ARGS]{}', None, [("a", '{"x": tru'), ("b", "{}")]),
    ("mistral", 'ok [TOOL_CALLS][{"name": "a", "arguments": {}}] and text', "ok ", [("a", "{}")]),
])
def test_a_committed_call_stands_whatever_follows(parser, text, content, calls):
    got = P(parser, text)
    assert (got.content, [(c.name, c.arguments) for c in got.calls]) == (content, calls)


@pytest.mark.parametrize("parser,text,calls", [
    # raw arguments text is carried as written: an escape stays an escape, a number its digits
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>', [("f", '{"x": "\\ud800"}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>', [("f", '{"x": 1e400}')]),
    ("llama3_json", '{"name": "f", "parameters": {"x": [-1E999]}}', [("f", '{"x": [-1E999]}')]),
    # NaN / Infinity are no JSON: the arguments end before them
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', [("f", '{"x": ')]),
    ("llama3_json", '{"name": "f", "parameters": {"x": -Infinity}}', [("f", '{"x": -')]),
    # a name or a string of arguments no response could carry: no call, all content
    ("hermes", '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"y\\": Infinity}"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"y\\": \\"\\ud800\\"}"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 70 + "]" * 70 + '}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 70 + "]" * 70 + '}}', [("f", '{"x": ' + "[" * 63)]),
])
def test_what_the_arguments_carry(parser, text, calls):
    """Arguments are the model's text of the JSON object as far as it is JSON (nesting at most
    MAX_DEPTH deep); a call that cannot be made is the text as content."""
    p = parse(parser, text)
    assert [(c.name, c.arguments) for c in p.calls] == calls
    assert p.content == (None if calls else text)


# ---------------------------------------------------------------- streaming == whole
def _stream(parser, pieces, parallel=True):
    """(each feed's Emit, finish's Emit), checking that accumulated they are the whole text's parse
    (with the same ids) and ``called`` says so."""
    s = ToolStream(parser, _ids(), parallel)
    fed = [s.feed(p) for p in pieces]
    end = s.finish()
    content, calls = accumulate([*fed, end])
    whole = parse(parser, "".join(pieces), _ids(), parallel)
    assert (content or None if calls else content, calls) == (whole.content, whole.calls)
    assert s.called == bool(calls)
    return fed, end


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
    '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]Ab3dE6gh9[ARGS]{"y": [1.5e-3, true, null]}',
    "[TOOL_CALLS nope",
    "plain text, no calls at all",
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.sampled_from(PARSERS), st.lists(st.integers(0, 200), max_size=12),
       st.booleans())
def test_streamed_equals_whole(text, parser, cuts, parallel):
    _stream(parser, _split(text, cuts), parallel)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<>/_{}[]\":;, toolcaTOLCAS|pythng\n", max_size=60), st.sampled_from(PARSERS),
       st.lists(st.integers(0, 60), max_size=8))
def test_streamed_equals_whole_any_text(text, parser, cuts):
    _stream(parser, _split(text, cuts))


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=6),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
                     max_leaves=8)
_CALL = st.tuples(st.text("abf_-1", min_size=1, max_size=6), st.dictionaries(st.text(max_size=4), _JSON, max_size=3),
                  st.sampled_from([(", ", ": "), (",", ":"), (" , ", " :  ")]))


def _obj(name, args, seps, key="arguments"):
    return json.dumps({"name": name, key: args}, separators=seps, ensure_ascii=False)


def _written(fmt, calls, before):
    """A text as a model of ``fmt`` writes ``calls`` ((name, arguments, separators)), with
    ``before`` as its leading content where the format has one."""
    if fmt == "hermes":
        return before + "".join(f"<tool_call>\n{_obj(*c)}\n</tool_call>\n" for c in calls)
    if fmt == "llama3_json":
        return "<|python_tag|>" * (before != "") + "; ".join(_obj(n, a, s, "parameters") for n, a, s in calls)
    if fmt == "mistral":
        return before + "[TOOL_CALLS]" + json.dumps([json.loads(_obj(*c)) for c in calls])
    if fmt == "mistral_v11":
        return before + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, separators=s)}" for n, a, s in calls)
    return "[" + ", ".join(_obj(n, a, s, "parameters") for n, a, s in calls) + "]"  # required


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["hermes", "llama3_json", "mistral", "mistral_v11", "required"]),
       st.lists(_CALL, min_size=1, max_size=3), st.sampled_from(["", "Sure. ", "<tool"]),
       st.one_of(st.none(), st.tuples(st.integers(0, 400), st.sampled_from(["", "x", "}", "]", '"', "<tool_call>"]))),
       st.lists(st.integers(0, 400), max_size=20), st.booleans())
def test_any_split_of_a_generated_text_streams_its_whole_answer(fmt, calls, before, damage, cuts, parallel):
    """Texts as models write calls (each parser's format, and ``required``'s array), whole, cut
    (max_tokens) or with a character put in anywhere: however the text is split into deltas, the
    stream accumulated as the openai client does is exactly the non-streamed answer; an intact
    text's calls are the calls written, arguments as written."""
    text = _written(fmt, calls, before)
    if damage is not None:
        at, ins = damage
        at %= len(text) + 1
        text = text[:at] + ins + (text[at:] if ins else "")  # "" cuts the text there
    pieces = _split(text, cuts)
    if fmt == "required":
        s = ForcedStream(None, _ids(), parallel)
        emits = [*(s.feed(p) for p in pieces), s.finish()]
        content, got = accumulate(emits)
        whole = parse_forced(None, text, _ids(), parallel)
        assert (content or None if got else content, got) == (whole.content, whole.calls)
    else:
        whole = parse(fmt.split("_v11")[0], text, _ids(), parallel)
        _stream(fmt.split("_v11")[0], pieces, parallel)
    if damage is None:
        want = [(n, json.dumps(a, separators=s) if fmt == "mistral_v11" else
                 json.dumps(a) if fmt == "mistral" else json.dumps(a, separators=s, ensure_ascii=False))
                for n, a, s in calls]
        assert [(c.name, c.arguments) for c in whole.calls] == want[:1 if not parallel else None]
        assert whole.content == (before or None if fmt in ("hermes", "mistral", "mistral_v11") else None)


def test_stream_holds_only_a_possible_marker():
    fed, end = _stream("hermes", ["Hi <tool", "_x more", " <tool_call>{", '"name": "f"}'])
    assert (fed, end) == ([Emit("Hi "), Emit("<tool_x more"), Emit(" "), Emit("", (CallDelta(0, "{}", "id0", "f"),))],
                          Emit())


def test_stream_llama_text_is_content_at_once():
    assert _stream("llama3_json", ["Hello", " there"]) == ([Emit("Hello"), Emit(" there")], Emit())
    assert _stream("llama3_json", ["<|py", 'thon_tag|>{"name": "f"}']) == (
        [Emit(), Emit("", (CallDelta(0, "{}", "id0", "f"),))], Emit())


# ---------------------------------------------------------------- exact chunks
WEATHER_TOKENS = ['<tool_call>', '\n{"', 'name', '": "', 'get', '_weather', '", "', 'arguments', '": {"',
                  'city', '": "', 'Paris', '"}}', '\n</tool_call>']


def test_exact_chunks_one_call_after_content():
    """The name goes out once it and the arguments' opening brace are read, then each token's
    piece of the arguments as it comes; text outside the block, nothing."""
    fed, end = _stream("hermes", ["Let me", " check.", "\n", *WEATHER_TOKENS])
    assert [e for e in fed] == [
        Emit("Let me"), Emit(" check."), Emit("\n"), *[Emit()] * 8, Emit("", (CallDelta(0, '{"', "id0", "get_weather"),)), Emit("", (CallDelta(0, "city"),)),
        Emit("", (CallDelta(0, '": "'),)), Emit("", (CallDelta(0, "Paris"),)), Emit("", (CallDelta(0, '"}'),)),
        Emit()]
    assert end == Emit()


def test_exact_chunks_two_parallel_calls_and_parallel_false():
    two = ['<tool_call>{"name": "a", "arguments": {"x"', ': 1}}</tool_call>\n<tool_call>{"name": "b", ',
           '"arguments": {}}', "</tool_call>"]
    fed, end = _stream("hermes", two)
    assert fed == [Emit("", (CallDelta(0, '{"x"', "id0", "a"),)),
                   Emit("", (CallDelta(0, ": 1}"),)),
                   Emit("", (CallDelta(1, "{}", "id1", "b"),)), Emit()]
    fed, end = _stream("hermes", two, parallel=False)  # the first call only: the rest is dropped
    assert fed == [Emit("", (CallDelta(0, '{"x"', "id0", "a"),)), Emit("", (CallDelta(0, ": 1}"),)), Emit(), Emit()]
    assert end == Emit()
    # two calls' items in one delta: one item each
    fed, end = _stream("hermes", ["".join(two)])
    assert fed == [Emit("", (CallDelta(0, '{"x": 1}', "id0", "a"), CallDelta(1, "{}", "id1", "b")))]


def test_exact_chunks_call_then_malformed_text():
    fed, end = _stream("hermes", ['<tool_call>{"name": "a", "arguments": {"x": ', "1, ", "oops", "}}</tool_call>"])
    assert fed == [Emit("", (CallDelta(0, '{"x": ', "id0", "a"),)), Emit("", (CallDelta(0, "1, "),)), Emit(), Emit()]
    assert end == Emit()


def test_exact_chunks_malformed_before_any_call_is_content_from_there():
    fed, end = _stream("hermes", ["ok ", "<tool_call>", '{"nam', "e\": 3", ", more"])
    assert fed == [Emit("ok "), Emit(), Emit(), Emit('<tool_call>{"name": 3'), Emit(", more")]
    assert end == Emit()
    fed, end = _stream("hermes", ["ok ", "<tool_call>", '{"name": "f"'])  # cut before the call is made
    assert fed == [Emit("ok "), Emit(), Emit()] and end == Emit('<tool_call>{"name": "f"')


def test_exact_chunks_required():
    fed, end = _stream_forced(None, ['[{"name": "a", "para', 'meters": {"x": 1', "}}, ", '{"name": "b"}]'])
    assert fed == [Emit(), Emit("", (CallDelta(0, '{"x": 1', "id0", "a"),)), Emit("", (CallDelta(0, "}"),)),
                   Emit("", (CallDelta(1, "{}", "id1", "b"),))]
    assert end == Emit()


def _stream_forced(function, pieces, parallel=True):
    s = ForcedStream(function, _ids(), parallel)
    fed = [s.feed(p) for p in pieces]
    return fed, s.finish()


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4),
       st.text(min_size=1, max_size=8))
def test_hermes_round_trips_any_arguments(args, name):
    t = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
    (call,) = P("hermes", t).calls
    assert (call.name, json.loads(call.arguments)) == (name, args)


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
    """``"required"``: the calls as they are read, or, for a text with none, the text as content
    (from where it breaks the array, or at the end)."""
    fed, end, called = _forced(None, _split(text, cuts), parallel)
    whole = _whole_forced(None, text, parallel)
    assert accumulate([*fed, end]) == whole and called == bool(whole[1])
    assert all(e.content == "" for e in [*fed, end]) if whole[1] else accumulate([*fed, end]) == (text, ())
