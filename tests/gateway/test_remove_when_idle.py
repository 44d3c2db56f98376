"""``drain {remove_when_idle: true}``: the gateway removes the instance as the last thing in
flight there ends, woken by that end, not by a poll (it looked every 0.1 s, so a removal
followed the last request by up to 0.1 s and raced whatever happened in between). The loop
here runs with its clock stopped: a watcher that slept between looks would never look again."""

from __future__ import annotations

import asyncio

from pdd.policy.membership import DRAINING, REMOVED
from tests.gateway.test_membership import _setup


class StoppedClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock never moves: a timer (``asyncio.sleep(0.1)``) never fires."""

    def time(self) -> float:
        return 0.0


def _run(coro):
    loop = StoppedClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _turns(n: int = 20) -> None:
    """Let every ready task run, ``n`` rounds (no time passes)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_removal_follows_the_last_in_flight_request_and_transfer_at_once():
    o, ms, _ = _setup(standby=())
    o.inflight["md1"] = 2  # two requests decoding there
    o.awaiting_kv["t9"] = ("p0", "md1")  # and a finished request's KV still on its way to it
    peer = o.peers["md1"]

    async def run():
        rep = await ms.drain("md1", remove_when_idle=True)
        assert (rep["state"], rep["in_flight"], rep["remove_when_idle"]) == (DRAINING, 3, True)
        watcher = ms._watchers["md1"]
        sent = len(peer.sent)  # the drain's own stats call
        await _turns()
        o.inflight["md1"] = 1  # the first request ends
        await _turns()
        o.inflight["md1"] = 0  # the second one
        await _turns()
        assert (ms.members["md1"].state, len(peer.sent), watcher.done()) == (DRAINING, sent, False)
        o.awaiting_kv.pop("t9")  # the KV has landed: nothing is in flight there now
        await _turns()
        assert [h["t"] for h in peer.sent[sent:]] == ["stats", "flush"]  # the removal's flush, at once
        await watcher
        assert ms.members["md1"].state == REMOVED and ms._watchers == {}
        assert [(e["op"], e["instance"], e["to"]) for e in ms.events] == [("drain", "md1", DRAINING),
                                                                          ("remove", "md1", REMOVED)]

    _run(run())


def test_the_watcher_ends_as_the_instance_leaves_draining_otherwise():
    """An operator's forced removal while the watcher waits: it stops waiting at once (one
    removal, not a second one later)."""
    o, ms, _ = _setup(standby=())
    o.inflight["md1"] = 1
    o._peer_closed = lambda name, peer=None, removed=None: None

    async def run():
        await ms.drain("md1", remove_when_idle=True)
        watcher = ms._watchers["md1"]
        await _turns()
        rep = await ms.remove("md1", force=True)
        assert rep["state"] == REMOVED
        await _turns()
        assert watcher.done() and ms._watchers == {}
        assert [e["op"] for e in ms.events] == ["drain", "remove"]

    _run(run())


def test_a_watcher_holds_one_waker_while_it_waits_and_none_once_it_ended():
    """Removals and re-roles wait on one set of wakers (``Membership._idle_waits``, all set by
    ``in_flight_fell``): a watcher's is in it while it waits, gone once it removed its instance
    and gone when it is cancelled (nothing is left to be set for a wait that is over)."""
    o, ms, _ = _setup(standby=(), main_decode=3)
    o.inflight["md1"] = 1
    o.inflight["md2"] = 1

    async def run():
        await ms.drain("md1", remove_when_idle=True)
        await ms.drain("md2", remove_when_idle=True)
        md1, md2 = ms._watchers["md1"], ms._watchers["md2"]
        await _turns()
        assert len(ms._idle_waits) == 2
        o.inflight["md1"] = 0
        ms.in_flight_fell()
        await md1
        assert ms.members["md1"].state == REMOVED and len(ms._idle_waits) == 1
        md2.cancel()
        await asyncio.gather(md2, return_exceptions=True)
        assert ms._idle_waits == set() and ms._watchers == {}

    _run(run())
