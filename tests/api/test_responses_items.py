"""``/v1/responses`` input checks OpenAI makes (a ``function_call_output`` answering no call, a
``function_call`` whose ``arguments`` is not JSON), response ids unique per response (not the
client's ``X-Request-Id``), ``GET /v1/responses/{id}/input_items`` and ``POST
/v1/responses/{id}/cancel``: through the official openai client where it has the call, on the
real gateway app over tests/api/test_responses_api.py's scripted orchestrator."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pdd.text import shown
from tests.api.test_responses_api import HERMES_ONE, MODEL, PLAIN, R_TOOLS, serve  # noqa: F401  (fixture)

BASE = {"model": MODEL, "input": "hi"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


# ---------------------------------------------------------------- function call items


@pytest.mark.parametrize("items,param,message", [
    ([{"role": "user", "content": "weather?"}, {"type": "function_call_output", "call_id": "call_9", "output": "x"}],
     "input[1].call_id", "input[1].call_id: No tool call found for function call output with call_id 'call_9'"),
    ([CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
      {"type": "function_call_output", "call_id": "call_2", "output": "noon"}],
     "input[2].call_id", "input[2].call_id: No tool call found for function call output with call_id 'call_2'"),
    # two outputs of one call: OpenAI refuses it (which is the call's result?)
    ([CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
      {"role": "user", "content": "and?"}, {"type": "function_call_output", "call_id": "call_1", "output": "rain"}],
     "input[3].call_id", "input[3].call_id: Duplicate function call output for call_id 'call_1': input[1] "
     "answers it already"),
    # two calls of one call_id: an output could not tell which it answers
    ([{"role": "user", "content": "weather?"}, CALL, {**CALL, "arguments": "{}"}], "input[2].call_id",
     "input[2].call_id: Duplicate function call with call_id 'call_1': input[1] has it already"),
    # an output before its call: the conversation would show the result before the model asked for it
    ([{"role": "user", "content": "weather?"}, {"type": "function_call_output", "call_id": "call_1", "output": "x"},
      CALL], "input[1].call_id",
     "input[1].call_id: the function call output for call_id 'call_1' comes before its function call (input[2]); "
     "an output must follow its call"),
    ([{**CALL, "arguments": '{"city": '}], "input[0].arguments",
     "input[0].arguments: must be a JSON string (the call's arguments as JSON text), got '{\"city\": '"),
    ([{"role": "user", "content": "hi"}, {**CALL, "arguments": ""}], "input[1].arguments",
     "input[1].arguments: must be a JSON string (the call's arguments as JSON text), got ''"),
    # nested past the decoder's recursion: a 500 and a reset connection
    ([{"role": "user", "content": "hi"}, {**CALL, "arguments": "[" * 1000 + "]" * 1000}], "input[1].arguments",
     "input[1].arguments: JSON nested too deeply to read (the call's arguments as JSON text), got "
     + shown("[" * 1000 + "]" * 1000)),
    # valid JSON Python's int cannot read (over 4,300 digits): said so, not "not JSON"
    ([{"role": "user", "content": "hi"}, {**CALL, "arguments": "1" * 5000}], "input[1].arguments",
     "input[1].arguments: must be a JSON string (the call's arguments as JSON text) (it holds an integer of more "
     "than 4,300 digits), got " + shown("1" * 5000)),
    # NaN / Infinity (and a number too large for a float) are Python's json's, not JSON: they were accepted
    *[([{"role": "user", "content": "hi"}, {**CALL, "arguments": f'{{"x": {bad}}}'}], "input[1].arguments",
        f"input[1].arguments: must be strict JSON text: {bad} is not a JSON number (JSON numbers are finite), got "
        f"'{{\"x\": {bad}}}'")
      for bad in ("NaN", "Infinity", "-Infinity", "1e999")],
    # a call's name is held to the tools' name pattern (it was not checked)
    *[([{**CALL, "name": name}], "input[0].name",
        f"input[0].name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{{1,64}}$), got "
        f"{name!r}") for name in ("get weather", "a.b", "x" * 65)],
])
async def test_function_call_items_that_cannot_be_a_conversation_are_400s(serve, items, param, message):
    from openai import BadRequestError

    s = await serve([PLAIN])
    with pytest.raises(BadRequestError) as e:
        await s.client().responses.create(model=MODEL, tools=R_TOOLS, input=items)
    assert e.value.status_code == 400
    assert (e.value.body["param"], e.value.body["type"], e.value.body["message"]) == (
        param, "invalid_request_error", message)
    assert s.orch.started == []


NAME_RULE = "must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$)"


@pytest.mark.parametrize("extra,param,message", [
    # parameters that are no JSON object: refused whatever tool_choice is (it was only when a call was forced)
    *[({"tools": [{"type": "function", "name": "f", "parameters": 5}], "tool_choice": tc}, "tools[0].parameters",
       "tools[0].parameters: must be a JSON schema object, got 5")
      for tc in (None, "auto", "none", "required", {"type": "function", "name": "f"})],
    ({"tools": [*R_TOOLS, {"type": "function", "name": "f", "parameters": "{}"}]}, "tools[2].parameters",
     "tools[2].parameters: must be a JSON schema object, got '{}'"),
    # a lone surrogate in a name: the name check's 400 (it was the surrogate walk's, naming tools)
    ({"tools": [{"type": "function", "name": "f\ud800"}]}, "tools[0].name",
     f"tools[0].name: {NAME_RULE}, got 'f\\ud800'"),
    ({"tools": [{"type": "function", "name": "f\ud800"}], "tool_choice": "required"}, "tools[0].name",
     f"tools[0].name: {NAME_RULE}, got 'f\\ud800'"),
    # a name that is no non-empty string names the name (it named tools)
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name", f"tools[0].name: {NAME_RULE}, got ''"),
    ({"tools": [*R_TOOLS, {"type": "function", "name": 5}]}, "tools[2].name",
     "tools[2].name: required, a string of 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), "
     "got 5"),
    ({"tools": [{"type": "function", "name": None}]}, "tools[0].name",
     "tools[0].name: required, a string of 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), "
     "got None"),
    # a description that is no string: refused (it was accepted)
    ({"tools": [{"type": "function", "name": "f", "description": 5}]}, "tools[0].description",
     "tools[0].description: must be a string, got 5"),
    ({"tools": [*R_TOOLS, {"type": "function", "name": "f", "description": ["d"]}], "tool_choice": "none"},
     "tools[2].description", "tools[2].description: must be a string, got ['d']"),
])
async def test_malformed_function_tools_are_400s_naming_the_field(serve, extra, param, message):
    s = await serve([PLAIN])
    body = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (400, {"error": {"message": message, "type": "invalid_request_error",
                                                         "param": param, "code": None}})
    assert s.orch.started == []


async def test_an_output_answers_a_call_of_the_previous_response_chain_only(serve):
    """call ids of the previous_response_id chain's outputs count; another response's do not."""
    from openai import BadRequestError

    s = await serve([HERMES_ONE])
    c = s.client()
    r1 = await c.responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS)
    r2 = await c.responses.create(model=MODEL, input="again?", tools=R_TOOLS, previous_response_id=r1.id)
    call1 = r1.output[1].call_id
    other = await c.responses.create(model=MODEL, input="weather in Rome?", tools=R_TOOLS)
    n = len(s.orch.started)
    with pytest.raises(BadRequestError) as e:
        await c.responses.create(model=MODEL, tools=R_TOOLS, previous_response_id=r1.id, input=[
            {"type": "function_call_output", "call_id": other.output[1].call_id, "output": "sunny"}])
    assert (e.value.body["param"], len(s.orch.started)) == ("input[0].call_id", n)
    # r1's call, two responses back in the chain
    r3 = await c.responses.create(model=MODEL, tools=R_TOOLS, previous_response_id=r2.id,
                                  input=[{"type": "function_call_output", "call_id": call1, "output": "sunny"}])
    assert r3.status == "completed" and len(s.orch.started) == n + 1


async def test_a_call_id_the_previous_response_chain_has_cannot_be_made_or_answered_again(serve):
    """A function_call item repeating a call id of the previous_response_id chain, or a
    function_call_output answering a call the chain answered already, is refused as the same
    repeat inside one input is (they were accepted: the conversation then had two calls, or two
    results, of one id)."""
    from openai import BadRequestError

    s = await serve([HERMES_ONE])
    c = s.client()
    r1 = await c.responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS)
    call1 = r1.output[1].call_id
    n = len(s.orch.started)
    with pytest.raises(BadRequestError) as e:
        await c.responses.create(model=MODEL, tools=R_TOOLS, previous_response_id=r1.id, input=[
            {"role": "user", "content": "again?"}, {**CALL, "call_id": call1}])
    assert (e.value.status_code, e.value.body["param"], e.value.body["message"]) == (
        400, "input[1].call_id", f"input[1].call_id: Duplicate function call with call_id {call1!r}: the "
        "previous_response_id chain has it already")
    r2 = await c.responses.create(model=MODEL, tools=R_TOOLS, previous_response_id=r1.id,
                                  input=[{"type": "function_call_output", "call_id": call1, "output": "sunny"}])
    assert len(s.orch.started) == n + 1
    r3 = await c.responses.create(model=MODEL, input="and tomorrow?", tools=R_TOOLS, previous_response_id=r2.id)
    for prev in (r2.id, r3.id):  # answered one response back, and two
        with pytest.raises(BadRequestError) as e:
            await c.responses.create(model=MODEL, tools=R_TOOLS, previous_response_id=prev, input=[
                {"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": call1, "output": "rain"}])
        assert (e.value.status_code, e.value.body["param"], e.value.body["message"]) == (
            400, "input[1].call_id", f"input[1].call_id: Duplicate function call output for call_id {call1!r}: the "
            "previous_response_id chain answers it already")
    assert len(s.orch.started) == n + 2


# ---------------------------------------------------------------- response ids


async def test_response_ids_are_unique_and_x_request_id_stays_the_correlation_id(serve):
    """Two requests sent with one X-Request-Id are two responses, both kept; the header is echoed."""
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        a = await http.post("/v1/responses", json={**BASE, "input": "one"}, headers={"X-Request-Id": "same-1"})
        b = await http.post("/v1/responses", json={**BASE, "input": "two"}, headers={"X-Request-Id": "same-1"})
        assert (a.status_code, b.status_code, a.headers["x-request-id"], b.headers["x-request-id"]) == (
            200, 200, "same-1", "same-1")
        ida, idb = a.json()["id"], b.json()["id"]
        assert re.fullmatch(r"resp_[0-9a-f]{32}", ida) and re.fullmatch(r"resp_[0-9a-f]{32}", idb) and ida != idb
        for rid, text in ((ida, "one"), (idb, "two")):
            got = await http.get(f"/v1/responses/{rid}/input_items")
            assert got.json()["data"][0]["content"] == [{"type": "input_text", "text": text}]


# ---------------------------------------------------------------- input items


async def test_input_items_are_listed_as_openai_lists_them(serve):
    s = await serve([PLAIN])
    c = s.client()
    r = await c.responses.create(model=MODEL, instructions="Be brief.", tools=R_TOOLS, input=[
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "id": "msg_given", "content": [{"type": "output_text", "text": "Ok."}]},
        CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    page = await c.responses.input_items.list(r.id)
    data = [i.model_dump(exclude_none=True) for i in page.data]
    assert [d["type"] for d in data] == ["function_call_output", "function_call", "message", "message"]  # desc
    ids = [d.pop("id") for d in data]
    assert re.fullmatch(r"fco_[0-9a-f]{24}", ids[0]) and re.fullmatch(r"fc_[0-9a-f]{24}", ids[1])
    assert ids[2] == "msg_given" and re.fullmatch(r"msg_[0-9a-f]{24}", ids[3]) and len(set(ids)) == 4
    assert data == [
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "status": "completed"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "status": "completed"},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Ok.", "annotations": []}]},
        {"type": "message", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "weather?"}]}]
    assert (page.first_id, page.last_id, page.has_more) == (ids[0], ids[3], False)
    asc = await c.responses.input_items.list(r.id, order="asc")
    assert [i.id for i in asc.data] == ids[::-1]


async def test_input_items_pages_with_limit_and_after(serve):
    s = await serve([PLAIN])
    c = s.client()
    r = await c.responses.create(model=MODEL, input=[{"role": "user", "content": f"m{i}"} for i in range(5)])
    page = await c.responses.input_items.list(r.id, limit=2, order="asc")
    texts = [i.content[0].text for i in page.data]
    assert (texts, page.has_more) == (["m0", "m1"], True)
    page2 = await c.responses.input_items.list(r.id, limit=2, order="asc", after=page.last_id)
    assert ([i.content[0].text for i in page2.data], page2.has_more) == (["m2", "m3"], True)
    every = [i.content[0].text async for i in c.responses.input_items.list(r.id, limit=2)]  # the client pages on
    assert every == ["m4", "m3", "m2", "m1", "m0"]
    last = await c.responses.input_items.list(r.id, order="asc", after=page2.data[1].id)
    assert ([i.content[0].text for i in last.data], last.has_more) == (["m4"], False)
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        got = (await http.get(f"/v1/responses/{r.id}/input_items", params={"after": last.data[0].id,
                                                                             "order": "asc"})).json()
        assert got == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
        got = (await http.get(f"/v1/responses/{r.id}/input_items", params={"limit": "100"})).json()
        assert len(got["data"]) == 5


@pytest.mark.parametrize("params,param,words", [
    ({"limit": "0"}, "limit", "limit: must be an integer from 1 to 100, got '0'"),
    ({"limit": "101"}, "limit", "limit: must be an integer from 1 to 100, got '101'"),
    ({"limit": "x"}, "limit", "limit: must be an integer from 1 to 100, got 'x'"),
    ({"order": "up"}, "order", "order: must be 'asc' or 'desc', got 'up'"),
    ({"after": "msg_nope"}, "after", "after: 'msg_nope' is not an input item of response"),
])
async def test_input_items_bad_query_is_a_400_naming_it(serve, params, param, words):
    s = await serve([PLAIN])
    r = await s.client().responses.create(model=MODEL, input="hi")
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        got = await http.get(f"/v1/responses/{r.id}/input_items", params=params)
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert (err["param"], err["type"]) == (param, "invalid_request_error") and err["message"].startswith(words), err


async def test_input_items_and_cancel_of_an_unknown_or_unstored_response_are_404s(serve):
    from openai import NotFoundError

    s = await serve([PLAIN])
    c = s.client()
    unstored = await c.responses.create(model=MODEL, input="hi", store=False)
    for rid in ("resp_nope", unstored.id):
        with pytest.raises(NotFoundError) as e:
            await c.responses.input_items.list(rid)
        assert (e.value.body["code"], e.value.body["param"]) == ("response_not_found", None)
        with pytest.raises(NotFoundError) as e:
            await c.responses.cancel(rid)
        assert e.value.body["code"] == "response_not_found"
    kept = await c.responses.create(model=MODEL, input="hi")
    await c.responses.delete(kept.id)
    with pytest.raises(NotFoundError):
        await c.responses.input_items.list(kept.id)


async def test_cancel_of_a_stored_response_is_a_400(serve):
    from openai import BadRequestError

    s = await serve([PLAIN])
    c = s.client()
    r = await c.responses.create(model=MODEL, input="hi")
    with pytest.raises(BadRequestError) as e:
        await c.responses.cancel(r.id)
    assert (e.value.body["type"], e.value.body["param"]) == ("invalid_request_error", None)
    assert e.value.body["message"] == (f"response {r.id!r} cannot be cancelled: only background responses can be "
                                       "cancelled, and pdd refuses background: true")
    assert (await c.responses.retrieve(r.id)).status == "completed"  # still kept, unchanged


async def test_a_streamed_response_lists_its_input_items(serve):
    s = await serve([PLAIN])
    c = s.client()
    stream = await c.responses.create(model=MODEL, stream=True, input="streamed?")
    last = [ev async for ev in stream][-1].response
    page = await c.responses.input_items.list(last.id)
    assert [(i.type, i.role, i.content[0].text) for i in page.data] == [("message", "user", "streamed?")]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "f"}])
async def test_a_forced_call_whose_parameters_nest_past_the_recursion_limit_is_a_400(serve, tool_choice):
    """Parameters 250 levels deep (within the body's 512 JSON levels) were a 500 (a RecursionError
    copying them into the call's schema); the chat path's 400, as shallower ones get."""
    from tests.api.test_tool_calls import _nested_parameters

    s = await serve([PLAIN])
    body = {**BASE, "tool_choice": tool_choice,
            "tools": [{"type": "function", "name": "f", "parameters": _nested_parameters(250)}]}
    async with httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "tools[0].parameters: recursion limit exceeded (nested too deeply to "
                                 "compile)", "type": "invalid_request_error", "param": "tools[0].parameters",
                                 "code": None}
    assert s.orch.started == []
