"""An add naming a relay decoder that is re-roled to main-decode duty (a member) is a 409
``duplicate`` ("already a member"), as for any member: it was a 400 ``role_mismatch`` saying
"instance rld0 is a main_decode slot, not relay_decode", while its slot is a relay decoder's."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.membership import MembershipError
from tests.gateway.test_membership import _rerole_setup


def test_an_add_of_a_rerolled_relay_decoder_is_a_duplicate_not_a_role_mismatch():
    o, ms = _rerole_setup()

    async def run():
        await ms.rerole("rld0", "main_decode")
        errs = []
        for role in ("relay_decode", "main_decode"):
            with pytest.raises(MembershipError) as ei:
                await ms.add(role, "rld0")
            errs.append(ei.value)
        return errs

    for err in asyncio.run(run()):
        assert (err.status, err.code, err.param) == (409, "duplicate", "name")
        assert err.message == "instance rld0 is already a member (active)"
