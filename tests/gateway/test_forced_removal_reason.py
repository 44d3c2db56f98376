"""A request recovered because the operator force-removed its instance (``DELETE
/pdd/instances/md0?force=1``) says so, at INFO (asked for, and recovered); a connection that
really dropped stays a WARNING with its text. Before, the forced removal logged per request
``instance md0 is unreachable (connection lost) ...; recovering`` at WARNING. Fake connections,
no processes, no clock."""

from __future__ import annotations

import asyncio
import logging

from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.types import Pipeline, SamplingParams
from tests.gateway.test_membership import _setup

LOGGER = "pdd.gateway.orchestrator"  # the gateway's request-life logger (recovery's too)


def _decoding_on_md0(o) -> ReqState:
    """A P->MD request MD0 decodes, 96 tokens streamed."""
    st = ReqState("r1", 40, SamplingParams(max_tokens=200), trid="r1", prompt_ids=[5] * 40, pipeline=Pipeline.P_MD)
    st.names = {"prefill": "p0", "main_decode": "md0"}
    for ph in (Phase.PREFILL, Phase.TRANSFER, Phase.MD_DECODE):
        st.to(ph)
    st.next_pos = 96
    st.emitted = [7] * 96
    o.reqs[st.trid] = st
    return st


def _recover(o, st) -> list[tuple[int, str]]:
    async def launched(st, prompt, sp, force_relay=False):
        return None

    o._launch = launched
    assert asyncio.run(o._recover(st)) is True
    return [(r.levelno, r.getMessage()) for r in o._caplog.records
            if r.name == LOGGER and r.getMessage().startswith("request r1: ")]


def test_a_forced_removal_recovers_its_requests_at_info_naming_the_operator(caplog):
    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup(standby=())
    o._caplog = caplog
    st = _decoding_on_md0(o)
    rep = asyncio.run(ms.remove("md0", force=True))
    assert rep["forced"] is True
    reason = "instance md0 was removed by the operator (force)"
    assert (st.recovery.lost, st.recovery.error) == (True, reason)
    assert _recover(o, st) == [(logging.INFO, f"request r1: {reason} at position 96 (phase md_decode); recovering")]
    assert st.recovery.recoveries[0]["reason"] == reason


def test_a_lost_connection_stays_a_warning(caplog):
    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup(standby=())
    o._caplog = caplog
    st = _decoding_on_md0(o)
    o._peer_closed("md0", o.peers["md0"])
    reason = "instance md0 is unreachable (connection lost)"
    assert (st.recovery.lost, st.recovery.error) == (True, reason)
    assert _recover(o, st) == [(logging.WARNING, f"request r1: {reason} at position 96 (phase md_decode); "
                                                 "recovering")]
