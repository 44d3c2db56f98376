"""A relayed request handed over to MD whose RLD was lost before the stream ended settles without
writing to RLD's closed connection: the settling logged "settling ... failed" for every such
request (seen live after each ``kill -9`` of RLD), while a lost RLD holds nothing to stop. A live
RLD is still told to abort. Fake connections, no processes."""

from __future__ import annotations

import logging

from tests.faults.test_recovery_rules import orch, relayed, stream_to  # noqa: F401 (orch: a fixture)


async def test_a_lost_rld_is_not_aborted_at_the_settling_and_nothing_is_logged(orch, caplog):
    st = relayed(orch, kv_ready=True, md_start=3, switch_pos=3)
    stream_to(st, 16)
    st.finished = True
    orch.reqs.pop(st.trid)
    orch.peers["rld0"].closed = True  # RLD's connection closed (its process killed)

    async def refuse(h, payload=b""):
        raise ConnectionError("connection to rld0 is closed")

    orch.peers["rld0"].send = refuse
    with caplog.at_level(logging.WARNING):
        await orch._settle_relayed(st)
    assert "settling" not in caplog.text
    assert not [m for m in orch.peers["md0"].sent if m["t"] == "finish"]  # MD streamed it: nothing to finish


async def test_a_live_rld_is_aborted_at_the_settling(orch):
    st = relayed(orch, kv_ready=True, md_start=3, switch_pos=3)
    stream_to(st, 16)
    st.finished = True
    orch.reqs.pop(st.trid)
    await orch._settle_relayed(st)
    assert [m["rid"] for m in orch.peers["rld0"].sent if m["t"] == "abort"] == ["r1"]
