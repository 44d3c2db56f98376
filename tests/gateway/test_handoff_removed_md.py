"""A handoff whose MD was removed by the operator (``DELETE /pdd/instances/md0``: its connection
is no longer in the gateway's peers) is handled as that instance's loss, like one whose
connection closed: before, ``Handoffs._handoff`` looked the instance up with ``self.peers[name]``
and raised KeyError (an "exception was never retrieved" traceback in the gateway's log), so
neither ``_instance_lost`` nor ``_fail_lost`` ran and the request was left to its timeout. Fake
connections, no processes, no clock."""

import pytest

from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer, fake_orchestrator


class FinalIds(FakePeer):
    """RLD answering the handoff call with its final ids (one-shot: it stops decoding)."""

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return {"token_ids": [100, 101, 102], "mode": "one_shot", "final": True}, b""


class Closing(FakePeer):
    """MD whose connection closes under the handoff's final extend."""

    async def send(self, h, payload=b""):
        self.closed = True
        raise ConnectionError("connection to md0 is closed (connection closed locally)")


@pytest.fixture
def orch():
    return fake_orchestrator()


def _relaying(o: Orchestrator) -> ReqState:
    """A relayed request RLD decodes (3 tokens out), MD's KV landed, its handoff not begun."""
    st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=[5] * 40,
                  pipeline=Pipeline.P_RLD_MD)
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    for ph in (Phase.PREFILL, Phase.TRANSFER, Phase.RLD_DECODE):
        st.to(ph)
    st.next_pos, st.emitted = 3, [100, 101, 102]
    st.handoff.kv_ready = True
    st.events["md_reserved"] = 0.0
    o.reqs[st.trid] = st
    return st


async def test_md_removed_before_the_handoff_loses_md_s_leg_and_rld_finishes(orch):
    st = _relaying(orch)
    del orch.peers["md0"]  # removed (membership pops its connection)
    await orch._handoff(st)  # raised KeyError: 'md0'
    assert st.recovery.md_lost and not st.recovery.lost  # RLD, still decoding, finishes it
    assert st.trid == "r1" and st.recovery.degraded


async def test_md_removed_under_the_final_extend_recovers_the_request(orch):
    st = _relaying(orch)
    orch.peers["rld0"] = FinalIds()
    md = orch.peers["md0"] = Closing()

    real_send = md.send

    async def send_and_go(h, payload=b""):  # the removal pops md0 as its connection closes
        orch.peers.pop("md0", None)
        await real_send(h, payload)

    md.send = send_and_go
    await orch._handoff(st)  # raised KeyError: 'md0'
    assert st.handoff.md_start == 3  # RLD stopped at its final round: MD's loss is the request's
    assert st.recovery.lost and st.recovery.error == \
        "instance md0 is unreachable (connection to md0 is closed (connection closed locally))"
