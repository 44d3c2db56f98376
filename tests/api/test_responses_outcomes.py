"""``POST /v1/responses`` ends as chat does: a client gone mid-stream is cancelled on every tier,
a tier's failure mid-stream is a ``response.failed`` event (503 when not streamed), each
request counted once (tests/api/test_gateway_outcomes.py's scripted tiers and live server)."""

from __future__ import annotations

import json
import re

from pdd.gateway.orchestrator import ABORT_CLIENT, ABORT_FAILED
from tests.api.test_gateway_outcomes import _settled, gateway  # noqa: F401 (a fixture)

BODY = {"model": "pdd-tiny", "input": "hello there", "max_output_tokens": 400}


def _events(text: str) -> list[dict]:
    """The ``data:`` objects of an SSE body, each checked against its ``event:`` line."""
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {obj['type']}", block
        out.append(obj)
    return out


async def test_client_gone_mid_stream_is_cancelled_on_every_tier(gateway):  # noqa: F811
    client, orch, _ = gateway
    async with client.stream("POST", "/v1/responses", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        deltas = 0
        async for line in r.aiter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas >= 5:
                break
    assert await _settled(orch, 1) == {"completed": 0, "failed": 0, "cancelled": 1, "rejected": 0}
    assert orch.abort_reasons == [ABORT_CLIENT]


async def test_a_tier_failing_mid_stream_is_response_failed(gateway):  # noqa: F811
    client, orch, _ = gateway
    orch.fail_at = 3
    r = await client.post("/v1/responses", json={**BODY, "stream": True})
    evs = _events(r.text)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs[-5:]] == ["response.output_text.delta", "response.output_text.done",
                                             "response.content_part.done", "response.output_item.done",
                                             "response.failed"]
    failed = evs[-1]["response"]
    assert (failed["status"], failed["error"]["code"]) == ("failed", "server_error")
    assert "injected tier failure" in failed["error"]["message"]
    assert failed["id"] == evs[0]["response"]["id"] and failed["output"][0]["content"][0]["text"] == evs[-4]["text"]
    assert await _settled(orch, 1) == {"completed": 0, "failed": 1, "cancelled": 0, "rejected": 0}
    assert (await client.get(f"/v1/responses/{failed['id']}")).status_code == 404  # a failed response is not kept
    r = await client.post("/v1/responses", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
    assert await _settled(orch, 2) == {"completed": 0, "failed": 2, "cancelled": 0, "rejected": 0}
    assert ABORT_FAILED in orch.abort_reasons and ABORT_CLIENT not in orch.abort_reasons



async def test_the_requests_own_failure_mid_stream_reads_as_its_400(gateway):  # noqa: F811
    """A request failed by its own grammar (``client_error``) is a 400 ``invalid_request_error``
    not streamed; streamed, its ``response.failed`` said ``server_error``."""
    client, orch, _ = gateway
    orch.fail_at, orch.fail_as_client = 3, "structured output failed at output 3: parser error"
    r = await client.post("/v1/responses", json={**BODY, "stream": True})
    failed = _events(r.text)[-1]
    assert (failed["type"], failed["response"]["status"], failed["response"]["error"]) == (
        "response.failed", "failed", {"code": "invalid_request_error",
                                      "message": "structured output failed at output 3: parser error"})
    r = await client.post("/v1/responses", json=BODY)
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "structured output failed at output 3: parser error", "type": "invalid_request_error",
        "param": None, "code": None}})
    r = await client.post("/v1/chat/completions", json={"model": "pdd-tiny", "max_tokens": 40, "stream": True,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    errors = [json.loads(ln[6:])["error"] for ln in r.text.splitlines() if ln.startswith('data: {"error"')]
    assert errors == [{"message": "structured output failed at output 3: parser error",
                       "type": "invalid_request_error", "param": None, "code": None}]

async def test_x_request_id_is_echoed_and_the_response_id_its_own(gateway):  # noqa: F811
    """X-Request-Id correlates the request (echoed in the header); the response's id is new for
    each response, streamed or not (one header sent twice made one id, the second replacing the
    first in the store)."""
    client, orch, _ = gateway
    r = await client.post("/v1/responses", json={**BODY, "max_output_tokens": 4}, headers={"X-Request-Id": "abc-1"})
    assert (r.status_code, r.headers["x-request-id"]) == (200, "abc-1")
    first = r.json()["id"]
    assert re.fullmatch(r"resp_[0-9a-f]{32}", first)
    r = await client.post("/v1/responses", json={**BODY, "max_output_tokens": 4, "stream": True},
                          headers={"X-Request-Id": "abc-1"})
    evs = _events(r.text)
    (streamed,) = {e["response"]["id"] for e in evs if "response" in e}
    assert re.fullmatch(r"resp_[0-9a-f]{32}", streamed) and streamed != first
    assert r.headers["x-request-id"] == "abc-1"
    assert evs[-1]["type"] == "response.incomplete"
    assert await _settled(orch, 2) == {"completed": 2, "failed": 0, "cancelled": 0, "rejected": 0}
