"""A reconnect asked for an instance the operator removed (a recovery planned while the
removal ran spawns one for each MD of the layout it read: ``_launch_p_rld``) leaves it removed:
no connection to it comes back into ``orch.peers``, so ``/pdd/instances`` does not show a
removed instance ``connected``, ``/pdd/flush`` does not count (or, once its process stops, list
as unreachable) an instance that is no member, and ``/health`` does not name it ``down``."""

from __future__ import annotations

import asyncio

from pdd.policy.membership import REMOVED
from tests.gateway.test_membership import _setup


def test_a_reconnect_of_a_removed_instance_leaves_it_removed():
    o, ms, connects = _setup(standby=())

    async def run():
        await ms.remove("md1")
        connects.clear()
        await o._reconnect("md1")  # e.g. spawned by a recovery routed while the removal ran

    asyncio.run(run())
    assert ms.members["md1"].state == REMOVED
    assert "md1" not in o.peers
    assert connects == []
    assert ms.view("md1")["connected"] is False
