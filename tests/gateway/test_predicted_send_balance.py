"""A predicted MD send (``policy.md_predicted_send``) books its WAN bytes before any reply: when the
attempt ends before P started its streams (RLD refused it or was lost, or P refused the prefill),
P never sends nor reports them, so they leave the planned and expected totals again. Fake
connections, no processes."""

import asyncio

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.state import ReqState
from pdd.topology import layout
from pdd.transfer.peer import RemoteError
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PAGE_BYTES = 32768  # small preset, 16-token pages


class SlowMD(FakePeer):
    """Never answers a reservation within the test (it is across the WAN)."""

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        await asyncio.sleep(30)
        return {"t": "ok"}, b""


class Failing(FakePeer):
    """Answers one message type with an exception, after yielding (a reply over the network)."""

    def __init__(self, t: str, exc: BaseException):
        super().__init__()
        self.t, self.exc = t, exc

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        await asyncio.sleep(0.01)
        if h.get("t") == self.t:
            raise self.exc
        return {"t": "ok"}, b""


def _orch(rld: FakePeer, p: FakePeer) -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": p, "rld0": rld, "md0": SlowMD()}
    o.page_bytes = PAGE_BYTES  # learnt from an earlier reservation
    return o


async def _launch_fails(o: Orchestrator, prompt: list[int]) -> ReqState:
    st = ReqState("r1", len(prompt), SamplingParams(max_tokens=16), trid="r1", prompt_ids=prompt)
    o.reqs[st.trid] = st
    with pytest.raises((ConnectionError, RemoteError)):
        await o._launch(st, prompt)
    return st


@pytest.mark.parametrize("who", ["rld_lost", "rld_refuses", "p_refuses"])
async def test_a_predicted_send_of_an_attempt_p_never_streamed_leaves_the_balance(who):
    if who == "rld_lost":
        o = _orch(Failing("expect", ConnectionError("rld0 lost")), FakePeer())
    elif who == "rld_refuses":
        o = _orch(Failing("expect", RemoteError("TierBusy: rld0 queue full", {})), FakePeer())
    else:
        o = _orch(FakePeer(), Failing("prefill", RemoteError("OutOfPages: out of KV pages", {})))
    prefix = list(range(100, 420))  # 20 whole pages the gateway routed to md0 before
    o.prefix_index["md0"].insert(prefix)
    await _launch_fails(o, prefix + list(range(7, 57)))
    # the send was predicted (P told where MD's cache ends, its bytes booked) ...
    assert o.totals["md_predicted_sends"] == 1
    assert any(h.get("t") == "target" and h.get("slot") == "md" and h.get("first_page") == 20
               for h in o.peers["p0"].sent)
    # ... and nothing of it stays planned or expected: P will never report it
    assert o.planned_wan == {}
    assert o.totals["wan_bytes_planned"] == o.totals["wan_bytes_expected"] == 0
