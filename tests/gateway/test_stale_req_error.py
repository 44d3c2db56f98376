"""A ``req_error`` that is stale is ignored (logged at debug), as a stale ``kv_progress`` or
token is: one read from an MD connection the gateway has since replaced (it reconnected to that
MD, or an add put a new connection in its place), one from an instance the attempt is not routed
to, and one of an attempt a recovery replaced. Before, the first two failed the request (the
connection check only chose between "MD's leg lost" and "fail"), though the request's MD, on its
current connection, was fine. Fake connections, no processes; each step waits on what it needs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdd.gateway.state import ReqState
from pdd.transfer.messages import ReqError, Tok
from pdd.types import Pipeline
from tests.gateway.fake_peer import FakePeer, consume, fake_orchestrator, streaming_request

BOUND_S = 10.0  # a step taking longer is a stall (the request timeout is 300 s)
ERROR = "md0: request r1: no KV for 300 s"
LOGGER = "pdd.gateway.orchestrator"


_request = streaming_request


async def _finishes_untouched(o, st: ReqState, consumer, got, tier: str) -> None:
    """The request goes on as if no error came: its decoder's next tokens end it, completed."""
    assert st.recovery.error is None and not st.recovery.lost and not st.recovery.md_lost and st.queue.empty()
    for i, tid in enumerate((103, 104, 105)):
        o._tok(Tok(st.trid, 3 + i, tid, "length" if tid == 105 else None, tier))
    await asyncio.wait_for(consumer, BOUND_S)
    assert got == [(3, 103, tier), (4, 104, tier), (5, 105, tier)]
    assert (o.totals["completed"], o.totals["failed"], o.totals["degraded"], o.totals.get("md_legs_lost", 0)) \
        == (1, 0, 0, 0)


@pytest.mark.parametrize("pipeline", [Pipeline.P_MD, Pipeline.P_RLD_MD])
async def test_a_req_error_from_a_replaced_md_connection_is_ignored(pipeline, caplog):
    """MD's old connection (the gateway reconnected since) still had a req_error of the request
    queued: the request, on MD's new connection, is not failed (P->MD) nor loses its MD leg
    (relayed)."""
    o = fake_orchestrator()
    st = _request(o, pipeline)
    old = o.peers["md0"]
    o.peers["md0"] = FakePeer()  # the reconnect's
    consumer, got = consume(o, st)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        await o.on_req_error(old, ReqError("r1", ERROR).wire(), b"")
    lines = [r for r in caplog.records if r.name == LOGGER and "req_error" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in lines] == [
        (logging.DEBUG, f"req_error of r1 from {old!r} ignored: not a connection the attempt uses now ({ERROR})")]
    await _finishes_untouched(o, st, consumer, got, "md" if pipeline == Pipeline.P_MD else "rld")
    assert o.peers["md0"].sent == [] and o.peers["p0"].sent == []  # no drop, no cancel: nothing was lost


async def test_a_req_error_from_an_instance_the_attempt_is_not_routed_to_is_ignored():
    o = fake_orchestrator(instances={"main_decode": 2})
    st = _request(o, Pipeline.P_MD)
    consumer, got = consume(o, st)
    await o.on_req_error(o.peers["md1"], ReqError("r1", "md1: refused a KV frame").wire(), b"")
    await _finishes_untouched(o, st, consumer, got, "md")


async def test_a_req_error_of_a_replaced_attempt_is_ignored(caplog):
    """The request's second attempt (r1.1) streams; its first attempt's MD fails r1 late."""
    o = fake_orchestrator()
    st = _request(o, Pipeline.P_MD, trid="r1.1")
    st.attempt = 1
    consumer, got = consume(o, st)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        await o.on_req_error(o.peers["md0"], ReqError("r1", ERROR).wire(), b"")
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        (logging.DEBUG, f"req_error of r1 from {o.peers['md0']!r} ignored: not a current attempt ({ERROR})")]
    await _finishes_untouched(o, st, consumer, got, "md")


async def test_a_req_error_from_the_current_md_connection_still_fails_a_p_md_request():
    """The check leaves a current error alone: MD, on the connection the attempt uses, fails it."""
    o = fake_orchestrator()
    st = _request(o, Pipeline.P_MD)
    await o.on_req_error(o.peers["md0"], ReqError("r1", ERROR).wire(), b"")
    assert st.recovery.error == ERROR and st.queue.get_nowait() is None
