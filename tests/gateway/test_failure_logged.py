"""A request that fails at the server (the API answers 503 ``server_error``) writes one WARNING
line naming it and why; it wrote none, so a gateway failing every request (a re-roled instance
running another role: ``LookupError: no handler for message type 'reserve'``) had a silent log
while ``/health`` said ok. The request's own failure (a 400) is logged at INFO, a tier's refusal
(429) not at all, and a refusal for lack of an instance (503 with Retry-After: none reachable on
the first try) once per ``pdd.gateway.start.UNAVAILABLE_LOG_EVERY_S`` at most."""

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


async def test_a_request_a_tier_refuses_for_now_is_not_a_warning(caplog):
    """A tier's 429 (its queue full): counted rejected and in pdd_gateway_rejected_total, no line."""
    caplog.set_level(logging.INFO)
    o = fake_orchestrator()

    async def launch(st, prompt_ids, force_relay=False):
        raise RuntimeError("TierBusy: p0's queue is full (3 of 3)")

    o._launch = launch
    with pytest.raises(RequestFailed):
        await o.start_request(list(range(10, 28)), SamplingParams(max_tokens=4), rid="r8")
    assert _lines(caplog) == [] and o.totals["rejected"] == 1


async def test_a_request_no_instance_can_take_is_one_warning_and_a_flood_one_line(caplog):
    """No instance reachable on its first try (503 with Retry-After): capacity is lost, which the
    log says; the requests refused right after it are counted, not logged one by one."""
    caplog.set_level(logging.INFO)
    o = fake_orchestrator()
    o.unavailable_log.clock = lambda: 5.0

    async def launch(st, prompt_ids, force_relay=False):
        raise NoInstance("no prefill instance is reachable")

    o._launch = launch
    for rid in ("r8", "r9"):
        with pytest.raises(RequestFailed):
            await o.start_request(list(range(10, 28)), SamplingParams(max_tokens=4), rid=rid)
    assert _lines(caplog) == [(logging.WARNING, "request r8 failed while starting: no prefill instance is reachable "
                               "(the client gets 503 with Retry-After; refused for lack of an instance: logged at "
                               "most once every 10 s)")]
    assert (o.totals["rejected"], o.totals["failed"], o.unavailable_log.unlogged) == (2, 0, 1)


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
