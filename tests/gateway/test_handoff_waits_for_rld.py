"""MD's KV landing before RLD has streamed the attempt's first token does not start the handoff:
RLD, not decoding yet (its fast-path KV still on its way in), answers a handoff round "finished"
(it holds nothing in its engine), the gateway then told MD to finish, and RLD went on to decode
the whole request alone, MD's KV wasted. Found live on a loaded host (two CPU hogs, six streams
of 1,200 tokens): every request handed over at position 0 was decoded by RLD to the end, and a
kill of RLD then left MD nothing to take over with (the stream stalled until the client gave up).
The handoff now starts at the first token RLD streams. No processes, no sleeps."""

from __future__ import annotations

import asyncio

from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.transfer.messages import HandoffOk, KvReady, Tok
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer, fake_orchestrator

BOUND_S = 10.0


class RLD(FakePeer):
    """RLD: a handoff round is answered as the real RLD does: "finished" while it decodes
    nothing (``decoding`` False), else one-shot final with its outputs so far."""

    def __init__(self):
        super().__init__()
        self.decoding = False
        self.outputs: list[int] = []

    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        if h.get("t") != "handoff":
            return {"t": "ok"}, b""
        if not self.decoding:
            return HandoffOk(h["rid"], True, [], None, True).wire(), b""
        return HandoffOk(h["rid"], False, list(self.outputs), "one_shot", True).wire(), b""


def test_md_s_kv_before_rld_s_first_token_waits_for_that_token():
    async def run():
        o = fake_orchestrator()
        rld, md = RLD(), FakePeer()
        o.peers["rld0"], o.peers["md0"] = rld, md
        st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=[5] * 40,
                      pipeline=Pipeline.P_RLD_MD)
        st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
        for ph in (Phase.PREFILL, Phase.TRANSFER):
            st.to(ph)
        st.events["md_reserved"] = 0.0
        o.reqs[st.trid] = st
        got = []

        async def consume():
            async for t in o.stream(st):
                got.append((t.pos, t.token_id, t.tier))

        task = asyncio.get_running_loop().create_task(consume())
        await o.on_kv_ready(md, KvReady("r1").wire(), b"")  # MD has the KV; RLD has streamed nothing
        for _ in range(4):  # a handoff task started by it would have asked RLD by now
            await asyncio.sleep(0)
        assert not rld.of("handoff"), "RLD was asked for its ids before it streamed a token"
        assert not md.of("finish")
        # RLD's first token (P's, which RLD streams once its KV is in and it decodes)
        rld.decoding, rld.outputs = True, [7]
        o._tok(Tok("r1", 0, 7, None, "rld"))
        await asyncio.wait_for(md.seen("extend").wait(), BOUND_S)
        ext = md.of("extend")
        assert [h["token_ids"] for h in ext] == [[7]] and ext[0]["final"] is True
        assert not md.of("finish")
        assert st.handoff.md_start == 1
        o._tok(Tok("r1", 1, 8, "length", "md"))  # MD goes on at position 1 and ends it
        await asyncio.wait_for(task, BOUND_S)
        assert got == [(0, 7, "rld"), (1, 8, "md")]

    asyncio.run(run())
