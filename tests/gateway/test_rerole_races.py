"""Operations on a relay decoder around a re-role (``Membership.rerole``): an operator's drain
sent while the re-role runs is refused (409 ``conflict``, retry once the re-role answered)
rather than answered "already draining" and then undone as the re-role made the instance
active in its new role; a re-role of a slot that is no member (removed, standby) is a 409
``conflict`` as docs/SERVE.md says, also to the role the slot already has (it answered 200
"already relay_decode" for a removed one)."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.membership import MembershipError
from pdd.policy.membership import ACTIVE, REMOVED, STANDBY, decide_rerole
from tests.gateway.test_membership import _rerole_setup


def test_a_drain_while_a_rerole_runs_is_refused_not_undone():
    o, ms = _rerole_setup()
    o.inflight["rld0"] = 1  # a relay still decoding there: the re-role waits for it

    async def run():
        task = asyncio.ensure_future(ms.rerole("rld0", "main_decode"))
        while ms.members["rld0"].state != "draining":
            await asyncio.sleep(0)
        with pytest.raises(MembershipError) as ei:
            await ms.drain("rld0")
        o.inflight["rld0"] = 0
        rep = await task
        return ei.value, rep

    err, rep = asyncio.run(run())
    assert (err.status, err.code, err.param) == (409, "conflict", "name")
    assert err.message == "instance rld0 is being changed now (an add, remove or re-role): retry once that has answered"
    assert (rep["role"], rep["state"]) == ("main_decode", ACTIVE)
    assert ms.changes["drain"] == 1  # the re-role's own drain only


@pytest.mark.parametrize("state", [REMOVED, STANDBY])
def test_a_rerole_of_a_slot_that_is_no_member_is_a_conflict_whatever_the_role(state):
    for to in ("relay_decode", "main_decode"):
        d = decide_rerole("rld0", "relay_decode", to, state, "A", allowed=True, others_active=1)
        assert (d.ok, d.changed, d.status, d.message) == (
            False, False, 409, f"instance rld0 is {state}: only an active member changes role")


def test_a_rerole_of_a_removed_relay_decoder_to_its_own_role_is_refused():
    o, ms = _rerole_setup()

    async def run():
        await ms.remove("rld0")
        with pytest.raises(MembershipError) as ei:
            await ms.rerole("rld0", "relay_decode")
        return ei.value

    err = asyncio.run(run())
    assert (err.status, err.code, err.param) == (409, "conflict", "name")
    assert ms.members["rld0"].state == REMOVED


def test_a_remove_while_a_rerole_drains_is_a_conflict_not_in_flight():
    # the re-role drains rld0 with 2 relays in flight: a DELETE answered 409 in_flight ("drain it
    # and wait until in_flight is 0"), though what stands in its way is the re-role under way
    o, ms = _rerole_setup()
    o.inflight["rld0"] = 2
    o.peers["rld0"].held = 0

    async def run():
        task = asyncio.ensure_future(ms.rerole("rld0", "main_decode"))
        while ms.members["rld0"].state != "draining":
            await asyncio.sleep(0)
        errs = []
        for force in (False, True):
            with pytest.raises(MembershipError) as ei:
                await ms.remove("rld0", force=force)
            errs.append(ei.value)
        o.inflight["rld0"] = 0
        rep = await task
        return errs, rep

    errs, rep = asyncio.run(run())
    for err in errs:
        assert (err.status, err.code, err.param) == (409, "conflict", "name")
        assert err.message == ("instance rld0 is being changed now (an add, remove or re-role): retry once that "
                               "has answered")
    assert (rep["role"], rep["state"]) == ("main_decode", ACTIVE)
    assert ms.changes["remove"] == 0
