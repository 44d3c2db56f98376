"""``totals.rld_finished_first`` and a response's ``pdd.rld_finished_first`` count the same
requests: a relayed request that completed on RLD before any handoff to MD (no final round, no
takeover) and whose WAN transfer was not cut off (MD keeps the prompt's KV). Both are set at
once, by the stream's settling, before the response's record is read.

Found in a review (a run's totals said 67 finished first and 26 cut-offs while the per-request
usage records disagreed): the total was counted whenever an MD ``kv_ready`` found its attempt
gone from the table or ended, so an attempt aborted (the client left, a stop string), cut off or
replaced by a recovery whose ``kv_ready`` crossed that event counted too; the handoff counted an
aborted request as finished first; and the request's flag was set only when the ``kv_ready``
found the request still in the table, mostly after its response had gone. Fake connections, no
processes: every order is forced."""

from __future__ import annotations

import asyncio

from pdd.gateway.state import ABORT_CLIENT, ABORT_STOP, TokenOut
from pdd.transfer.messages import KvReady
from tests.faults.test_recovery_rules import orch, relayed, settle, stream_to  # noqa: F401 (orch: a fixture)


async def _kv_ready(o, trid: str) -> None:
    await o.on_kv_ready(o.peers["md0"], KvReady(trid).wire(), b"")


def _ended(o, st) -> None:
    """The stream's end: its last token went out, it left the table (then the settling runs)."""
    stream_to(st, 16)
    st.finished = True
    o.reqs.pop(st.trid)


def _finishes(o, trid: str) -> int:
    return [m["rid"] for m in o.peers["md0"].sent if m["t"] == "finish"].count(trid)


async def test_rld_finished_first_is_set_with_the_total_at_the_settling_before_the_kv_lands(orch):
    """RLD finished the request while its KV still crossed (the transfer not cut off): the flag
    and the total are set when the stream settles, not when MD's kv_ready comes later (the
    response had gone by then: its record said false while the total counted it)."""
    orch.cfg.policy.cutoff = False
    st = relayed(orch)
    _ended(orch, st)
    await orch._settle_relayed(st)
    assert st.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 1
    await _kv_ready(orch, "r1")  # the KV lands: MD keeps the prompt's, counted once
    assert orch.totals["rld_finished_first"] == 1 and _finishes(orch, "r1") == 1
    # its kv_ready before the settling (MD had the KV, no handoff yet): the same, once
    st2 = relayed(orch, rid="r2", trid="r2", kv_ready=True)
    _ended(orch, st2)
    await orch._settle_relayed(st2)
    assert st2.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 2
    # and a kv_ready that came after the end but before the settling (kv_landed)
    st3 = relayed(orch, rid="r3", trid="r3")
    _ended(orch, st3)
    await _kv_ready(orch, "r3")
    assert not st3.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 2
    await orch._settle_relayed(st3)
    assert st3.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 3
    assert orch.totals["cut_offs"] == 0


async def test_a_cut_off_is_not_finished_first_even_when_its_kv_ready_crosses_the_cancel(orch):
    """A transfer cut off (RLD finished before MD's KV was complete) is counted in ``cut_offs``
    only, also when MD's kv_ready (the KV landed as the cancel crossed) comes after it."""
    orch.cfg.policy.cutoff_min_remaining_s = 0.0  # whatever is left to send is cut off (cutoff is on)
    st = relayed(orch)
    _ended(orch, st)
    await orch._settle_relayed(st)
    assert st.wan.cut_off and orch.totals["cut_offs"] == 1
    await _kv_ready(orch, "r1")
    assert not st.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 0


async def test_an_aborted_attempt_s_kv_ready_is_not_finished_first(orch):
    """The client left (or a stop string ended the request at the gateway) while MD's kv_ready
    was on its way: the abort dropped the request on every tier; nothing finished first."""
    for i, reason in enumerate((ABORT_CLIENT, ABORT_STOP)):
        st = relayed(orch, rid=f"r{i}", trid=f"r{i}")
        stream_to(st, 3)
        await orch.abort(st, reason)
        await orch._settle_relayed(st)  # the stream's end after the abort
        await _kv_ready(orch, st.trid)
        assert not st.handoff.rld_finished_first
    assert orch.totals["rld_finished_first"] == 0


async def test_an_aborted_request_reaching_its_handoff_is_not_finished_first(orch):
    """The handoff of a request that ended by an abort (MD had the KV) read it as RLD's
    ``finished`` reply: the request's flag and the total were set for a cancelled request."""
    st = relayed(orch, kv_ready=True)
    stream_to(st, 3)
    await orch.abort(st, ABORT_CLIENT)
    await orch._handoff(st)
    assert not st.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 0


async def test_a_replaced_attempt_s_kv_ready_is_not_finished_first(orch):
    """Recovery replaced the attempt (a lost P): the old attempt's kv_ready, crossing that, found
    its tier rid gone from the table and was counted."""
    st = relayed(orch)
    stream_to(st, 3)
    orch._fail_lost(st, "instance p0 is unreachable")
    orch._new_attempt(st, st.recovery.error)
    assert st.trid == "r1.1"
    await _kv_ready(orch, "r1")
    assert not st.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 0


async def test_a_request_handed_over_to_md_is_not_finished_first(orch):
    """One that switched to MD, or whose final round was sent (MD's tokens then differed and RLD
    finished it, ``md_diverged``), was handed over: not RLD finished first."""
    for i, kw in enumerate(({"switch_pos": 3}, {"md_diverged": True})):
        st = relayed(orch, rid=f"r{i}", trid=f"r{i}", kv_ready=True, md_start=3, **kw)
        _ended(orch, st)
        await orch._settle_relayed(st)
        assert not st.handoff.rld_finished_first
    assert orch.totals["rld_finished_first"] == 0


async def test_the_flag_is_set_before_a_consumer_sees_the_stream_s_last_token(orch):
    """As the HTTP layer reads it (``openai_run.Generation``: a pump task queues the stream's
    tokens; the response, with its ``pdd`` record, is built once the finishing token is read
    from the queue): the stream's settling has set the flag by then."""
    orch.cfg.policy.cutoff = False
    st = relayed(orch)
    q: asyncio.Queue = asyncio.Queue()

    async def pump():
        async for t in orch.stream(st):
            q.put_nowait(t)

    task = asyncio.ensure_future(pump())
    for pos in range(3):
        st.queue.put_nowait(TokenOut(pos, 100 + pos, "rld", "length" if pos == 2 else None))
    while (t := await asyncio.wait_for(q.get(), 10)).fin is None:
        pass
    assert st.handoff.rld_finished_first and orch.totals["rld_finished_first"] == 1
    await asyncio.wait_for(task, 10)
    await settle()
    assert orch.totals["rld_finished_first"] == 1 and orch.totals["completed"] == 1
