"""What the gateway does on its event loop for a constrained request before the compile queue
(``openai_schemas.checked_constraint_summary``): the size refusal, the compiled-key and the
character count from one JSON writing of each constraint value. Each of them wrote the
constraint's JSON itself, up to three times per request (a 32 KiB schema: three 32 KiB
``json.dumps`` on the loop). The refusals and their order are check_constraint_size's, pinned in
test_structured_outputs.py; here: how often the constraint is written, and that the key and
count equal constraint_summary's."""

from __future__ import annotations

import json

import pytest

import pdd.gateway.openai_schemas as schemas
import pdd.structured as structured
from pdd.gateway.openai_schemas import (ApiError, ChatCompletionRequest, CompletionRequest, check_constraint_size,
                                        checked_constraint_summary, constraint_summary, structured_constraint)

MARK = "mark-" + "m" * 200  # a text only the constraint holds
MSGS = [{"role": "user", "content": "hi"}]


def _tools(params: list[dict | None]) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "description": "d",
                                              **({} if p is None else {"parameters": p})}}
            for i, p in enumerate(params)]


P_MARK = {"type": "object", "properties": {"a": {"type": "string", "description": MARK}}}
P_DEFS = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "string"}}}

FORMS = {
    "guided_json": {"guided_json": {"enum": [MARK, "é", "😀"]}},
    "guided_json text": {"guided_json": json.dumps({"enum": [MARK]})},
    "guided_choice": {"guided_choice": [MARK, "b\x7f"]},
    "guided_regex": {"guided_regex": MARK},
    "guided_grammar": {"guided_grammar": f'root ::= "{MARK}"'},
    "response_format": {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "n", "schema": {"enum": [MARK]}}}},
    "response_format json_object": {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": MARK},
    "structured_outputs json": {"structured_outputs": {"json": {"enum": [MARK]}, "whitespace_pattern": " "}},
    "structured_outputs choice": {"structured_outputs": {"choice": [MARK]}},
    "structured_outputs regex": {"structured_outputs": {"regex": MARK}},
    "whitespace": {"guided_json": {"enum": [MARK]}, "guided_whitespace_pattern": "[ ]?"},
    "tool named": {"tools": _tools([P_MARK, None]), "tool_choice": {"type": "function", "function": {"name": "f0"}}},
    "tool required": {"tools": _tools([P_MARK, None, {"type": "object"}]), "tool_choice": "required"},
    "tool required one": {"tools": _tools([P_MARK]), "tool_choice": "required", "parallel_tool_calls": False},
}


class Counting:
    """A stand-in for a module's ``json``: ``dumps`` writes as json's and counts the texts it
    wrote that hold MARK."""

    def __init__(self):
        self.marked = 0

    def dumps(self, *a, **kw):
        out = json.dumps(*a, **kw)
        self.marked += MARK in out
        return out

    def __getattr__(self, name):
        return getattr(json, name)


@pytest.fixture
def counting(monkeypatch) -> Counting:
    c = Counting()
    monkeypatch.setattr(schemas, "json", c)
    monkeypatch.setattr(structured, "json", c)
    return c


@pytest.mark.parametrize("form", FORMS)
def test_the_constraint_is_written_once(form, counting):
    body = ChatCompletionRequest.model_validate({"messages": MSGS, **FORMS[form]})
    key, chars = checked_constraint_summary(body)
    assert counting.marked == 1
    assert key is not None and MARK in key


@pytest.mark.parametrize("form", FORMS)
def test_the_key_and_count_are_constraint_summarys(form):
    body = ChatCompletionRequest.model_validate({"messages": MSGS, **FORMS[form]})
    assert checked_constraint_summary(body) == constraint_summary(body)
    assert check_constraint_size(body) is None


def test_a_tool_whose_parameters_have_defs_is_measured_as_the_compile_does():
    """Its parameters lose their $defs to the call's schema: written apart, the same key and count."""
    body = ChatCompletionRequest.model_validate({"messages": MSGS, "tools": _tools([P_DEFS, P_MARK]),
                                                 "tool_choice": "required"})
    assert checked_constraint_summary(body) == constraint_summary(body)


BIG = "e" * 40_000


@pytest.mark.parametrize("form", [
    {"guided_json": {"enum": [BIG, "é" * 10, "😀" * 10, "\x7f"]}},
    {"guided_json": {"enum": ["é" * 8_000]}},  # 8,000 characters, 48,000 written as JSON escapes
    {"guided_choice": ["😀" * 3_000]},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [BIG]}}}},
    {"structured_outputs": {"json": {"enum": [BIG]}}},
    {"tools": _tools([{"type": "object", "properties": {"a": {"enum": [BIG]}}}]), "tool_choice": "required"},
    {"tools": _tools([{"type": "object", "properties": {"a": {"enum": ["é" * 8_000]}}}]),
     "tool_choice": {"type": "function", "function": {"name": "f0"}}},
    {"tools": _tools([P_DEFS, {"type": "object", "properties": {"a": {"enum": [BIG]}}}]), "tool_choice": "required"},
])
def test_its_size_is_the_compiles(form, counting):
    """The characters refused are those the compile counts (pdd.structured.size_refusal: the
    value's JSON with non-ASCII characters escaped), though written once, unescaped."""
    body = ChatCompletionRequest.model_validate({"messages": MSGS, **form})
    with pytest.raises(ApiError) as want:
        structured_constraint(body)
    with pytest.raises(ApiError) as got:
        checked_constraint_summary(body)
    assert (got.value.message, got.value.param) == (want.value.message, want.value.param)
    assert "characters; at most 32,768 are compiled" in got.value.message


def test_a_completion_request_alike():
    body = CompletionRequest.model_validate({"prompt": "x", "guided_json": {"enum": [MARK]}})
    assert checked_constraint_summary(body) == constraint_summary(body)
    assert checked_constraint_summary(CompletionRequest.model_validate({"prompt": "x"})) == (None, 0)


@pytest.mark.parametrize("form", ["guided_json", "response_format", "tool required", "whitespace"])
def test_a_request_through_the_gateway_writes_it_once_before_its_compile(api, monkeypatch, counting, form):
    """The HTTP app's path up to the compile queue (the compile itself stubbed: it runs on the
    compiler thread, not on the event loop)."""
    import pdd.gateway.api as gapi

    client, orch = api
    monkeypatch.setattr(gapi, "structured_constraint", lambda body, lltok=None: None)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **FORMS[form]})
    assert r.status_code == 200, r.text
    assert counting.marked == 1


@pytest.mark.parametrize("form", [
    {"tools": _tools([None, {}]), "tool_choice": "required"},
    {"tools": _tools([P_DEFS]), "tool_choice": {"type": "function", "function": {"name": "f0"}}},
    {"guided_json": {"enum": ["\x00pdd-constraint-hole-0\x00", MARK]}},  # the mark a hole is written with
    {"response_format": {"type": "json_schema", "json_schema": {"name": "\x00pdd-constraint-hole-0\x00",
                                                                "schema": {"enum": [MARK]}}}},
    {"tools": [{"type": "function", "function": {"name": "\x00pdd-constraint-hole-0\x00", "parameters": P_MARK}}],
     "tool_choice": "required"},
])
def test_odd_values_are_summarised_as_constraint_summary_does(form):
    body = ChatCompletionRequest.model_validate({"messages": MSGS, **form})
    assert checked_constraint_summary(body) == constraint_summary(body)
