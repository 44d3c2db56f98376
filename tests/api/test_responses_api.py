"""``POST /v1/responses`` through the official openai client (``client.responses.create``,
streamed and not): the real gateway app and orchestrator on a live uvicorn server over scripted
tiers whose single choice generates a known text (tests/api/test_tool_calls.py's ``TextOrch``),
so the output, the events and the prompt the chat path built are exact."""

from __future__ import annotations

import contextlib
import itertools
import json
import re

import httpx
import pytest

from pdd.config import ClusterConfig
from tests.api.live_app import served
from tests.api.test_tool_calls import (HERMES_ONE, HERMES_TWO, PLAIN, REQUIRED_TWO, T_CALL, W_ARGS, W_CALL, Server,
                                      TextOrch)

MODEL = "pdd-tiny"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": CITY},
           {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
C_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}},
           {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


# renders what a tool-aware template does with tools, an assistant's tool calls and tool results
TOOL_TEMPLATE = (
    "{% if tools %}[tools {% for t in tools %}{{ t.function.name }}:{{ t.function.description }};{% endfor %}]"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
    "[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments }}]{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class PromptOrch(TextOrch):
    """``TextOrch`` that records each request's prompt ids and sampling parameters."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.started: list[tuple[list[int], object]] = []

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0):
        self.started.append((list(prompt_ids), sp))
        return await super().start_request(prompt_ids, sp, rid, sibling_of, siblings)


@pytest.fixture
async def serve(tiny_model):
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    async with contextlib.AsyncExitStack() as stack:
        async def start(texts, parser="hermes", template=None):
            cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model,
                                                "served_model_name": MODEL, "tool_call_parser": parser,
                                                "engine": {"max_model_len": 512, "max_input_len": 400}})
            tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
            orch = PromptOrch(cfg, tok, texts, json.load(open(f"{tiny_model}/config.json"))["eos_token_id"])
            port = await stack.enter_async_context(served(create_app(cfg, orch, tok, template)))
            srv = Server(f"http://127.0.0.1:{port}", orch)
            stack.push_async_callback(srv.oa.close)
            return srv

        yield start


async def _chat_prompt(s, **chat) -> list[int]:
    """The prompt ids the chat endpoint builds for ``chat`` (the same gateway's)."""
    await s.client().chat.completions.create(model=MODEL, **chat)
    return s.orch.started[-1][0]


async def test_string_input_is_one_user_message_and_the_answer_a_message_item(serve):
    s = await serve([PLAIN])
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?")
    got = s.orch.started[-1][0]
    assert got == await _chat_prompt(s, messages=[{"role": "user", "content": "weather in Paris?"}])
    assert re.fullmatch(r"resp_\S+", r.id) and r.object == "response" and r.model == MODEL
    assert (r.status, r.incomplete_details, r.error, r.output_text) == ("completed", None, None, PLAIN)
    (item,) = r.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert re.fullmatch(r"msg_[0-9a-f]{24}", item.id)
    assert [(c.type, c.text, c.annotations) for c in item.content] == [("output_text", PLAIN, [])]
    n_out = len(s.orch.tok.encode(PLAIN, add_special_tokens=False).ids) + 1  # and EOS
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(got), n_out, len(got) + n_out)
    assert (r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens_details.reasoning_tokens) == (0, 0)
    assert (r.tools, r.tool_choice, r.parallel_tool_calls, r.store, r.previous_response_id) == ([], "auto", True,
                                                                                               True, None)


async def test_instructions_items_and_sampling_become_the_chat_request(serve):
    """instructions: a system message first; message items (string or input_text parts); the
    sampling values and the echoed fields."""
    s = await serve([PLAIN])
    r = await s.client().responses.create(
        model=MODEL, instructions="Be brief.", temperature=0.5, top_p=0.9, max_output_tokens=40, user="u1",
        metadata={"k": "v"},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                            {"type": "input_text", "text": "there"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
               {"type": "message", "role": "user", "content": "weather?"}])
    got, sp = s.orch.started[-1]
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.5, 0.9, 40)
    assert got == await _chat_prompt(s, messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi\nthere"},
                                                  {"role": "assistant", "content": "Hello."},
                                                  {"role": "user", "content": "weather?"}])
    assert (r.instructions, r.temperature, r.top_p, r.max_output_tokens, r.user, r.metadata) == (
        "Be brief.", 0.5, 0.9, 40, "u1", {"k": "v"})
    assert r.output_text == PLAIN


async def test_function_calls_and_their_outputs_are_the_chat_tool_turns(serve):
    """Under a template that renders tools, tool calls and tool results: the prompt is exact,
    and chat's for the same conversation."""
    from pdd.gateway.openai_chat import ChatTemplate

    s = await serve([PLAIN], template=ChatTemplate(TOOL_TEMPLATE, {}))
    await s.client().responses.create(model=MODEL, tools=R_TOOLS, input=[
        {"role": "user", "content": "weather and time?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}])
    got = s.orch.started[-1][0]
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert got == await _chat_prompt(s, tools=C_TOOLS, messages=[
        {"role": "user", "content": "weather and time?"}, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}])
    want = ("[tools get_weather:weather;get_time:;]<|user|>weather and time?</s>"
            '<|assistant|>[call call_1 get_weather {"city": "Paris"}][call call_2 get_time {}]</s>'
            "<|tool|>sunny(for call_1)</s><|tool|>noon(for call_2)</s><|assistant|>")
    assert got == s.orch.tok.encode(want, add_special_tokens=False).ids


async def test_output_items_fed_back_as_input_are_the_models_turn(serve):
    """The agent loop (the Agents SDK's): a response's output items, as the client returns them,
    then the call's output, as the next input; the message item and its function calls are one
    assistant turn, as chat would send it."""
    from pdd.gateway.openai_chat import ChatTemplate

    s = await serve([HERMES_ONE], template=ChatTemplate(TOOL_TEMPLATE, {}))
    r1 = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS)
    call_id = r1.output[1].call_id
    await s.client().responses.create(model=MODEL, tools=R_TOOLS, input=[
        {"role": "user", "content": "weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r1.output],
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"}])
    got = s.orch.started[-1][0]
    call = {"id": call_id, "type": "function", "function": {"name": W_CALL[0], "arguments": W_CALL[1]}}
    assert got == await _chat_prompt(s, tools=C_TOOLS, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me check.\n", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}])
    want = ("[tools get_weather:weather;get_time:;]<|user|>weather in Paris?</s>"
            f"<|assistant|>Let me check.\n[call {call_id} {W_CALL[0]} {W_CALL[1]}]</s>"
            f"<|tool|>sunny(for {call_id})</s><|assistant|>")
    assert got == s.orch.tok.encode(want, add_special_tokens=False).ids


def _calls(output):
    out = []
    for o in output:
        if o.type == "function_call":
            assert re.fullmatch(r"fc_[0-9a-f]{24}", o.id) and re.fullmatch(r"call_[0-9a-f]{24}", o.call_id), o
            assert o.status == "completed"
            out.append((o.name, o.arguments))
    return out


async def test_tool_calls_are_function_call_items(serve):
    s = await serve([HERMES_ONE])
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert (r.output_text, _calls(r.output), r.status) == ("Let me check.\n", [W_CALL], "completed")
    s = await serve([HERMES_TWO])
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS, tool_choice="auto")
    assert [o.type for o in r.output] == ["function_call", "function_call"]
    assert (r.output_text, _calls(r.output)) == ("", [W_CALL, T_CALL])
    assert len({o.call_id for o in r.output}) == 2
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS,
                                          parallel_tool_calls=False)
    assert (_calls(r.output), r.parallel_tool_calls) == ([W_CALL], False)
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS, tool_choice="none")
    assert (r.output_text, _calls(r.output), r.tool_choice) == (HERMES_TWO, [], "none")
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]


async def test_max_output_tokens_reached_is_incomplete(serve):
    s = await serve([PLAIN])
    r = await s.client().responses.create(model=MODEL, input="weather?", max_output_tokens=3)
    want = s.orch.tok.decode(s.orch.tok.encode(PLAIN, add_special_tokens=False).ids[:3])
    assert (r.status, r.incomplete_details.reason, r.output[0].status, r.usage.output_tokens) == (
        "incomplete", "max_output_tokens", "incomplete", 3)
    assert r.output_text == want


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "name": "get_weather"}])
async def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item(serve, tool_choice):
    """The call the output ended in is ``incomplete``, streamed (its ``output_item.done`` too) and
    not; a message before it is whole. It was ``completed``, with arguments cut mid-JSON."""
    text = HERMES_ONE if tool_choice == "auto" else W_ARGS
    s = await serve([text])
    n = len(s.orch.tok.encode(text[:text.index('"unit"')], add_special_tokens=False).ids)  # cut in the arguments
    kw = dict(input="weather in Paris?", tools=R_TOOLS, tool_choice=tool_choice, max_output_tokens=n)
    chat = await s.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=C_TOOLS, max_tokens=n,
        tool_choice=tool_choice if tool_choice == "auto" else {"type": "function", "function": {"name": "get_weather"}})
    (call,) = chat.choices[0].message.tool_calls
    cut = call.function.arguments
    assert W_ARGS.startswith(cut) and cut != W_ARGS
    want = ([("message", "completed")] if tool_choice == "auto" else []) + [("function_call", "incomplete")]
    r = await s.client().responses.create(model=MODEL, **kw)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert ([(o.type, o.status) for o in r.output], r.output[-1].arguments) == (want, cut)
    evs = await _events(s, **kw)
    assert [(e.item.type, e.item.status) for e in evs if e.type == "response.output_item.done"] == want
    last = evs[-1].response
    assert (evs[-1].type, [(o.type, o.status) for o in last.output], last.output[-1].arguments) == (
        "response.incomplete", want, cut)


async def _events(s, **kw):
    stream = await s.client().responses.create(model=MODEL, stream=True, **kw)
    return [ev async for ev in stream]


async def test_streamed_text_events(serve):
    s = await serve([PLAIN])
    evs = await _events(s, input="weather in Paris?", metadata={"k": "v"})
    kinds = [e.type for e in evs]
    n_tok = len(s.orch.tok.encode(PLAIN, add_special_tokens=False).ids)
    deltas = [e for e in evs if e.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert 0 < len(deltas) <= n_tok and "".join(d.delta for d in deltas) == PLAIN
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    created, last = evs[0].response, evs[-1].response
    assert (created.status, created.output, created.usage) == ("in_progress", [], None)
    assert created.id == last.id and re.fullmatch(r"resp_\S+", last.id)
    item_id = evs[2].item.id
    assert (evs[2].item.type, evs[2].item.status, evs[2].output_index) == ("message", "in_progress", 0)
    assert {e.item_id for e in evs[3:-2] if hasattr(e, "item_id")} == {item_id}
    assert (evs[-4].text, evs[-3].part.text, evs[-2].item.content[0].text) == (PLAIN, PLAIN, PLAIN)
    assert (last.status, last.output_text, last.metadata, last.usage.output_tokens) == ("completed", PLAIN,
                                                                                         {"k": "v"}, n_tok + 1)
    # the same response as the non-streamed one, but its ids and time
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?", metadata={"k": "v"})
    same = lambda x: re.sub(r'"(resp|msg)_[^"]*"', '""', json.dumps({**x.model_dump(), "created_at": 0}))  # noqa
    assert same(last) == same(r)


async def test_streamed_tool_calls(serve):
    s = await serve([HERMES_ONE])
    evs = await _events(s, input="weather in Paris?", tools=R_TOOLS)
    kinds = [k for k, _ in itertools.groupby(e.type for e in evs if e.type != "response.output_text.delta")]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    # the arguments as generated: a delta per token's piece
    pieces = [e.delta for e in evs if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == W_CALL[1]
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == "Let me check.\n"
    added = [e for e in evs if e.type == "response.output_item.added"][1]
    assert (added.output_index, added.item.type, added.item.name, added.item.arguments, added.item.status) == (
        1, "function_call", "get_weather", "", "in_progress")
    done = [e for e in evs if e.type == "response.function_call_arguments.done"][0]
    assert (done.item_id, done.arguments) == (added.item.id, W_CALL[1])
    last = evs[-1].response
    assert (last.output_text, _calls(last.output)) == ("Let me check.\n", [W_CALL])
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    s = await serve([HERMES_TWO])
    evs = await _events(s, input="weather in Paris?", tools=R_TOOLS)
    assert [e.type for e in evs if e.type.startswith("response.output_text")] == []
    assert _calls(evs[-1].response.output) == [W_CALL, T_CALL]
    assert [e.output_index for e in evs if e.type == "response.output_item.done"] == [0, 1]


async def test_streamed_incomplete_ends_with_response_incomplete(serve):
    s = await serve([PLAIN])
    evs = await _events(s, input="weather?", max_output_tokens=2)
    last = evs[-1]
    assert (last.type, last.response.status, last.response.incomplete_details.reason) == (
        "response.incomplete", "incomplete", "max_output_tokens")
    assert [e.item.status for e in evs if e.type == "response.output_item.done"] == ["incomplete"]


async def test_streamed_with_the_stream_helper(serve):
    """The client's ``responses.stream`` helper accumulates the events into the final response."""
    s = await serve([HERMES_ONE])
    async with s.client().responses.stream(model=MODEL, input="weather in Paris?", tools=R_TOOLS) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert (final.output_text, _calls(final.output), final.status) == ("Let me check.\n", [W_CALL], "completed")


BASE = {"model": MODEL, "input": "hi"}


@pytest.mark.parametrize("extra,param,words", [
    ({"background": True}, "background", "background: true is not supported"),
    ({"conversation": "conv_1"}, "conversation", "no conversation state"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stored prompt template"),
    ({"tools": [{"type": "web_search"}]}, "tools", "the built-in tool 'web_search' is not supported"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools", "'file_search' is not supported"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools", "'computer_use_preview' is not supported"),
    ({"tools": [{"type": "function"}]}, "tools[0].name", "tools[0].name: required"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", "tools[0].name: required"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools[1].name",
     "tools[1].name: 'f' is tools[0]'s too; function names must be unique"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "no built-in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none'"),
    # a number was "tool_choice.str: Input should be a valid string" (pydantic's union branch)
    ({"tool_choice": 5}, "tool_choice", "tool_choice: must be 'auto', 'none', 'required' or an object, got 5"),
    ({"input": 5}, "input", "input: must be a string or a non-empty list of items, got 5"),
    ({"tools": [{"type": "function", "name": "get weather"}]}, "tools[0].name",
     "tools[0].name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), got "
     "'get weather'"),
    ({"tools": [*R_TOOLS, {"type": "function", "name": "x" * 65}]}, "tools[2].name",
     "tools[2].name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), got "
     f"{'x' * 65!r}"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning mode"),
    # the chat path's structured-output refusals, named as the Responses field
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text",
     "text.format.name: required, a non-empty string"),
    ({"tools": R_TOOLS, "tool_choice": {"type": "function", "name": "get_tme"}}, "tool_choice",
     "function 'get_tme' is not one of the tools ('get_weather', 'get_time')"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "text.format: must be an object of type 'text'"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.name: required"),
    ({"tools": R_TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "allowed_tools is not supported"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools: the request has none"),
    ({"include": ["message.output_text.logprobs", "x.y"]}, "include",
     "include[1]: 'x.y' is not one of 'message.output_text.logprobs', "),
    ({"include": [[1], None]}, "include", "include[0]: [1] is not one of 'message.output_text.logprobs', "),
    ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"truncation": "auto"}, "truncation", "truncation 'auto' is not supported"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 keys, got 17"),
    ({"metadata": {"k": 1}}, "metadata", "must be a string of at most 512 characters"),
    ({"input": []}, "input", "input: must be a string or a non-empty list of items"),
    # an input item's refusal names its field in param too (it was "input")
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]", "input[0].content[0]: content of type 'input_image' is not supported"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "input_file",
                                                                               "file_id": "f"}]}]},
     "input[1].content[0]", "input[1].content[0]: content of type 'input_file' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "x"}]}]},
     "input[0].content[1]", "input[0].content[1]: must be a text part (input_text with a string 'text'), got "),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", "input[0].content[0].text: must be a string, got 5"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content",
     "input[0].content: must be a string or a list of content parts, got int"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "input[0].role: must be one of"),
    ({"input": [{"role": "user"}]}, "input[0].content", "input[0].content: required"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "input[0].call_id: required"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c"}]}, "input[1].output", "input[1].output: required"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name",
     "input[0].name: required"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "input[0].call_id: required"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments",
     "input[0].arguments: required"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference is not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "a reasoning item is not supported"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type",
     "input[0].type: item type 'web_search_call' is not supported"),
    ({"input": ["hi"]}, "input[0]", "input[0]: must be an object"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 1000}, "max_output_tokens", "max_output_tokens (1000) exceeds the context window"),
    ({"input": "x " * 500}, "input", "input (as a prompt)"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(serve, extra, param, words):
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", json={**BASE, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["type"]) == (param, "invalid_request_error"), err
    assert words in err["message"], err
    assert s.orch.started == []


@pytest.mark.parametrize("extra,param,message", [
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}}}, "text.format.schema",
     "text.format.schema: Invalid type: nonsense"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"enum": ["e" * 40_000]}}}},
     "text.format.schema", "text.format.schema: the constraint is 40,014 characters; at most 32,768 are compiled"),
])
async def test_a_schema_its_compile_refuses_is_a_400_whose_param_is_the_path_named(serve, extra, param, message):
    """param was the top-level field (text) while the message named the schema's path."""
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", json={**BASE, **extra})
    assert (r.status_code, r.json()["error"]) == (400, {"message": message, "type": "invalid_request_error",
                                                        "param": param, "code": None})
    assert s.orch.started == []


async def test_refusals_through_the_client(serve):
    from openai import BadRequestError, NotFoundError

    s = await serve([PLAIN])
    with pytest.raises(BadRequestError) as e:
        await s.client().responses.create(model=MODEL, input="hi", background=True)
    assert e.value.status_code == 400 and e.value.body["param"] == "background"
    with pytest.raises(NotFoundError) as e:
        await s.client().responses.create(model="other", input="hi")
    assert e.value.body["code"] == "model_not_found"


async def test_missing_input_and_tools_without_a_parser(serve):
    s = await serve([PLAIN], parser="none")
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", json={"model": MODEL})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "input")
        r = await http.post("/v1/responses", content=b"")
        assert r.status_code in (400, 415), r.text
        r = await http.post("/v1/responses", json={**BASE, "tools": R_TOOLS})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tool_choice")
        assert "tool_call_parser" in r.json()["error"]["message"]
        r = await http.post("/v1/responses", json={**BASE, "tools": R_TOOLS, "tool_choice": "none"})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == PLAIN


@pytest.mark.parametrize("extra", [
    {"tools": "x"}, {"tools": ["x"]}, {"tools": [None]}, {"tool_choice": 5}, {"tool_choice": {}},
    {"reasoning": "high"}, {"reasoning": {"effort": 5}}, {"text": {"format": "text"}}, {"text": "x"},
    {"text": {"verbosity": "low"}}, {"include": "x"}, {"metadata": []}, {"metadata": {"k": None}},
    {"input": [{"role": "user", "content": None}]}, {"input": [{"role": "user", "content": [None]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": None}]},
    {"input": [{"type": 5}]}, {"input": [{"role": ["user"], "content": "x"}]}, {"input": None},
    {"instructions": 5}, {"user": 5}, {"stream": "yes"}, {"store": "no"},
    {"temperature": True}, {"top_p": 0}, {"max_output_tokens": "5"}, {"truncation": 5}, {"previous_response_id": 5},
])
async def test_malformed_fields_are_400s_never_500s(serve, extra):
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", json={**BASE, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("extra,param,words", [
    ({"input": "a\ud800"}, "input", "input: not valid Unicode text (a lone surrogate at character 1)"),
    ({"instructions": "a\ud800"}, "instructions", "instructions: not valid Unicode text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "\ud800"}]}]},
     "input[0].content[0].text", "input[0].content[0].text: not valid Unicode text"),
    ({"input": [{"role": "user", "content": "a\ud800"}]}, "input[0].content",
     "input[0].content: not valid Unicode text (a lone surrogate at character 1)"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "\ud800"}]}, "input[0].arguments",
     "input[0].arguments: not valid Unicode text"),
    ({"input": [{"type": "function_call", "call_id": "c\ud800", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "input[0].call_id: not valid Unicode text"),
    # echoed in the response: its rendering was a 500 after the model ran, its stored copy too
    ({"user": "\ud83d"}, "user", "user: not valid Unicode text (a lone surrogate at character 0)"),
    ({"metadata": {"k": "v\ud83d"}}, "metadata.k", "metadata.k: not valid Unicode text"),
    ({"metadata": {"k\ud83d": "v"}}, "metadata", "metadata key 'k\\ud83d': not valid Unicode text"),
    ({"tools": [{"type": "function", "name": "f", "description": "d\ud83d", "parameters": {}}],
      "tool_choice": "none"}, "tools[0].description", "tools[0].description: not valid Unicode text"),
    ({"text": {"format": {"type": "json_schema", "name": "n\ud83d", "schema": {"type": "object"}}}},
     "text.format.name", "text.format.name: not valid Unicode text"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"enum": ["a\ud83d"]}}}},
     "text.format.schema.enum[0]", "text.format.schema.enum[0]: not valid Unicode text (a lone surrogate at character 1)"),
    *[({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"\udc00": {}}}}],
        "tool_choice": tc}, "tools[0].parameters.properties",
       "tools[0].parameters.properties key '\\udc00': not valid Unicode text (a lone surrogate at character 0)")
      for tc in ("none", "required", {"type": "function", "name": "f"})],
])
async def test_a_lone_surrogate_is_a_400_naming_its_field(serve, extra, param, words):
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:  # json.dumps escapes it: \ud800
        r = await http.post("/v1/responses", content=json.dumps({**BASE, **extra}),
                            headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


# not checked as input was converted, yet kept as sent: stored, then every GET of
# /v1/responses/{id}/input_items was a plain-text 500 (UnicodeEncodeError)
_CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize("items,param,at", [
    ([{"id": "m\ud800", "role": "user", "content": "x"}], "input[0].id", 1),
    ([{"role": "user", "content": "x"}, {**_CALL, "id": "\ud800fc"}], "input[1].id", 0),
    ([_CALL, {"type": "function_call_output", "call_id": "c", "output": "y", "id": "o\ud800"}], "input[1].id", 1),
    ([{"role": "user", "content": [{"type": "input_text", "text": "ok", "x": "\ud800"}]}], "input[0].content[0].x", 0),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": ["\ud800"]}]}],
     "input[1].content[0].annotations[0]", 0),
    ([_CALL, {"type": "function_call_output", "call_id": "c",
              "output": [{"type": "input_text", "text": "y", "x": ["ab\ud800"]}]}], "input[1].output[0].x[0]", 2),
])
async def test_a_lone_surrogate_in_an_input_field_kept_as_sent_is_a_400_naming_its_path(serve, items, param, at):
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:  # json.dumps escapes it: \ud800
        r = await http.post("/v1/responses", content=json.dumps({**BASE, "input": items}),
                            headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"{param}: not valid Unicode text (a lone surrogate at character {at})",
                                 "type": "invalid_request_error", "param": param, "code": None}
    assert s.orch.started == []


async def test_a_lone_surrogate_in_previous_response_id_is_a_400_not_a_404_echoing_it(serve):
    s = await serve([PLAIN])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", content=json.dumps({**BASE, "previous_response_id": "resp_\ud800"}),
                            headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]) == (400, {
        "message": "previous_response_id: not valid Unicode text (a lone surrogate at character 5)",
        "type": "invalid_request_error", "param": "previous_response_id", "code": None})
    assert s.orch.started == []


async def test_a_lone_surrogate_in_an_input_key_is_a_400_naming_the_key(serve):
    s = await serve([PLAIN])
    items = [{"role": "user", "content": [{"type": "input_text", "text": "ok", "k\ud800": 1}]}]
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.post("/v1/responses", content=json.dumps({**BASE, "input": items}),
                            headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (
        "input[0].content[0]",
        "input[0].content[0] key 'k\\ud800': not valid Unicode text (a lone surrogate at character 1)")
    assert s.orch.started == []


async def test_previous_response_id_continues_the_stored_conversation(serve):
    """A response is kept (store left out: OpenAI's default); the next request's
    previous_response_id puts its conversation (input and output, not its instructions) before
    the new input; GET returns it as it was sent; DELETE drops it."""
    s = await serve([PLAIN])
    c = s.client()
    r1 = await c.responses.create(model=MODEL, instructions="Old.", input="weather?")
    assert r1.store is True
    assert (await c.responses.retrieve(r1.id)).model_dump() == r1.model_dump()
    r2 = await c.responses.create(model=MODEL, instructions="New.", input="and tomorrow?", previous_response_id=r1.id)
    assert (r2.previous_response_id, r2.output_text) == (r1.id, PLAIN)
    assert s.orch.started[-1][0] == await _chat_prompt(s, messages=[
        {"role": "system", "content": "New."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": PLAIN}, {"role": "user", "content": "and tomorrow?"}])
    # a chain: r3 continues r2, which continued r1
    await c.responses.create(model=MODEL, input="thanks", previous_response_id=r2.id, store=False)
    assert s.orch.started[-1][0] == await _chat_prompt(s, messages=[
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": PLAIN},
        {"role": "user", "content": "and tomorrow?"}, {"role": "assistant", "content": PLAIN},
        {"role": "user", "content": "thanks"}])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        r = await http.delete(f"/v1/responses/{r1.id}")
        assert (r.status_code, r.json()) == (200, {"id": r1.id, "object": "response", "deleted": True})
        for method in ("GET", "DELETE"):
            r = await http.request(method, f"/v1/responses/{r1.id}")
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["param"]) == (404, "response_not_found", None)
        r = await http.post("/v1/responses", json={**BASE, "previous_response_id": r1.id})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (404, "response_not_found", "previous_response_id")
        assert "keeps the last 1024 responses" in err["message"]


async def test_store_false_is_not_kept_and_a_streamed_response_is(serve):
    from openai import NotFoundError

    s = await serve([PLAIN])
    c = s.client()
    r = await c.responses.create(model=MODEL, input="weather?", store=False)
    assert r.store is False
    with pytest.raises(NotFoundError):
        await c.responses.retrieve(r.id)
    evs = await _events(s, input="weather?")
    last = evs[-1].response
    assert (evs[0].response.store, last.store) == (True, True)
    assert (await c.responses.retrieve(last.id)).model_dump() == last.model_dump()


async def test_previous_response_with_a_tool_call_then_its_output(serve):
    from pdd.gateway.openai_chat import ChatTemplate

    s = await serve([HERMES_ONE], template=ChatTemplate(TOOL_TEMPLATE, {}))
    c = s.client()
    r1 = await c.responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS)
    call_id = r1.output[1].call_id
    await c.responses.create(model=MODEL, tools=R_TOOLS, previous_response_id=r1.id,
                             input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}])
    call = {"id": call_id, "type": "function", "function": {"name": W_CALL[0], "arguments": W_CALL[1]}}
    assert s.orch.started[-1][0] == await _chat_prompt(s, tools=C_TOOLS, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me check.\n", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"}])


def test_the_store_is_bounded_oldest_first():
    from pdd.gateway.openai_responses import ResponseStore

    st = ResponseStore(max_items=2, max_chars=10_000)
    for i in range(3):
        st.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert list(st.items) == ["r1", "r2"] and st.get("r0") is None
    assert st.get("r2") == ({"id": "r2"}, [{"role": "user", "content": "x"}])
    size = st.chars // 2
    st = ResponseStore(max_items=10, max_chars=2 * size)
    for i in range(3):
        st.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert list(st.items) == ["r1", "r2"] and st.chars == 2 * size
    st.put({"id": "big"}, [{"role": "user", "content": "x" * 3 * size}])  # larger than the bound alone: not kept
    assert list(st.items) == ["r1", "r2"] and st.get("big") is None
    assert st.delete("r1") and not st.delete("r1") and st.chars == size


def test_chat_errors_are_renamed_to_the_responses_fields():
    from pdd.gateway.openai_responses import renamed
    from pdd.gateway.openai_schemas import ApiError

    e = renamed(ApiError("prompt (10 tokens) + max_completion_tokens (9) exceeds ...", "max_completion_tokens"))
    want = "prompt (10 tokens) + max_output_tokens (9) exceeds ..."
    assert (e.message, e.param, str(e)) == (want, "max_output_tokens", want)
    e = renamed(ApiError("messages[1].content: bad", "messages[1].content"))
    assert (e.message, e.param) == ("input[1].content: bad", "input[1].content")
    e = renamed(ApiError("n (1) choices ... max_tokens (500)", "max_tokens"))
    assert (e.message, e.param) == ("n (1) choices ... max_output_tokens (500)", "max_output_tokens")
    e = renamed(ApiError("server overloaded", None, status=429))
    assert (e.message, e.param, e.status) == ("server overloaded", None, 429)


def test_text_format_and_tool_choice_become_chats():
    """What the chat path gets for them (its structured outputs constrain the output to them)."""
    from pdd.gateway.openai_responses import ResponsesRequest, chat_body

    def chat(**kw):
        return chat_body(ResponsesRequest.model_validate({**BASE, "tools": R_TOOLS, **kw}))[0]

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = chat(text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert c.response_format == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                        "strict": True}}
    assert chat(text={"format": {"type": "json_object"}}).response_format == {"type": "json_object"}
    assert chat(text={"format": {"type": "text"}}).response_format is None
    assert chat(tool_choice={"type": "function", "name": "get_weather"}).tool_choice == {
        "type": "function", "function": {"name": "get_weather"}}
    assert [chat(tool_choice=t).tool_choice for t in ("auto", "none", "required", None)] == [
        "auto", "none", "required", None]
    assert chat(max_output_tokens=7, temperature=0.25, top_p=0.5, user="u", parallel_tool_calls=False).model_dump(
        include={"max_completion_tokens", "temperature", "top_p", "user", "parallel_tool_calls", "stream"}) == {
        "max_completion_tokens": 7, "temperature": 0.25, "top_p": 0.5, "user": "u", "parallel_tool_calls": False,
        "stream": False}


def _sse_events(text: str) -> list[dict]:
    return [json.loads(b.split("\n", 1)[1].removeprefix("data: ")) for b in text.strip().split("\n\n")]


@pytest.mark.parametrize("ask", [{"include": ["message.output_text.logprobs"], "top_logprobs": 2},
                                 {"include": ["message.output_text.logprobs"]}, {"top_logprobs": 3}])
def test_logprobs_are_chats_on_the_output_text(api, ask):
    """On the real engine (tests/api/conftest.py), greedy: the message's logprobs are chat's for
    the same conversation, streamed (spread over the deltas, whole at the end) and not."""
    client, _ = api
    top = ask.get("top_logprobs", 0)
    chat = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "The prefill stage"}], "max_tokens": 8,
        "temperature": 0, "logprobs": True, "top_logprobs": top}).json()["choices"][0]
    want = chat["logprobs"]["content"]
    assert len(want) == 8 and all(len(e["top_logprobs"]) == top for e in want)
    body = {"model": MODEL, "input": "The prefill stage", "max_output_tokens": 8, "temperature": 0, **ask}
    r = client.post("/v1/responses", json=body).json()
    part = r["output"][0]["content"][0]
    assert (part["text"], part["logprobs"], r["top_logprobs"]) == (chat["message"]["content"], want,
                                                                  ask.get("top_logprobs"))
    evs = _sse_events(client.post("/v1/responses", json={**body, "stream": True}).text)
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert [x for d in deltas for x in d["logprobs"]] == want[:sum(len(d["logprobs"]) for d in deltas)]
    done = next(e for e in evs if e["type"] == "response.output_text.done")
    assert done["logprobs"] == want and evs[-1]["response"]["output"][0]["content"][0]["logprobs"] == want


def test_no_logprobs_unless_asked(api):
    client, _ = api
    body = {"model": MODEL, "input": "The prefill stage", "max_output_tokens": 4, "temperature": 0}
    for extra in ({}, {"top_logprobs": 0}, {"include": ["reasoning.encrypted_content"]}):
        r = client.post("/v1/responses", json={**body, **extra})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["logprobs"] == [], r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice,chat_choice,text,calls", [
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, W_ARGS,
     [W_CALL]),
    ("required", "required", REQUIRED_TWO, [W_CALL, T_CALL]),
])
async def test_a_forced_tool_call_is_chats_structured_output(serve, stream, tool_choice, chat_choice, text, calls):
    """tool_choice "required" or a named function: the chat path's constraint (the same grammar
    as chat's for the same tools) and its calls, as function_call items."""
    s = await serve([text])
    if stream:
        evs = await _events(s, input="weather in Paris?", tools=R_TOOLS, tool_choice=tool_choice)
        r = evs[-1].response
        assert [e.type for e in evs if "output_text" in e.type or "content_part" in e.type] == []
    else:
        r = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS,
                                              tool_choice=tool_choice)
    assert (r.status, r.output_text, _calls(r.output)) == ("completed", "", calls)
    sp = s.orch.started[-1][1]
    await s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}],
                                             tools=C_TOOLS, tool_choice=chat_choice)
    want = s.orch.started[-1][1]
    assert sp.structured is not None and (sp.grammar, sp.structured) == (want.grammar, want.structured)


@pytest.mark.parametrize("fmt,rf", [
    ({"type": "json_schema", "name": "thing", "schema": CITY, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "thing", "schema": CITY, "strict": True}}),
    ({"type": "json_object"}, {"type": "json_object"}),
])
async def test_text_format_is_chats_response_format(serve, fmt, rf):
    s = await serve(['{"city": "Paris"}'])
    r = await s.client().responses.create(model=MODEL, input="weather?", text={"format": fmt})
    assert (r.output_text, r.text.format.type) == ('{"city": "Paris"}', fmt["type"])
    sp = s.orch.started[-1][1]
    await s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                             response_format=rf)
    want = s.orch.started[-1][1]
    assert sp.structured is not None and (sp.grammar, sp.structured) == (want.grammar, want.structured)


async def test_streamed_named_function_arguments_come_piece_by_piece(serve):
    """A named function's arguments come from chat piece by piece: one
    ``function_call_arguments.delta`` per piece, ``.done`` (the whole arguments) and the item's
    ``output_item.done`` once, at the end; the final response is the non-streamed one's."""
    s = await serve([W_ARGS])
    named = {"type": "function", "name": "get_weather"}
    evs = await _events(s, input="weather in Paris?", tools=R_TOOLS, tool_choice=named)
    kinds = [e.type for e in evs]
    deltas = [e for e in evs if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == W_ARGS
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * len(deltas)
                     + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"])
    item = evs[2].item
    assert {d.item_id for d in deltas} == {item.id} and evs[-3].arguments == W_ARGS
    assert (evs[-2].item.status, evs[-2].item.arguments) == ("completed", W_ARGS)
    r = await s.client().responses.create(model=MODEL, input="weather in Paris?", tools=R_TOOLS, tool_choice=named)
    assert (evs[-1].response.status, _calls(evs[-1].response.output)) == (r.status, _calls(r.output)) == (
        "completed", [W_CALL])
    async with s.client().responses.stream(model=MODEL, input="weather in Paris?", tools=R_TOOLS,
                                           tool_choice=named) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert _calls(final.output) == [W_CALL]


async def test_a_failure_mid_arguments_leaves_the_call_incomplete():
    """response_events over a chat stream that fails after a call's first arguments piece: no
    ``.done`` for it, and the failed response's item is ``incomplete`` with the pieces so far."""
    from pdd.gateway.openai_responses import ResponsesRequest, Shell, response_events

    def chunk(delta, finish=None):
        return "data: " + json.dumps({"id": "chatcmpl-x", "model": MODEL, "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}) + "\n\n"

    async def chat():
        yield chunk({"role": "assistant", "content": ""})
        yield chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"ci'}}]})
        yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "P'}}]})
        yield "data: " + json.dumps({"error": {"message": "tier failed"}}) + "\n\n"

    shell = Shell(ResponsesRequest.model_validate({"model": MODEL, "input": "x"}), MODEL)
    evs = [json.loads(e.split("\n", 1)[1].removeprefix("data: ")) async for e in response_events(shell, chat(), 0)]
    assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.delta", "response.failed"]
    (item,) = evs[-1]["response"]["output"]
    assert (item["status"], item["arguments"], item["call_id"]) == ("incomplete", '{"city": "P', "call_1")
