"""A handoff round whose call to RLD fails because RLD's connection ended decides the request's
recovery only once that connection's drain is over: the one-way messages the gateway read before
the end (RLD's last tokens) are handed to their handlers first (:class:`pdd.transfer.peer.Peer`,
module doc "Close"), so the recovery sees them, and the loss is declared once, by the close's
report (``Orchestrator._peer_closed``), not a second time by the handoff.

Before, ``Handoffs._handoff`` declared RLD lost as soon as ``peer.closed`` turned true, while RLD's
last token still waited in the connection's queue: the new attempt started from the position
before it (the token was dropped with the old attempt's queue), and MD's takeover from the ids
before it.

RLD's connection is a real ``Peer`` whose reader the test feeds (its handoff call, then a token
frame, then the end); the gateway's handler of that token is held on an event (a dispatcher
still busy when the connection ends), so the handoff's call fails while the drain is under way.
P and MD are fake connections. No processes, no sleeps: each step waits on what it needs."""

from __future__ import annotations

import asyncio

import pytest

from pdd.gateway.phase import Phase
from pdd.gateway.state import ReqState
from pdd.transfer import wire
from pdd.transfer.messages import Tok
from pdd.transfer.peer import Peer
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import SocketWriter, consume, fake_orchestrator

BOUND_S = 10.0  # how long a step may take before the test calls it a stall
TURNS = 50  # loop turns (no clock) given to a handoff that would decide without waiting for the drain
PROMPT = [5] * 40
STREAMED = [100, 101, 102]  # RLD's outputs the client has; RLD's next one (103) is in its last frame


def _relaying(o, kv_ready: bool) -> ReqState:
    """A relayed request RLD decodes (3 tokens streamed); MD holds its KV or not yet."""
    st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=list(PROMPT),
                  pipeline=Pipeline.P_RLD_MD)
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    for ph in (Phase.PREFILL, Phase.TRANSFER, Phase.RLD_DECODE):
        st.to(ph)
    st.next_pos, st.emitted = 3, list(STREAMED)
    st.handoff.kv_ready = kv_ready
    st.events["md_reserved"] = 0.0
    o.reqs[st.trid] = st
    return st


class Rld:
    """RLD's connection to the gateway: a real Peer with the gateway's handlers, whose handling
    of RLD's token frames waits for ``release`` (``held`` is set once the first one is held)."""

    def __init__(self, o):
        self.reader, self.writer = asyncio.StreamReader(), SocketWriter()
        self.peer = Peer(self.reader, self.writer, o.handlers(), name="rld0", drain_timeout_s=3600)
        self.held, self.release = asyncio.Event(), asyncio.Event()
        on_tok = o.on_tok

        async def held_tok(p, h, payload):
            self.held.set()
            await self.release.wait()
            return await on_tok(p, h, payload)

        self.peer.on("tok", held_tok)
        self.peer.on_close(lambda p: o._peer_closed("rld0", p))  # as Orchestrator._connect registers it
        o.peers["rld0"] = self.peer
        self.peer.start()

    async def dies_during_the_handoff_call(self) -> None:
        """RLD gets the handoff call, sends its next token (103 at position 3) and dies; the
        gateway reads both, its token handler held: the call fails while the connection drains."""
        call, _ = await asyncio.wait_for(wire.read_frame(self.writer.out), BOUND_S)
        assert call["t"] == "handoff" and call["rid"] == "r1"
        self.reader.feed_data(wire.frame_bytes(Tok("r1", 3, 103, None, "rld").wire()))
        self.reader.feed_eof()
        await asyncio.wait_for(self.held.wait(), BOUND_S)
        await asyncio.wait_for(asyncio.shield(self.peer._reader_task), BOUND_S)  # it read the end
        assert self.peer.closed and self.peer.draining


def _count_losses(o) -> list:
    """Record every ``_instance_lost(st, name, ...)`` as (rid, name)."""
    calls: list = []
    real = o._instance_lost

    def spy(st, name, reason, asked=False):
        calls.append((st.rid, name))
        return real(st, name, reason, asked)

    o._instance_lost = spy
    return calls


async def _turns(n: int = TURNS) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _ends(task: asyncio.Task, st: ReqState) -> None:
    try:
        await asyncio.wait_for(asyncio.shield(task), BOUND_S)
    except asyncio.TimeoutError:
        task.cancel()
        pytest.fail(f"the stream stalled at position {st.next_pos}")


async def test_a_new_attempt_after_a_failed_handoff_call_starts_after_rld_s_drained_token():
    """Early handoff (MD's KV not landed): RLD lost during the call means a new attempt. It
    starts after RLD's drained token 103: the client gets 103 at position 3, the new attempt's
    prompt ends with it and it goes on at position 4. The loss is declared once; the old attempt
    is aborted on every instance still connected (P and MD free its pages; RLD's died with it)."""
    o = fake_orchestrator(policy={"early_handoff": True})
    launched: list = []
    started = asyncio.Event()

    async def launch(st, prompt, sp=None, force_relay=False):
        launched.append((st.trid, list(prompt), sp.max_tokens, force_relay))
        started.set()

    o._launch = launch
    losses = _count_losses(o)
    st = _relaying(o, kv_ready=False)
    st.handoff.early = True
    rld = Rld(o)
    consumer, got = consume(o, st)
    handoff = asyncio.get_running_loop().create_task(o._handoff(st))
    await rld.dies_during_the_handoff_call()
    await _turns()
    # the call failed, but nothing is decided while RLD's last token is still being handled
    assert not handoff.done() and not st.recovery.lost and losses == [] and got == []
    rld.release.set()
    await asyncio.wait_for(asyncio.shield(handoff), BOUND_S)
    await asyncio.wait_for(started.wait(), BOUND_S)
    assert losses == [("r1", "rld0")]  # by the close's report only
    assert launched == [("r1.1", PROMPT + STREAMED + [103], 16 - 4, True)]
    assert st.trid == "r1.1" and st.base == 4 and st.next_pos == 4
    assert [(r["attempt"], r["pos"], r["reason"]) for r in st.recovery.recoveries] == \
        [(0, 4, "instance rld0 is unreachable (connection lost)")]
    assert o.totals["recoveries"] == 1 and o.totals["instances_lost"] == 1 and o.totals["recovered"] == 0
    o._tok(Tok("r1.1", 0, 104, "length", "rld"))  # the new attempt's first output, at position 4
    await _ends(consumer, st)
    assert got == [(3, 103, "rld"), (4, 104, "rld")]
    assert (o.totals["completed"], o.totals["recovered"]) == (1, 1)  # a request that completed after a new attempt
    assert st.emitted == STREAMED + [103, 104]
    for name in ("p0", "md0"):
        await asyncio.wait_for(o.peers[name].seen("abort").wait(), BOUND_S)
        assert o.peers[name].of("abort") == [{"t": "abort", "rid": "r1"}], name


async def test_md_takes_over_after_rld_s_drained_token_and_the_loss_is_declared_once():
    """MD holds the KV, no round answered: RLD lost during the call means MD takes over from
    the ids streamed. It does so once RLD's drained token 103 reached the stream: MD is extended
    once with the 4 ids and makes position 4 on. The loss is declared once (the handoff does not
    declare it again after the close's report did). (The takeover reads the ids the stream has
    taken from its queue when its task runs: the drained token wakes the stream before the
    drain's end runs ``_peer_closed``, which spawns that task. Without the stream consuming,
    MD would start at 3 and RLD's 103, still queued, would not be streamed.)"""
    o = fake_orchestrator()
    losses = _count_losses(o)
    st = _relaying(o, kv_ready=True)
    rld = Rld(o)
    consumer, got = consume(o, st)
    handoff = asyncio.get_running_loop().create_task(o._handoff(st))
    await rld.dies_during_the_handoff_call()
    await _turns()
    assert not handoff.done() and not st.handoff.takeover and losses == []
    assert o.peers["md0"].of("extend") == []
    rld.release.set()
    await asyncio.wait_for(asyncio.shield(handoff), BOUND_S)
    await asyncio.wait_for(o.peers["md0"].seen("extend").wait(), BOUND_S)
    assert losses == [("r1", "rld0")]
    assert o.peers["md0"].of("extend") == [{"t": "extend", "rid": "r1", "token_ids": STREAMED + [103],
                                            "final": True}]
    assert st.handoff.takeover and st.handoff.md_start == 4 and o.totals["takeovers"] == 1
    for i, tid in enumerate([204, 205]):  # MD's tokens from position 4; the last ends the request
        o._tok(Tok("r1", 4 + i, tid, "length" if i == 1 else None, "md"))
    await _ends(consumer, st)
    assert got == [(3, 103, "rld"), (4, 204, "md"), (5, 205, "md")]
    assert not st.recovery.lost and st.attempt == 0 and o.totals["recovered"] == 0
