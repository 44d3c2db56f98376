"""A relayed request whose MD's prefix index holds its prefix as another attempt's claim (that
attempt's KV still crossing the WAN) reserves on MD with ``after`` = that attempt: MD answers once
the claimed KV is in its cache (``roles.main_decode``: the sibling wait), and P sends only the
pages MD then lacks, instead of the claimed pages again (a radix cache's in-flight insert). MD's
reservation matched only what had landed, so each relayed turn behind a queued copy shipped its
whole prompt again (``pdd sim experiment cutoff`` with the cut-off off ran the WAN away at 3 req/s).
Fake connections, no processes."""

from __future__ import annotations

import asyncio

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.topology import layout
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PAGE = 16
SLOT = 2048  # small preset: KV bytes per token
TURN1 = list(range(10, 110))  # 100 tokens: 6 whole pages + 4
TURN2 = TURN1 + list(range(500, 540))  # 140 tokens: 8 whole pages + 12


class MD(FakePeer):
    """An MD across the WAN: a reservation with ``after`` finds turn 1's 6 whole pages cached (the
    claimed KV landed while it waited), any other nothing."""

    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        if h.get("t") != "reserve":
            return {"t": "ok"}, b""
        pages = 6 if h.get("after") else 0
        n = len(h["prompt_ids"])
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": pages * PAGE, "md_cached_pages": pages,
                "n_pages": -(-n // PAGE), "prompt_tokens": n, "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


class P(FakePeer):
    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        if h.get("t") == "prefill":
            return {"t": "prefill_ok", "p_cached_tokens": 0}, b""
        return {"t": "ok"}, b""


def _orch(n_md: int = 1, wan_gbps: float = 0.05) -> Orchestrator:
    """pdd relaying every request; a 0.05 Gbit/s line of 20 ms RTT: turn 1's 96 tokens of whole
    pages (192 KiB) take 31 ms to cross, more than a round trip, so they are worth a wait."""
    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": {"pipeline_ttft_budget_ms": 0},
                                        "engine": {"page_size": PAGE}, "instances": {"main_decode": n_md},
                                        "link": {"wan_gbps": wan_gbps, "wan_rtt_ms": 20}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "rld0": FakePeer(), "md0": MD(), "md1": MD()}
    return o


def _reserves(o):
    return {h["rid"]: h for name, peer in o.peers.items() if name.startswith("md") for h in peer.of("reserve")}


def _md_targets(o):
    return {h["rid"]: h["first_page"] for h in o.peers["p0"].sent if h.get("t") == "target" and h.get("slot") == "md"}


async def _start(o, prompt):
    st = await o.start_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    await asyncio.wait_for(st.md_settled.wait(), 10)
    return st


async def test_a_relayed_turn_behind_a_claim_reserves_after_it_and_ships_only_its_own_pages():
    o = _orch()
    first = await _start(o, TURN1)
    md = first.names["main_decode"]
    assert first.pipeline.value == "p_rld_md" and "after" not in _reserves(o)[first.trid]
    # turn 1's KV is still crossing (no kv_ready): turn 2 follows its claim to the same MD and waits for it
    second = await _start(o, TURN2)
    assert second.names["main_decode"] == md
    assert _reserves(o)[second.trid]["after"] == first.trid
    assert "first_page" not in _reserves(o)[second.trid]  # not a predicted send: P waits for MD's reply
    assert o.totals["md_claim_waits"] == 1
    assert _md_targets(o) == {first.trid: 0, second.trid: 6}
    assert [st.wan.expected for st in (first, second)] == [100 * SLOT, (140 - 96) * SLOT]
    # once turn 1's KV landed (MD's kv_ready) its pages are no claim: a third turn does not wait
    o._index_landed(first.trid)
    o._index_landed(second.trid)
    third = await _start(o, TURN2 + [7] * 20)
    assert third.names["main_decode"] == md and "after" not in _reserves(o)[third.trid]
    assert o.totals["md_claim_waits"] == 1


async def test_a_claim_that_crosses_in_less_than_a_round_trip_is_sent_again():
    """On a 10 Gbit/s line turn 1's 192 KiB take 0.16 ms: a copy costs the line less than the
    round trip a wait costs turn 2 (policy.siblings.claim_waits_for_kv), so turn 2 reserves as
    any request: a predicted send from the index's 6 pages, and MD's reply (nothing cached) makes
    P send pages 0-6 again as the fill; 140 tokens in all."""
    o = _orch(wan_gbps=10.0)
    first = await _start(o, TURN1)
    second = await _start(o, TURN2)
    assert "after" not in _reserves(o)[second.trid] and o.totals["md_claim_waits"] == 0
    assert _reserves(o)[second.trid]["first_page"] == 6 and o.totals["md_predicted_fills"] == 1
    fills = [(h["first_page"], h["last_page"]) for h in o.peers["p0"].sent if h.get("slot") == "md_fill"]
    assert _md_targets(o) == {first.trid: 0, second.trid: 6} and fills == [(0, 6)]
    assert second.wan.expected == 140 * SLOT


async def test_the_ablation_sends_the_claimed_pages_again():
    """policy.md_wait_claims false: no wait, turn 2 ships its whole prompt (MD matched nothing)."""
    o = _orch()
    o.cfg.policy.md_wait_claims = False
    await _start(o, TURN1)
    second = await _start(o, TURN2)
    assert "after" not in _reserves(o)[second.trid] and second.wan.expected == 140 * SLOT


async def test_a_claim_taken_back_is_not_waited_for():
    """Turn 1's transfer was cut off (its claim dropped): turn 2 reserves as any request."""
    o = _orch()
    first = await _start(o, TURN1)
    o._index_dropped(first.trid)
    second = await _start(o, TURN2)
    assert "after" not in _reserves(o)[second.trid] and o.totals["md_claim_waits"] == 0


def test_the_claimer_is_the_newest_unsettled_claim_holding_the_prefix():
    o = _orch(n_md=2)
    ix = o.prefix_index["md0"]
    assert o._record_route("md0", TURN1, "a") == 0 and "a" not in o.index_after
    o.prefix_index["md1"].insert(TURN1)  # a claim no tracked attempt brings: taken as held, no wait
    assert o._record_route("md1", TURN2, "x") == 96 and "x" not in o.index_after
    assert o._record_route("md0", TURN2, "b") == 96
    assert o.index_after["b"] == ("a", 0)  # 6 pages held, none landed: turn 1's claim brings them
    assert o._record_route("md0", TURN2 + [1] * 16, "c") == 128
    assert o.index_after["c"] == ("b", 0)  # the 8th page is only b's
    o._index_landed("a")
    assert ix.match_landed(TURN2) == (128, 96)
    assert o._record_route("md0", TURN2, "d") == 128 and o.index_after["d"] == ("c", 96)  # b's and c's claims, c newest
    o._index_landed("b")
    o._index_landed("c")
    assert o._record_route("md0", TURN2, "e") == 128 and "e" not in o.index_after  # all landed
    assert o._claim_to_wait_for("d") == ("c", 96) and o._claim_to_wait_for("d") is None  # taken once


def _cross() -> Orchestrator:
    cfg = ClusterConfig.model_validate({"mode": "cross_dc_pd", "engine": {"page_size": PAGE},
                                        "instances": {"prefill": 1, "main_decode": 1}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "md0": MD()}
    return o


async def test_a_turn_planned_on_md_s_reply_waits_only_for_a_claim_already_being_sent():
    """Cross-DC PD (the plan, and so the first token, waits for MD's reply): turn 2 waits for turn
    1's claim only once turn 1's KV is being sent (its prefill returned and MD's reply is in):
    that KV lands no later than a copy sent now. A claim not being sent yet (turn 1's reservation
    or prefill still out) could keep turn 2 waiting for all of it: turn 2 ships its whole prompt."""
    o = _cross()
    first = await o.start_request(TURN1, SamplingParams(max_tokens=8))
    assert "md_reserved" in first.events and "prefilled" in first.events  # its KV is being sent
    second = await o.start_request(TURN2, SamplingParams(max_tokens=8))
    assert _reserves(o)[second.trid]["after"] == first.trid and o.totals["md_claim_waits"] == 1
    assert _md_targets(o)[second.trid] == 6 and second.wan.expected == (140 - 96) * SLOT
    # a claim whose KV is not being sent yet is not waited for
    del second.events["prefilled"]
    third = await o.start_request(TURN2 + [7] * 20, SamplingParams(max_tokens=8))
    assert "after" not in _reserves(o)[third.trid] and o.totals["md_claim_waits"] == 1


class MDHolding(FakePeer):
    """An MD that decodes turn 1 P->MD: once its first token is out, turn 1's 6 whole pages are
    in its cache, so a later reservation of turn 2 finds them (no ``after`` needed)."""

    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        if h.get("t") != "reserve":
            return {"t": "ok"}, b""
        n = len(h["prompt_ids"])
        pages = 6 if n > len(TURN1) else 0
        return {"t": "reserve_ok", "rid": h["rid"], "md_cached_tokens": pages * PAGE, "md_cached_pages": pages,
                "n_pages": -(-n // PAGE), "prompt_tokens": n, "page_size": PAGE, "page_bytes": PAGE * SLOT}, b""


async def test_a_p_md_turn_whose_first_token_md_streamed_has_landed_for_the_next_turn():
    """Found in review: MD sends kv_ready only for relayed requests, so a P->MD turn's pages stayed
    a claim until the request ended; a next turn routed while MD decoded it had its TTFT budget
    judged on nothing landed (relayed, though MD held its prefix) and reserved ``after`` a request
    whose KV was there already. MD's first token of a P->MD turn is its proof of landing (it is
    emitted once the prompt's KV is all in), as the given-up path already read it."""
    from pdd.transfer.messages import Tok

    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": {"pipeline_ttft_budget_ms": 60},
                                        "engine": {"page_size": PAGE}, "instances": {"main_decode": 1},
                                        "link": {"wan_gbps": 0.05, "wan_rtt_ms": 20}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {"p0": P(), "rld0": FakePeer(), "md0": MDHolding()}
    first = await _start(o, TURN1)
    assert first.pipeline.value == "p_md"
    assert o.prefix_index["md0"].match_landed(TURN2) == (96, 0)  # routed there, still a claim
    stream = o.stream(first)
    o._tok(Tok(first.trid, 0, 5, None, "md"))
    assert (await asyncio.wait_for(stream.__anext__(), 10)).token_id == 5
    assert o.prefix_index["md0"].match_landed(TURN2) == (96, 96)  # landed: MD emitted from it
    second = await _start(o, TURN2)
    assert second.pipeline.value == "p_md"  # 6 of 8 whole pages held: within the budget
    assert "after" not in _reserves(o)[second.trid] and o.totals["md_claim_waits"] == 0
    await stream.aclose()
