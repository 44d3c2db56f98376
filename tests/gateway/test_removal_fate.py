"""``prefix_cache.fate`` of a removed instance says what really happened to its pages, from what
the gateway knows: whether it was connected, whether the instance confirmed it had freed the
pages of the requests it aborted (``wait_idle`` answered), and whether the gateway started the
process (and so stops it). A frozen (SIGSTOPped) instance force-removed was said to have "freed
the pages ... itself as the gateway's connection closed", though a stopped process frees nothing
until it is resumed (it gets SIGTERM then SIGCONT only if the gateway started it)."""

from __future__ import annotations

import asyncio
import types

from pdd.gateway.membership import Membership
from pdd.policy.membership import REMOVED
from tests.gateway.test_removal_flush import _silent_instance

INDEX = "the gateway's prefix index of it is forgotten, so routing counts no hits there"
STOPPED = ("the gateway stops the process it started (SIGTERM, then SIGCONT so that a frozen one runs its clean "
           "stop too; SIGKILL if it has not exited 10 s later), and its pages go with it")
KEPT = ("the gateway did not start its process and does not stop it: running, or frozen (SIGSTOP) until it is "
        "resumed, it keeps them (stop it yourself)")
ERR = "TimeoutError: instance md1 did not answer a new connection within 5 s (liveness.dead_after_s)"
fate = Membership._removal_fate


def test_not_connected_and_started_by_the_gateway():
    assert fate({"flushed": False}, False, {"requests": 1, "transfers": 0}, started=True) == (
        "not flushed: the gateway was not connected to the instance (its connection lost: the instance dead, "
        "frozen or cut off), so it neither flushed its cache nor learned its pages; " + STOPPED + "; " + INDEX)


def test_not_connected_and_not_started_by_the_gateway():
    assert fate({"flushed": False}, False, {"requests": 0, "transfers": 0}) == (
        "not flushed: the gateway was not connected to the instance (its connection lost: the instance dead, "
        "frozen or cut off), so it neither flushed its cache nor learned its pages; the gateway did not start its "
        "process and does not stop it: one that died took its pages with it, one restarted since started empty, "
        "one still running, or frozen (SIGSTOP) until it is resumed, keeps them (stop it yourself); " + INDEX)


def test_flush_failed_with_requests_whose_freeing_was_not_confirmed():
    """The frozen instance force-removed while still connected: the fresh connection is never
    answered, so nothing confirms the requests' pages were freed."""
    assert fate({"flushed": False, "error": ERR}, True, {"requests": 2, "transfers": 1}, started=True) == (
        f"not flushed: the flush failed ({ERR}); the gateway closed its connection, on which the instance aborts "
        "the 2 request(s) and 1 KV transfer(s) in flight there and frees their pages once it reads that close, "
        "which it did not confirm (a frozen instance frees nothing until it is resumed); its cache pages are "
        "unknown here: " + STOPPED + "; " + INDEX)


def test_flush_failed_with_requests_whose_freeing_was_confirmed():
    err = "RuntimeError: flush refused"
    assert fate({"flushed": False, "error": err}, True, {"requests": 1, "transfers": 0}, freed=True) == (
        f"not flushed: the flush failed ({err}); the instance said it had aborted the 1 request(s) in flight there "
        "and freed their pages (the gateway closed its connection first); its cache pages are unknown here: "
        + KEPT + "; " + INDEX)


def test_flush_failed_with_nothing_in_flight():
    err = "TimeoutError: stats"
    assert fate({"flushed": False, "error": err}, True, {"requests": 0, "transfers": 0}, started=True) == (
        f"not flushed: the flush failed ({err}); its cache pages are unknown here: " + STOPPED + "; " + INDEX)


def test_flushed_but_not_again_after_late_requests():
    assert fate({"flushed": True, "error": ERR}, True, {"requests": 1, "transfers": 0}) == (
        f"flushed, but not again after the 1 request(s) that reached it during that flush ({ERR}): the gateway "
        "closed its connection, on which the instance aborts them and frees their pages once it reads that close, "
        "which it did not confirm (a frozen instance frees nothing until it is resumed); the cache pages they "
        "held are unknown here: " + KEPT + "; " + INDEX)


def test_a_frozen_instance_the_gateway_started_force_removed():
    """End to end on the membership: md1 stopped (it answers nothing), started by the gateway,
    with a request in flight, force-removed before its heartbeat found it dead."""
    o, ms, inst, conn, tries = _silent_instance(dead_after_s=0.01)
    inst.admit("r1", 3, sorted(inst.cache)[:2], conn)
    conn.close = _closed(conn)  # frozen: it reads no close, so it aborts nothing
    o.inflight["md1"] = 1
    ms.members["md1"].proc = types.SimpleNamespace(pid=-1, poll=lambda: None)
    stopped = []
    ms._kill = stopped.append
    rep = asyncio.run(asyncio.wait_for(ms.remove("md1", force=True), 30))  # a guard
    assert (rep["state"], rep["forced"], rep["leaked_pages"]) == (REMOVED, True, None)
    err = ERR.replace("5 s", "0.01 s")
    assert rep["prefix_cache"]["fate"] == (
        f"not flushed: the flush failed ({err}); the gateway closed its connection, on which the instance aborts "
        "the 1 request(s) in flight there and frees their pages once it reads that close, which it did not "
        "confirm (a frozen instance frees nothing until it is resumed); its cache pages are unknown here: "
        + STOPPED + "; " + INDEX)
    assert len(stopped) == 1 and "r1" in inst.reqs  # nothing was freed: it is stopped as it is


def _closed(conn):
    async def close():
        conn.closed = True
    return close
