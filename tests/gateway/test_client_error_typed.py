"""A request's own failure (its structured output's grammar failed at run time) is a 400 because
it says so in a typed field, from the engine to the API: ``Engine.pop_failed`` ->
``EngineWorker._fail_seq`` -> ``on_seq_failed(..., client_error=True)`` -> ``ReqError.client_error``
(or a failed prefill call's ``detail.client_error``) -> ``RequestFailed.client_error`` ->
``api._failure``. Before, ``_failure`` searched the error's text for
``pdd.structured.FAILED_AT``: a server failure quoting that text was a 400, and a reworded one a
503. Fake connections and engines, no processes."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.api import _failure
from pdd.gateway.state import RequestFailed, client_error_of, client_reason_of
from pdd.structured import FAILED_AT
from pdd.transfer.messages import OMIT, ReqError
from pdd.transfer.peer import CallFailed, RemoteError
from pdd.types import Pipeline
from tests.gateway.fake_peer import consume, fake_orchestrator, streaming_request

BOUND_S = 10.0  # a step taking longer is a stall (the request timeout is 300 s)
GRAMMAR = f"md0: {FAILED_AT} 3: token 7 doesn't satisfy the grammar"


def test_the_status_is_the_typed_field_not_the_text():
    assert _failure(RequestFailed("request r1 failed: md0: out of KV pages", client_error=True)) \
        == (400, "invalid_request_error")
    assert _failure(RequestFailed(f"request r1 failed: {GRAMMAR}")) == (503, "server_error")
    assert _failure(RequestFailed("request r1 failed: md0: out of KV pages")) == (503, "server_error")


def test_req_error_sends_client_error_only_when_set_and_reads_an_old_header():
    assert ReqError("r1", "x").wire() == {"t": "req_error", "rid": "r1", "error": "x"}
    assert ReqError("r1", "x", True).wire() == {"t": "req_error", "rid": "r1", "error": "x", "client_error": True}
    assert ReqError.decode({"t": "req_error", "rid": "r1", "error": "x"}).client_error is not True
    assert ReqError.decode({"t": "req_error", "rid": "r1", "error": "x", "client_error": True}).client_error is True


def test_a_failed_calls_detail_is_a_client_error():
    """P's prefill call failed by the request's grammar (``CallFailed(..., client_error=True)``)
    reaches the gateway as a RemoteError whose header carries it, however it was wrapped."""
    remote = RemoteError(f"CallFailed: {GRAMMAR}", {"t": "error", "error": "x", "detail": {"client_error": True}})
    try:
        try:
            raise remote
        except RemoteError as e:
            raise RuntimeError("recovery failed") from e
    except RuntimeError as wrapped:
        assert client_error_of(wrapped)
    assert not client_error_of(RemoteError(f"RuntimeError: {GRAMMAR}", {"t": "error", "error": "x"}))
    assert CallFailed("x", client_error=True).detail == {"client_error": True}


@pytest.mark.parametrize("client_error,status", [(True, 400), (False, 503)])
async def test_a_tiers_req_error_fails_the_stream_with_its_kind(client_error, status):
    o = fake_orchestrator()
    st = streaming_request(o, Pipeline.P_MD)
    consumer, _got = consume(o, st)
    text = GRAMMAR if client_error else f"md0: {FAILED_AT} (quoted by a server failure)"
    await o.on_req_error(o.peers["md0"], ReqError("r1", text, True if client_error else OMIT).wire(), b"")
    with pytest.raises(RequestFailed) as ex:
        await asyncio.wait_for(consumer, BOUND_S)
    assert str(ex.value) == f"request r1 failed: {text}"
    assert ex.value.client_error is client_error and _failure(ex.value)[0] == status
    # what the client reads: its own failure's why, without the gateway's request id nor the tier's
    # name (the server's, for its log); the server's failure as it is
    assert ex.value.client_message == (GRAMMAR.removeprefix("md0: ") if client_error else str(ex.value))


def test_a_failed_calls_reason_is_its_text_without_the_exceptions_name():
    """P's prefill call failed by the request's grammar: "CallFailed: <why>" (pdd.transfer.peer's
    error text); the client reads <why>, however the failure was wrapped."""
    why = f"{FAILED_AT} 0: parser error: too many items"
    remote = RemoteError(f"CallFailed: {why}", {"t": "error", "error": "x", "detail": {"client_error": True}})
    try:
        try:
            raise remote
        except RemoteError as e:
            raise RequestFailed(f"request r1 failed while starting: {e}", client_error_of(e),
                                client_reason_of(e)) from e
    except RequestFailed as wrapped:
        assert (wrapped.client_message, client_reason_of(wrapped)) == (why, why)
    assert client_reason_of(RemoteError(f"RuntimeError: {why}", {"t": "error", "error": "x"})) is None
    assert RequestFailed("request r1 failed: p0: x", client_error=True).client_message == "request r1 failed: p0: x"


async def test_the_worker_fails_a_popped_sequence_as_the_clients_and_a_raising_step_as_the_servers():
    from pdd.roles.worker import EngineWorker

    class Seq:
        def __init__(self, seq_id):
            self.seq_id = seq_id

    class Engine:
        def __init__(self):
            self.seqs, self.steps, self.released = {"b": Seq("b")}, 0, []
            self.failed = [(Seq("a"), GRAMMAR)]

        def has_work(self):
            return self.steps < 2

        def step(self):
            self.steps += 1
            if self.steps == 2:
                raise RuntimeError("device lost")
            return []

        def pop_failed(self):
            out, self.failed = self.failed, []
            return out

        def release(self, seq, cache=False):
            self.released.append(seq.seq_id)
            self.seqs.pop(seq.seq_id, None)

    got: list = []
    both = asyncio.Event()

    def on_seq_failed(*args):
        got.append(args)
        if len(got) == 2:
            both.set()

    eng = Engine()
    w = EngineWorker(eng, asyncio.get_running_loop(), on_events=lambda ev: None, on_seq_failed=on_seq_failed)
    w.start()
    try:
        await asyncio.wait_for(both.wait(), BOUND_S)
    finally:
        w.stop()
    assert got == [("a", GRAMMAR, True), ("b", "RuntimeError: device lost")]
    assert eng.released == ["a", "b"]


@pytest.mark.parametrize("client_error,sent", [(True, {"client_error": True}), (False, {})])
async def test_a_tier_tells_the_gateway_whose_failure_it_was(client_error, sent):
    from tests.roles.test_wait_idle import _hold, _instance

    inst = _instance()
    ctx = _hold(inst, "r1")
    inst.on_seq_failed("r1", GRAMMAR, client_error)
    assert ctx.sink.put_headers == [{"t": "req_error", "rid": "r1", "error": f"md0: {GRAMMAR}", **sent}]


@pytest.mark.parametrize("client_error,detail", [(True, {"client_error": True}), (False, None)])
async def test_p_fails_its_prefill_call_with_whose_failure_it_was(client_error, detail):
    """The request's first token on P (its grammar at output 0): the prefill call's error reply
    carries ``detail.client_error`` (the gateway reads it when a recovery's new attempt fails)."""
    from pdd.config import ClusterConfig
    from pdd.roles.prefill import PrefillInstance
    from pdd.topology import layout

    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    lay = layout(cfg)
    inst = PrefillInstance(cfg, lay.get("p0"), lay)
    fut = inst.first_token_waiters["r1"] = asyncio.get_running_loop().create_future()
    inst.on_seq_failed("r1", GRAMMAR, client_error)
    e = fut.exception()
    assert str(e) == GRAMMAR and getattr(e, "detail", None) == detail
