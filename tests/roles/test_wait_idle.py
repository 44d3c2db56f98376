"""``wait_idle`` on an engine instance (``pdd.roles.base``): it answers once every request the
instance held when the call arrived is gone, its pages freed (woken by the release itself, not
by a clock), or once ``timeout_s`` ran out; a request arriving meanwhile is not waited for.
The instance's own handlers on a fake engine thread whose page frees the test lets through; no
model, no socket, no clock."""

from __future__ import annotations

import asyncio

from pdd.config import ClusterConfig
from pdd.roles.base import EngineInstance, ReqCtx
from pdd.topology import layout
from pdd.transfer.messages import Abort, IdleOk, WaitIdle
from pdd.types import SamplingParams


class FakeEngine:
    def __init__(self):
        self.released: list = []

    def release(self, seq, cache):
        self.released.append(seq)


class GatedWorker:
    """The engine thread: a call runs once ``open`` is set (the test decides when pages are freed)."""

    def __init__(self, engine):
        self.engine, self.open = engine, asyncio.Event()

    async def call(self, fn, overlap=False):
        await self.open.wait()
        return fn(self.engine)


def _instance() -> EngineInstance:
    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    lay = layout(cfg)
    inst = EngineInstance(cfg, lay.get("md0"), lay)
    inst.engine = FakeEngine()
    inst.worker = GatedWorker(inst.engine)
    return inst


class Sink:
    def __init__(self):
        self.put_headers: list = []

    def put(self, header, payload=b""):
        self.put_headers.append(header)


def _hold(inst: EngineInstance, rid: str) -> ReqCtx:
    ctx = inst.reqs[rid] = ReqCtx(rid, f"seq-{rid}", Sink(), SamplingParams())
    return ctx


async def _settle():
    """Let every task run until it waits on something only the test can set."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_wait_idle_answers_once_the_requests_it_found_are_freed():
    inst = _instance()
    assert inst.handlers()["wait_idle"] == inst.on_wait_idle
    _hold(inst, "r1")
    r2 = _hold(inst, "r2")
    call = asyncio.ensure_future(inst.on_wait_idle(None, WaitIdle(30.0).wire(), b""))
    await _settle()
    abort = asyncio.ensure_future(inst.on_abort(None, Abort("r1").wire(), b""))  # its pages wait for the engine
    await _settle()
    assert not call.done() and "r1" not in inst.reqs  # out of reqs, its pages not freed yet
    inst.worker.open.set()
    await abort
    await _settle()
    assert not call.done()  # r2 still held
    _hold(inst, "r3")  # arrives during the wait: not waited for
    inst.on_seq_failed("r2", "out of pages")  # the engine dropped it (its pages freed there)
    rep, _ = await call
    assert IdleOk.decode(rep) == IdleOk("md0", waited_for=2, left=0, running=1)
    assert inst.engine.released == ["seq-r1"] and inst._idle_waiters == []
    assert [h["t"] for h in r2.sink.put_headers] == ["req_error"]


async def test_wait_idle_is_bounded_and_answers_at_once_when_nothing_is_held():
    inst = _instance()
    rep, _ = await inst.on_wait_idle(None, WaitIdle(30.0).wire(), b"")
    assert IdleOk.decode(rep) == IdleOk("md0", waited_for=0, left=0, running=0)
    _hold(inst, "r1")
    rep, _ = await inst.on_wait_idle(None, WaitIdle(0.0).wire(), b"")  # the wait runs out at once
    assert IdleOk.decode(rep) == IdleOk("md0", waited_for=1, left=1, running=1)
    assert inst._idle_waiters == []
