"""Cache-aware routing to main-decode instances across the WAN uses the gateway's own record of
what it routed there (pdd.policy.prefix_index), not a peek: no round trip before the
reservation. P (same datacenter) is still asked. ``policy.md_route_peek`` restores the peek."""
import asyncio

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, layout
from tests.gateway.fake_peer import FakePeer


class PeekPeer(FakePeer):
    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return {"t": "peek_ok", "hit_tokens": 0}, b""


def _orch(**policy):
    cfg = ClusterConfig.model_validate({"mode": "cross_dc_pd", "instances": {"prefill": 2, "main_decode": 3},
                                        "policy": policy})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {s.name: PeekPeer() for s in o.layout.engines}
    return o


def _peeks(o):
    return {n: sum(h.get("t") == "peek" for h in p.sent) for n, p in o.peers.items()}


def test_md_routing_follows_the_prefix_without_asking_md():
    o = _orch()
    mds = [s.name for s in o.layout.by_role(ROLE_MAIN)]
    session = list(range(100, 420))  # 20 pages of 16
    first = asyncio.run(o._route(ROLE_MAIN, session))
    # another conversation is routed elsewhere by load-free round robin (no hit anywhere) ...
    o.inflight[first] = 1
    other = asyncio.run(o._route(ROLE_MAIN, list(range(5000, 5320))))
    assert other != first
    # ... and the session's next turn (its prefix + new tokens) goes back to the first MD
    assert asyncio.run(o._route(ROLE_MAIN, session + [7] * 40)) == first
    assert all(_peeks(o)[n] == 0 for n in mds)
    assert o.prefix_index[first].match(session) == 320
    # P is in datacenter A: still asked
    asyncio.run(o._route(ROLE_PREFILL, session))
    assert sum(_peeks(o)[s.name] for s in o.layout.by_role(ROLE_PREFILL)) == 2


def test_peek_ablation_asks_every_md():
    o = _orch(md_route_peek=True)
    asyncio.run(o._route(ROLE_MAIN, list(range(64))))
    assert [_peeks(o)[s.name] for s in o.layout.by_role(ROLE_MAIN)] == [1, 1, 1]


def test_a_lost_md_forgets_its_prefixes():
    o = _orch()
    name = asyncio.run(o._route(ROLE_MAIN, list(range(64))))
    assert o.prefix_index[name].match(list(range(64))) == 64
    o._peer_closed(name, o.peers[name])
    assert o.prefix_index[name].match(list(range(64))) == 0


def test_route_hit_is_what_the_index_held_before_this_request():
    o = _orch()
    session = list(range(100, 420))  # 20 pages of 16
    name, held = asyncio.run(o._route_hit(ROLE_MAIN, session))
    assert held == 0
    again, held = asyncio.run(o._route_hit(ROLE_MAIN, session + [7] * 40))
    assert (again, held) == (name, 320)
    assert asyncio.run(o._route_hit(ROLE_PREFILL, session))[1] is None  # no index of a P


def _ended(o, pipeline, md_name, prompt, emitted, **kw):
    from pdd.gateway.state import ReqState
    from pdd.types import Pipeline, SamplingParams

    st = ReqState("r", len(prompt), SamplingParams(), trid="r", prompt_ids=prompt, pipeline=Pipeline(pipeline))
    st.names[ROLE_MAIN] = md_name
    st.emitted = list(emitted)
    for k, v in kw.items():  # HandoffState fields (switch_pos, md_diverged)
        setattr(st.handoff, k, v)
    o._record_decoded(st)


def test_an_md_that_decoded_a_request_is_indexed_with_its_output():
    o = _orch()
    md = o.layout.by_role(ROLE_MAIN)[0].name
    prompt, out = list(range(100, 140)), list(range(9000, 9030))  # 40 + 30 tokens
    nxt = prompt + out + [1] * 20
    # MD decoded it to the end: prompt + all but the last output token (69 tokens: 4 whole pages)
    _ended(o, "p_md", md, prompt, out)
    assert o.prefix_index[md].match(nxt) == 64
    # relayed and ended on RLD (no switch) or on a diverged MD: MD has no output to offer
    o2 = _orch()
    _ended(o2, "p_rld_md", md, prompt, out)
    _ended(o2, "p_rld_md", md, prompt, out, switch_pos=5, md_diverged=True)
    assert o2.prefix_index[md].match(nxt) == 0
    _ended(o2, "p_rld_md", md, prompt, out, switch_pos=5)
    assert o2.prefix_index[md].match(nxt) == 64


def _routed(o, trid, prompt):
    """Route attempt ``trid`` of ``prompt`` to an MD (recorded in its index, as launch does)."""
    from pdd.gateway.state import ReqState
    from pdd.types import SamplingParams

    name, _ = asyncio.run(o._route_hit(ROLE_MAIN, prompt, trid))
    st = ReqState(trid, len(prompt), SamplingParams(), trid=trid, prompt_ids=prompt)
    st.names[ROLE_MAIN] = name
    return name, st


def _kv_ready(o, name, trid):
    from pdd.transfer.messages import KvReady

    asyncio.run(o.on_kv_ready(o.peers[name], KvReady(trid).wire(), b""))


def test_a_cut_off_transfer_takes_its_prompt_out_of_the_index():
    """The transfer was cut off: MD caches nothing of it, so the gateway's index of MD must not
    plan the next turn on it (a predicted send that MD's reservation then has to fill) nor keep
    it in place of prefixes MD holds."""
    o = _orch(routing="load")  # one MD by load: the index alone is under test
    shared, rest = list(range(100, 164)), list(range(500, 820))  # 4 + 20 pages
    name, a = _routed(o, "a", shared + rest)
    _kv_ready(o, name, "a")  # a's KV landed: MD caches its pages
    b_prompt = shared + list(range(2000, 2320))
    name_b, b = _routed(o, "b", b_prompt)
    ix = o.prefix_index[name_b]
    assert ix.match(b_prompt) == 384 and len(ix) == 24 + (20 if name_b == name else 0)
    o._count_cut_off(b)  # RLD finished b first: its transfer is cut off
    assert ix.match(b_prompt) == (64 if name_b == name else 0)  # b's own pages are gone
    if name_b == name:
        assert ix.match(shared + rest) == 384  # a's landed pages stay
    assert o.index_claims["b"][2] and o.totals["cut_offs"] == 1  # kept, dropped, for a late kv_ready


def test_pages_another_request_still_brings_stay_until_it_is_settled():
    """Two requests routed with one new prefix to one MD: the first is cut off while the second's
    KV is on its way (the pages stay), then the second lands (they stay for good: a later
    drop of a third does not take them)."""
    o = _orch(routing="load")
    o.peers = {n: p for n, p in o.peers.items()}
    p = list(range(3000, 3160))  # 10 pages
    name, first = _routed(o, "x1", p)
    for other in o.layout.by_role(ROLE_MAIN):  # the second turn goes to the same MD
        if other.name != name:
            o.inflight[other.name] = 10
    name2, second = _routed(o, "x2", p + [5] * 16)
    assert name2 == name
    ix = o.prefix_index[name]
    o._count_cut_off(first)
    assert ix.match(p) == 160  # x2's KV is still bringing them
    _kv_ready(o, name, "x2")
    name3, third = _routed(o, "x3", p + [6] * 16)
    o._count_cut_off(third)
    assert ix.match(p + [5] * 16) == 176 and ix.match(p + [6] * 16) == 160


def test_an_md_leg_given_up_before_its_kv_landed_takes_its_prompt_out():
    o = _orch(routing="load")
    prompt = list(range(7000, 7320))

    async def lose(st):  # in a loop: the leg's tidy-up (drops on P and MD) runs as a task
        o._md_leg_lost(st, "test: MD lost")
        await asyncio.sleep(0)

    name, st = _routed(o, "m1", prompt)
    asyncio.run(lose(st))
    assert o.prefix_index[name].match(prompt) == 0
    # landed first: MD keeps its pages when its leg is given up later
    name, st = _routed(o, "m2", prompt)
    _kv_ready(o, name, "m2")
    st.handoff.kv_ready = True
    asyncio.run(lose(st))
    assert o.prefix_index[name].match(prompt) == 320


def test_a_kv_ready_that_crossed_the_cut_off_records_the_prompt_again():
    """The cut-off came while MD already held the whole KV (its kv_ready on the way): MD keeps it
    cached, so when that kv_ready arrives the index records the prompt again, landed; a second
    drop of the same attempt changes nothing."""
    o = _orch(routing="load")
    prompt = list(range(8000, 8320))
    name, st = _routed(o, "c1", prompt)
    o._count_cut_off(st)
    ix = o.prefix_index[name]
    assert ix.match(prompt) == 0
    o._index_dropped("c1")
    _kv_ready(o, name, "c1")
    assert ix.match(prompt) == 320 and "c1" not in o.index_claims
    _, other = _routed(o, "c2", prompt)
    o._count_cut_off(other)
    assert ix.match(prompt) == 320  # landed: another request's drop keeps it


def test_an_aborted_request_takes_its_prompt_out():
    """A request aborted before its KV landed on MD (the client disconnected, a stop string, a tier
    refused it): every tier drops it and MD caches none of its KV, so its MD's index takes back the
    pages only it was bringing, as for a cut-off; one whose KV had landed keeps them."""
    from pdd.gateway.state import ABORT_CLIENT, ABORT_STOP
    from pdd.types import Pipeline

    o = _orch(routing="load")
    prompt = list(range(9000, 9320))
    name, st = _routed(o, "d1", prompt)
    st.pipeline = Pipeline.P_RLD_MD
    asyncio.run(o.abort(st, ABORT_CLIENT))
    assert o.prefix_index[name].match(prompt) == 0
    assert o.index_claims.get("d1", (None, None, True))[2]  # settled (kept dropped, or gone)
    name, st = _routed(o, "d2", prompt)
    st.pipeline = Pipeline.P_RLD_MD
    _kv_ready(o, name, "d2")
    st.handoff.kv_ready = True
    asyncio.run(o.abort(st, ABORT_STOP))
    assert o.prefix_index[name].match(prompt) == 320


def test_a_new_attempt_takes_the_old_attempts_prompt_out():
    """Recovery gives up an attempt (aborted on every tier) before its KV landed on MD: the old
    attempt's pages leave its MD's index; the new attempt routes (and claims) on its own."""
    from pdd.gateway.phase import Phase
    from pdd.types import Pipeline

    o = _orch(routing="load")
    prompt = list(range(9500, 9820))

    async def recover(st):  # the old attempt's aborts run as a task
        o._new_attempt(st, "test: RLD lost")
        await asyncio.sleep(0)

    name, st = _routed(o, "e1", prompt)
    st.rid, st.pipeline = "e1", Pipeline.P_RLD_MD
    st.to(Phase.PREFILL)
    st.to(Phase.TRANSFER)  # P streams its KV to RLD and MD; then RLD is lost
    o.reqs["e1"] = st
    asyncio.run(recover(st))
    assert st.trid == "e1.1"
    assert o.prefix_index[name].match(prompt) == 0


def test_a_claim_keeps_the_prompts_page_keys_not_its_tokens():
    """Up to INDEX_CLAIMS_MAX claims are kept (a dropped one for a kv_ready that crossed it), each
    outliving its request: a claim holds its prompt's whole-page keys (one per 16 tokens), not the
    prompt's token list, whose memory grows with the prompt (a soak's gateway grew ~40 MB with
    ~700 claims of ~1,100-token prompts); landed and dropped settle the same pages."""
    from pdd.gateway.state import ABORT_CLIENT
    from pdd.types import Pipeline

    o = _orch(routing="load")
    prompt = list(range(10000, 13000))  # 3,000 tokens: 187 whole pages
    name, st = _routed(o, "k1", prompt)
    ix = o.prefix_index[name]
    assert o.index_claims["k1"] == (name, ix.page_keys(prompt), None) and len(ix.page_keys(prompt)) == 187
    st.pipeline = Pipeline.P_RLD_MD
    asyncio.run(o.abort(st, ABORT_CLIENT))  # the client went away before the KV landed
    assert o.index_claims["k1"][:2] == (name, ix.page_keys(prompt)) and ix.match(prompt) == 0
    _kv_ready(o, name, "k1")  # a kv_ready that crossed the abort: MD holds the pages after all
    assert ix.match(prompt) == 2992 and "k1" not in o.index_claims


async def _first_token_ended(o, st):  # in a loop: the leg's tidy-up (drops on P and MD) runs as a task
    o._md_leg_lost(st, "finished by its first token", degraded=False)
    await asyncio.sleep(0)


def test_dropped_claims_are_forgotten_once_no_kv_ready_can_cross_them():
    """Requests that end without their KV landing on MD (the client went away, a stop string, a
    cut-off, a relayed request its first token finished) leave a dropped claim for a kv_ready that
    crossed the drop; request_timeout_s after the drop it is forgotten, so ended requests leave
    nothing behind (a soak's gateway held 731 claims after 14 minutes, on their way to the 1,024
    cap, which then pushes live requests' claims out first). A live claim stays."""
    import time

    from pdd.gateway.state import ABORT_CLIENT, ABORT_STOP
    from pdd.types import Pipeline

    o = _orch(routing="load")
    t0 = time.monotonic()
    for i in range(40):
        name, st = _routed(o, f"e{i}", list(range(20000 + 400 * i, 20320 + 400 * i)))
        st.pipeline = Pipeline.P_RLD_MD
        if i % 4 == 0:
            asyncio.run(o.abort(st, ABORT_CLIENT))
        elif i % 4 == 1:
            asyncio.run(o.abort(st, ABORT_STOP))
        elif i % 4 == 2:
            o._count_cut_off(st)
        else:
            asyncio.run(_first_token_ended(o, st))
    _routed(o, "live", list(range(90000, 90320)))
    assert len(o.index_claims) == 41
    assert o._expire_dropped_claims(t0 + o.cfg.request_timeout_s - 1) == 0  # a crossing kv_ready may still come
    t1 = time.monotonic()
    assert o._expire_dropped_claims(t1 + o.cfg.request_timeout_s) == 40
    assert list(o.index_claims) == ["live"] and o._expire_dropped_claims(t1 + 10 * o.cfg.request_timeout_s) == 0


def test_a_relayed_request_its_first_token_ended_is_no_warning(caplog):
    """A relayed request whose first token ends it (EOS, a stop id, max_tokens 1) needs no decoder:
    its MD leg is cut, nothing is lost, so the log line is INFO; a leg lost for real stays a warning."""
    import logging

    from pdd.types import Pipeline

    o = _orch(routing="load")
    caplog.set_level(logging.INFO, logger="pdd.gateway.orchestrator")
    for trid, degraded in (("f1", False), ("f2", True)):
        _, st = _routed(o, trid, list(range(30000, 30320)))
        st.pipeline = Pipeline.P_RLD_MD

        async def lose(st=st, degraded=degraded):
            o._md_leg_lost(st, "test", degraded=degraded)
            await asyncio.sleep(0)

        asyncio.run(lose())
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "MD leg lost" in r.getMessage()] == [
        ("INFO", "request f1: MD leg lost (test); RLD finishes it"),
        ("WARNING", "request f2: MD leg lost (test); RLD finishes it")]


def test_md_load_cap_routes_a_turn_past_its_md_once_that_md_holds_the_cap():
    """``policy.md_load_cap``: the MD whose index holds the session's prefix takes its next turn
    while it has fewer requests in flight than the cap (within the slack either way); at the cap
    another MD does."""
    session = list(range(100, 420))
    for cap, follows in ((0, True), (3, True), (2, False)):
        o = _orch(md_load_cap=cap)
        first = asyncio.run(o._route(ROLE_MAIN, session))
        o.inflight[first] = 2
        assert (asyncio.run(o._route(ROLE_MAIN, session + [7] * 40)) == first) is follows, cap
