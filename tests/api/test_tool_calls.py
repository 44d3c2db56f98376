"""Tool calls in /v1/chat/completions through the official openai client: the real gateway app
and orchestrator on a live uvicorn server, over scripted tiers whose choices generate known
texts (tool-call strings in the tiny checkpoint's tokens, then EOS), so what the gateway parses
out of them is exact. The tiny checkpoint is a plain llama (no tool-call tokens): its family
default is no parser, and ``tool_call_parser`` in the config picks one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator, ReqState, TokenOut
from pdd.gateway.phase import Phase
from pdd.topology import layout
from pdd.types import Pipeline
from tests.api.live_app import served
from tests.gateway.fake_peer import FakePeer

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET"}}'
HERMES_ONE = f"Let me check.\n<tool_call>\n{W}\n</tool_call>"
HERMES_TWO = f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"
PLAIN = "It is sunny in Paris today."
MALFORMED = '<tool_call>{"name": get_weather, "arguments": {"city": "Paris"}}</tool_call>'  # no call: content
BROKEN = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'  # a call, its arguments cut
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MSGS = [{"role": "user", "content": "weather in Paris?"}]
W_CALL = ("get_weather", '{"city": "Paris", "unit": "c"}')
T_CALL = ("get_time", '{"tz": "CET"}')


class TextOrch(Orchestrator):
    """The real orchestrator; ``start_request`` makes a colocated request whose tokens are
    ``texts[seed % len(texts)]`` (so choice i of a request seeded 0 generates text i) then EOS
    (fin "stop"), cut at max_tokens (fin "length")."""

    def __init__(self, cfg: ClusterConfig, tok, texts: list[str], eos: int):
        super().__init__(cfg, layout(cfg))
        self.peers = {s.name: FakePeer() for s in self.layout.engines}
        self.tok, self.texts, self.eos = tok, texts, eos
        self.sps = []  # the SamplingParams of every choice started, in order

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        rid = rid or f"r{next(self._ids)}"
        self.sps.append(sp)
        st = ReqState(rid, len(prompt_ids), sp, pipeline=Pipeline.COLOCATED, trid=rid, prompt_ids=list(prompt_ids))
        self.reqs[rid] = st
        self.totals["requests"] += 1
        st.to(Phase.PREFILL, "attempt 0 starts")
        ids = self.tok.encode(self.texts[sp.seed % len(self.texts)], add_special_tokens=False).ids + [self.eos]
        self._spawn(self._feed(st, ids[:sp.max_tokens]))
        return st

    async def _feed(self, st: ReqState, ids: list[int]) -> None:
        for pos, t in enumerate(ids):
            if st.end.aborted:
                return
            if pos == 0:
                st.to(Phase.DECODE, "first token sampled")
            fin = None if pos < len(ids) - 1 else "stop" if t == self.eos else "length"
            st.queue.put_nowait(TokenOut(pos, t, "c", fin))
            await asyncio.sleep(0)


class Server:
    def __init__(self, base_url, orch):
        from openai import AsyncOpenAI

        self.base_url, self.orch = base_url, orch
        self.oa = AsyncOpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0)

    def client(self):
        return self.oa


async def _serve(tiny_model, texts, parser, stack: contextlib.AsyncExitStack) -> "Server":
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "tool_call_parser": parser,
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    orch = TextOrch(cfg, tok, texts, json.load(open(f"{tiny_model}/config.json"))["eos_token_id"])
    port = await stack.enter_async_context(served(create_app(cfg, orch, tok)))
    srv = Server(f"http://127.0.0.1:{port}", orch)
    stack.push_async_callback(srv.oa.close)
    return srv


@pytest.fixture
async def serve(tiny_model):
    async with contextlib.AsyncExitStack() as stack:
        async def start(texts, parser="hermes"):
            return await _serve(tiny_model, texts, parser, stack)

        yield start


def _calls(tool_calls):
    for c in tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.type == "function", c
    return [(c.function.name, c.function.arguments) for c in tool_calls]


async def test_non_streamed_call_with_text_before_it(serve):
    s = await serve([HERMES_ONE])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0)
    (c,) = r.choices
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == ("Let me check.\n", [W_CALL],
                                                                                   "tool_calls")


async def test_non_streamed_several_calls_content_null_and_parallel_false_keeps_the_first(serve):
    s = await serve([HERMES_TWO])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, tool_choice="auto",
                                                 seed=0)
    m = r.choices[0].message
    assert (m.content, _calls(m.tool_calls), r.choices[0].finish_reason) == (None, [W_CALL, T_CALL], "tool_calls")
    assert len({c.id for c in m.tool_calls}) == 2
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0,
                                                 parallel_tool_calls=False)
    assert _calls(r.choices[0].message.tool_calls) == [W_CALL]


async def test_a_call_of_a_function_not_in_tools_is_passed_on_as_vllm_does(serve):
    """vLLM's hermes parser (vllm/tool_parsers/hermes_tool_parser.py) reads the name as written,
    never matched against the request's tools; the client sees the name and decides."""
    s = await serve(['<tool_call>{"name": "get_tme", "arguments": {"tz": "CET"}}</tool_call>'])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0)
    (c,) = r.choices
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == (
        None, [("get_tme", '{"tz": "CET"}')], "tool_calls")


async def test_no_call_and_malformed_call_are_plain_content(serve):
    s = await serve([PLAIN, MALFORMED])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0, n=2)
    got = [(c.message.content, c.message.tool_calls, c.finish_reason) for c in r.choices]
    assert got == [(PLAIN, None, "stop"), (MALFORMED, None, "stop")]


async def test_a_call_made_before_its_text_breaks_keeps_its_arguments_so_far(serve):
    """A call is made once its name and its arguments' start are read (as a stream must send
    it): text after that which breaks the format cuts its arguments there."""
    s = await serve([BROKEN])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0)
    c = r.choices[0]
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == (
        None, [("get_weather", '{"city": ')], "tool_calls")
    _, final = await _streamed(s)
    await _same_as_not_streamed(s, final)


async def test_n_choices_are_parsed_each(serve):
    s = await serve([HERMES_ONE, PLAIN, HERMES_TWO])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0, n=3)
    got = [(c.index, c.message.content, _calls(c.message.tool_calls or []), c.finish_reason) for c in r.choices]
    assert got == [(0, "Let me check.\n", [W_CALL], "tool_calls"), (1, PLAIN, [], "stop"),
                   (2, None, [W_CALL, T_CALL], "tool_calls")]


async def _streamed(s, **kw):
    """The stream's chunks, and the completion the openai client's stream state accumulates
    from them (per choice: its content, its calls, its finish_reason; a choice cut by
    max_tokens too, where ``get_final_completion`` raises)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState(input_tools=TOOLS)
    chunks = []
    async for chunk in await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0,
                                                                stream=True, **kw):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return chunks, state.current_completion_snapshot


async def test_streamed_calls_accumulate_in_the_openai_client(serve):
    s = await serve([HERMES_ONE, HERMES_TWO, PLAIN])
    chunks, final = await _streamed(s, n=3)
    got = [(c.index, c.message.content, _calls(c.message.tool_calls or []), c.finish_reason) for c in final.choices]
    # content: the role chunk's "" (as vLLM's), accumulated
    assert got == [(0, "Let me check.\n", [W_CALL], "tool_calls"), (1, "", [W_CALL, T_CALL], "tool_calls"),
                   (2, PLAIN, [], "stop")]
    # per choice: each call's first item (id, type, name) once its name and the arguments'
    # opening brace are generated, then a piece of its arguments per token, as generated
    for index, calls in ((0, [W_CALL]), (1, [W_CALL, T_CALL])):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert _pieces_per_call(_arguments_items(chunks, index)) == calls
        assert all(len(ch.delta.tool_calls or []) <= 1 for ch in mine)  # one token: one item
        assert len([ch for ch in mine if ch.delta.tool_calls]) > len(calls)  # arguments in several pieces
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["tool_calls"]
        assert mine[-1].delta.tool_calls is None  # EOS's chunk: no text
        # no content of the call's text was streamed
        assert "".join(ch.delta.content or "" for ch in mine) == ("Let me check.\n" if index == 0 else "")
    await _same_as_not_streamed(s, final, n=3)


def _pieces_per_call(items):
    """(name, arguments) per call of ``_arguments_items``, checking each call's first item has
    its id and name and every later one a piece of its arguments alone, calls in order."""
    calls = []
    for index, has_id, name, args in items:
        if has_id:
            assert (index, name is not None) == (len(calls), True)
            calls.append([name, args])
        else:
            assert (index, name) == (len(calls) - 1, None)
            calls[-1][1] += args
    return [tuple(c) for c in calls]


async def test_streamed_parallel_false_keeps_the_first_call(serve):
    s = await serve([HERMES_TWO])
    _, final = await _streamed(s, parallel_tool_calls=False)
    assert _calls(final.choices[0].message.tool_calls) == [W_CALL]


async def test_streamed_malformed_call_is_content(serve):
    s = await serve([MALFORMED])
    _, final = await _streamed(s)
    c = final.choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == (MALFORMED, None, "stop")


def _no_created(body: str) -> str:
    return re.sub(r'"created": \d+', '"created": 0', body)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_without_tools_is_unchanged_by_a_parser(serve, stream):
    """The same request (no tools) to a gateway with and without a parser: the same bytes, tool-call
    text and all (but the time in ``created``, and a whole response's ``pdd`` block, which has
    timings and a random rid suffix)."""
    bodies = []
    for parser in ("hermes", "none"):
        s = await serve([HERMES_ONE], parser)
        async with httpx.AsyncClient(base_url=s.base_url) as http:
            r = await http.post("/v1/chat/completions", headers={"X-Request-Id": "same"},
                                json={"model": "pdd-tiny", "messages": MSGS, "seed": 0, "stream": stream,
                                      "logprobs": True, "top_logprobs": 1})
            assert r.status_code == 200, r.text
            body = re.sub(r'"created": ?\d+', '"created": 0', r.text)
            bodies.append(body if stream else body[:body.index(',"pdd":')])
    assert bodies[0] == bodies[1]
    if stream:
        chunks = [json.loads(x[6:]) for x in bodies[0].split("\n\n") if x.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)
    else:
        msg = json.loads(bodies[0] + "}")["choices"][0]["message"]
        assert list(msg) == ["role", "content"]
        text = msg["content"]
    assert text == HERMES_ONE


async def test_tool_choice_none_renders_tools_but_parses_nothing(serve):
    s = await serve([HERMES_ONE])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                                 seed=0)
    c = r.choices[0]
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == (HERMES_ONE, None, "stop")


NAMED = {"type": "function", "function": {"name": "get_weather"}}
W_ARGS = '{"city": "Paris", "unit": "c"}'
REQUIRED_TWO = f'[{{"name": "get_weather", "parameters": {W_ARGS}}}, {{"name": "get_time", "parameters": {{"tz": "CET"}}}}]'


def _forced_constraint(tool_choice, parallel=True):
    from pdd.gateway.openai_schemas import tool_schema
    from pdd.structured import grammar_for

    schema = tool_schema(tool_choice, TOOLS, parallel)
    return grammar_for("json", schema), {"json": schema}


@pytest.mark.parametrize("parser", ["hermes", "auto"])  # auto: this checkpoint has no parser; none is needed
async def test_named_tool_choice_constrains_to_the_arguments_and_calls_it(serve, parser):
    """As vLLM: the output is the function's arguments (its parameters' schema), the message one
    call of it with content null, finish_reason the choice's own ("stop": OpenAI's for a named
    call)."""
    s = await serve([W_ARGS], parser)
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, tool_choice=NAMED,
                                                 seed=0, n=2)
    assert [(c.message.content, _calls(c.message.tool_calls), c.finish_reason) for c in r.choices] == [
        (None, [W_CALL], "stop")] * 2
    grammar, structured = _forced_constraint(NAMED)
    assert structured == {"json": CITY}
    assert [(sp.grammar, sp.structured) for sp in s.orch.sps] == [(grammar, structured)] * 2


async def test_named_tool_choice_cut_by_max_tokens_keeps_length(serve, tiny_model):
    from tokenizers import Tokenizer

    n = len(Tokenizer.from_file(f"{tiny_model}/tokenizer.json").encode(W_ARGS, add_special_tokens=False).ids)
    s = await serve([W_ARGS])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, tool_choice=NAMED,
                                                 seed=0, max_tokens=n)  # the arguments, no EOS
    c = r.choices[0]
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == (None, [W_CALL], "length")


async def test_required_tool_choice_constrains_to_an_array_of_calls(serve):
    s = await serve([REQUIRED_TWO])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS,
                                                 tool_choice="required", seed=0)
    c = r.choices[0]
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == (None, [W_CALL, T_CALL],
                                                                                   "tool_calls")
    assert [(sp.grammar, sp.structured) for sp in s.orch.sps] == [_forced_constraint("required")]
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS,
                                                 tool_choice="required", seed=0, parallel_tool_calls=False)
    assert _calls(r.choices[0].message.tool_calls) == [W_CALL]
    assert s.orch.sps[-1].structured == _forced_constraint("required", parallel=False)[1]
    assert s.orch.sps[-1].structured["json"]["maxItems"] == 1


async def test_required_output_that_is_no_array_is_content(serve):
    """Cut by max_tokens: no calls; the text is the content, finish_reason "length" (vLLM answers
    an empty message)."""
    s = await serve([REQUIRED_TWO])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS,
                                                 tool_choice="required", seed=0, max_tokens=5)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "length"
    assert REQUIRED_TWO.startswith(c.message.content) and c.message.content


def _arguments_items(chunks, index=0):
    """The ``delta.tool_calls`` items of choice ``index``'s chunks: (call index, has id, name, arguments)."""
    return [(tc.index, tc.id is not None, tc.function.name, tc.function.arguments)
            for ch in chunks for c in ch.choices if c.index == index for tc in (c.delta.tool_calls or [])]


async def _same_as_not_streamed(s, final, **kw):
    """The streamed choices, accumulated by the openai client, against the non-streamed response
    to the same request: content ("" for null), each call's name and arguments, finish_reason."""
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0, **kw)
    norm = lambda c: (c.index, c.message.content or "", _calls(c.message.tool_calls or []),  # noqa: E731
                      c.finish_reason)
    assert [norm(c) for c in final.choices] == [norm(c) for c in r.choices]


@pytest.mark.parametrize("n", [1, 2])
async def test_forced_named_function_streams_its_arguments_as_generated(serve, tiny_model, n):
    """A named function's output is its arguments: each token's text goes out as an arguments
    piece (the first with the call's id, type and name); accumulated, exactly the non-streamed
    call; finish_reason the choice's own."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    pieces = [tok.decode([t]) for t in tok.encode(W_ARGS, add_special_tokens=False).ids]
    s = await serve([W_ARGS])
    chunks, final = await _streamed(s, tool_choice=NAMED, n=n)
    for index in range(n):
        items = _arguments_items(chunks, index)
        assert len(items) > 1 and "".join(a for *_, a in items) == W_ARGS
        assert items[0][:3] == (0, True, "get_weather") and all(i[:3] == (0, False, None) for i in items[1:])
        assert [a for *_, a in items] == pieces  # one piece per token, as generated (this text decodes alike)
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert "".join(ch.delta.content or "" for ch in mine) == ""
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["stop"]
    assert [(c.message.content, _calls(c.message.tool_calls), c.finish_reason) for c in final.choices] == [
        ("", [W_CALL], "stop")] * n
    await _same_as_not_streamed(s, final, tool_choice=NAMED, n=n)


async def test_forced_named_function_cut_by_max_tokens_streamed(serve):
    s = await serve([W_ARGS])
    chunks, final = await _streamed(s, tool_choice=NAMED, max_tokens=4)
    assert len(_arguments_items(chunks)) == 4
    c = final.choices[0]
    assert c.finish_reason == "length" and W_ARGS.startswith(c.message.tool_calls[0].function.arguments)
    await _same_as_not_streamed(s, final, tool_choice=NAMED, max_tokens=4)


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_streamed_calls_come_as_generated(serve, parallel):
    """``"required"``: each call's first item once its name and its arguments' start are
    generated, then its arguments piece by piece; an array cut before its first call is made
    is no call: its text is the content, at the end."""
    s = await serve([REQUIRED_TWO])
    kw = {"tool_choice": "required"} if parallel else {"tool_choice": "required", "parallel_tool_calls": False}
    chunks, final = await _streamed(s, **kw)
    calls = [W_CALL, T_CALL] if parallel else [W_CALL]
    items = _arguments_items(chunks)
    assert _pieces_per_call(items) == calls and len(items) > len(calls)
    mine = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(ch.delta.content or "" for ch in mine) == ""
    assert [(ch.finish_reason, len(ch.delta.tool_calls or [])) for ch in mine if ch.finish_reason] == [
        ("tool_calls", 0)]
    assert [(sp.grammar, sp.structured) for sp in s.orch.sps] == [_forced_constraint("required", parallel)]
    await _same_as_not_streamed(s, final, **kw)
    chunks, final = await _streamed(s, tool_choice="required", max_tokens=5)  # cut: content, at the end
    assert _arguments_items(chunks) == [] and final.choices[0].message.content
    await _same_as_not_streamed(s, final, tool_choice="required", max_tokens=5)


async def test_forced_tool_choice_is_refused_when_md_runs_on_vllm(tiny_model):
    """MD on vLLM continues every request after P's first token: it cannot resume a grammar."""
    from openai import BadRequestError
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "vllm": {"main_decode": True},
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    orch = TextOrch(cfg, tok, [W_ARGS], json.load(open(f"{tiny_model}/config.json"))["eos_token_id"])
    async with served(create_app(cfg, orch, tok)) as port:
        from openai import AsyncOpenAI

        oa = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        try:
            for kw, param in (({"tools": TOOLS, "tool_choice": NAMED}, "tool_choice"),
                              ({"response_format": {"type": "json_object"}}, "response_format"),
                              ({"extra_body": {"guided_regex": "[a-z]+"}}, "guided_regex")):
                with pytest.raises(BadRequestError) as e:
                    await oa.chat.completions.create(model="pdd-tiny", messages=MSGS, **kw)
                assert e.value.body["param"] == param
                assert e.value.body["message"] == (
                    f"{param}: structured outputs are not supported with MD on vLLM (vllm.main_decode): vLLM "
                    "continues each request after P's first token and would start the constraint there; serve it "
                    "with pdd's MD (vllm.main_decode: false)")
            r = await oa.chat.completions.create(model="pdd-tiny", messages=MSGS, seed=0)  # no constraint: served
            assert r.choices[0].message.content == W_ARGS
        finally:
            await oa.close()
    assert [sp.grammar for sp in orch.sps] == [None]


@pytest.mark.parametrize("extra,param,message", [
    ({"tool_choice": "sometimes"}, "tool_choice",
     "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
     "got 'sometimes'"),
    ({"tool_choice": {"type": "function"}}, "tool_choice",
     "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
     "got {'type': 'function'}"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "tool_choice 'required' needs tools: the request has none"),
    ({"tools": [{"type": "function"}]}, "tools[0].function",
     "tools[0].function: must be an object with a non-empty string name, got None"),
    # a name that is no non-empty string names the name (it named tools)
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name",
     "tools[0].function.name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), "
     "got ''"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": 5}}]}, "tools[2].function.name",
     "tools[2].function.name: required, a string of 1 to 64 letters, digits, underscores or dashes "
     "(^[a-zA-Z0-9_-]{1,64}$), got 5"),
    ({"tools": [{"type": "function", "function": {"name": None}}]}, "tools[0].function.name",
     "tools[0].function.name: required, a string of 1 to 64 letters, digits, underscores or dashes "
     "(^[a-zA-Z0-9_-]{1,64}$), got None"),
    # a description the chat template would render as a number or an object: refused (it was accepted)
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
     "tools[0].function.description", "tools[0].function.description: must be a string, got 5"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "description": {"a": 1}}}],
      "tool_choice": "none"}, "tools[2].function.description",
     "tools[2].function.description: must be a string, got {'a': 1}"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]: must be an object with type 'function', got {'type': "
     "'retrieval'}"),
    # two functions of one name were served: a call names one of them, which the client cannot tell apart
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}},
                {"type": "function", "function": {"name": "f", "description": "other"}}]}, "tools[2].function.name",
     "tools[2].function.name: 'f' is tools[0]'s too; function names must be unique"),
    # OpenAI's pattern for a function name: a space, a dot or a 65th character is a 400 naming the field
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "get weather"}}]}, "tools[2].function.name",
     "tools[2].function.name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), "
     "got 'get weather'"),
    ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name",
     "tools[0].function.name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), "
     "got 'a.b'"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name",
     "tools[0].function.name: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{1,64}$), "
     f"got {'f' * 65!r}"),
    # parameters that are no JSON object: refused whatever tool_choice is (it was only when a call was forced)
    *[({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}], "tool_choice": tc},
       "tools[0].function.parameters", "tools[0].function.parameters: must be a JSON schema object, got 5")
      for tc in (None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}})],
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "tool_choice": "none"},
     "tools[2].function.parameters", "tools[2].function.parameters: must be a JSON schema object, got ['x']"),
    # a number was "tool_choice.str: Input should be a valid string" (pydantic's union branch)
    ({"tool_choice": 5}, "tool_choice",
     "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
     "got 5"),
    ({"tool_choice": ["auto"]}, "tool_choice",
     "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
     "got ['auto']"),
])
async def test_malformed_tools_and_tool_choice_are_400s_saying_what_is_wrong(serve, extra, param, message):
    """Before, any tool_choice other than none / auto got the guided-decoding message (an unknown
    word, required without tools) and a tool without a function was served."""
    s = await serve([HERMES_ONE])
    body = {"model": "pdd-tiny", "messages": MSGS, "tools": TOOLS, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    async with httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["message"]) == (param, message)


@pytest.mark.parametrize("tool_choice", [None, "required", {"type": "function", "function": {"name": "f\ud800"}}])
async def test_a_lone_surrogate_in_a_tool_name_is_the_name_check_s_400(serve, tool_choice):
    """A forced call compiled the name into its grammar first: "the tools' parameters: unexpected
    end of hex escape"."""
    s = await serve([HERMES_ONE])
    body = {"model": "pdd-tiny", "messages": MSGS, "tools": [{"type": "function", "function": {"name": "f\ud800"}}]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    async with httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {
        "message": "tools[0].function.name: must be 1 to 64 letters, digits, underscores or dashes "
                   "(^[a-zA-Z0-9_-]{1,64}$), got 'f\\ud800'",
        "type": "invalid_request_error", "param": "tools[0].function.name", "code": None}}


async def test_auto_without_a_parser_is_refused_saying_how_to_set_one(serve):
    """The tiny checkpoint's family (a plain llama, no <|python_tag|>) has no default parser."""
    from openai import BadRequestError

    s = await serve([HERMES_ONE], "auto")
    with pytest.raises(BadRequestError) as e:
        await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS)
    err = e.value.body
    assert err["param"] == "tool_choice" and "tool_call_parser" in err["message"], err


async def test_llama3_json_parser(serve):
    s = await serve(['{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'], "llama3_json")
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0)
    c = r.choices[0]
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == (None, [W_CALL], "tool_calls")
    _, final = await _streamed(s)
    c = final.choices[0]
    assert (c.message.content, _calls(c.message.tool_calls), c.finish_reason) == ("", [W_CALL], "tool_calls")


async def test_special_token_text_is_kept_while_calls_are_parsed(serve, tiny_model):
    """Call markers may be special tokens (Qwen's <tool_call> in pdd's make-model checkpoints,
    Llama's <|python_tag|>): with tools parsed, special tokens are not skipped (as SGLang does);
    without tools they are, as before."""
    s = await serve(["<s>" + PLAIN])
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, tools=TOOLS, seed=0)
    assert r.choices[0].message.content == "<s>" + PLAIN
    r = await s.client().chat.completions.create(model="pdd-tiny", messages=MSGS, seed=0)
    assert r.choices[0].message.content == PLAIN


class _Vocab:
    def __init__(self, tokens):
        self.tokens = tokens

    def token_to_id(self, t):
        return 7 if t in self.tokens else None


@pytest.mark.parametrize("setting,model_type,tokens,want", [
    ("auto", "qwen2", {"<tool_call>"}, "hermes"),
    ("auto", "qwen3", {"<tool_call>"}, "hermes"),
    ("auto", "llama", {"<|python_tag|>"}, "llama3_json"),
    ("auto", "llama", set(), None),
    ("auto", "mistral", set(), None),
    ("none", "qwen2", {"<tool_call>"}, None),
    ("hermes", "llama", set(), "hermes"),
    ("mistral", "qwen2", set(), "mistral"),
])
def test_chat_tool_parser_family_default_and_override(setting, model_type, tokens, want):
    from pdd.gateway.api import chat_tool_parser

    assert chat_tool_parser(setting, model_type, _Vocab(tokens)) == want


def test_config_refuses_an_unknown_parser():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tool_call_parser"):
        ClusterConfig.model_validate({"tool_call_parser": "pythonic"})


@pytest.mark.parametrize("like,want", [("qwen2.5-0.5b", "hermes"), ("qwen3-0.6b", "hermes"),
                                       ("llama-3.2-1b", "llama3_json"), ("mistral-7b", None)])
def test_family_default_of_like_checkpoints(tmp_path, like, want):
    """``tool_call_parser: auto`` (the default) on ``pdd make-model --like`` checkpoints: their
    config.json model_type and tokenizer pick the family's parser (Mistral-7B v0.1 calls no tools)."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import chat_tool_parser
    from pdd.gateway.orchestrator import checkpoint_config
    from pdd.modelgen import make_like

    path = make_like(str(tmp_path / like), like, seed=0)
    cfg = ClusterConfig.model_validate({"model_path": path})
    assert cfg.tool_call_parser == "auto"
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    assert chat_tool_parser(cfg.tool_call_parser, checkpoint_config(cfg).model_type, tok) == want


async def test_return_token_ids_with_tool_calls(serve, tiny_model):
    """vLLM's ``return_token_ids`` with calls parsed: the choice's ids are those of its text (and
    EOS), whole or streamed (the tool-call chunks add none: ``token_ids: []``)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    want = tok.encode(HERMES_ONE, add_special_tokens=False).ids + [json.load(open(f"{tiny_model}/config.json"))[
        "eos_token_id"]]
    s = await serve([HERMES_ONE])
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        body = {"model": "pdd-tiny", "messages": MSGS, "tools": TOOLS, "seed": 0, "return_token_ids": True}
        r = (await http.post("/v1/chat/completions", json=body)).json()
        (c,) = r["choices"]
        assert (c["finish_reason"], c["token_ids"]) == ("tool_calls", want)
        r = await http.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == want
    calls = [ch["choices"][0] for ch in chunks if "tool_calls" in ch["choices"][0]["delta"]]
    # each token's chunk carries its own id, a call's pieces included; EOS's has the finish_reason
    assert calls and all(len(x["token_ids"]) == 1 and x["finish_reason"] is None for x in calls)
    assert [(x["token_ids"], x["finish_reason"]) for x in (ch["choices"][0] for ch in chunks)
            if x["finish_reason"]] == [([want[-1]], "tool_calls")]


def _nested_parameters(levels: int) -> dict:
    """An object schema whose property nests ``levels`` deep (two JSON levels each)."""
    p: dict = {"type": "object"}
    for _ in range(levels):
        p = {"type": "object", "properties": {"a": p}}
    return p


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}])
async def test_a_forced_call_whose_parameters_nest_past_the_recursion_limit_is_a_400(serve, tool_choice):
    """Parameters 250 levels deep (about 505 JSON levels: within the body's 512) were a 500: a
    RecursionError copying them into the call's schema. 120 levels is llguidance's own refusal."""
    s = await serve([HERMES_ONE])
    got = []
    for levels in (120, 250):
        body = {"model": "pdd-tiny", "messages": MSGS, "tool_choice": tool_choice,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested_parameters(levels)}}]}
        async with httpx.AsyncClient(base_url=s.base_url, timeout=60) as c:
            r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        got.append(r.json()["error"])
    # llguidance's refusal, of the schema made of the tools' parameters; copying names the tool it could not copy
    assert got[0]["param"] == "tools", got[0]
    assert got[0]["message"].startswith("the tools' parameters: recursion limit exceeded at line 1 column "), got[0]
    assert got[1] == {"message": "tools[0].function.parameters: recursion limit exceeded (nested too deeply to "
                                 "compile)", "type": "invalid_request_error", "param": "tools[0].function.parameters",
                      "code": None}
    assert s.orch.sps == []
