"""``Membership.rerole`` switches the instance's role as the last thing in flight there ends,
woken by that end (``state.ReleaseDict`` -> ``Membership.in_flight_fell``), as a removal when
idle is, not by a poll (it looked every 0.05 s). The loop here runs with its clock stopped: a
re-role that slept between looks would never look again. Its deadline (``wait_s``) is the
loop's clock: a loop whose clock is moved by hand refuses it once the clock passes it."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.membership import MembershipError
from pdd.policy.membership import ACTIVE, DRAINING
from tests.gateway.test_membership import _rerole_setup
from tests.gateway.test_remove_when_idle import StoppedClockLoop, _turns


def _run(loop, coro):
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_rerole_switches_as_the_last_relay_ends_with_the_clock_stopped():
    o, ms = _rerole_setup()
    o.inflight["rld0"] = 2  # two relays still decoding there
    peer = o.peers["rld0"]

    async def run():
        task = asyncio.ensure_future(ms.rerole("rld0", "main_decode"))
        try:
            await _turns()
            assert (ms.members["rld0"].state, task.done(), peer.sent) == (DRAINING, False, [])
            o.inflight["rld0"] = 1  # the first relay ends
            await _turns()
            assert (task.done(), peer.sent) == (False, [])
            o.inflight["rld0"] = 0  # the last one: the switch follows at once, no time passing
            await _turns()
            assert task.done()
            rep = task.result()
            assert (rep["role"], rep["state"], rep["role_from"], rep["drained_in_flight"]) == \
                ("main_decode", ACTIVE, "relay_decode", 2)
            assert peer.sent == [{"t": "set_role", "role": "main_decode"}]
            assert ms._idle_waits == set()  # its waker is gone with it
        finally:
            task.cancel()

    _run(StoppedClockLoop(), run())


class HandClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock reads ``now``, moved only by the test."""

    now = 0.0

    def time(self) -> float:
        return self.now


def test_rerole_still_refuses_once_the_loops_clock_passes_its_deadline():
    o, ms = _rerole_setup()
    o.inflight["rld0"] = 1
    loop = HandClockLoop()

    async def run():
        task = asyncio.ensure_future(ms.rerole("rld0", "main_decode", wait_s=30.0))
        try:
            await _turns()
            loop.now = 29.0
            o.inflight["rld0"] = 1  # (no release: nothing wakes it)
            await _turns()
            assert not task.done()
            loop.now = 30.5  # past the deadline: its timer fires
            await _turns()
            assert task.done()
            with pytest.raises(MembershipError) as ei:
                task.result()
            assert (ei.value.status, ei.value.code) == (409, "in_flight")
            assert ei.value.message == ("instance rld0 still has 1 request(s) in flight after draining; it is active "
                                        "as relay_decode again")
            assert (ms.members["rld0"].state, ms.members["rld0"].role) == (ACTIVE, "relay_decode")
            assert o.peers["rld0"].sent == [] and ms._idle_waits == set()
        finally:
            task.cancel()

    _run(loop, run())
