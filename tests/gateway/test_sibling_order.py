"""The choices of one prompt ship its KV across the WAN once whatever order the messages take
(pdd.policy.siblings). Fake connections, no processes: the order is forced, not raced.

``pdd`` with a zero TTFT budget relays every request, so choice 0's start returns at P's first
token while its MD reservation is still out. The other choices must not decide where to reserve
on what the gateway knows at that moment (nothing yet: no MD reply, so no KV size): they wait for
choice 0's reply, then reserve on its MD with ``after`` (MD answers once choice 0's KV is in its
cache), and each ships only the prompt's partial last page.
"""

from __future__ import annotations

import asyncio

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.topology import layout
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PAGE = 16
SLOT = 2048  # small preset: KV bytes per token
PROMPT = list(range(10, 110))  # 100 tokens: 6 whole pages + 4 tokens


class HeldMD(FakePeer):
    """An MD across the WAN whose reply to choice 0's reservation waits for ``release``; a
    sibling's ``reserve {after}`` finds choice 0's 6 whole pages cached (its KV has landed)."""

    def __init__(self, fail_first: bool = False):
        super().__init__()
        self.fail_first = fail_first  # choice 0's reservation fails (MD lost) once released
        self.release = asyncio.Event()
        self.first_replied = False
        self.order: list[str] = []  # "reserve <rid>" as each reservation reaches MD, "reply <rid>" as it leaves

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") != "reserve":
            return {"t": "ok"}, b""
        self.order.append(f"reserve {h['rid']}")
        if h.get("after"):
            assert self.first_replied, "a sibling's reserve {after} reached MD before choice 0 was reserved there"
            cached_pages = 6
        else:
            await self.release.wait()
            if self.fail_first:
                raise ConnectionError("md0 lost")
            self.first_replied = True
            cached_pages = 0
        self.order.append(f"reply {h['rid']}")
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": cached_pages * PAGE,
                "md_cached_pages": cached_pages, "n_pages": 7, "prompt_tokens": len(h["prompt_ids"]),
                "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


class P(FakePeer):
    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        if h.get("t") == "prefill":
            return {"t": "prefill_ok", "p_cached_tokens": 0}, b""
        return {"t": "ok"}, b""


def _orch(fail_first: bool = False) -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": {"pipeline_ttft_budget_ms": 0},
                                        "engine": {"page_size": PAGE}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "rld0": FakePeer(), "md0": HeldMD(fail_first)}
    return o


async def test_siblings_started_before_choice_0_is_reserved_wait_for_its_reply():
    o = _orch()
    md: HeldMD = o.peers["md0"]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    first = await o.start_request(PROMPT, sp)
    assert first.pipeline.value == "p_rld_md" and "md_reserved" not in first.events  # reply still out
    rest = await asyncio.gather(*(o.start_request(PROMPT, sp, sibling_of=first, siblings=2) for _ in range(2)))
    assert all(st.pipeline.value == "p_rld_md" for st in rest)  # relayed at once: their first tokens do not wait
    # nothing reached MD for the siblings while choice 0's reply is out
    assert md.order == [f"reserve {first.trid}"]
    md.release.set()
    for st in rest:
        await asyncio.wait_for(st.md_settled.wait(), 10)
    assert md.order[:2] == [f"reserve {first.trid}", f"reply {first.trid}"]
    after = [h for h in md.sent if h.get("t") == "reserve" and h.get("after")]
    assert sorted(h["rid"] for h in after) == sorted(st.trid for st in rest)
    assert {h["after"] for h in after} == {first.trid}
    # choice 0 ships 100 tokens' KV, each sibling the last page's 4
    assert [st.wan.expected for st in [first, *rest]] == [100 * SLOT, 4 * SLOT, 4 * SLOT]
    assert o.totals["wan_bytes_expected"] == (100 + 2 * 4) * SLOT
    # P was told MD's first page for each: 0 for choice 0, 6 for the siblings
    targets = {h["rid"]: h["first_page"] for h in o.peers["p0"].sent if h.get("t") == "target" and h.get("slot") == "md"}
    assert targets == {first.trid: 0, rest[0].trid: 6, rest[1].trid: 6}


async def test_siblings_of_a_choice_whose_reservation_failed_route_on_their_own():
    """Choice 0's MD leg is lost (its reservation fails): the siblings do not wait for a KV that
    will never come, they reserve as any request once that is known: the first routed with no
    ``after``, the second after the first's KV, which its index of MD then holds as a claim
    (policy.md_wait_claims: 100 tokens' KV take 33 ms of this line, more than its 20 ms RTT)."""
    o = _orch(fail_first=True)
    md: HeldMD = o.peers["md0"]
    md.first_replied = True  # the siblings' reservations are not ``after`` ones: no order to check
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    first = await o.start_request(PROMPT, sp)
    rest = await asyncio.gather(*(o.start_request(PROMPT, sp, sibling_of=first, siblings=2) for _ in range(2)))
    assert md.order == [f"reserve {first.trid}"]
    md.release.set()
    for st in [first, *rest]:
        await asyncio.wait_for(st.md_settled.wait(), 10)
    assert first.recovery.md_lost
    sib_reserves = [h for h in md.sent if h.get("t") == "reserve" and h["rid"] != first.trid]
    assert sorted(h["rid"] for h in sib_reserves) == sorted(st.trid for st in rest)
    assert not any(h.get("after") == first.trid for h in sib_reserves)
    assert [h.get("after") for h in sib_reserves] == [None, sib_reserves[0]["rid"]]
