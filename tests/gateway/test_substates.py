"""A request's sub-states across a new attempt (recovery): each owner resets its attempt's part
and keeps the request's record, exactly; and a sub-state refuses a field it does not have (a write
to a name that moved fails loudly instead of making a stray attribute)."""

import dataclasses

import pytest

from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.phase import Phase
from pdd.gateway.state import EndState, HandoffState, RecoveryState, ReqState, TokenOut, WanPlan
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import fake_orchestrator


@pytest.fixture
def orch():
    return fake_orchestrator()


def _mid_handoff(o: Orchestrator) -> ReqState:
    """A relayed request that switched to MD at position 6 after two catch-up rounds, its WAN
    transfer booked and reported, when MD is lost."""
    st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=[5] * 40,
                  pipeline=Pipeline.P_RLD_MD)
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    st.to(Phase.PREFILL)
    st.to(Phase.TRANSFER)
    st.to(Phase.RLD_DECODE)
    st.to(Phase.HANDOFF)
    st.to(Phase.MD_DECODE)
    st.next_pos, st.emitted = 8, list(range(100, 108))
    st.pending[9] = TokenOut(9, 1, "rld", None)
    ho = st.handoff
    ho.kv_ready = ho.started = ho.early = True
    ho.mode, ho.rounds, ho.tokens, ho.md_start, ho.switch_pos, ho.pos = "catch_up", 2, 6, 6, 6, 6
    ho.md_pending[9] = TokenOut(9, 2, "md", None)
    ho.rld_finished_first = False
    ho.extend_extra_step_ms = [1.5, 2.5]
    w = st.wan
    w.expected, w.reported, w.predicted_pages, w.predicted_bytes, w.kv_sent, w.fill_slot = 4000, 4000, 2, 3000, True, True
    o.reqs[st.trid] = st
    return st


async def test_a_new_attempt_resets_each_owner_s_attempt_part_and_keeps_the_record(orch):
    st = _mid_handoff(orch)
    orch._instance_lost(st, "md0", "instance md0 is unreachable")
    assert st.recovery == RecoveryState(lost=True, error="instance md0 is unreachable")
    orch._new_attempt(st, st.recovery.error)
    assert (st.trid, st.base, st.attempt, st.names, st.pending) == ("r1.1", 8, 1, {}, {})
    assert st.handoff == HandoffState(pos=6, tokens=6, extend_extra_step_ms=[1.5, 2.5])
    assert st.wan == WanPlan(reported=4000)
    assert st.recovery == RecoveryState(recoveries=[{"attempt": 0, "reason": "instance md0 is unreachable",
                                                     "phase": "md_decode", "pos": 8, "pipeline": "p_rld_md",
                                                     "names": {"prefill": "p0", "relay_decode": "rld0",
                                                               "main_decode": "md0"}}])
    assert st.end == EndState()
    assert orch.reqs == {"r1.1": st} and orch.totals["recoveries"] == 1


async def test_degraded_is_the_last_attempt_s(orch):
    """Found by a new user: md0 killed (RLD finishes: degraded), then rld0 (a new attempt, planned
    through MD, ends on MD): the request was still counted degraded ("ended on RLD without MD",
    docs/FAULTS.md). A new attempt starts undegraded; its own plan or MD leg sets it again."""
    st = _mid_handoff(orch)
    orch._md_leg_lost(st, "instance md0 is unreachable")
    assert st.recovery.degraded
    orch._new_attempt(st, "instance rld0 is unreachable")
    assert not st.recovery.degraded
    orch._plan_degraded(st)  # no MD reachable for the new attempt: RLD finishes it
    assert st.recovery.degraded


async def test_a_cut_off_is_the_request_s_and_outlives_a_new_attempt(orch):
    st = _mid_handoff(orch)
    orch._count_cut_off(st)
    orch._count_cut_off(st)
    assert st.wan.cut_off and orch.totals["cut_offs"] == 2
    orch._new_attempt(st, "instance md0 is unreachable")
    assert st.wan == WanPlan(reported=4000, cut_off=True)


def test_unbooking_md_takes_its_bytes_out_of_the_totals(orch):
    st = _mid_handoff(orch)
    orch.totals["wan_bytes_expected"] = orch.totals["wan_bytes_planned"] = 5000
    orch.planned_wan["r1"], orch.planned_src["r1"] = 4000, "p0"
    orch._unbook_md(st)
    assert (orch.totals["wan_bytes_expected"], orch.totals["wan_bytes_planned"]) == (1000, 1000)
    assert (orch.planned_wan, orch.planned_src, st.wan.expected) == ({}, {}, 0)


async def test_an_abort_counts_the_outcome_once_and_keeps_the_first_reason(orch):
    st = _mid_handoff(orch)
    await orch.abort(st, "client_disconnect")
    await orch.abort(st, "failed")
    assert st.end == EndState(outcome="cancelled", aborted=True, abort_reason="client_disconnect")
    assert (orch.totals["cancelled"], orch.totals["failed"], st.finished, st.phase) == (1, 0, True, Phase.DONE)


@pytest.mark.parametrize("obj", [ReqState("r", 1, SamplingParams()), WanPlan(), HandoffState(), RecoveryState(),
                                 EndState()], ids=lambda o: type(o).__name__)
def test_a_field_that_is_not_there_cannot_be_written(obj):
    assert dataclasses.is_dataclass(obj)
    with pytest.raises(AttributeError):
        obj.handoff_mode = "one_shot"  # moved to ReqState.handoff.mode
