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
    # budget 0: every request relayed at once (the prompts below fit the default budget: P->MD)
    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": {"pipeline_ttft_budget_ms": 0}})
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


@pytest.mark.parametrize("held,relayed", [(0, True), (320, False)], ids=["misses_budget", "fits_budget"])
async def test_a_positive_budget_plans_on_the_prefix_index_before_md_replies(held, relayed):
    """Budget 50 ms on the default line (0.05 Gbit/s, 20 ms RTT), 2,048 KV bytes a token: a
    370-token prompt MD lacks (141 ms) is relayed at once, RLD's target not deferred, the decision
    recorded on the index's prediction and MD's pages sent predicted; with 320 of its tokens in
    MD's index (50 missing: 36 ms) it fits, and P waits for MD's reply with both targets deferred.
    P refuses the prefill (or MD the reservation) so the launch ends where the plan shows."""
    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": {"pipeline_ttft_budget_ms": 50}})
    o = Orchestrator(cfg, layout(cfg))
    p = Failing("prefill", RemoteError("OutOfPages: out of KV pages", {}))
    md = SlowMD() if relayed else Failing("reserve", ConnectionError("md0 lost"))
    o.peers = {"p0": p, "rld0": FakePeer(), "md0": md}
    o.page_bytes, o.kv_bytes_per_token = PAGE_BYTES, 2048
    prefix = list(range(100, 420))
    if held:
        o.prefix_index["md0"].insert(prefix)
    st = await _launch_fails(o, prefix + list(range(7, 57)))
    prefill = next(h for h in p.sent if h["t"] == "prefill")
    if relayed:
        assert prefill["targets"][0] == {"name": "rld0", "first_page": 0, "relay": False}
        assert [d["inputs"]["md_cached_tokens"] for d in st.decisions if d["policy"] == "pipeline"] == [0]
        assert [d["result"] for d in st.decisions] == ["p_rld_md"]
        assert o.totals["md_predicted_sends"] == 1
    else:
        assert all(t.get("deferred") for t in prefill["targets"])
        assert not [d for d in st.decisions if d["policy"] == "pipeline"]  # planned on MD's reply
        assert o.totals["md_predicted_sends"] == 0
