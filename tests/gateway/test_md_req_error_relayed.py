"""MD failing a relayed request that RLD still decodes (MD refused one of its KV frames:
``EngineInstance.refuse_kv``, docs/LINK.md "What a receiver refuses") is MD's leg lost, as when MD
itself is (docs/FAULTS.md, Recovery): RLD finishes the request, counted degraded, MD is told to
drop it once. Before, MD's ``req_error`` failed the whole request although RLD held its full KV
and was streaming it. A P->MD request (MD its only decoder), or one the client already switched
to MD for, still fails. Fake connections, no processes; each step waits on what it needs."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.state import RequestFailed
from pdd.transfer.messages import HandoffOk, ReqError, Tok
from pdd.types import Pipeline
from tests.gateway.fake_peer import FakePeer, consume, fake_orchestrator, streaming_request

BOUND_S = 10.0  # a step taking longer is a stall (the request timeout is 300 s)
ERROR = "md0: refused a KV frame: kv frame of 'r1': pages [0, 1) are not within its uncached prompt pages [4, 5)"


_request = streaming_request


async def _req_error(o, name: str) -> None:
    await o.on_req_error(o.peers[name], ReqError("r1", ERROR).wire(), b"")


async def test_md_refusing_a_relayed_request_rld_decodes_leaves_it_to_rld():
    o = fake_orchestrator()
    st = _request(o, Pipeline.P_RLD_MD)
    consumer, got = consume(o, st)
    await _req_error(o, "md0")
    assert st.recovery.md_lost and st.recovery.degraded and not st.recovery.lost and st.recovery.error is None
    for i, tid in enumerate((103, 104, 105)):  # RLD decodes on to the end
        o._tok(Tok("r1", 3 + i, tid, "length" if tid == 105 else None, "rld"))
    await asyncio.wait_for(consumer, BOUND_S)
    assert got == [(3, 103, "rld"), (4, 104, "rld"), (5, 105, "rld")] and st.emitted == [100, 101, 102, 103, 104, 105]
    assert (o.totals["completed"], o.totals["degraded"], o.totals["failed"], o.totals["md_legs_lost"]) == (1, 1, 0, 1)
    await asyncio.wait_for(o.peers["md0"].seen("drop").wait(), BOUND_S)
    await asyncio.wait_for(o.peers["p0"].seen("cancel").wait(), BOUND_S)
    assert [h["t"] for h in o.peers["md0"].sent] == ["drop"]  # dropped once; no finish, no abort, no extend
    assert o.peers["p0"].of("cancel") == [{"t": "cancel", "rid": "r1", "name": "md0"}]


@pytest.mark.parametrize("case", ["p_md", "switched_to_md", "from_rld"])
async def test_a_req_error_fails_the_request_where_rld_cannot_finish_it(case):
    """P->MD (no RLD); relayed after the client switched to MD (RLD stopped); or the error is RLD's."""
    o = fake_orchestrator()
    st = _request(o, Pipeline.P_MD if case == "p_md" else Pipeline.P_RLD_MD)
    if case == "switched_to_md":
        st.handoff.md_start, st.handoff.switch_pos, st.handoff.mode = 3, 3, "one_shot"
    consumer, got = consume(o, st)
    await _req_error(o, "rld0" if case == "from_rld" else "md0")
    with pytest.raises(RequestFailed) as e:
        await asyncio.wait_for(consumer, BOUND_S)
    assert str(e.value) == f"request r1 failed: {ERROR}"
    assert (o.totals["failed"], o.totals["degraded"], got) == (1, 0, [])
    assert not st.recovery.md_lost


async def test_md_failing_the_request_while_rld_stops_for_a_one_shot_handoff_recovers_it():
    """MD's req_error comes while the gateway waits for RLD's handoff reply, and that reply is a
    one-shot final round (RLD stopped): nobody is left to decode, so the request gets a new
    attempt. Before, MD was sent the extend it had dropped and the stream stalled."""
    o = fake_orchestrator()
    st = _request(o, Pipeline.P_RLD_MD)
    st.handoff.kv_ready = False  # an early handoff: MD's KV not landed yet
    asked, answer = asyncio.Event(), asyncio.Event()

    class RLD(FakePeer):
        async def call(self, h, payload=b"", timeout=None):
            self._record(h)
            asked.set()
            await answer.wait()
            return HandoffOk("r1", False, [100, 101, 102], "one_shot", True).wire(), b""

    o.peers["rld0"] = RLD()
    handoff = asyncio.get_running_loop().create_task(o._handoff(st))
    await asyncio.wait_for(asked.wait(), BOUND_S)
    await _req_error(o, "md0")
    assert st.recovery.md_lost and not st.recovery.lost
    answer.set()
    await asyncio.wait_for(handoff, BOUND_S)
    assert st.recovery.lost and st.recovery.error == "MD's leg was lost while RLD stopped for a one-shot handoff"
    assert st.queue.get_nowait() is None  # the stream wakes and recovers
    assert st.handoff.md_start is None and o.peers["md0"].of("extend") == []
