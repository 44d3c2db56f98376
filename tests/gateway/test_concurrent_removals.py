"""The guard on a role's last active instance holds across operations that overlap: an instance
being removed (its cache flush awaited) no longer counts as another active one, so a second
removal (or a drain, or a re-role away) of the role's only other instance sent meanwhile is
refused as the last one (409 ``conflict``) unless ``force``. Two concurrent ``DELETE``s of md0
and md1 both answered 200 and left no main decoder in service."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.membership import MembershipError
from pdd.policy.membership import ACTIVE, REMOVED
from tests.gateway.test_membership import SlowFlushPeer, _setup


def _removing_md1():
    """``_setup``'s gateway (md0, md1 active) and a task removing md1, paused in its cache flush."""
    o, ms, _ = _setup(standby=())
    slow = o.peers["md1"] = SlowFlushPeer()
    return o, ms, slow


@pytest.mark.parametrize("op", ["remove", "drain"])
def test_the_other_instance_of_a_role_being_removed_is_the_last_active_one(op):
    o, ms, slow = _removing_md1()

    async def run():
        rm = asyncio.ensure_future(ms.remove("md1"))
        await slow.flushing.wait()
        with pytest.raises(MembershipError) as ei:
            await getattr(ms, op)("md0")
        slow.release.set()
        return ei.value, await rm

    err, rep = asyncio.run(run())
    assert (err.status, err.code, err.param) == (409, "conflict", "name")
    assert err.message == "instance md0 is the last active main_decode instance: add another first (or force)"
    assert rep["state"] == REMOVED
    assert (ms.members["md0"].state, ms.members["md1"].state) == (ACTIVE, REMOVED)


def test_force_still_removes_the_other_instance_while_one_is_being_removed():
    o, ms, slow = _removing_md1()

    async def run():
        rm = asyncio.ensure_future(ms.remove("md1"))
        await slow.flushing.wait()
        rep0 = await ms.remove("md0", force=True)
        slow.release.set()
        return rep0, await rm

    rep0, rep1 = asyncio.run(run())
    assert (rep0["state"], rep1["state"]) == (REMOVED, REMOVED)
