"""The gateway's rules for a lost instance (``Orchestrator._instance_lost``), with fake connections:
which legs a request still needs in each phase, and what it does when one is lost. Fast (no
processes); the fault matrix checks the same rules end to end."""

import asyncio
import dataclasses

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator, ReqState
from pdd.gateway.phase import IllegalTransition, Phase
from pdd.topology import layout
from pdd.gateway.state import HandoffState, TokenOut
from pdd.transfer.messages import KvReady, Tok, XferDone
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer


@pytest.fixture
def orch():
    cfg = ClusterConfig.model_validate({"mode": "pdd", "instances": {"prefill": 2, "relay_decode": 2,
                                                                     "main_decode": 2}})
    o = Orchestrator(cfg, layout(cfg))
    o.peers = {s.name: FakePeer() for s in o.layout.engines}
    return o


def relayed(o: Orchestrator, **kw) -> ReqState:
    st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=[5] * 40)
    st.pipeline = Pipeline.P_RLD_MD
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    st.to(Phase.PREFILL)
    o._prefilled(st)
    handoff = {f.name for f in dataclasses.fields(HandoffState)}
    for k, v in kw.items():  # a HandoffState field (kv_ready, md_start, ...) or a top-level one
        setattr(st.handoff if k in handoff else st, k, v)
    if st.handoff.kv_ready:  # the phase moves the set-up's events would have made
        st.to(Phase.RLD_DECODE)
    if st.handoff.md_start is not None:
        st.to(Phase.HANDOFF)
    if st.handoff.switch_pos is not None:
        st.to(Phase.MD_DECODE)
    o.reqs[st.trid] = st
    return st


def stream_to(st: ReqState, n: int) -> None:
    st.emitted = list(range(100, 100 + n))
    st.next_pos = n


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


class HandoffPeer(FakePeer):
    """An RLD that answers every call with ``rep`` (a handoff reply)."""

    def __init__(self, rep: dict):
        super().__init__()
        self.rep = rep

    async def call(self, h, payload=b"", timeout=None):
        self.sent.append(dict(h))
        return dict(self.rep), b""


async def test_phases_move_with_the_request_s_events(orch):
    """A relayed request's held phase: transfer until MD's kv_ready, rld_decode until the
    handoff's first call, handoff until MD's first token streams, md_decode; a lost instance
    then makes it recover (a new attempt starts at prefill). Each move is recorded in order."""
    orch.peers["rld0"] = HandoffPeer({"token_ids": [100, 101, 102], "mode": "one_shot", "final": True})
    st = relayed(orch)
    assert orch.phase(st) == "transfer"
    stream_to(st, 3)
    assert orch.phase(st) == "transfer"  # RLD decodes while MD's KV crosses
    await orch.on_kv_ready(orch.peers["md0"], KvReady("r1").wire(), b"")
    assert orch.phase(st) == "rld_decode"  # the handoff task starts next
    await settle()
    assert orch.phase(st) == "handoff" and st.handoff.md_start == 3
    toks = orch._next_tokens(st, TokenOut(3, 7, "md", None))
    assert [t.pos for t in toks] == [3] and orch.phase(st) == "md_decode" and st.handoff.switch_pos == 3
    assert orch.requests_view()["r1"]["phase"] == "md_decode"
    orch._instance_lost(st, "md0", "gone")
    orch._new_attempt(st, st.recovery.error)
    assert orch.phase(st) == "recovery" and st.recovery.recoveries[-1]["phase"] == "md_decode"
    assert [p.value for p, _ in st.life.history] == ["queued", "prefill", "transfer", "rld_decode", "handoff",
                                                     "md_decode", "recovery"]
    ts = [t for _, t in st.life.history]
    assert ts == sorted(ts)


async def test_p_md_request_decodes_at_its_first_token_and_ends_done(orch):
    st = relayed(orch)
    st.pipeline = Pipeline.P_MD
    assert [t.pos for t in orch._next_tokens(st, TokenOut(0, 9, "md", None))] == [0]
    assert orch.phase(st) == "md_decode"
    await orch.abort(st, "client_disconnect")
    assert orch.phase(st) == "done"
    assert not st.to(Phase.TRANSFER)  # a finished request's phase never moves (late events)
    assert orch.phase(st) == "done"


def test_an_illegal_transition_raises_under_tests_and_is_logged_otherwise(monkeypatch, caplog):
    from pdd.gateway import phase

    st = ReqState("r9", 4, SamplingParams(max_tokens=2))
    with pytest.raises(IllegalTransition, match="r9: illegal phase transition queued -> md_decode"):
        st.to(Phase.MD_DECODE)
    monkeypatch.setattr(phase, "STRICT", False)
    assert not st.to(Phase.HANDOFF, "no prefill yet")
    assert st.phase is Phase.QUEUED and [p for p, _ in st.life.history] == [Phase.QUEUED]
    assert "illegal phase transition queued -> handoff (no prefill yet)" in caplog.text


async def test_p_lost_before_rld_has_kv_recovers(orch):
    st = relayed(orch)
    orch._instance_lost(st, "p0", "gone")
    assert st.recovery.lost and st.queue.get_nowait() is None


async def test_p_lost_while_md_kv_crosses_drops_md_leg_rld_finishes(orch):
    st = relayed(orch)
    stream_to(st, 3)
    orch._instance_lost(st, "p0", "gone")
    await settle()
    assert not st.recovery.lost and st.recovery.md_lost and st.recovery.degraded
    assert {"t": "drop", "rid": "r1"} in orch.peers["md0"].sent


async def test_p_lost_after_xfer_done_with_early_handoff_started_recovers(orch):
    """P reported xfer_done (its sockets took MD's KV) and died before MD's kv_ready: bytes the
    line had not read died with P. The early handoff already asked RLD for its ids (one-shot:
    RLD stopped) and MD's extend waits for KV that never comes, so neither leg can finish the
    request: a new attempt, and every tier (MD too: its partial KV) frees the old one."""
    orch._in_b = lambda name: name.startswith("md")
    orch.peers["rld0"] = HandoffPeer({"token_ids": [100, 101, 102], "mode": "one_shot", "final": True})
    st = relayed(orch)
    stream_to(st, 3)
    st.events["md_reserved"] = 0.0
    await orch.on_xfer_done(None, XferDone("r1", {"md0": 4000}, {}, {}).wire(), b"")
    await settle()
    assert st.wan.kv_sent and not st.handoff.kv_ready and orch.phase(st) == "handoff" and st.handoff.md_start == 3
    assert {"t": "extend", "rid": "r1", "token_ids": [100, 101, 102], "final": True} in orch.peers["md0"].sent
    orch._instance_lost(st, "p0", "gone")
    assert st.recovery.lost and not st.recovery.md_lost and st.queue.get_nowait() is None
    orch._new_attempt(st, st.recovery.error)
    await settle()
    assert st.trid == "r1.1" and not st.handoff.started and "handoff_call" not in st.events
    assert {"t": "abort", "rid": "r1"} in orch.peers["md0"].sent


async def test_p_lost_after_xfer_done_before_rld_was_asked_drops_md_leg(orch):
    """As above, but the early handoff still waits for RLD's ``handoff_min_tokens``: RLD was
    not asked for its ids, so it finishes the request and the handoff never calls it."""
    orch._in_b = lambda name: name.startswith("md")
    orch.cfg.policy.handoff_min_tokens = 5
    orch.peers["rld0"] = HandoffPeer({"token_ids": [100, 101, 102], "mode": "one_shot", "final": True})
    st = relayed(orch)
    stream_to(st, 3)
    st.events["md_reserved"] = 0.0
    await orch.on_xfer_done(None, XferDone("r1", {"md0": 4000}, {}, {}).wire(), b"")
    await settle()
    assert st.wan.kv_sent and st.handoff.started and "handoff_call" not in st.events
    orch._instance_lost(st, "p0", "gone")
    assert not st.recovery.lost and st.recovery.md_lost and st.recovery.degraded
    stream_to(st, 6)
    for _ in range(20):
        await asyncio.sleep(0.002)
    assert orch.peers["rld0"].sent == [] and orch.phase(st) == "rld_decode"
    assert {"t": "drop", "rid": "r1"} in orch.peers["md0"].sent


async def test_a_replaced_attempt_s_waiting_handoff_leaves_the_next_attempt_alone(orch):
    """An attempt's handoff waiting for ``handoff_min_tokens`` when recovery replaces the attempt
    stops: it never asks RLD (nor sends MD) the new attempt's ids; the new attempt's own handoff
    runs once, from its first round."""
    orch.cfg.policy.handoff_min_tokens = 5
    orch.peers["rld0"] = HandoffPeer({"token_ids": [42], "mode": "one_shot", "final": True})
    st = relayed(orch)
    stream_to(st, 3)
    await orch.on_kv_ready(orch.peers["md0"], KvReady("r1").wire(), b"")
    await settle()
    assert st.handoff.started and "handoff_call" not in st.events
    orch._fail_lost(st, "instance p0 is unreachable")  # the attempt is given up: a new one
    orch._new_attempt(st, st.recovery.error)
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}  # same instances again
    st.to(Phase.PREFILL)
    orch._prefilled(st)
    st.emitted.append(200)
    st.next_pos = 4  # the new attempt streamed its first token (position 3)
    st.emitted.append(201)
    st.next_pos = 5
    for _ in range(20):
        await asyncio.sleep(0.002)
    assert [h for h in orch.peers["rld0"].sent if h.get("t") == "handoff"] == []
    assert [h for h in orch.peers["md0"].sent if h.get("t") == "extend"] == []
    await orch.on_kv_ready(orch.peers["md0"], KvReady("r1.1").wire(), b"")
    await settle()
    calls = [h for h in orch.peers["rld0"].sent if h.get("t") == "handoff"]
    assert [h["rid"] for h in calls] == ["r1.1"] and orch.phase(st) == "handoff"
    assert [h for h in orch.peers["md0"].sent if h.get("t") == "extend"] == [
        {"t": "extend", "rid": "r1.1", "token_ids": [42], "final": True}]


async def test_md_lost_before_its_reservation_reply_cancels_p_s_fill_slot(orch):
    # a predicted MD send: P holds an md_fill slot that only MD's reply would resolve; the reply
    # never comes, and a cancel reaching P before it admitted the request is ignored there
    st = relayed(orch)
    st.wan.fill_slot = True
    orch._instance_lost(st, "md0", "gone")
    await settle()
    assert st.recovery.md_lost and not st.recovery.lost
    assert {"t": "target", "rid": "r1", "slot": "md_fill", "name": "md0", "cancelled": True} in orch.peers["p0"].sent
    # without a fill slot (no predicted send) P is not sent one
    st2 = relayed(orch)
    st2.trid = st2.rid = "r2"
    orch.reqs["r2"] = st2
    orch._instance_lost(st2, "md0", "gone")
    await settle()
    assert not [h for h in orch.peers["p0"].sent if h.get("rid") == "r2" and h.get("slot") == "md_fill"]


async def test_p_lost_after_kv_arrived_changes_nothing(orch):
    st = relayed(orch, kv_ready=True)
    stream_to(st, 3)
    orch._instance_lost(st, "p0", "gone")
    assert not st.recovery.lost and not st.recovery.md_lost


async def test_rld_lost_with_kv_at_md_md_takes_over_from_streamed_ids(orch):
    st = relayed(orch, kv_ready=True)
    stream_to(st, 4)
    orch._instance_lost(st, "rld0", "gone")
    await settle()
    assert st.handoff.takeover and st.handoff.md_start == 4 and not st.recovery.lost
    assert orch.peers["md0"].sent[-1] == {"t": "extend", "rid": "r1", "token_ids": [100, 101, 102, 103],
                                          "final": True}


async def test_rld_lost_before_md_has_kv_recovers(orch):
    st = relayed(orch)
    stream_to(st, 4)
    orch._instance_lost(st, "rld0", "gone")
    assert st.recovery.lost


async def test_rld_lost_after_final_handoff_changes_nothing(orch):
    st = relayed(orch, kv_ready=True, md_start=6, mode="one_shot")
    stream_to(st, 6)
    orch._instance_lost(st, "rld0", "gone")
    assert not st.recovery.lost and not st.handoff.takeover


async def test_md_lost_before_handoff_rld_finishes(orch):
    st = relayed(orch, kv_ready=True)
    stream_to(st, 4)
    orch._instance_lost(st, "md0", "gone")
    assert st.recovery.md_lost and st.recovery.degraded and not st.recovery.lost


async def test_md_lost_while_streaming_recovers_and_new_attempt_continues_at_next_position(orch):
    st = relayed(orch, kv_ready=True, md_start=6, switch_pos=6, mode="one_shot")
    stream_to(st, 9)
    orch._instance_lost(st, "md0", "gone")
    assert st.recovery.lost
    orch._new_attempt(st, st.recovery.error)
    await settle()
    assert st.trid == "r1.1" and st.base == 9 and st.handoff.switch_pos is None and not st.recovery.lost
    assert "r1" not in orch.reqs and orch.reqs["r1.1"] is st
    assert st.queue.empty()
    assert {"t": "abort", "rid": "r1"} in orch.peers["p1"].sent  # the old attempt, everywhere
    prompt, sp = orch._attempt_prompt(st)
    assert prompt == [5] * 40 + list(range(100, 109)) and sp.max_tokens == 16 - 9
    assert sp.output_offset == 9  # draws, min_tokens, penalties count the streamed 9 as outputs
    # the new attempt's token 0 is the request's position 9; a stale token of the old rid is ignored
    await orch.on_tok(None, Tok("r1", 9, 7, None, "md").wire(), b"")
    await orch.on_tok(None, Tok("r1.1", 0, 42, None, "rld").wire(), b"")
    tok = st.queue.get_nowait()
    assert (tok.pos, tok.token_id) == (9, 42) and st.queue.empty()
    assert [t.pos for t in orch._next_tokens(st, tok)] == [9]


async def test_unrelated_instance_changes_nothing(orch):
    st = relayed(orch)
    orch._instance_lost(st, "md1", "gone")
    orch._instance_lost(st, "p1", "gone")
    assert not st.recovery.lost and not st.recovery.md_lost


async def test_md_reservation_failing_after_rld_finished_still_frees_p(orch):
    """A recovery attempt planned P->RLD->MD during a WAN outage: RLD finishes the request (no
    cut-off: nothing was planned on the WAN yet) before MD's reservation fails when MD's heartbeat
    drops. P waits for MD's part of the plan (deferred target): it must be told the target is
    cancelled, else it holds the request for request_timeout_s (fault matrix wan_outage x handoff)."""
    st = relayed(orch)
    stream_to(st, 16)
    st.finished = True
    st.to(Phase.DONE)
    reserve = asyncio.get_running_loop().create_future()
    reserve.set_exception(ConnectionError("connection to md0 lost: no sign of life (heartbeat)"))
    await orch._md_leg(st, st.trid, reserve, orch.peers["p0"])
    await settle()
    sent = orch.peers["p0"].sent
    assert {"t": "target", "rid": "r1", "slot": "md", "name": "md0", "cancelled": True} in sent
    assert not st.recovery.degraded  # it ended at the client already: nothing to count


def test_health_degraded_while_serving_unavailable_without_p_or_decoder(orch):
    assert orch.health()["status"] == "ok"
    orch.peers["md0"].closed = True
    h = orch.health()
    assert h["status"] == "degraded" and h["down"] == ["md0"]  # RLD still decodes
    for name in orch.peers:
        if name.startswith("rld"):
            orch.peers[name].closed = True
    assert orch.health()["status"] == "degraded"  # md1 still decodes
    orch.peers["md1"].closed = True
    assert orch.health()["status"] == "unavailable"  # no decoder left
    for peer in orch.peers.values():
        peer.closed = False
    for name in orch.peers:
        if name.startswith("p"):
            orch.peers[name].closed = True
    assert orch.health()["status"] == "unavailable"  # no prefill left


async def test_restarted_instance_rejoins_without_traffic(monkeypatch):
    """The gateway's watcher reconnects a closed instance on its own (a restarted instance rejoins
    and /health recovers with no request routed to it)."""
    cfg = ClusterConfig.model_validate({"mode": "pdd", "liveness": {"reconnect_interval_s": 0.01}})
    o = Orchestrator(cfg, layout(cfg))
    attempts: list[str] = []
    down: set[str] = set()

    async def connect(name, retries):
        attempts.append(name)
        if name in down:
            raise ConnectionRefusedError(name)
        return FakePeer()

    monkeypatch.setattr(o, "_connect", connect)
    await o.start()
    down.add("md0")  # md0 dies (its connection closes) and stays down for a while
    try:
        dead = FakePeer()
        dead.closed = True
        o.peers["md0"] = dead
        assert o.health()["status"] == "degraded" and o.health()["down"] == ["md0"]
        await asyncio.sleep(0.1)
        assert attempts.count("md0") >= 3 and o.peers["md0"] is dead  # still down: tried again and again
        down.clear()  # restarted
        for _ in range(100):
            if not o.peers["md0"].closed:
                break
            await asyncio.sleep(0.01)
        assert not o.peers["md0"].closed and o.health()["status"] == "ok"
    finally:
        await o.close()


def _launch_failing(monkeypatch, orch, fails: int, exc: Exception) -> list:
    """Replace ``orch._launch`` with one that raises ``exc`` on its first ``fails`` calls and then
    starts nothing; returns the list of tier rids it was called with."""
    calls: list = []

    async def launch(st, prompt, sp=None, force_relay=False):
        calls.append(st.trid)
        if len(calls) <= fails:
            raise exc

    monkeypatch.setattr(orch, "_launch", launch)
    return calls


async def test_recovery_refused_by_a_full_tier_waits_and_retries(orch, monkeypatch):
    """A recovery's new attempt refused because a tier is full (OutOfPages / TierBusy at start)
    waits and tries again, instead of failing a request that has streamed tokens (a new user: 3
    of 4 recoveries failed at once on a full RLD). Other errors still fail it at once."""
    from pdd.gateway import recovery
    from pdd.transfer.peer import RemoteError

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    calls = _launch_failing(monkeypatch, orch, 2,
                            RemoteError("OutOfPages: out of KV pages: need 211, 14 free (seq x)", {}))
    st = relayed(orch, kv_ready=True, md_start=6, switch_pos=6, mode="one_shot")
    stream_to(st, 9)
    st.recovery.error = "instance md0 is unreachable"
    assert await orch._recover(st)
    assert calls == ["r1.1", "r1.2", "r1.3"] and st.trid == "r1.3" and st.base == 9
    # one recovery, however many refused tries it took (a live run had counted 356 for 10)
    assert orch.totals["recoveries"] == 1 and len(st.recovery.recoveries) == 1

    calls.clear()

    async def broken(st, prompt, sp=None, force_relay=False):
        calls.append(st.trid)
        raise RuntimeError("something else")

    monkeypatch.setattr(orch, "_launch", broken)
    st2 = relayed(orch)
    st2.rid = st2.trid = "r2"
    orch.reqs["r2"] = st2
    st2.recovery.error = "gone"
    assert not await orch._recover(st2)
    assert calls == ["r2.1"] and "recovery failed: something else" in st2.recovery.error


async def test_recovery_waits_for_a_restarting_tier(orch, monkeypatch):
    """A recovery whose new attempt finds no live instance of a tier it needs (NoInstance: the
    only P was killed, and its supervisor restarts it in seconds) waits and tries again, as for
    a full tier, instead of failing every request that was waiting for P (a new user: 6 of 8
    streams failed with 503 when p0 was killed, though it was back in ~4 s)."""
    from pdd.gateway import recovery
    from pdd.gateway.state import NoInstance

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    calls = _launch_failing(monkeypatch, orch, 3, NoInstance("no prefill instance is reachable"))
    st = relayed(orch)
    st.recovery.error = "instance p0 is unreachable"
    assert await orch._recover(st)
    assert calls == ["r1.1", "r1.2", "r1.3", "r1.4"] and orch.totals["recoveries"] == 1


async def test_wan_byte_balance_survives_recovery_and_a_lost_p(orch, monkeypatch):
    """planned = sent + not sent, per transfer, whatever fails (a verifying new user: after
    kill -9 of md0 mid-transfer, /pdd/stats wan_bytes stayed below wan_bytes_expected for good;
    after a P restart wan_bytes read 0, P's fresh counter)."""
    orch._in_b = lambda name: name.startswith("md")
    rep = {"md_cached_tokens": 0, "md_cached_pages": 0, "n_pages": 3, "prompt_tokens": 40, "page_size": 16,
           "page_bytes": 16 * 100}
    st = relayed(orch)
    orch._reserved(st, "md0", rep)
    assert st.wan.expected == 4000 and orch.planned_wan == {"r1": 4000}

    async def launch(st, prompt, sp=None, force_relay=False):
        return None

    monkeypatch.setattr(orch, "_launch", launch)
    st.recovery.error = "instance md0 is unreachable"
    assert await orch._recover(st)  # the old attempt r1 is replaced by r1.1; P still reports r1
    await orch.on_xfer_done(None, {"t": "xfer_done", "rid": "r1", "bytes": {"md0": 1500}, "unsent": {"md0": 2500},
                                   "errors": {"md0": "connection lost"}}, b"")
    t = orch.totals
    assert (t["wan_bytes_sent"], t["wan_bytes_expected"], t["wan_bytes_cancelled"]) == (1500, 1500, 2500)
    # the new attempt's plan, then its P dies before reporting: out of the balance, counted apart
    st.names = {"prefill": "p0", "relay_decode": "rld1", "main_decode": "md1"}
    orch._reserved(st, "md1", rep)
    assert t["wan_bytes_expected"] == 5500
    orch._peer_closed("p0")
    await settle()
    assert (t["wan_bytes_sent"], t["wan_bytes_expected"], t["wan_bytes_unreported"]) == (1500, 1500, 4000)
    assert not orch.planned_wan and not orch.superseded_wan


def _p_lost_then_back(tries: list, none_until: int):
    """An ``Orchestrator._launch`` stand-in: the first try loses its P (ConnectionError), tries up
    to ``none_until`` find no P (NoInstance: its supervisor restarts it), later ones start; each
    try's attempt id is appended to ``tries``."""
    from pdd.gateway.state import NoInstance

    async def launch(st, prompt, sp=None, force_relay=False):
        tries.append(st.trid)
        if len(tries) == 1:
            raise ConnectionError("instance p0 is unreachable")
        if len(tries) <= none_until:
            raise NoInstance("no prefill instance is reachable")

    return launch


async def test_a_start_that_lost_its_p_waits_for_it_to_come_back(orch, monkeypatch):
    """A request whose P died while it started is started again; if no P is up yet (its
    supervisor restarts it in seconds) it waits instead of failing with 503 (a verifying new
    user: 3 of 8 requests still starting when p0 was killed got 503s). A request that finds no
    P on its first try still fails at once (503 + Retry-After for the client: no work done)."""
    from pdd.gateway import recovery
    from pdd.gateway.state import NoInstance, RequestFailed

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    tries: list = []
    monkeypatch.setattr(orch, "_launch", _p_lost_then_back(tries, none_until=4))
    st = await orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="s1")
    assert tries == ["s1", "s1.1", "s1.2", "s1.3", "s1.4"] and st.trid == "s1.4"

    async def none_up(st, prompt, sp=None, force_relay=False):
        raise NoInstance("no prefill instance is reachable")

    monkeypatch.setattr(orch, "_launch", none_up)
    with pytest.raises(RequestFailed, match="no prefill instance"):
        await orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="s2")
    # s2 was refused before any tier ran it (503 + Retry-After): rejected, as a 429 is, not failed
    assert {k: orch.totals[k] for k in ("failed", "rejected")} == {"failed": 0, "rejected": 1}


async def test_a_start_aborted_while_it_waits_for_its_p_is_not_started_again(orch, monkeypatch):
    """A request whose start waits for its restarting P (as above) and is aborted meanwhile (its
    client left: ``abort_starting``; the server's shutdown timeout ended it) fails at once and is
    never launched again: a new user's 4 requests whose clients left while p0 restarted were
    launched once p0 was back and held 289 of P's pages for good (``/pdd/flush`` leaked_pages
    289), and under SIGTERM the drain waited for them until uvicorn cancelled them (HTTP 500)."""
    from pdd.gateway import recovery
    from pdd.gateway.state import ABORT_CLIENT, RequestFailed

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    tries: list = []

    async def client_leaves_while_waiting(seen, timeout_s):
        await orch.abort(orch.reqs["s1.2"], ABORT_CLIENT)

    # P is back from the third try: launching the aborted request then is the leak
    monkeypatch.setattr(orch, "_launch", _p_lost_then_back(tries, none_until=2))
    monkeypatch.setattr(orch, "_topology_wait", client_leaves_while_waiting)
    with pytest.raises(RequestFailed, match=r"aborted \(client_disconnect\) while it waited to start again"):
        await orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="s1")
    assert tries == ["s1", "s1.1"] and orch.totals["cancelled"] == 1 and not orch.reqs


def _p_lost_while_back(tries: list, lost_at: tuple, none_at: tuple):
    """An ``Orchestrator._launch`` stand-in: try k (1-based) loses its P (ConnectionError) when
    k is in ``lost_at``, finds no P (NoInstance: restarting) when in ``none_at``, else starts."""
    from pdd.gateway.state import NoInstance

    async def launch(st, prompt, sp=None, force_relay=False):
        tries.append(st.trid)
        if len(tries) in lost_at:
            raise ConnectionError("instance p0 is unreachable")
        if len(tries) in none_at:
            raise NoInstance("no prefill instance is reachable")

    return launch


async def test_waiting_for_a_restarting_p_spends_no_recovery_attempt(orch, monkeypatch):
    """The tries a start makes while its P restarts are attempts (``s1.2``, ``s1.3``, ...) but not
    recoveries: P lost again once it is back is still started again while fewer than
    ``liveness.recovery_attempts`` (2) new attempts were made (a start that had waited 3 tries
    failed at once on its next lost P: the budget read ``st.attempt``). Once the budget is spent
    the start fails at once, its error naming the budget, counted failed."""
    from pdd.gateway import recovery
    from pdd.gateway.state import RequestFailed

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    tries: list = []
    monkeypatch.setattr(orch, "_launch", _p_lost_while_back(tries, lost_at=(1, 5), none_at=(2, 3, 4)))
    st = await orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="s1")
    assert tries == ["s1", "s1.1", "s1.2", "s1.3", "s1.4", "s1.5"] and st.trid == "s1.5"
    assert [r["attempt"] for r in st.recovery.recoveries] == [0, 4] and orch.totals["recoveries"] == 2

    tries.clear()
    monkeypatch.setattr(orch, "_launch", _p_lost_while_back(tries, lost_at=(1, 3, 4), none_at=(2,)))
    with pytest.raises(RequestFailed) as e:
        await orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="s2")
    assert str(e.value) == ("request s2 failed while starting: instance p0 is unreachable (after 2 new attempts: "
                            "liveness.recovery_attempts 2)")
    assert tries == ["s2", "s2.1", "s2.2", "s2.3"] and orch.totals["failed"] == 1 and "s2.3" not in orch.reqs


async def test_a_recovery_that_waited_for_its_p_keeps_its_budget(orch, monkeypatch):
    """A mid-stream recovery that waited for a restarting P (3 tries) has spent 1 of its 2
    recoveries: the next lost instance is recovered; the one after that fails the request with
    its budget named."""
    from pdd.gateway import recovery

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    tries: list = []
    monkeypatch.setattr(orch, "_launch", _p_lost_while_back(tries, lost_at=(), none_at=(1, 2, 3)))
    st = relayed(orch)
    st.recovery.error = "instance p0 is unreachable"
    assert await orch._recover(st)
    assert tries == ["r1.1", "r1.2", "r1.3", "r1.4"] and len(st.recovery.recoveries) == 1
    st.recovery.error = "instance rld0 is unreachable"
    assert await orch._recover(st)
    assert tries[-1] == "r1.5" and len(st.recovery.recoveries) == 2 and orch.totals["recoveries"] == 2
    st.recovery.error = "instance md0 is unreachable"
    assert not await orch._recover(st)
    assert tries[-1] == "r1.5" and st.recovery.error == ("instance md0 is unreachable (after 2 new attempts: "
                                                         "liveness.recovery_attempts 2)")


async def test_a_start_waiting_for_its_p_ends_at_once_when_the_drain_begins(orch, monkeypatch):
    """SIGTERM while the only P restarts: a start waiting for it (it lost its P while starting)
    ends as soon as the drain begins, with ShuttingDown (the API's 503 ``shutting_down``), counted
    failed, instead of holding the drain for ``RECOVERY_WAIT_S`` (30 s) and then failing with
    "no prefill instance is reachable" (nobody restarts P during a shutdown)."""
    from pdd.gateway.shutdown import Drain
    from pdd.gateway.state import ShuttingDown

    tries: list = []
    lost_then_none = _p_lost_while_back(tries, lost_at=(1,), none_at=range(2, 10 ** 6))
    waiting = asyncio.Event()

    async def launch(st, prompt, sp=None, force_relay=False):
        if len(tries) == 1:
            waiting.set()  # this try finds no P: the start waits for it next
        await lost_then_none(st, prompt, sp, force_relay)

    monkeypatch.setattr(orch, "_launch", launch)
    start = asyncio.ensure_future(orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="s1"))
    await waiting.wait()
    rep = await asyncio.wait_for(Drain(60).run(orch), 10)
    assert (rep["ended"], rep["left"]) == (0, [])
    with pytest.raises(ShuttingDown, match="the gateway is shutting down while it waited "
                                           r"\(no prefill instance is reachable\)"):
        await start
    assert tries == ["s1", "s1.1", "s1.2"] and not orch.reqs  # woken, it tries once more: still no P
    assert {k: orch.totals[k] for k in ("failed", "rejected", "recovered")} == {"failed": 1, "rejected": 0,
                                                                              "recovered": 0}


async def test_recovered_counts_requests_that_completed_after_a_new_attempt(orch):
    """``totals.recovered`` counts requests (once each) that completed after at least one new
    attempt; a recovered request its client then left is cancelled, not recovered (it counted 1
    per new attempt, whatever became of the request). ``totals.recoveries`` counts the new
    attempts."""
    from pdd.gateway.state import ABORT_CLIENT, ABORT_STOP

    left = relayed(orch)
    orch._new_attempt(left, "instance p0 is unreachable")
    orch._new_attempt(left, "instance p1 is unreachable")
    await orch.abort(left, ABORT_CLIENT)
    done = relayed(orch)
    done.rid = done.trid = "r2"
    orch.reqs = {"r2": done}
    orch._new_attempt(done, "instance md0 is unreachable")
    await orch.abort(done, ABORT_STOP)  # a stop string completed it at the gateway
    t = orch.totals
    assert {k: t[k] for k in ("completed", "cancelled", "recovered", "recoveries")} == \
        {"completed": 1, "cancelled": 1, "recovered": 1, "recoveries": 3}


async def test_a_sibling_choice_that_finds_no_instance_waits_with_its_first_choice(orch, monkeypatch):
    """The other choices of an ``n`` > 1 request start after choice 0 (its first token sampled);
    if the only MD (cross_dc_pd) or P dies in between, choice 0 recovers once the supervisor
    restarts it, so a choice finding no instance of the tier waits for it too instead of failing
    the whole request with a 503 (a new user: kill -9 md0 under four n=4 requests, two of them
    failed with 503 "no main_decode instance is reachable" 0.6 s in, the other two completed)."""
    from pdd.gateway import recovery
    from pdd.gateway.state import NoInstance

    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 0.0)
    tries = _launch_failing(monkeypatch, orch, 3, NoInstance("no main_decode instance is reachable"))
    first = ReqState("c0", 20, SamplingParams(max_tokens=4), trid="c0", prompt_ids=[5] * 20)
    st = await orch.start_request([5] * 20, SamplingParams(max_tokens=4), rid="c1", sibling_of=first, siblings=1)
    assert tries == ["c1", "c1.1", "c1.2", "c1.3"] and st.trid == "c1.3"


async def test_a_reservation_returning_after_its_p_died_is_booked_unreported(orch):
    """A plan booked after its P's loss was processed (a sibling choice's ``reserve {after}``
    waits on MD for choice 0's KV; P is killed meanwhile; the reply comes back when choice 0's
    old attempt is aborted there) is never reported by that P: it goes to
    ``wan_bytes_unreported`` at once, so the balance holds (a new user: kill -9 p0 in
    cross_dc_pd under four n=4 requests left wan_bytes 18.4 MB below wan_bytes_expected for
    good: six siblings' plans, superseded when their start failed, waited on a dead P)."""
    orch._in_b = lambda name: name.startswith("md")
    rep = {"md_cached_tokens": 0, "md_cached_pages": 0, "n_pages": 3, "prompt_tokens": 40, "page_size": 16,
           "page_bytes": 16 * 100}
    st = relayed(orch)
    st.pipeline = Pipeline.P_MD
    dead = orch.peers["p0"]
    orch._peer_closed("p0")
    dead.closed = True
    orch._reserved(st, "md0", rep, dead)
    t = orch.totals
    assert (t["wan_bytes_planned"], t["wan_bytes_unreported"], t["wan_bytes_expected"]) == (4000, 4000, 0)
    assert not orch.planned_wan and not orch.planned_src
    # a restarted p0 reconnected meanwhile: the old connection's P still never reports it
    orch.peers["p0"] = FakePeer()
    st2 = relayed(orch, rid="r2", trid="r2")
    orch._reserved(st2, "md0", rep, dead)
    assert (t["wan_bytes_unreported"], t["wan_bytes_expected"]) == (8000, 0) and not orch.planned_wan
    # the live connection books it as planned, to be reported by P's xfer_done
    orch._reserved(st2, "md0", rep)
    assert orch.planned_wan == {"r2": 4000} and t["wan_bytes_expected"] == 4000
    await orch.on_xfer_done(None, XferDone("r2", {"md0": 4000}, {}, {}).wire(), b"")
    assert t["wan_bytes_sent"] == t["wan_bytes_expected"] == 4000


async def test_md_kv_ready_read_before_p_s_reply_still_reaches_rld_decode(orch):
    """MD's kv_ready (its own connection) may be handled before P's prefill reply: the request
    is in prefill then, and P's reply moves it to rld_decode, not transfer."""
    st = relayed(orch)
    st.life = type(st.life)()  # back to queued: P's reply not read yet
    st.to(Phase.PREFILL)
    del st.events["prefilled"]
    await orch.on_kv_ready(orch.peers["md0"], KvReady("r1").wire(), b"")
    assert orch.phase(st) == "prefill" and st.handoff.kv_ready
    orch._prefilled(st)
    assert orch.phase(st) == "rld_decode"


async def test_kv_ready_after_the_request_ended_is_not_awaited_again(orch):
    """MD's kv_ready can come after a relayed request has ended at the client (RLD finished it)
    and left the request table, but before its settling ran. MD is told then to keep the prompt's
    KV; the settling must not wait for a kv_ready that has already come, or p0 and md0 would count
    one transfer in flight for ever (a drain or remove of md0 would never finish)."""
    orch.cfg.policy.cutoff = False  # the settling's wait path, whatever the transfer's remaining time
    st = relayed(orch)
    stream_to(st, 16)
    st.finished = True
    orch.reqs.pop(st.trid)  # the stream's end takes it out of the table first
    await orch.on_kv_ready(orch.peers["md0"], KvReady("r1").wire(), b"")
    assert [m["t"] for m in orch.peers["md0"].sent] == ["finish"]  # MD keeps the prompt's KV
    await orch._settle_relayed(st)
    # kv_landed keeps it (bounded): MD's reservation reply may still come (the test below)
    assert orch.awaiting_kv == {} and orch.kv_landed == {"r1": None}
    # without that kv_ready the settling waits for it (MD is told to keep the KV when it lands)
    st2 = relayed(orch, rid="r2", trid="r2")
    st2.finished = True
    orch.reqs.pop(st2.trid)
    await orch._settle_relayed(st2)
    assert orch.awaiting_kv == {"r2": ("p0", "md0")}


async def test_an_aborted_relayed_request_awaits_no_kv_ready(orch):
    """An abort drops the request on every tier (MD frees its reservation, keeps none of its KV),
    so no kv_ready will come for it. Whichever runs first, the abort or the stream's settling,
    nothing may wait for one: an entry left in ``awaiting_kv`` kept the topology busy for good
    (``kv_awaited`` in /pdd/stats; seen live after a client disconnect during prefill)."""
    from pdd.gateway.state import ABORT_CLIENT, ABORT_STOP

    orch.cfg.policy.cutoff = False  # the settling's wait path
    st = relayed(orch)  # settled first (its last token went out), then a stop string aborts it
    stream_to(st, 16)
    st.finished = True
    orch.reqs.pop(st.trid)
    await orch._settle_relayed(st)
    assert orch.awaiting_kv == {"r1": ("p0", "md0")}
    await orch.abort(st, ABORT_STOP)
    assert orch.awaiting_kv == {} and orch.kv_landed == {}
    assert "abort" in [m["t"] for m in orch.peers["md0"].sent]
    st2 = relayed(orch, rid="r2", trid="r2")  # aborted first (the client left), then the stream's end settles it
    await orch.abort(st2, ABORT_CLIENT)
    await orch._settle_relayed(st2)
    assert orch.awaiting_kv == {} and "finish" not in [m["t"] for m in orch.peers["md0"].sent]


async def test_a_kv_ready_never_coming_expires_and_drops_the_reservation_on_md(orch):
    """A finished relayed request awaited past ``request_timeout_s`` (its kv_ready lost on a path
    not foreseen) is forgotten, dropped on its MD and counted; the topology settles instead of
    awaiting it for good. One still in time, or whose kv_ready came, is left alone."""
    orch.cfg.policy.cutoff = False
    st = relayed(orch)
    stream_to(st, 16)
    st.finished = True
    orch.reqs.pop(st.trid)
    await orch._settle_relayed(st)
    deadline = orch.awaiting_kv_deadline["r1"]
    assert orch._expire_awaited_kv(deadline - 0.001) == [] and "r1" in orch.awaiting_kv
    assert orch._expire_awaited_kv(deadline) == ["r1"]
    await settle()
    assert orch.awaiting_kv == {} and orch.awaiting_kv_deadline == {}
    assert orch.totals["kv_awaited_expired"] == 1 and orch.peers["md0"].sent[-1]["t"] == "drop"
    st2 = relayed(orch, rid="r2", trid="r2")  # its kv_ready came: its deadline goes with it
    stream_to(st2, 16)
    st2.finished = True
    orch.reqs.pop(st2.trid)
    await orch._settle_relayed(st2)
    await orch.on_kv_ready(orch.peers["md0"], KvReady("r2").wire(), b"")
    assert orch._expire_awaited_kv(orch.awaiting_kv_deadline.get("r2", 0.0) + 1e9) == []
    assert orch.awaiting_kv_deadline == {} and orch.totals["kv_awaited_expired"] == 1


async def test_a_new_attempt_of_an_ended_request_does_not_enter_the_table_again(orch):
    """A recovery step (a full tier refused the new attempt, retried later) that runs after the
    request ended (its stream's end or an abort took it out of the table) must not put it back:
    the gateway would count a live request for good."""
    st = relayed(orch)
    st.finished = True
    orch.reqs.pop(st.trid)
    orch._new_attempt(st, "retried after its end", counted=False)
    assert st.trid not in orch.reqs and orch.reqs == {}


async def test_a_kv_ready_before_md_s_reservation_reply_is_not_awaited_again(orch):
    """With a predicted send, MD imports the frames that came before the reservation while it
    admits it, so its kv_ready can reach the gateway before its reservation reply. For a request
    RLD already finished, the reply (``_md_leg``) must not start awaiting a kv_ready that came:
    the entry stayed in ``awaiting_kv`` and kept the topology busy (``kv_awaited 1``; seen live
    with one-slot tiers, ``tests/api/test_overload_live.py``). Each order of the three events:
    kv_ready, the stream's settling, the reservation reply."""
    from pdd.transfer.messages import ReserveOk

    orch.cfg.policy.cutoff = False
    rep = ReserveOk("x", 32, 2, 3, 40, 16, 8192, "float32").wire()

    async def reply():
        return "md0", dict(rep)

    async def kv_ready(st):
        await orch.on_kv_ready(orch.peers["md0"], KvReady(st.trid).wire(), b"")

    async def stream_end(st):  # the stream's finally: out of the table, then the settling
        orch.reqs.pop(st.trid, None)
        await orch._settle_relayed(st)

    async def md_leg(st):
        await orch._md_leg(st, st.trid, reply(), orch.peers["p0"])

    orders = [(kv_ready, stream_end, md_leg), (stream_end, kv_ready, md_leg), (kv_ready, md_leg, stream_end),
              (stream_end, md_leg, kv_ready), (md_leg, kv_ready, stream_end), (md_leg, stream_end, kv_ready)]
    for i, order in enumerate(orders):
        st = relayed(orch, rid=f"r{i}", trid=f"r{i}")
        st.wan.predicted_pages = 2
        stream_to(st, 16)
        st.finished = True
        for step in order:
            await step(st)
        names = [f.__name__ for f in order]
        assert orch.awaiting_kv == {}, names
        assert [m["rid"] for m in orch.peers["md0"].sent if m["t"] == "finish"].count(st.trid) == 1, names


async def test_a_booking_of_no_bytes_after_p_s_report_awaits_no_transfer(orch):
    """MD's reservation reply can come after P reported the attempt's transfer (a predicted send
    MD received before its reservation): a reply that adds no bytes (no fill) must not open a
    planned transfer again, or ``transfers_pending`` stays 1 for good. One that adds bytes to a
    plan not yet reported adds to it."""
    st = relayed(orch)
    p = orch.peers["p0"]
    orch._book_wan(st, 4000, p)
    assert orch.planned_wan == {"r1": 4000}
    orch._book_wan(st, 0, p)
    assert orch.planned_wan == {"r1": 4000}
    await orch.on_xfer_done(None, XferDone("r1", {"md0": 4000}, {}, {}).wire(), b"")
    assert orch.planned_wan == {}
    orch._book_wan(st, 0, p)
    assert orch.planned_wan == {} and (await orch.stats())["transfers_pending"] == 0


async def test_an_early_handoff_that_finds_rld_finished_leaves_md_for_its_kv_ready(orch):
    """Early handoff (at the KV's predicted landing, before MD's kv_ready) that finds the request
    finished (RLD's reply ``finished``, or the stream's end first): MD must not be told to finish
    before its KV lands. A ``finish`` then released MD's reservation, so the KV found no request
    there and no kv_ready ever came, while the stream's settling awaited it: the request stayed in
    ``awaiting_kv`` (``kv_awaited 1``) until ``request_timeout_s`` (seen live: md_predicted_send
    false, short streamed requests, /work/meas/stress_gen.py). Each order of RLD's reply and the
    stream's settling; MD's kv_ready then ends the wait, and MD gets one finish (after it)."""
    orch._in_b = lambda name: name.startswith("md")
    orch.cfg.policy.cutoff = False
    orch.peers["rld0"] = HandoffPeer({"finished": True})
    for i, settle_first in enumerate((False, True)):
        trid = f"r{i}"
        st = relayed(orch, rid=trid, trid=trid)
        stream_to(st, 3)
        st.events["md_reserved"] = 0.0
        if settle_first:  # the stream ended (RLD's last token) before the early handoff started
            st.finished = True
            orch.reqs.pop(trid)
            await orch._settle_relayed(st)
            await orch._handoff(st)
        else:  # P reported the KV written: the early handoff asks RLD, which has just finished it
            await orch.on_xfer_done(None, XferDone(trid, {"md0": 4000}, {}, {}).wire(), b"")
            await settle()
            assert st.handoff.started and {"t": "handoff"} .items() <= orch.peers["rld0"].sent[-1].items()
            st.finished = True
            orch.reqs.pop(trid)
            await orch._settle_relayed(st)
        finishes = [m for m in orch.peers["md0"].sent if m["t"] == "finish" and m["rid"] == trid]
        assert finishes == [], (settle_first, "MD was told to finish before its KV landed")
        assert orch.awaiting_kv == {trid: ("p0", "md0")}
        await orch.on_kv_ready(orch.peers["md0"], KvReady(trid).wire(), b"")
        assert orch.awaiting_kv == {}
        finishes = [m for m in orch.peers["md0"].sent if m["t"] == "finish" and m["rid"] == trid]
        assert len(finishes) == 1
