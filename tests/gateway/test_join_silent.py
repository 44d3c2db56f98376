"""Adding an instance that accepts connections but never answers the handshake (a stopped or
hung process: the kernel still accepts; an MD in B behind a WAN outage) is refused within the
join's budget (``Membership.join_timeout_s``: the retries' back-off, about 6 s, plus
``liveness.dead_after_s`` once), with a 503 ``unreachable`` naming it. Each of the 8 connect
attempts waited out its own 10 s handshake timeout: the add answered after 87 s."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.membership import JOIN_RETRIES, MembershipError, join_budget_s
from pdd.policy.membership import STANDBY
from tests.gateway.test_membership import _setup

GUARD_S = 30


def test_a_join_that_never_answers_is_refused_within_its_budget():
    o, ms, _ = _setup()
    asked = []

    async def silent(name, retries):  # accepts, never answers the handshake
        asked.append((name, retries))
        await asyncio.Event().wait()

    o._connect = silent
    ms.join_timeout_s = 0.01

    async def run():
        with pytest.raises(MembershipError) as ei:
            await asyncio.wait_for(ms.add("main_decode", "md1"), GUARD_S)
        return ei.value

    err = asyncio.run(run())
    assert (err.status, err.code, err.param) == (503, "unreachable", "address")
    assert err.message == ("instance md1 is not reachable at 127.0.0.1:18002: TimeoutError: no connection to it "
                           "answered the handshake within 0.01 s")
    assert asked == [("md1", JOIN_RETRIES)]
    assert ms.members["md1"].state == STANDBY and not ms.changing


def test_the_join_budget_is_the_retries_back_off_plus_the_dead_peer_timeout():
    o, ms, _ = _setup()
    # back-off 0.1, 0.2, 0.4, 0.8, 1.6, 2, 2 s between the 8 tries, then dead_after_s (5 s) once
    assert join_budget_s(JOIN_RETRIES, o.cfg.liveness.dead_after_s) == pytest.approx(12.1)
    assert ms.join_timeout_s == pytest.approx(12.1)
