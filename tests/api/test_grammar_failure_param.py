"""A structured output whose grammar fails at run time (after it compiled: a tier's
``ReqError.client_error``, ``pdd.structured.FAILED_AT``) is the request's own 400; its ``param``
names the field the request gave the constraint in (``response_format``, ``structured_outputs``,
``guided_*``, SGLang's ``regex``, a forced ``tool_choice``; ``/v1/responses``: ``text``), as the
400 of a constraint refused before any tier works does. It was null. The real gateway app and
orchestrator (``httpx.ASGITransport``, no socket) over a scripted tier that sends one token and
then fails the request as a tier's grammar failure arrives."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import ReqState, TokenOut
from pdd.gateway.phase import Phase
from pdd.gateway.state import RequestFailed
from pdd.structured import FAILED_AT
from tests.api.test_tool_calls import MSGS, TOOLS, TextOrch

WHY = f"{FAILED_AT} 1: token 7 doesn't satisfy the grammar"
BOUND_S = 30.0  # what one request may take at most before the test fails (it takes milliseconds)


class GrammarFailsAfterOneToken(TextOrch):
    """``TextOrch`` whose every request generates one token, then fails as MD's ``req_error``
    of a grammar failure does (``pdd.gateway.recovery``: ``client_error`` and the tier's why)."""

    async def _feed(self, st: ReqState, ids: list[int]) -> None:
        st.to(Phase.DECODE, "first token sampled")
        st.queue.put_nowait(TokenOut(0, ids[0], "c", None))
        await asyncio.sleep(0)
        st.queue.put_nowait(None)  # the request's end: its recovery state says why

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        st = await super().start_request(prompt_ids, sp, rid, sibling_of, siblings)
        st.recovery.error, st.recovery.client_error, st.recovery.client_reason = f"md0: {WHY}", True, WHY
        return st


@pytest.fixture
def app(tiny_model):
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "tool_call_parser": "hermes",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    orch = GrammarFailsAfterOneToken(cfg, tok, ["abc"], json.load(open(f"{tiny_model}/config.json"))["eos_token_id"])
    return create_app(cfg, orch, tok)


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await asyncio.wait_for(client.post(path, json=body), BOUND_S)


CHAT = {"model": "pdd-tiny", "messages": MSGS, "max_tokens": 8}
COMPLETION = {"model": "pdd-tiny", "prompt": "hi", "max_tokens": 8}
REQUESTS = [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "[a-z]+"}, "guided_regex"),
    ("/v1/completions", {**COMPLETION, "regex": "[a-z]+"}, "regex"),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["yes", "no"]}, "guided_choice"),
]


@pytest.mark.parametrize("path,body,param", REQUESTS)
async def test_a_grammar_failing_at_run_time_is_a_400_naming_the_constraints_field(app, path, body, param):
    r = await _post(app, path, body)
    assert (r.status_code, r.json()) == (400, {"error": {"message": WHY, "type": "invalid_request_error",
                                                         "param": param, "code": None}})


@pytest.mark.parametrize("path,body,param", REQUESTS)
async def test_streamed_its_error_event_names_the_field_too(app, path, body, param):
    r = await _post(app, path, {**body, "stream": True})
    assert r.status_code == 200
    lines = [ln.removeprefix("data: ") for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2]) == {"error": {"message": WHY, "type": "invalid_request_error", "param": param,
                                              "code": None}}


async def test_a_grammar_failing_without_a_constraint_names_no_field(app):
    """(A tier reports its grammar failed for a request that gave none: nothing to name.)"""
    r = await _post(app, "/v1/chat/completions", CHAT)
    assert (r.status_code, r.json()["error"]["param"]) == (400, None)


@pytest.mark.parametrize("extra,param", [
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"tools": [{"type": "function", "name": "get_weather"}], "tool_choice": "required"}, "tool_choice"),
])
async def test_responses_name_the_responses_field(app, extra, param):
    r = await _post(app, "/v1/responses", {"model": "pdd-tiny", "input": "hi", "max_output_tokens": 8, **extra})
    assert (r.status_code, r.json()) == (400, {"error": {"message": WHY, "type": "invalid_request_error",
                                                         "param": param, "code": None}})


class GrammarFailsAtStart(TextOrch):
    """``TextOrch`` whose every request fails as it starts, as a grammar failing on P's first
    token does (``RequestFailed.client_error``; streamed or not, nothing was sent yet)."""

    async def start_request(self, prompt_ids, sp, rid=None, sibling_of=None, siblings=0) -> ReqState:
        raise RequestFailed(f"request r1 failed: p0: {WHY}", True, WHY)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,param", [
    *REQUESTS[:1], *REQUESTS[4:5],
    ("/v1/responses", {"model": "pdd-tiny", "input": "hi", "text": {"format": {"type": "json_object"}}}, "text")])
async def test_a_grammar_failing_as_the_request_starts_names_the_field_too(tiny_model, path, body, param, stream):
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400}})
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    app = create_app(cfg, GrammarFailsAtStart(cfg, tok, ["abc"], 2), tok)
    r = await _post(app, path, {**body, "stream": stream})
    assert (r.status_code, r.json()) == (400, {"error": {"message": WHY, "type": "invalid_request_error",
                                                         "param": param, "code": None}})
