"""A request's ``usage.pdd.wan_bytes`` is the sum over its attempts of what their P reported
(``xfer_done``), so it agrees with the gateway's totals after a recovery (a known bug: after
kill -9 of P mid-prefill the recovered request read ``wan_bytes: null`` while the totals counted
the bytes). Fake connections, no processes."""
import asyncio

from pdd.gateway.api import _pdd_summary
from pdd.gateway.orchestrator import ReqState
from pdd.gateway.phase import Phase
from pdd.transfer.messages import XferDone
from pdd.types import Pipeline, SamplingParams
from tests.gateway.fake_peer import fake_orchestrator

REP = {"md_cached_tokens": 0, "md_cached_pages": 0, "n_pages": 3, "prompt_tokens": 40, "page_size": 16,
       "page_bytes": 16 * 100}


def _orch():
    o = fake_orchestrator(instances={"prefill": 2, "relay_decode": 2, "main_decode": 2})
    o._in_b = lambda name: name.startswith("md")

    async def launch(st, prompt, sp=None, force_relay=False):
        return None

    o._launch = launch
    return o


def _relayed(o) -> ReqState:
    st = ReqState("r1", 40, SamplingParams(max_tokens=16), trid="r1", prompt_ids=[5] * 40)
    st.pipeline = Pipeline.P_RLD_MD
    st.names = {"prefill": "p0", "relay_decode": "rld0", "main_decode": "md0"}
    st.to(Phase.PREFILL)
    o.reqs[st.trid] = st
    return st


def test_p_killed_mid_prefill_then_the_new_attempt_reports():
    async def run():
        o = _orch()
        st = _relayed(o)
        o._reserved(st, "md0", REP)  # attempt r1 planned 4000 bytes from p0
        o._peer_closed("p0")  # kill -9 p0 mid-prefill: it never reports r1
        await asyncio.sleep(0)
        st.recovery.error = "instance p0 is unreachable"
        assert await o._recover(st) and st.trid == "r1.1"
        st.names = {"prefill": "p1", "relay_decode": "rld0", "main_decode": "md0"}
        o._reserved(st, "md0", REP)
        await o.on_xfer_done(o.peers["p1"], XferDone("r1.1", {"md0": 4000, "rld0": 4000}, {}, {}).wire(), b"")
        t = o.totals
        assert (t["wan_bytes_sent"], t["wan_bytes_expected"], t["wan_bytes_unreported"]) == (4000, 4000, 4000)
        assert st.wan.reported == 4000 and _pdd_summary(st)["wan_bytes"] == 4000
        # P's report is the request's xfer_done event (when its sockets took the KV's last byte)
        assert "xfer_done" in _pdd_summary(st)["events_ms"]

    asyncio.run(run())


def test_a_replaced_attempts_late_report_is_added_to_the_request():
    async def run():
        o = _orch()
        st = _relayed(o)
        o._reserved(st, "md0", REP)
        st.recovery.error = "instance md0 is unreachable"
        assert await o._recover(st)  # r1 replaced by r1.1; p0 still reports r1 later
        st.names = {"prefill": "p0", "relay_decode": "rld1", "main_decode": "md1"}
        o._reserved(st, "md1", REP)
        await o.on_xfer_done(None, XferDone("r1.1", {"md1": 4000}, {}, {}).wire(), b"")
        await o.on_xfer_done(None, XferDone("r1", {"md0": 1500}, {"md0": 2500}, {"md0": "connection lost"}).wire(),
                             b"")
        assert o.totals["wan_bytes_sent"] == 5500 == st.wan.reported
        assert _pdd_summary(st)["wan_bytes"] == 5500
        assert st.recovery.error is None and st.trid == "r1.1"  # the old attempt's error is not this one's
        ev = _pdd_summary(st)["events_ms"]  # this attempt's report is its xfer_done; the replaced one's
        assert "xfer_done" in ev and not any(k.startswith("xfer_done@") for k in ev)  # late report is none

    asyncio.run(run())


def test_request_of_attempt_matches_only_earlier_attempts_of_that_rid():
    o = _orch()
    st = _relayed(o)
    st.attempt, st.trid = 2, "r1.2"
    o.reqs = {"r1.2": st}
    assert o._request_of_attempt("r1") is st and o._request_of_attempt("r1.1") is st
    assert o._request_of_attempt("r1.2") is None and o._request_of_attempt("r1.3") is None
    assert o._request_of_attempt("r10") is None and o._request_of_attempt("r1.x") is None
