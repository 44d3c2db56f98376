"""RLD lost in the middle of a handoff: every order of its loss, its final round's reply and the
tokens it streamed ends the client's stream (MD goes on from the right position) or recovers it,
never a stall until ``request_timeout_s``.

Found live (1 run in 7: six streams, ``kill -9`` of RLD 0.6 s in, two requests in phase handoff
stopped after a few tokens until the client's read timeout). RLD writes its tokens ahead of the
final round's reply, but the gateway's connection (:class:`pdd.transfer.peer.Peer`) resolves a
reply as it reads it and hands one-way messages (tokens) to their handler through a queue: when
the reply, the tokens before it and the connection's end are read together, the handoff goes on
with the reply (MD decodes from ``md_start``) while the close drops the queued tokens. RLD's loss
was then ignored ("MD has the final handoff"), and positions below ``md_start`` never came. The
first test drives that order through a real ``Peer`` (its reader fed by the test, so the order
is forced); the others drive the orchestrator's handlers with fake connections. No processes,
no sleeps: each step waits on what it needs."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState, TokenOut
from pdd.transfer import wire
from pdd.transfer.messages import HandoffOk, Tok
from pdd.transfer.peer import Peer
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import FakePeer, SocketWriter, consume, fake_orchestrator

BOUND_S = 10.0  # how long a step may take before the test calls it a stall (the request timeout is 300 s)
RLD_IDS = [100, 101, 102, 103, 104]  # RLD's outputs at its final round; the client has the first 3


def _frame(header: dict) -> bytes:
    return b"".join(bytes(b) for b in wire.encode_frame(header))


def _orch(**config):
    o = fake_orchestrator(**config)
    o.peers["md0"] = FakePeer()  # MD: records what it is sent
    return o


def _relaying(o, logprobs=None) -> ReqState:
    """A relayed request RLD decodes (3 tokens streamed), MD holds its KV, no handoff yet."""
    st = ReqState("r1", 40, SamplingParams(max_tokens=16, logprobs=logprobs), trid="r1", prompt_ids=[5] * 40,
                  pipeline=Pipeline.P_RLD_MD)
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    for ph in (Phase.PREFILL, Phase.TRANSFER, Phase.RLD_DECODE):
        st.to(ph)
    st.next_pos, st.emitted = 3, RLD_IDS[:3]
    st.handoff.kv_ready = True
    st.events["md_reserved"] = 0.0
    o.reqs[st.trid] = st
    return st


def _md_streams(o, first: int, ids: list[int]) -> None:
    """MD's tokens (positions ``first`` on), as its connection's handler delivers them; the last ends it."""
    for i, tid in enumerate(ids):
        o._tok(Tok("r1", first + i, tid, "length" if i == len(ids) - 1 else None, "md"))


async def _ends(task: asyncio.Task, st: ReqState, what: str) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(task), BOUND_S)
    except asyncio.TimeoutError:
        task.cancel()
        pytest.fail(f"the stream stalled at position {st.next_pos} ({what})")


def _final_rld() -> FakePeer:
    class RLD(FakePeer):
        async def call(self, h, payload=b"", timeout=None):
            self.sent.append(dict(h))
            return HandoffOk("r1", False, RLD_IDS, "one_shot", True).wire(), b""
    return RLD()


async def test_final_reply_read_with_rld_s_end_streams_its_dropped_tokens_from_the_reply():
    """The reply overtakes RLD's tokens 3 and 4 and the connection ends in the same read: the
    close drops the queued tokens. The stream goes on: 3 and 4 from the final round's ids, then
    MD's from 5; MD is extended once, with RLD's 5 ids; no takeover, no recovery."""
    o = _orch()
    st = _relaying(o)
    reader, writer = asyncio.StreamReader(), SocketWriter()
    rld = Peer(reader, writer, o.handlers(), name="rld0")
    rld.on_close(lambda p: o._peer_closed("rld0", p))
    o.peers["rld0"] = rld
    rld.start()
    consumer, got = consume(o, st)
    handoff = asyncio.get_running_loop().create_task(o._handoff(st))
    call, _ = await asyncio.wait_for(wire.read_frame(writer.out), BOUND_S)  # the gateway asks RLD for its ids
    assert call["t"] == "handoff" and call["rid"] == "r1" and o.phase(st) == "handoff"
    # RLD's reply and the tokens written ahead of it, then its end, all read in one go
    reader.feed_data(_frame(Tok("r1", 3, 103, None, "rld").wire()))
    reader.feed_data(_frame(Tok("r1", 4, 104, None, "rld").wire()))
    reader.feed_data(_frame({**HandoffOk("r1", False, RLD_IDS, "one_shot", True).wire(),
                             "cid": call["cid"], "reply": True}))
    reader.feed_eof()
    await asyncio.wait_for(o.peers["md0"].seen("extend").wait(), BOUND_S)
    await handoff
    assert st.handoff.md_start == 5 and rld.closed
    _md_streams(o, 5, [105, 106, 107])
    await _ends(consumer, st, "MD from 5")
    assert got == [(3, 103, "rld"), (4, 104, "rld"), (5, 105, "md"), (6, 106, "md"), (7, 107, "md")]
    assert st.emitted == RLD_IDS + [105, 106, 107] and st.handoff.switch_pos == 5
    assert o.peers["md0"].of("extend") == [{"t": "extend", "rid": "r1", "token_ids": RLD_IDS, "final": True}]
    assert o.totals.get("takeovers", 0) == 0 and o.totals["recovered"] == 0 and o.totals["completed"] == 1


async def test_rld_lost_after_its_final_round_fills_only_the_positions_not_queued():
    """RLD's loss seen after the final round's extend went out: token 3 reached the stream's
    queue before the loss, 4 did not. 3 is streamed as RLD sent it (the reply's copy of it is
    ignored), 4 comes from the reply, MD goes on from 5."""
    o = _orch()
    st = _relaying(o)
    o.peers["rld0"] = _final_rld()
    await o._handoff(st)
    assert st.handoff.md_start == 5 and len(o.peers["md0"].of("extend")) == 1
    o._tok(Tok("r1", 3, 103, None, "rld", lp={"lp": -0.5, "top": []}))
    o.peers["rld0"].closed = True
    o._peer_closed("rld0")
    consumer, got = consume(o, st)
    _md_streams(o, 5, [105, 106])
    await _ends(consumer, st, "MD from 5")
    assert got == [(3, 103, "rld"), (4, 104, "rld"), (5, 105, "md"), (6, 106, "md")]
    assert not st.recovery.lost and st.attempt == 0


async def test_rld_lost_after_its_final_round_recovers_a_request_that_asked_for_logprobs():
    """The final round's ids carry no logprobs: a request that asked for them is recovered (a
    new attempt from position 3) rather than streamed without them."""
    o = _orch()
    st = _relaying(o, logprobs=1)
    o.peers["rld0"] = _final_rld()
    await o._handoff(st)
    o.peers["rld0"].closed = True
    o._peer_closed("rld0")
    assert st.recovery.lost and st.recovery.error == "instance rld0 is unreachable (connection lost)"
    assert st.queue.get_nowait() is None  # the stream wakes and recovers


async def test_takeover_does_not_stream_rld_s_tokens_queued_past_where_md_starts():
    """RLD lost before its reply (MD takes over from the 3 streamed ids) while its tokens 3 and 4
    were queued for the stream: MD makes positions 3 on. Streaming RLD's 3 and 4 made MD's 3 a
    check against them, and a differing token (a near-tie on MD's recomputed KV, or a sampled
    draw) dropped MD for RLD to finish the request: RLD was gone, and the stream stalled."""
    o = _orch()
    st = _relaying(o)
    o.peers["rld0"].closed = True
    o._tok(Tok("r1", 3, 103, None, "rld"))
    o._tok(Tok("r1", 4, 104, None, "rld"))
    o._peer_closed("rld0")
    await asyncio.wait_for(o.peers["md0"].seen("extend").wait(), BOUND_S)
    assert st.handoff.takeover and st.handoff.md_start == 3
    assert o.peers["md0"].of("extend") == [{"t": "extend", "rid": "r1", "token_ids": RLD_IDS[:3], "final": True}]
    consumer, got = consume(o, st)
    _md_streams(o, 3, [203, 204, 205])
    await _ends(consumer, st, "MD from 3")
    assert got == [(3, 203, "md"), (4, 204, "md"), (5, 205, "md")]
    assert st.handoff.switch_pos == 3 and not st.handoff.md_diverged
    assert not [h for h in o.peers["md0"].sent if h.get("t") == "drop"]
    assert o.totals["takeovers"] == 1 and o.totals.get("md_diverged", 0) == 0


async def test_md_diverged_with_rld_lost_recovers_in_either_order():
    """Catch-up: MD's token differed from one streamed, so RLD was to finish the request. RLD
    lost then (or before MD's differing token came, after the final round): nobody would stream
    again. The request is recovered."""
    o = _orch()
    st = _relaying(o)
    st.handoff.md_start, st.handoff.mode, st.handoff.md_diverged = 3, "catch_up", True
    st.handoff.final_ids = RLD_IDS[:3]
    st.to(Phase.HANDOFF)
    o.peers["rld0"].closed = True
    o._peer_closed("rld0")
    assert st.recovery.lost  # RLD was lost after MD's tokens differed
    st2 = _relaying(o)
    st2.rid = st2.trid = "r2"
    o.reqs["r2"] = st2
    st2.handoff.md_start, st2.handoff.mode, st2.handoff.final_ids = 3, "catch_up", RLD_IDS[:3]
    st2.to(Phase.HANDOFF)
    o._tok(Tok("r2", 3, 103, None, "rld"))  # RLD streamed on past the final round (catch-up), then was lost
    o._peer_closed("rld0")
    assert not st2.recovery.lost and st2.handoff.rld_lost
    assert [t.token_id for t in o._next_tokens(st2, st2.queue.get_nowait())] == [103]
    assert st2.queue.empty()  # nothing below md_start was missing
    assert o._next_tokens(st2, TokenOut(3, 203, "md", None)) == []  # MD's 3 differs from RLD's
    assert st2.handoff.md_diverged and st2.recovery.lost
    assert st2.recovery.error == "MD's token at 3 differs from the one streamed and RLD is lost"
    assert not [h for h in o.peers["md0"].sent if h.get("t") == "drop"]  # the recovery aborts it everywhere
