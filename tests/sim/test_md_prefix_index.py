"""The gateway's prefix index of MD in the simulator (``SimConfig.md_prefix_index``), as the
runtime plans on it (``pdd.policy.prefix_index``; ``gateway.routing._record_route`` and
``gateway.stream._record_decoded``): the predicted send starts from what the index holds, MD caps
its match there, and a prefix the index holds but MD lacks is sent too (the fill). One relayed
request then a second turn on an idle cluster; times in simulated seconds."""

import pytest

from pdd.sim.cluster import ClusterSim, SimConfig
from tests.sim.sim_checks import check_settled

KVB = 131072  # llama-3.1-8b KV bytes per token
FIRST = {"timestamp": 0, "input_length": 4096, "output_length": 200, "hash_ids": list(range(8))}
SECOND = {"timestamp": 20000, "input_length": 6000, "output_length": 20, "hash_ids": list(range(12))}
RELAY = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=10.0, wan_rtt_ms=400.0, ttft_budget_ms=0.0,
                  warmup_frac=0.0)


def run(cfg, recs, at=None):
    """``recs`` simulated; ``at`` = (seconds, fn(sim)) runs ``fn`` at that simulated time."""
    sim = ClusterSim(cfg)
    if at is not None:
        sim.after(at[0], at[1], sim)
    sim.run(recs)
    check_settled(sim)
    return sim


def test_the_index_records_the_prompt_at_routing_and_the_outputs_decoded_on_md():
    sim = run(RELAY, [FIRST])
    r = sim.reqs[0]
    assert r.md_held == 0 and r.md_hit == 0 and r.md_tokens > 0  # handed over: MD decoded its end
    page = sim.page
    # the prompt's 4,096 tokens and 199 of its 200 outputs (the last has no KV): whole pages
    assert len(sim.md_index["MD0"]) == (4096 + 199) // page


def test_a_second_turn_sends_only_what_the_index_says_md_lacks():
    sim = run(RELAY, [FIRST, SECOND])
    r = sim.reqs[1]
    assert (r.md_held, r.md_hit, r.md_predicted) == (4096, 4096, True)
    assert r.wan_bytes == (6000 - 4096) * KVB and sim.md_predicted_short == 0


def test_a_prefix_the_index_forgot_is_sent_again_though_md_holds_it():
    """The index is approximate: when it no longer holds a prefix MD still caches, the predicted
    send starts from its first page and MD caps its match there (the runtime's reserve with
    ``first_page``), so the KV crosses the WAN again; planning on MD's cache instead (the old
    model, ``md_prefix_index=False``) sends only the rest."""
    forget = (10.0, lambda sim: sim.md_index["MD0"].clear())
    sim = run(RELAY, [FIRST, SECOND], at=forget)
    r = sim.reqs[1]
    assert sim.tiers["MD"][0].cache.match(list(range(8))) == 8  # MD still caches the first turn
    assert (r.md_held, r.md_hit) == (0, 0)
    assert r.wan_bytes == 6000 * KVB
    old = run(RELAY.replace(md_prefix_index=False), [FIRST, SECOND])
    assert old.reqs[1].md_hit == 4096 and old.reqs[1].wan_bytes == (6000 - 4096) * KVB
    assert not old.md_index and old.reqs[1].md_held is None


def test_a_cut_off_prompt_leaves_the_index():
    """RLD finishes the first turn (2 tokens) while its 0.54 GB crosses a 1 Gbit/s line: the
    transfer is cut off and MD caches nothing, so the gateway takes the prompt's pages back out
    of its index (``PrefixIndex.dropped``, the runtime's ``_index_dropped``): the second turn is
    planned on what MD holds, and no fill is needed."""
    first = dict(FIRST, output_length=2)
    sim = run(RELAY.replace(wan_gbps=1.0, ttft_budget_ms=40.0), [first, SECOND])
    r0, r1 = sim.reqs
    assert r0.cut_off and len(sim.md_index["MD0"]) == 0
    assert r1.md_held == 0 and r1.md_hit == 0 and sim.md_predicted_short == 0


def test_a_cut_off_prompt_kept_in_the_index_makes_md_s_reservation_ask_for_a_fill():
    """As before the gateway took cut-off prompts back (``md_index_drops_cut_offs`` False): the
    index recorded the prompt at routing and keeps it. The second turn is planned on the index
    (4,096 tokens held); MD's reservation finds none and P sends the whole prompt (the runtime's
    fill, counted in ``md_predicted_short``; the second turn's own transfer is cut off too on
    this line)."""
    first = dict(FIRST, output_length=2)
    cfg = RELAY.replace(wan_gbps=1.0, ttft_budget_ms=40.0, md_index_drops_cut_offs=False)
    sim = ClusterSim(cfg)
    sim.record_decisions = True
    sim.run([first, SECOND])
    r0, r1 = sim.reqs
    assert r0.cut_off
    assert sim.tiers["MD"][0].cache.match(list(range(8))) == 0  # MD cached nothing of it
    assert r1.md_held == 4096 and sim.md_predicted_short == 1
    plan = [d for d in sim.decision_log[1] if d["policy"] == "pipeline"]
    assert plan[0]["inputs"]["md_cached_tokens"] == 4096  # the decision read the index
    assert r1.md_hit == 0 and r1.md_missing == 6000  # MD's reservation: the whole prompt is sent


def test_md_routing_reads_the_index_not_the_cache():
    """Two MDs: the second turn goes to the MD whose index holds its prefix; once that index is
    cleared (the runtime clears it when the MD restarts), the cache it still has does not draw it."""
    cfg = RELAY.replace(n_md=2)
    sim = run(cfg, [FIRST, SECOND])
    assert sim.reqs[1].md is sim.reqs[0].md and sim.reqs[1].md_held == 4096
    first_md = {}

    def forget(s):
        first_md["name"] = s.reqs[0].md.name
        s.md_index[s.reqs[0].md.name].clear()

    sim = run(cfg, [FIRST, SECOND], at=(10.0, forget))
    assert sim.reqs[1].md_held == 0
    hits = {m.name: m.cache.match(list(range(8))) for m in sim.tiers["MD"]}
    assert hits[first_md["name"]] == 8  # its cache held the prefix; routing did not see it


def test_a_fill_after_the_predicted_send_completes_md_s_kv_when_it_lands():
    """(The index keeping a cut-off prompt, as the gateway before: a fill.) The reservation
    reaches MD (one way, 0.2 s) after P's short prefill (the second turn's prefix is in P's cache): the predicted send is already on the line, so the fill goes after
    MD's reply is back at the gateway, on the same connection; MD's KV is complete (its
    ``kv_ready``) only when both have landed."""
    first = dict(FIRST, output_length=2)
    second = dict(SECOND, output_length=3000)  # RLD does not finish it first: handed over to MD
    sim = run(RELAY.replace(wan_gbps=1.0, ttft_budget_ms=40.0, md_index_drops_cut_offs=False), [first, second])
    r1 = sim.reqs[1]
    main, fill = r1.wan_flow, r1.fill_flow
    assert main.t_start == r1.t_prefill_done < 0.2 + 20.0  # started before the reservation reached MD
    assert fill is not None and fill.t_start == pytest.approx(20.0 + 2 * 0.2)  # MD's reply back at the gateway
    assert main.total == (6000 - 4096) * KVB and fill.total == 4096 * KVB
    assert r1.wan_bytes == 6000 * KVB and not r1.cut_off
    assert r1.t_md_kv == pytest.approx(max(main.t_end, fill.t_end) + 0.2)
    assert r1.md_tokens > 0 and sim.tiers["MD"][0].cache.match(list(range(12))) >= 8


def test_an_md_whose_cache_fills_its_pool_still_draws_the_turns_it_holds():
    """MD's pool of 16 blocks (8,192 tokens) filled to the last token by its prefix cache (the
    first turn's 8 blocks and 8 others, none locked) is not full: MD evicts cache to admit, and
    the gateway the simulator mirrors passes no page counts to routing. The second turn goes to
    the MD whose index holds its prefix, and only the rest crosses the WAN. (Counting the
    evictable cache as used made routing drop that MD, pool full, for the empty one: the whole
    prompt crossed again, what saturated ``pdd sim experiment cutoff``'s line with no cut-off.)"""
    from pdd.sim.sim_config import SimEngine

    cfg = RELAY.replace(n_md=2, tier_engines={"MD": SimEngine(kv_pool_tokens=16 * 512)})
    held = {}

    def fill(s):
        md = s.reqs[0].md
        held["name"] = md.name
        md.cache_insert(list(range(1000, 1008)))
        held["used"] = (md.used, md.pool, len(md.cache.locks))

    sim = run(cfg, [FIRST, SECOND], at=(10.0, fill))
    assert held["used"] == (8192, 8192, 0)
    r = sim.reqs[1]
    assert r.md.name == held["name"] and (r.md_held, r.md_hit) == (4096, 4096)
    assert r.wan_bytes == (6000 - 4096) * KVB


# --- a prefix whose KV is still on its way to MD (a claim): md_wait_claims --------------------------
# turn 1 relayed (RLD finishes its 2 tokens first) with the cut-off off: its 4,096-token prompt
# keeps crossing a 1 Gbit/s line (0.54 GB, 4.3 s); turns 2 and 3 extend the conversation by
# 1,904 and 2,000 tokens and arrive while the copies before them are still on the line
SLOW = RELAY.replace(wan_gbps=1.0, cutoff=False)
TURN1 = dict(FIRST, output_length=2)
TURN2 = {"timestamp": 1000, "input_length": 6000, "output_length": 2, "hash_ids": list(range(12))}
TURN3 = {"timestamp": 2000, "input_length": 8000, "output_length": 2, "hash_ids": list(range(16))}


def test_a_turn_whose_prefix_is_on_its_way_to_md_waits_for_it_and_ships_only_its_own_pages():
    """Each turn's prefix is a claim on MD when it is routed (its KV still on the line): its
    reservation waits for that KV to land in MD's cache, then matches it; only the turn's new
    pages cross, and the partial last block of the turn before (turn 2's last 368 tokens: MD
    caches whole 512-token blocks). Without the wait (``md_wait_claims`` False) MD's reservation
    matched only what had landed and every turn shipped its whole prompt again (fills): 18,096
    tokens of KV instead of 8,368."""
    sim = run(SLOW, [TURN1, TURN2, TURN3])
    r1, r2, r3 = sim.reqs
    assert [r.md_held for r in sim.reqs] == [0, 4096, 5632]  # the index's hit at routing, claims included
    assert [r.md_landed for r in sim.reqs] == [0, 0, 0]  # none of it had landed then
    assert r2.md_after is r1 and r3.md_after is r2
    assert [r.md_predicted for r in sim.reqs] == [True, False, False]  # a waiting one is not predicted
    assert [r.md_hit for r in sim.reqs] == [0, 4096, 5632] and sim.md_predicted_short == 0
    assert [r.wan_bytes for r in sim.reqs] == [4096 * KVB, (6000 - 4096) * KVB, (8000 - 5632) * KVB]
    assert sim.wan.bytes_sent == (4096 + 1904 + 2368) * KVB == 8368 * KVB
    assert not any(r.cut_off for r in sim.reqs)
    # each reservation reached MD only after the KV before it had landed there
    assert r1.t_md_kv < r2.t_md_replied and r2.t_md_kv < r3.t_md_replied
    old = run(SLOW.replace(md_wait_claims=False), [TURN1, TURN2, TURN3])
    assert [r.md_hit for r in old.reqs] == [0, 0, 0] and old.md_predicted_short == 2
    assert [r.wan_bytes for r in old.reqs] == [4096 * KVB, 6000 * KVB, 8000 * KVB]
    assert old.wan.bytes_sent == 18096 * KVB


def test_a_claim_cut_off_meanwhile_is_not_waited_for():
    """With the cut-off on, turn 2 arrives 10 ms after turn 1, while turn 1 is in prefill: it is
    routed on turn 1's claim (4,096 tokens held, none landed). RLD then finishes turn 1 and its
    transfer is cut off before turn 2's reservation reaches MD, so the reservation does not wait
    for KV that will not come: MD matches at once (nothing) and P sends the whole prompt. Turn 2
    was to wait for a claim when it arrived, so it is not a predicted send (as the gateway's):
    planned on MD's reply back at 0.41 s, admitted then, its reply counted one way later."""
    sim = run(SLOW.replace(cutoff=True), [TURN1, dict(TURN2, timestamp=10)])
    r1, r2 = sim.reqs
    assert r1.cut_off and r2.md_after is r1 and (r2.md_held, r2.md_landed) == (4096, 0)
    assert not r2.md_predicted and r2.t_md_replied == pytest.approx(0.01 + 0.4 + 0.2)
    assert r2.md_hit == 0 and r2.md_missing == 6000 and sim.md_predicted_short == 0


CROSS = SimConfig(mode="cross_dc_pd", n_p=1, n_md=1, wan_gbps=1.0, wan_rtt_ms=400.0, warmup_frac=0.0)


def test_a_turn_planned_on_md_s_reply_waits_for_a_claim_already_on_the_line():
    """Cross-DC PD (each plan waits for MD's reservation reply): turn 2 arrives at 2 s, while turn
    1's 4,096-token KV (0.54 GB on 1 Gbit/s, started at 0.4 s) is on the line. Its reservation
    waits for that KV, then only its 1,904 new tokens cross, after it: turn 2 is faster than
    when it sent its own copy of turn 1's pages (md_wait_claims False: 10,096 tokens sent, the
    copy queued behind turn 1 on the runtime's fifo line: TTFTs 5.09 s and 9.39 s; on a
    processor-shared line, wan_order ps, the copy also slowed turn 1: 7.39 s and 9.39 s)."""
    sim = run(CROSS, [TURN1, dict(TURN2, timestamp=2000)])
    r1, r2 = sim.reqs
    assert r2.md_after is r1 and (r2.md_held, r2.md_landed, r2.md_hit) == (4096, 0, 4096)
    assert [r.wan_bytes for r in sim.reqs] == [4096 * KVB, 1904 * KVB] and sim.wan.bytes_sent == 6000 * KVB
    assert r2.wan_flow.t_start == pytest.approx(r1.t_md_kv + 0.2)  # MD replies once it holds turn 1: one way later
    assert [round(r.t_first - r.arrival, 2) for r in sim.reqs] == [5.09, 5.49]
    old = run(CROSS.replace(md_wait_claims=False), [TURN1, dict(TURN2, timestamp=2000)])
    assert [r.wan_bytes for r in old.reqs] == [4096 * KVB, 6000 * KVB]
    assert [round(r.t_first - r.arrival, 2) for r in old.reqs] == [5.09, 9.39]
    ps = run(CROSS.replace(md_wait_claims=False, wan_order="ps", wan_express_lane_bdp=0.0),
             [TURN1, dict(TURN2, timestamp=2000)])
    assert [round(r.t_first - r.arrival, 2) for r in ps.reqs] == [7.39, 9.39]


def test_a_claim_not_on_the_line_yet_is_not_waited_for_by_a_turn_planned_on_md_s_reply():
    """Turn 2 arrives 10 ms after turn 1, whose KV has not started crossing (its reservation is
    still out): waiting could last turn 1's whole prefill, queue and transfer, so turn 2 ships
    its whole prompt, as without md_wait_claims."""
    sim = run(CROSS, [TURN1, dict(TURN2, timestamp=10)])
    r2 = sim.reqs[1]
    assert (r2.md_held, r2.md_landed, r2.md_after) == (4096, 0, None)
    assert r2.md_hit == 0 and r2.wan_bytes == 6000 * KVB and sim.wan.bytes_sent == 10096 * KVB


def test_the_claimer_map_keeps_only_claims_still_coming():
    """Found in review: every page key ever routed stayed in ``md_claimer`` (40,000 requests: 35k-75k
    keys per MD beside an index capped at 1,651 pages), though a claim whose KV landed or was cut
    off is never waited for. At the end of a run no key names such a request."""
    from pdd.sim.cluster import ClusterSim
    from pdd.sim.experiments import _agentic_cluster
    from pdd.workload.records import generate_agentic

    sim = ClusterSim(_agentic_cluster(15.0)["pdd"]).run(generate_agentic(400, seed=21, rate=2.0))
    assert sim.stalled is None and sum(len(ix) for ix in sim.md_index.values()) > 0
    assert all(not r.md_kv_complete and not r.cut_off for m in sim.md_claimer.values() for r in m.values())
    assert sum(len(m) for m in sim.md_claimer.values()) == 0  # every transfer ended one way or the other


def test_md_load_cap_sends_a_turn_past_the_md_holding_its_prefix():
    """Two MDs; three requests on one prefix, each decoding long. Within the MD slack (64) the
    second and third follow the first to the MD whose index holds the prefix; with
    ``md_load_cap=2`` that MD has 2 requests when the third is routed, so it goes to the other
    (the whole prompt crosses). The choices are the policy's for the loads recorded."""
    recs = [{"timestamp": t, "input_length": 4096, "output_length": 8000, "hash_ids": list(range(8))}
            for t in (0, 20000, 21000)]
    cfg = RELAY.replace(n_md=2, ttft_budget_ms=1e6)
    free = run(cfg, recs)
    assert [r.md.name for r in free.reqs] == ["MD0", "MD0", "MD0"]
    capped = run(cfg.replace(md_load_cap=2), recs)
    assert [r.md.name for r in capped.reqs] == ["MD0", "MD0", "MD1"]
    assert [r.md_hit for r in capped.reqs] == [0, 4096, 0]
