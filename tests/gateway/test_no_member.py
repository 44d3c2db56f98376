"""A role with no instance in service (every one removed by the operator) fails a request at once
with a 503 naming the role, instead of the recovery wait (``RECOVERY_WAIT_S``) meant for a crashed
instance or a full tier; a recovery that does wait ends on a topology change (an instance added,
removed or reconnected), not at its next retry tick. Real orchestrator and membership over fake
connections; the retry tick is an hour here, so only an event can end a wait, and each test
checks, by loop turns and never by a clock, that it did."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdd.gateway import recovery
from pdd.gateway.phase import Phase
from pdd.gateway.state import NoMember, ReqState, RequestFailed
from pdd.policy.membership import REMOVED
from pdd.topology import ROLE_PREFILL
from pdd.types import Pipeline, SamplingParams
from tests.gateway.test_membership import PoolPeer, _setup

TURNS = 50  # loop turns a woken recovery gets to finish (no clock: it has nothing else to wait for)


@pytest.fixture(autouse=True)
def retry_tick_of_an_hour(monkeypatch):
    monkeypatch.setattr(recovery, "RECOVERY_RETRY_S", 3600.0)


async def _turns(task: asyncio.Task) -> bool:
    """Whether ``task`` finishes within TURNS turns of the event loop."""
    for _ in range(TURNS):
        if task.done():
            return True
        await asyncio.sleep(0)
    return task.done()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _p_down(o, up: set):
    """Connections as ``_setup``'s, but an instance not in ``up`` refuses (a crashed P is
    reconnected only once it is in ``up``)."""

    async def connect(name, retries):
        if name.startswith("p") and name not in up:
            raise ConnectionRefusedError(name)
        return PoolPeer(held=0)

    o._connect = connect


async def test_a_request_mid_prefill_fails_at_once_when_the_only_p_is_removed():
    """``DELETE /pdd/instances/p0?force=true`` while a request prefills on the only P: its prefill
    call fails as the connection closes, and its restart found no P: it waited the whole recovery
    wait (30 s) for a P that is not coming back before its 503. It fails at once now, naming the
    role; nothing waits."""
    o, ms, _ = _setup(standby=())
    waits = []
    o._retry_later = lambda *a: waits.append(a) or asyncio.sleep(3600)
    closed = asyncio.Event()
    p0 = o.peers["p0"]
    close0 = p0.close

    async def close():
        await close0()
        closed.set()  # the real connection fails its pending calls here

    p0.close = close
    real_launch = o._launch
    prefilling = asyncio.Event()

    async def launch(st, prompt, sp=None, force_relay=False):
        if st.attempt == 0:  # routed to p0, its prefill call pending there
            st.names[ROLE_PREFILL] = await o._route(ROLE_PREFILL, prompt)
            o._assign(st, ROLE_PREFILL)
            prefilling.set()
            await closed.wait()
            raise ConnectionError("connection to p0 is closed (connection closed locally)")
        await real_launch(st, prompt, sp, force_relay)

    o._launch = launch
    start = asyncio.ensure_future(o.start_request([5] * 40, SamplingParams(max_tokens=4), rid="s1"))
    await prefilling.wait()
    rep = await ms.remove("p0", force=True)
    assert (rep["state"], rep["forced"]) == (REMOVED, True)
    finished = await _turns(start)
    if not finished:
        await _cancel(start)
    assert finished and waits == []
    with pytest.raises(RequestFailed) as ei:
        start.result()
    assert isinstance(ei.value.__cause__, NoMember)
    assert str(ei.value) == ("request s1 failed while starting: no prefill instance is in service (p0 removed): "
                             "every one was removed or drained, and none serves again until an operator adds one "
                             "(POST /pdd/instances)")
    assert o.totals["failed"] == 1 and not o.reqs


def _lost_stream(o) -> ReqState:
    """A relayed request that streamed 3 tokens and lost its P (its stream recovers it)."""
    st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=[5] * 40)
    st.pipeline = Pipeline.P_RLD_MD
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    st.to(Phase.PREFILL)
    o._prefilled(st)
    st.emitted, st.next_pos = [100, 101, 102], 3
    st.recovery.error = "instance p0 is unreachable (connection lost)"
    o.reqs[st.trid] = st
    return st


def _launch_on_p(o) -> list:
    """``o._launch`` routes P (the real routing: NoInstance / NoMember) and starts there; returns
    the P of each attempt that started."""
    started = []

    async def launch(st, prompt, sp=None, force_relay=False):
        started.append(await o._route(ROLE_PREFILL, prompt))

    o._launch = launch
    return started


async def _waiting_recovery(o):
    """The only P (p0) crashed; a request's recovery waits for a P. Returns its task once it waits."""
    o.peers["p0"].closed = True
    st = _lost_stream(o)
    task = asyncio.ensure_future(o._recover(st))
    for _ in range(TURNS):  # to its first failed try and into the wait
        await asyncio.sleep(0)
    assert not task.done() and st.attempt == 2  # tried once (NoInstance), waiting with the next attempt
    return st, task


async def test_a_waiting_recovery_uses_a_p_the_operator_adds():
    """The only P crashed: a recovery waits (up to RECOVERY_WAIT_S) for it; a P the operator adds
    meanwhile takes it at once, not at the next retry tick."""
    o, ms, _ = _setup(standby=("p1",), prefill=2)
    _p_down(o, up={"p1"})
    started = _launch_on_p(o)
    st, task = await _waiting_recovery(o)
    await ms.add("prefill", name="p1")
    finished = await _turns(task)
    if not finished:
        await _cancel(task)
    assert finished and task.result() is True
    assert started == ["p1"] and st.trid == "r1.2" and o.totals["recoveries"] == 1


async def test_a_waiting_recovery_fails_at_once_when_the_p_it_waits_for_is_removed():
    """The only P crashed and a recovery waits for its restart; the operator removes it (it will
    not come back): the recovery fails now, naming the role, instead of waiting out the 30 s."""
    o, ms, _ = _setup(standby=())
    _p_down(o, up=set())
    started = _launch_on_p(o)
    st, task = await _waiting_recovery(o)
    rep = await ms.remove("p0", force=True)
    # nothing in flight there: force only lifted the "last active" refusal (docs/SERVE.md)
    assert rep["state"] == REMOVED and rep["forced"] is False
    finished = await _turns(task)
    if not finished:
        await _cancel(task)
    assert finished and task.result() is False and started == []
    assert st.recovery.error.startswith("recovery failed: no prefill instance is in service (p0 removed)")


async def test_a_waiting_recovery_goes_on_when_its_crashed_p_reconnects():
    """A crashed P back (its supervisor restarted it; the gateway reconnected it) ends the wait
    at once too; the wait itself is kept for a crashed instance."""
    o, ms, _ = _setup(standby=())
    up: set = set()
    _p_down(o, up)
    started = _launch_on_p(o)
    st, task = await _waiting_recovery(o)
    up.add("p0")
    await o._reconnect("p0")
    finished = await _turns(task)
    if not finished:
        await _cancel(task)
    assert finished and task.result() is True and started == ["p0"]


async def test_a_new_request_with_no_p_in_service_gets_a_503_naming_the_role():
    """It got a 503 at once already, but read "no prefill instance is reachable", as if P were down
    and coming back."""
    from pdd.gateway.api import create_app

    class Tok:
        def get_vocab_size(self, with_added_tokens=True):
            return 256

    o, ms, _ = _setup(standby=())
    app = create_app(o.cfg, o, Tok())
    await ms.remove("p0", force=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("server_error", None, None)
    assert err["message"].endswith("failed while starting: no prefill instance is in service (p0 removed): every one "
                                   "was removed or drained, and none serves again until an operator adds one "
                                   "(POST /pdd/instances)")

