"""``/v1/responses`` through the official openai client against a running pdd topology (P -> RLD
-> MD over the WAN): the same text as the chat endpoint for the same conversation, streamed or
not."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pdd_topology(tmp_path_factory, small_model):
    from pdd.launch import Topology

    topo = Topology(make_cfg(small_model, "pdd"), log_dir=tmp_path_factory.mktemp("logs"))
    topo.start()
    yield topo
    topo.stop()


def test_responses_match_chat_streamed_and_not(pdd_topology):
    from openai import OpenAI

    client = OpenAI(base_url=pdd_topology.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "The prefill stage reads the whole prompt"}]
    chat = client.chat.completions.create(model="pdd-small", messages=msgs, max_tokens=40, temperature=0)
    want = chat.choices[0].message.content
    r = client.responses.create(model="pdd-small", instructions="Answer briefly.",
                                input="The prefill stage reads the whole prompt", max_output_tokens=40,
                                temperature=0)
    assert r.output_text == want and want
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model="pdd-small", instructions="Answer briefly.",
                                          input=[{"role": "user", "content": [
                                              {"type": "input_text", "text": "The prefill stage reads the whole "
                                                                             "prompt"}]}],
                                          max_output_tokens=40, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert (last.response.output_text, last.response.usage.output_tokens) == (want, chat.usage.completion_tokens)


def test_previous_response_id_continues_on_a_live_topology(pdd_topology):
    from openai import OpenAI

    client = OpenAI(base_url=pdd_topology.url + "/v1", api_key="none", max_retries=0)
    r1 = client.responses.create(model="pdd-small", input="The decode stage", max_output_tokens=12, temperature=0)
    r2 = client.responses.create(model="pdd-small", input="and then", previous_response_id=r1.id,
                                 max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="pdd-small", max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "The decode stage"}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "and then"}])
    assert r2.output_text == chat.choices[0].message.content
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(r2.id).output_text == r2.output_text


def test_forced_tool_call_matches_chat_on_a_live_topology(pdd_topology):
    """A named tool_choice is chat's structured output on every tier: the same call (or, cut by
    max_output_tokens, the same text) as chat's for the same tools, greedy."""
    from openai import OpenAI

    client = OpenAI(base_url=pdd_topology.url + "/v1", api_key="none", max_retries=0)
    params = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = client.chat.completions.create(
        model="pdd-small", messages=[{"role": "user", "content": "is it sunny?"}], max_tokens=40, temperature=0,
        tools=[{"type": "function", "function": {"name": "check", "parameters": params}}],
        tool_choice={"type": "function", "function": {"name": "check"}})
    r = client.responses.create(model="pdd-small", input="is it sunny?", max_output_tokens=40, temperature=0,
                                tools=[{"type": "function", "name": "check", "parameters": params}],
                                tool_choice={"type": "function", "name": "check"})
    m = chat.choices[0].message
    got = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert got == [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert r.output_text == (m.content or "")
    assert got and got[0][1] in ('{"ok": true}', '{"ok": false}')
