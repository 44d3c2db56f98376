"""What ``DELETE /pdd/instances/{name}`` does to the removed instance's prefix cache and KV pages,
and what its answer says about them, on a fake instance that keeps its pages as an engine
instance does (``pdd.roles.base``): requests own pages and lock the cache pages their prompt hit,
an abort frees a request's pages once, a closed owner's requests are aborted, a flush evicts only
the cache's unlocked pages, ``wait_idle`` answers once the requests held when it arrived are gone.
Real orchestrator and membership; no processes, no clock."""

from __future__ import annotations

import asyncio
from collections import Counter

from pdd.policy.membership import REMOVED
from tests.gateway.fake_peer import FakePeer
from tests.gateway.test_membership import _setup

PAGE_SIZE = 16  # the config's default engine page size


class FakeInstance:
    """One instance's KV pool: ``cache`` (page ids in its prefix cache), ``reqs`` (rid -> its own
    pages, the cache pages it locks, the connection that owns it), ``freed`` (every page freed,
    in order: a page freed twice shows twice)."""

    def __init__(self, total: int = 64):
        self.total, self.next = total, 0
        self.cache: set[int] = set()
        self.reqs: dict[str, tuple[set[int], set[int], Conn]] = {}
        self.freed: list[int] = []
        self.refuse = False  # a new connection is refused
        self.gone = asyncio.Event()  # set (and cleared) on every abort: wakes the wait_idle calls

    def _alloc(self, n: int) -> set[int]:
        pages = set(range(self.next, self.next + n))
        self.next += n
        return pages

    def cached(self, n: int) -> list[int]:
        pages = self._alloc(n)
        self.cache |= pages
        return sorted(pages)

    def admit(self, rid: str, own: int, locks: list[int], conn: "Conn") -> None:
        self.reqs[rid] = (self._alloc(own), set(locks), conn)

    def used(self) -> int:
        return len(self.cache) + sum(len(own) for own, _l, _c in self.reqs.values())

    def abort(self, rid: str) -> None:
        r = self.reqs.pop(rid, None)  # a second abort finds nothing (ReqCtx.released)
        if r is not None:
            self.freed += sorted(r[0])
            self.gone.set()
            self.gone.clear()

    async def wait_idle(self) -> dict:
        """Answer once every request held now is gone (as ``pdd.roles.base``: no clock here)."""
        held = set(self.reqs)
        while held & set(self.reqs):
            await self.gone.wait()
        return {"waited_for": len(held), "left": 0, "running": len(self.reqs)}

    def flush(self) -> None:
        locked = set().union(*(locks for _o, locks, _c in self.reqs.values()))
        evict = self.cache - locked
        self.cache -= evict
        self.freed += sorted(evict)

    def connect(self) -> "Conn":
        if self.refuse:
            raise ConnectionRefusedError("connection refused")
        return Conn(self)


class Conn(FakePeer):
    """A connection to a FakeInstance, answering stats / flush / abort as an instance does."""

    def __init__(self, inst: FakeInstance):
        super().__init__()
        self.inst = inst
        self.before_flush = None  # an async hook run when a flush is asked, before it runs

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        i = self.inst
        if h["t"] == "stats":
            return {"pages_total": i.total, "pages_free": i.total - i.used(), "running": len(i.reqs)}, b""
        if h["t"] == "flush":
            if self.before_flush is not None:
                await self.before_flush()
            used = i.used()
            i.flush()
            return {"pages_total": i.total, "pages_free": i.total - i.used(), "live_requests": len(i.reqs),
                    "pages_dropped": used - i.used()}, b""
        if h["t"] == "wait_idle":
            return await i.wait_idle(), b""
        if h["t"] == "abort":
            i.abort(h["rid"])
        return {"t": "ok"}, b""

    async def close(self):
        self.closed = True
        for rid in [r for r, (_o, _l, c) in self.inst.reqs.items() if c is self]:  # its owner is gone
            self.inst.abort(rid)


def _with_instance(name: str = "md1"):
    """``_setup``'s gateway (md0, md1 active) with ``name`` a FakeInstance: its cache holds 5 pages;
    returns (orchestrator, membership, instance, the gateway's connection, connections opened)."""
    o, ms, _ = _setup(standby=())
    inst = FakeInstance()
    conn = o.peers[name] = Conn(inst)
    opened = []

    async def connect(n, retries):
        assert n == name
        c = inst.connect()
        opened.append(c)
        return c

    o._connect = connect
    inst.cached(5)
    return o, ms, inst, conn, opened


def _freed_once(inst: FakeInstance) -> bool:
    return all(n == 1 for n in Counter(inst.freed).values())


def test_forced_removal_with_a_request_in_flight_flushes_and_frees_every_page_once():
    """``DELETE /pdd/instances/md1?force=true`` with a request decoding there: the answer said
    "dropped with the instance (flushed)" but nothing was flushed (the instance kept its 5 cache
    pages) and it gave no pages dropped. The request is recovered elsewhere, the instance
    aborts it as the gateway's connection closes, and its cache (the 2 pages the request locked
    included) is flushed over a fresh connection: each of the 8 pages freed exactly once."""
    o, ms, inst, conn, opened = _with_instance()
    cache_pages = sorted(inst.cache)
    inst.admit("r1", 3, cache_pages[:2], conn)  # its prompt hit 2 cache pages; 3 pages of its own
    o.inflight["md1"] = 1
    lost = []
    o._peer_closed = lambda name, peer=None, removed=None: lost.append((name, peer.closed))
    rep = asyncio.run(ms.remove("md1", force=True))
    assert lost == [("md1", False)]  # recovered before its connection closed
    assert (rep["state"], rep["forced"], rep["leaked_pages"]) == (REMOVED, True, 0)
    assert rep["in_flight_at_removal"] == {"requests": 1, "transfers": 0}
    assert rep["prefix_cache"] == {
        "flushed": True, "pages_dropped": 5, "tokens_dropped": 5 * PAGE_SIZE, "gateway_index_pages_forgotten": 0,
        "fate": "flushed once the instance had freed the pages of the 1 request(s) in flight there "
                "(recovered elsewhere: the gateway closed its connection first, so the instance aborted them) and "
                "dropped with the instance; the gateway's prefix index of it is forgotten, so routing counts no hits "
                "there"}
    assert inst.cache == set() and inst.reqs == {} and inst.used() == 0
    assert sorted(inst.freed) == list(range(8)) and _freed_once(inst)
    assert conn.closed and conn.sent == [] and [c.closed for c in opened] == [True]
    assert ms.events[-1]["prefix_cache"] == rep["prefix_cache"] and ms.events[-1]["forced"] is True


def test_a_forced_removal_whose_flush_fails_says_the_cache_was_not_flushed():
    """The instance refuses the fresh connection: the answer says the cache was not flushed and
    why, and leaked_pages is unknown; the request's pages are freed once all the same (its owner
    gone), the cache pages stay with the instance. The fate does not claim the freeing: nothing
    confirmed it (a frozen instance would free nothing)."""
    o, ms, inst, conn, opened = _with_instance()
    inst.admit("r1", 3, sorted(inst.cache)[:2], conn)
    inst.refuse = True
    o.inflight["md1"] = 1
    o._peer_closed = lambda name, peer=None, removed=None: None
    rep = asyncio.run(ms.remove("md1", force=True))
    assert (rep["state"], rep["forced"], rep["leaked_pages"]) == (REMOVED, True, None)
    assert rep["prefix_cache"] == {
        "flushed": False, "gateway_index_pages_forgotten": 0, "error": "ConnectionRefusedError: connection refused",
        "fate": "not flushed: the flush failed (ConnectionRefusedError: connection refused); the gateway closed its "
                "connection, on which the instance aborts the 1 request(s) in flight there and frees their pages once "
                "it reads that close, which it did not confirm (a frozen instance frees nothing until it is resumed); "
                "its cache pages are unknown here: the gateway did not start its process and does not stop it: "
                "running, or frozen (SIGSTOP) until it is resumed, it keeps them (stop it yourself); the gateway's "
                "prefix index of it is forgotten, so routing counts no hits there"}
    assert len(inst.cache) == 5 and inst.reqs == {} and sorted(inst.freed) == [5, 6, 7] and _freed_once(inst)


def test_a_request_reaching_an_instance_during_its_removal_leaves_nothing_cached():
    """A request routed there just before the removal, assigned while its cache was flushed: the
    flush could not evict the cache page it locked, and leaked_pages was null. The instance is
    flushed again once it freed that request (the gateway's connection closed): every cache
    page dropped, each page freed once, leaked_pages exact."""
    o, ms, inst, conn, opened = _with_instance()
    o._peer_closed = lambda name, peer=None, removed=None: None
    first = sorted(inst.cache)[0]

    async def arrives():  # during the first flush
        conn.before_flush = None
        inst.admit("r2", 2, [first], conn)
        o.inflight["md1"] = 1

    conn.before_flush = arrives
    rep = asyncio.run(ms.remove("md1"))
    assert (rep["state"], rep["forced"], rep["in_flight_recovered"], rep["leaked_pages"]) == (REMOVED, False, 1, 0)
    assert (rep["prefix_cache"]["flushed"], rep["prefix_cache"]["pages_dropped"]) == (True, 5)
    assert inst.cache == set() and inst.reqs == {} and sorted(inst.freed) == list(range(7)) and _freed_once(inst)
    assert [h["t"] for h in conn.sent] == ["stats", "flush"] and [[h["t"] for h in c.sent] for c in opened] == [
        ["wait_idle", "stats", "flush"]]


def test_a_request_the_gateway_does_not_know_is_no_leak():
    """An idle removal whose flush finds a request still running there (one the gateway no
    longer counts, its abort still on its way): its pages were reported as leaked. They are not
    counted as leaked; the instance aborts it as the gateway's connection closes, and the cache
    is flushed again then."""
    o, ms, inst, conn, opened = _with_instance()
    inst.admit("old", 4, sorted(inst.cache)[:1], conn)
    rep = asyncio.run(ms.remove("md1"))
    assert (rep["forced"], rep["leaked_pages"], rep["prefix_cache"]["pages_dropped"]) == (False, 0, 5)
    assert "live_requests" not in rep["prefix_cache"]
    assert inst.cache == set() and inst.reqs == {} and sorted(inst.freed) == list(range(9)) and _freed_once(inst)


def test_a_forced_removal_flushes_once_the_instance_has_aborted_its_requests_however_late():
    """The instance notices the gateway's connection closed (and aborts its requests) only after
    the fresh connection's first message has arrived: the flush waits for the instance's word
    that those requests are gone (``wait_idle``), not for a clock, so the cache pages the request
    locked are flushed too and every page is freed once."""
    o, ms, inst, conn, opened = _with_instance()
    inst.admit("r1", 3, sorted(inst.cache)[:2], conn)
    o.inflight["md1"] = 1
    o._peer_closed = lambda name, peer=None, removed=None: None
    noticed = asyncio.Event()  # the instance has read the gateway's close

    async def late_close():  # the close is read later: the abort waits for the test
        conn.closed = True

        async def notice():
            await noticed.wait()
            inst.abort("r1")
        asyncio.ensure_future(notice())
    conn.close = late_close

    async def run():
        removal = asyncio.ensure_future(ms.remove("md1", force=True))
        while not (opened and opened[0].sent):  # the fresh connection's first message
            await asyncio.sleep(0)
        assert [h["t"] for h in opened[0].sent] == ["wait_idle"] and "r1" in inst.reqs and not removal.done()
        noticed.set()
        return await removal

    rep = asyncio.run(run())
    assert (rep["state"], rep["forced"], rep["leaked_pages"], rep["prefix_cache"]["pages_dropped"]) == (REMOVED, True, 0, 5)
    assert [h["t"] for h in opened[0].sent] == ["wait_idle", "stats", "flush"]
    assert inst.cache == set() and inst.reqs == {} and sorted(inst.freed) == list(range(8)) and _freed_once(inst)


def _silent_instance(dead_after_s: float = 0.01):
    """``_with_instance``'s gateway whose instance sits behind a WAN outage: a new connection is
    never answered (``connects`` counts the tries, ``cancelled`` those given up), and the
    liveness config's ``dead_after_s`` is ``dead_after_s``."""
    o, ms, inst, conn, opened = _with_instance()
    o.cfg = o.cfg.model_copy(update={"liveness": o.cfg.liveness.model_copy(update={"dead_after_s": dead_after_s})})
    tries = {"connects": 0, "cancelled": 0}

    async def never_answers(n, retries):
        tries["connects"] += 1
        try:
            await asyncio.Event().wait()  # the handshake's answer never comes
        except asyncio.CancelledError:
            tries["cancelled"] += 1
            raise
    o._connect = never_answers
    o._peer_closed = lambda name, peer=None, removed=None: None
    return o, ms, inst, conn, tries


def test_a_forced_removal_of_an_unreachable_instance_answers_after_dead_after_s_once():
    """``DELETE /pdd/instances/md1?force=true`` during a WAN outage took 32 s: the flush's fresh
    connection was tried three times, each waiting its 10 s handshake timeout. The new
    connection is given ``liveness.dead_after_s`` in all, once: the answer says the cache was not
    flushed and why; the request's pages are freed all the same (its owner's connection closed)."""
    o, ms, inst, conn, tries = _silent_instance()
    inst.admit("r1", 3, sorted(inst.cache)[:2], conn)
    o.inflight["md1"] = 1
    rep = asyncio.run(asyncio.wait_for(ms.remove("md1", force=True), 30))  # a guard: hung for ever before
    err = "TimeoutError: instance md1 did not answer a new connection within 0.01 s (liveness.dead_after_s)"
    assert (rep["state"], rep["forced"], rep["leaked_pages"]) == (REMOVED, True, None)
    assert (rep["prefix_cache"]["flushed"], rep["prefix_cache"]["error"]) == (False, err)
    assert rep["prefix_cache"]["fate"].startswith(f"not flushed: the flush failed ({err})")
    assert tries == {"connects": 1, "cancelled": 1} and conn.closed and conn.sent == []
    assert inst.reqs == {} and len(inst.cache) == 5 and _freed_once(inst)


def test_an_idle_instance_found_dead_by_its_flush_is_not_asked_again():
    """An idle instance's flush over the gateway's connection fails as its heartbeat finds it
    dead (a request reaching it meanwhile): the removal no longer tries a fresh connection after
    it (a second wait on the same silent instance)."""
    o, ms, inst, conn, tries = _silent_instance(dead_after_s=5.0)

    async def dead(h, payload=b"", timeout=None):
        conn.sent.append(dict(h))
        o.inflight["md1"] = 1  # routed there before the removal, assigned while the call was out
        raise ConnectionError("connection to md1 lost: no sign of life from md1 for 5.0 s (heartbeat)")
    conn.call = dead
    rep = asyncio.run(asyncio.wait_for(ms.remove("md1"), 30))  # a guard: hung for ever before
    assert (rep["state"], rep["forced"], rep["in_flight_recovered"], rep["leaked_pages"]) == (REMOVED, False, 1, None)
    assert rep["prefix_cache"]["flushed"] is False and "no sign of life" in rep["prefix_cache"]["error"]
    assert tries == {"connects": 0, "cancelled": 0} and [h["t"] for h in conn.sent] == ["stats"]


def test_a_removal_does_not_wait_for_a_reconnect_under_way_nor_gets_it_back():
    """The gateway's connection to md1 already closed (outage) and its reconnect watcher trying
    again: the removal waited up to 5 s for that try, polling, and a try answered after it put the
    removed instance's connection back. Now the removal goes on at once and a late try's
    connection is closed, not kept."""
    o, ms, inst, conn, _ = _silent_instance()
    conn.closed = True
    answer = asyncio.Event()
    late = []

    async def reconnect_try(n, retries):
        await answer.wait()  # answered only when the test says so
        c = inst.connect()
        late.append(c)
        return c
    o._connect = reconnect_try

    async def run():
        watcher = asyncio.ensure_future(o._reconnect("md1"))
        await asyncio.sleep(0)
        assert o._reconnecting == {"md1"}
        rep = await asyncio.wait_for(ms.remove("md1", force=True), 30)  # a guard
        assert not watcher.done()
        answer.set()
        await watcher
        return rep

    rep = asyncio.run(run())
    assert (rep["state"], rep["prefix_cache"]["flushed"]) == (REMOVED, False)
    assert "md1" not in o.peers and [c.closed for c in late] == [True]


def test_a_forced_removal_counts_requests_and_their_transfers_apart():
    """P removed with 6 requests there, each with its KV transfer planned: the answer showed
    ``in_flight`` 6 beside a fate of "the 12 request(s) or transfer(s)". The fate counts the
    requests and names the transfers, and ``in_flight_at_removal`` (answer and event) gives both."""
    o, ms, _connects = _setup(standby=(), prefill=2)
    lost = []
    o._peer_closed = lambda name, peer=None, removed=None: lost.append(name)
    for i in range(6):
        o.planned_src[f"r{i}"] = "p0"  # P has not reported the transfer's outcome yet
    o.inflight["p0"] = 6
    rep = asyncio.run(ms.remove("p0", force=True))
    assert lost == ["p0"] and (rep["state"], rep["forced"]) == (REMOVED, True)
    assert rep["in_flight_at_removal"] == {"requests": 6, "transfers": 6}
    assert rep["prefix_cache"]["fate"] == (
        "flushed once the instance had freed the pages of the 6 request(s) and 6 KV transfer(s) in flight there "
        "(the requests recovered elsewhere, the transfers given up: the gateway closed its connection first, so the "
        "instance aborted them) and dropped with the instance; the gateway's prefix index of it is forgotten, so "
        "routing counts no hits there")
    ev = ms.events[-1]
    assert (ev["op"], ev["in_flight"], ev["in_flight_at_removal"]) == ("remove", 12, {"requests": 6, "transfers": 6})


def test_the_fate_of_a_removal_with_only_transfers_in_flight_names_them():
    """MD removed while a finished request's KV was still on its way there: no request is
    counted, the transfer is named."""
    o, ms, _connects = _setup(standby=())
    o._peer_closed = lambda name, peer=None, removed=None: None
    o.awaiting_kv["t1"] = ("p0", "md1")
    rep = asyncio.run(ms.remove("md1", force=True))
    assert rep["in_flight_at_removal"] == {"requests": 0, "transfers": 1}
    assert rep["prefix_cache"]["fate"].startswith(
        "flushed once the instance had freed the pages of the 1 KV transfer(s) in flight there (given up: ")
