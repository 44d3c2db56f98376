"""``flush`` on an engine instance (``pdd.roles.base``) while an aborted request's pages are still
being freed (out of ``reqs``, its release waiting for the engine thread): that request is live,
so the gateway waits for it (``wait_idle``) instead of counting its pages as leaked. The
instance's own handlers on a fake engine thread; the test decides when the pages are freed."""

from __future__ import annotations

import asyncio

from pdd.config import ClusterConfig
from pdd.roles.base import EngineInstance, ReqCtx
from pdd.topology import layout
from pdd.transfer.messages import Abort, AbortOk, FlushOk, IdleOk, WaitIdle
from pdd.types import SamplingParams
from tests.roles.test_wait_idle import Sink

HELD = 3  # pages each request holds


class Pool:
    num_pages = 64

    def __init__(self):
        self.num_free = 64


class FakeEngine:
    def __init__(self):
        self.pool = Pool()

    def release(self, seq, cache):
        self.pool.num_free += HELD

    def flush_cache(self):
        pass


class ReleaseGatedWorker:
    """The engine thread: a release runs once ``open`` is set; any other call (the flush) at once."""

    def __init__(self, engine):
        self.engine, self.open = engine, asyncio.Event()
        self.releasing = asyncio.Event()  # set once a release waits for ``open``

    async def call(self, fn, overlap=False):
        if getattr(fn, "__name__", "") == "_rel":
            self.releasing.set()
            await self.open.wait()
        return fn(self.engine)


async def test_a_request_whose_pages_are_being_freed_is_live_at_a_flush():
    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    lay = layout(cfg)
    inst = EngineInstance(cfg, lay.get("md0"), lay)
    inst.engine = FakeEngine()
    inst.worker = ReleaseGatedWorker(inst.engine)
    inst.reqs["r1"] = ReqCtx("r1", "seq-r1", Sink(), SamplingParams())
    inst.engine.pool.num_free -= HELD
    abort = asyncio.ensure_future(inst.on_abort(None, Abort("r1").wire(), b""))
    await inst.worker.releasing.wait()
    assert "r1" not in inst.reqs and not abort.done()  # out of reqs, its pages not freed yet
    rep, _ = await inst.on_flush(None, {"t": "flush"}, b"")
    assert FlushOk.decode(rep) == FlushOk("md0", 64, 64 - HELD, live_requests=1, pages_dropped=0)
    wait = asyncio.ensure_future(inst.on_wait_idle(None, WaitIdle(30.0).wire(), b""))
    inst.worker.open.set()
    assert AbortOk.decode((await abort)[0]) == AbortOk("r1", True)
    assert IdleOk.decode((await wait)[0]) == IdleOk("md0", waited_for=1, left=0, running=0)
    rep, _ = await inst.on_flush(None, {"t": "flush"}, b"")
    assert FlushOk.decode(rep) == FlushOk("md0", 64, 64, live_requests=0, pages_dropped=0)
