"""A request planned on MD's reservation (pdd's pipeline budget: a short or well-cached prompt
that fits it; or cross_dc_pd) whose client goes before its first byte: the abort reaches P (which
never got its targets, so never streams: ``abort_ok streams: false``) before MD's reservation
reply crosses back. The reply must book no WAN bytes: P will never send nor report them, so they
would stay in ``wan_bytes_expected`` (above ``wan_bytes_sent``) for good. Seen live: ``curl
--max-time 0.01`` on a well-cached long prompt left expected - sent at +22,528 bytes per such
request. Fake connections, no processes: the order is forced, not raced."""

from __future__ import annotations

import asyncio

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.state import ABORT_CLIENT
from pdd.topology import layout
from pdd.transfer.messages import AbortOk
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PAGE, SLOT = 16, 2048  # the small preset's KV bytes per token
PROMPT = list(range(10, 18))  # 8 tokens: 20 ms RTT + 16 KiB at 0.05 Gbit/s fits the 50 ms budget


class HeldMD(FakePeer):
    """MD across the WAN: its reservation reply waits for ``release``."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()
        self.reserving = asyncio.Event()

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") != "reserve":
            return AbortOk(h["rid"], True).wire() if h.get("t") == "abort" else {"t": "ok"}, b""
        self.reserving.set()
        await self.release.wait()
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": 0, "md_cached_pages": 0, "n_pages": 1,
                "prompt_tokens": len(h["prompt_ids"]), "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


class P(FakePeer):
    """P has prefilled and sampled the first token (its reply is back: the prompt's missing part
    is short) and holds the KV for its deferred targets; the abort finds no stream."""

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") == "prefill":
            return {"t": "prefill_ok", "p_cached_tokens": 0}, b""
        if h.get("t") == "abort":
            return AbortOk(h["rid"], True, cancelled_transfers=0, streams=False).wire(), b""
        return {"t": "ok"}, b""


@pytest.mark.parametrize("mode", ["pdd", "cross_dc_pd"])
async def test_abort_before_mds_reply_books_no_wan_bytes(mode):
    cfg = ClusterConfig.model_validate({"mode": mode, "engine": {"page_size": PAGE}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "md0": HeldMD()} | ({"rld0": FakePeer()} if mode == "pdd" else {})
    md: HeldMD = o.peers["md0"]
    start = asyncio.ensure_future(o.start_request(PROMPT, SamplingParams(max_tokens=8)))
    await asyncio.wait_for(md.reserving.wait(), 10)
    (st,) = o.reqs.values()
    await o.abort(st, ABORT_CLIENT)  # the client went: P answers that it never streamed
    md.release.set()  # MD's reply crosses back after the abort
    # P's first token was back before the abort, so the start runs to its end (unless_gone drops it):
    # nothing later writes off what the reply would have booked
    assert (await asyncio.wait_for(start, 10)) is st and st.end.outcome == "cancelled"
    t = o.totals
    assert (t["wan_bytes_planned"], t["wan_bytes_expected"], t["wan_bytes_sent"]) == (0, 0, 0)
    assert st.wan.expected == 0 and t["cancelled"] == 1
