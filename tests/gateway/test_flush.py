"""``Orchestrator.flush``: a request the client saw finish may still be live on an instance for a
moment; that is not a leak. Fake connections, no processes."""

import asyncio

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.state import ReqState
from pdd.topology import layout
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer


class FlushPeer(FakePeer):
    """Answers ``flush`` with ``held`` pages in use and one live request while it holds one
    (``live``); ``wait_idle`` as an instance does: once that request is gone (``finishing``: it
    finishes as the call arrives; else, an orphan, it is still there when the wait runs out).
    Records each call's header (``sent``) and timeout (``timeouts``)."""

    def __init__(self, live=False, held=3, finishing=True):
        super().__init__()
        self.live, self.held, self.finishing, self.flushes = live, held, finishing, 0
        self.timeouts: list = []

    async def call(self, h, payload=b"", timeout=None):
        self.timeouts.append(timeout)
        if h.get("t") == "wait_idle":
            self.sent.append(dict(h))
            waited = int(self.live)
            if self.finishing:
                self.live = False
            return {"t": "idle_ok", "name": "x", "waited_for": waited, "left": int(self.live),
                    "running": int(self.live)}, b""
        if h.get("t") != "flush":
            return await super().call(h, payload, timeout)
        self.sent.append(dict(h))
        self.flushes += 1
        return {"pages_total": 64, "pages_free": 64 - (self.held if self.live else 0),
                "live_requests": int(self.live)}, b""


def _orch(peers):
    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = dict(zip([s.name for s in o.layout.engines], peers))
    return o


def test_flush_waits_for_a_finishing_request_then_counts_nothing():
    """The instance whose flush found a live request is asked to answer once it is gone
    (``wait_idle``, bounded by ``settle_s``) and flushed again then: no flush repeated on a
    clock, and the instances with nothing live are flushed once."""
    finishing, idle = FlushPeer(live=True), FlushPeer()
    o = _orch([finishing, idle, FlushPeer()])
    rep = asyncio.run(o.flush(settle_s=5.0))
    assert rep["leaked_pages"] == 0 and rep["busy"] == [] and rep["unreachable"] == []
    assert finishing.sent == [{"t": "flush"}, {"t": "wait_idle", "timeout_s": 5.0}, {"t": "flush"}]
    assert finishing.timeouts[1] == 5.0 + o.cfg.liveness.dead_after_s  # the instance answers within settle_s
    assert idle.sent == [{"t": "flush"}]


def test_flush_counts_an_orphaned_live_request_as_leaked_when_idle():
    orphan = FlushPeer(live=True, held=5, finishing=False)
    o = _orch([orphan, FlushPeer(), FlushPeer()])
    rep = asyncio.run(o.flush(settle_s=0.05))
    assert rep["leaked_pages"] == 5 and rep["busy"] == []
    assert [h["t"] for h in orphan.sent] == ["flush", "wait_idle", "flush"]


def test_flush_under_traffic_does_not_wait_and_lists_busy_instances():
    peers = [FlushPeer(live=True, held=5, finishing=False), FlushPeer(), FlushPeer()]
    o = _orch(peers)
    o.reqs["r1"] = ReqState("r1", 4, SamplingParams(max_tokens=4), trid="r1", prompt_ids=[1] * 4)
    rep = asyncio.run(o.flush(settle_s=5.0))
    name = o.layout.engines[0].name
    assert rep["busy"] == [name] and rep["leaked_pages"] == 0 and peers[0].sent == [{"t": "flush"}]


def test_flush_with_an_unreachable_instance_reports_leaks_unknown():
    """A new user saw ``leaked_pages: 0`` right after killing md0: the dead instance's pages were
    simply not counted. Now the count is None and the instance is named."""

    class DeadPeer(FlushPeer):
        async def call(self, h, timeout=None):
            raise ConnectionError("no sign of life (heartbeat)")

    o = _orch([FlushPeer(), FlushPeer(), DeadPeer()])
    rep = asyncio.run(o.flush(settle_s=0.05))
    dead = o.layout.engines[2].name
    assert rep["leaked_pages"] is None and rep["unreachable"] == [dead] and "error" in rep["instances"][dead]
    rep = asyncio.run(_orch([FlushPeer(), FlushPeer(), FlushPeer()]).flush(settle_s=0.05))
    assert rep["leaked_pages"] == 0 and rep["unreachable"] == []


def test_flush_forgets_what_the_gateway_routed_to_each_md():
    """The caches are empty after a flush, so the gateway's index of each MD (routing, and a
    predicted send's first page) must not claim the prefixes any more."""
    o = _orch([FlushPeer(), FlushPeer(), FlushPeer()])
    md = next(iter(o.prefix_index))
    o._record_route(md, list(range(64)))
    assert o.prefix_index[md].match(list(range(64))) == 64
    asyncio.run(o.flush(settle_s=0.05))
    assert o.prefix_index[md].match(list(range(64))) == 0


class RemovingPeer(FlushPeer):
    """While answering ``flush`` and ``stats``, the instance ``gone`` leaves the gateway's peers
    (a removal finishing meanwhile: ``remove_when_idle``, another operator's DELETE)."""

    def __init__(self, o_ref, gone):
        super().__init__()
        self.o_ref, self.gone = o_ref, gone

    async def call(self, h, payload=b"", timeout=None):
        self.o_ref[0].peers.pop(self.gone, None)
        if h.get("t") == "stats":
            return {"pages_total": 64, "pages_free": 64}, b""
        return await super().call(h, payload, timeout)


def test_flush_and_stats_while_an_instance_leaves_the_membership():
    """A removal that completed while /pdd/flush or /pdd/stats awaited an instance's answer made
    them a 500 (RuntimeError: dictionary changed size during iteration)."""
    ref = [None]
    o = ref[0] = _orch([RemovingPeer(ref, "md0"), FlushPeer(), FlushPeer()])
    names = [s.name for s in o.layout.engines]
    assert names == ["p0", "rld0", "md0"]
    rep = asyncio.run(o.flush(settle_s=0.05))
    assert rep["leaked_pages"] == 0 and sorted(rep["instances"]) == ["p0", "rld0"]
    o.peers["md0"] = FlushPeer()
    st = asyncio.run(o.stats())
    assert sorted(st["instances"]) == ["p0", "rld0"]


class WaitingPeer(FlushPeer):
    """Answers ``stats`` / ``flush`` only once every instance has been asked (``asked`` counts
    the calls out; ``all_out`` is set by the last): asked one after another, the first would
    wait for ever, as an instance across a WAN outage made /pdd/stats wait its 10 s timeout
    per such instance before the next was asked."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    async def call(self, h, payload=b"", timeout=None):
        st = self.state
        st["asked"] += 1
        if st["asked"] % st["n"] == 0:
            st["all_out"].set()
        await asyncio.wait_for(st["all_out"].wait(), 30)  # a guard: the order, not a clock, decides
        if h.get("t") == "stats":
            return {"pages_total": 64, "pages_free": 64}, b""
        return await super().call(h, payload, timeout)


def test_stats_and_flush_ask_every_instance_at_once():
    async def run():
        st = {"asked": 0, "n": 3, "all_out": asyncio.Event()}
        o = _orch([WaitingPeer(st), WaitingPeer(st), WaitingPeer(st)])
        stats = await o.stats()
        assert sorted(stats["instances"]) == ["md0", "p0", "rld0"]
        assert all("error" not in v for v in stats["instances"].values())
        st["all_out"].clear()
        rep = await o.flush(settle_s=0.05)
        assert rep["leaked_pages"] == 0 and rep["unreachable"] == [] and st["asked"] == 6
    asyncio.run(run())


class AbortingPeer(FlushPeer):
    """An instance holding one request (``held`` pages) that the gateway aborts: ``abort`` is
    answered once ``freed`` is set (an instance frees the pages, then answers, as
    ``pdd.roles.base`` does); until then a ``flush`` finds the pages in use and, as an instance
    did while the release waited for its engine thread, no live request."""

    def __init__(self):
        super().__init__(held=5)
        self.freed = asyncio.Event()
        self.aborted = asyncio.Event()

    async def call(self, h, payload=b"", timeout=None):
        if h.get("t") == "abort":
            self.sent.append(dict(h))
            self.aborted.set()
            await self.freed.wait()
            return {"t": "abort_ok", "rid": h["rid"], "streams": True}, b""
        if h.get("t") == "flush":
            self.sent.append(dict(h))
            return {"pages_total": 64, "pages_free": 64 if self.freed.is_set() else 64 - self.held,
                    "live_requests": 0}, b""
        return await super().call(h, payload, timeout)


class Watched(set):
    """``Orchestrator._abort_waiters``: ``waiting`` is set once a flush waits for the aborts."""

    def __init__(self):
        super().__init__()
        self.waiting = asyncio.Event()

    def add(self, fut):
        super().add(fut)
        self.waiting.set()



def _aborting_topology():
    """Three instances that hold an abort until released, a gateway over them whose flush waits
    are watched, and one request r1 in flight: (peers, orchestrator, r1's state)."""
    peers = [AbortingPeer(), AbortingPeer(), AbortingPeer()]
    o = _orch(peers)
    o._abort_waiters = Watched()
    st = ReqState("r1", 4, SamplingParams(max_tokens=4), trid="r1", prompt_ids=[1] * 4)
    o.reqs["r1"] = st
    return peers, o, st

def test_flush_after_a_disconnect_waits_for_its_abort_to_release():
    """A burst of client disconnects, then /pdd/flush: each aborted request had left the
    gateway's table (``reqs``) before its instances answered the abort, so the flush found the
    gateway idle and their pages in use, and reported them leaked (2-40 pages, free 1-3 s
    later). Now the flush waits for every abort still under way to be answered, then flushes:
    no instance is flushed before then, and nothing is leaked. The order is the test's
    (events), not a clock's."""
    from pdd.gateway.state import ABORT_CLIENT

    async def run():
        peers, o, st = _aborting_topology()
        abort = asyncio.ensure_future(o.abort(st, ABORT_CLIENT))
        for p in peers:
            await p.aborted.wait()
        assert not o.reqs and o.aborting == {"r1": 1}  # out of the table, its abort not answered
        flush = asyncio.ensure_future(o.flush(settle_s=30.0))
        waiting = asyncio.ensure_future(o._abort_waiters.waiting.wait())
        done, _ = await asyncio.wait({flush, waiting}, return_when=asyncio.FIRST_COMPLETED)
        assert flush not in done, flush.result()
        assert [p.of("flush") for p in peers] == [[], [], []]
        for p in peers:
            p.freed.set()
        await abort
        rep = await flush
        assert (rep["leaked_pages"], rep["busy"], rep["aborting"]) == (0, [], [])
        assert [[h["t"] for h in p.sent] for p in peers] == [["abort", "flush"]] * 3
        assert o.aborting == {} and len(o._abort_waiters) == 0
    asyncio.run(run())


def test_flush_reports_an_abort_not_answered_in_settle_s_as_in_flight():
    """An abort still unanswered after ``settle_s`` (an instance slow to answer): the flush goes
    on, names it in ``aborting`` and counts the instances holding pages as busy, not leaked."""
    from pdd.gateway.state import ABORT_CLIENT

    async def run():
        peers = [AbortingPeer(), AbortingPeer(), AbortingPeer()]
        o = _orch(peers)
        st = ReqState("r1", 4, SamplingParams(max_tokens=4), trid="r1", prompt_ids=[1] * 4)
        o.reqs["r1"] = st
        abort = asyncio.ensure_future(o.abort(st, ABORT_CLIENT))
        for p in peers:
            await p.aborted.wait()
        rep = await o.flush(settle_s=0.0)
        assert (rep["leaked_pages"], rep["aborting"]) == (0, ["r1"])
        assert rep["busy"] == ["md0", "p0", "rld0"]
        for p in peers:
            p.freed.set()
        await abort
        rep = await o.flush(settle_s=0.0)
        assert (rep["leaked_pages"], rep["aborting"], rep["busy"]) == (0, [], [])
    asyncio.run(run())


def test_a_stream_closed_by_its_client_is_aborting_before_its_abort_task_runs():
    """The client goes away mid-stream: the stream forgets the request (``reqs``) at once and
    aborts it in a task of its own; from that moment, before the task first runs, the abort is
    under way (``aborting``), so a flush that begins in between waits for it too."""
    from pdd.transfer.messages import Tok

    async def run():
        peers, o, st = _aborting_topology()
        stream = o.stream(st)
        o._tok(Tok("r1", 0, 5, None, "md"))
        assert (await stream.__anext__()).token_id == 5
        await stream.aclose()  # the client went away
        assert (dict(o.reqs), o.aborting, [p.of("abort") for p in peers]) == ({}, {"r1": 1}, [[], [], []])
        flush = asyncio.ensure_future(o.flush(settle_s=30.0))
        waiting = asyncio.ensure_future(o._abort_waiters.waiting.wait())
        done, _ = await asyncio.wait({flush, waiting}, return_when=asyncio.FIRST_COMPLETED)
        assert flush not in done, flush.result()
        for p in peers:
            await p.aborted.wait()
            p.freed.set()
        rep = await flush
        assert (rep["leaked_pages"], rep["busy"], rep["aborting"], o.totals["cancelled"]) == (0, [], [], 1)
        assert [[h["t"] for h in p.sent] for p in peers] == [["abort", "flush"]] * 3
    asyncio.run(run())
