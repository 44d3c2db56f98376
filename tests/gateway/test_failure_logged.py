"""A request that fails at the server (the API answers 503 ``server_error``) writes one WARNING
line naming it and why; it wrote none, so a gateway failing every request (a re-roled instance
running another role: ``LookupError: no handler for message type 'reserve'``) had a silent log
while ``/health`` said ok. The request's own failure (a 400) is logged at INFO, and a refusal
(429, or 503 with Retry-After: no instance reachable on the first try) not per request."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdd.gateway.state import NoInstance, RequestFailed
from pdd.transfer.messages import OMIT, ReqError
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import consume, fake_orchestrator, streaming_request

BOUND_S = 10.0  # a step taking longer is a stall (the request timeout is 300 s)


def _lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "pdd.gateway.orchestrator" and " failed" in r.getMessage()]


async def test_a_request_failing_while_it_starts_is_one_warning(caplog):
    caplog.set_level(logging.INFO)
    o = fake_orchestrator()

    async def launch(st, prompt_ids, force_relay=False):
        raise LookupError("no handler for message type 'reserve'")

    o._launch = launch
    with pytest.raises(RequestFailed) as ex:
        await o.start_request(list(range(10, 28)), SamplingParams(max_tokens=4), rid="r7")
    msg = "request r7 failed while starting: no handler for message type 'reserve'"
    assert str(ex.value) == msg
    assert _lines(caplog) == [(logging.WARNING, f"{msg} (the client gets 503 server_error)")]
    assert o.totals["failed"] == 1


async def test_a_request_refused_on_its_first_try_is_not_a_warning(caplog):
    caplog.set_level(logging.INFO)
    o = fake_orchestrator()

    async def launch(st, prompt_ids, force_relay=False):
        raise NoInstance("no prefill instance is reachable")

    o._launch = launch
    with pytest.raises(RequestFailed):
        await o.start_request(list(range(10, 28)), SamplingParams(max_tokens=4), rid="r8")
    assert _lines(caplog) == [] and o.totals["rejected"] == 1


@pytest.mark.parametrize("client_error,level,tail", [
    (False, logging.WARNING, "(the client gets 503 server_error)"),
    (True, logging.INFO, "(the request's own failure: the client gets 400 invalid_request_error)")])
async def test_a_request_a_tier_fails_while_it_streams_is_logged_once(caplog, client_error, level, tail):
    caplog.set_level(logging.INFO)
    o = fake_orchestrator()
    st = streaming_request(o, Pipeline.P_MD)
    consumer, _got = consume(o, st)
    await o.on_req_error(o.peers["md0"], ReqError("r1", "md0: boom", True if client_error else OMIT).wire(), b"")
    with pytest.raises(RequestFailed):
        await asyncio.wait_for(consumer, BOUND_S)
    assert _lines(caplog) == [(level, f"request r1 failed: md0: boom {tail}")]
