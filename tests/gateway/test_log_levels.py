"""The level of the gateway's operator log lines: a routine event (an instance added, drained,
removed or re-roled as asked, one the gateway started, a clean shutdown drain, an autoscale
decision) is INFO; a refusal, a failure, a timeout running out, requests ended with an error or
work left pending stay WARNING. Every one of these was a WARNING, so a healthy gateway's log at
``--log-level WARNING`` was full of routine membership and autoscale lines."""

from __future__ import annotations

import asyncio
import logging
import threading
import types

from pdd.gateway.membership import Membership
from pdd.gateway.shutdown import Drain
from tests.gateway.fake_peer import fake_orchestrator
from tests.gateway.test_autoscale import make as make_autoscaler
from tests.gateway.test_membership import _rerole_setup, _setup

INFO, WARNING = logging.INFO, logging.WARNING


def _levels(caplog, logger: str, prefix: str) -> list[tuple[int, str]]:
    """(level, the message's first word after ``prefix``) of each record of ``logger`` whose
    message starts with ``prefix``."""
    return [(r.levelno, r.getMessage()[len(prefix):].split()[0]) for r in caplog.records
            if r.name == logger and r.getMessage().startswith(prefix)]


def _ops(caplog) -> list[tuple[int, str]]:
    """(level, op) of each ``membership: {event}`` line."""
    import json

    return [(r.levelno, json.loads(r.getMessage()[len("membership: "):])["op"]) for r in caplog.records
            if r.name == "pdd.gateway.membership" and r.getMessage().startswith("membership: {")]


def test_add_drain_and_remove_as_asked_are_info(caplog):
    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup()

    async def run():
        await ms.add("main_decode", "md1")
        await ms.drain("md0")
        await ms.remove("md0")

    asyncio.run(run())
    assert _ops(caplog) == [(INFO, "add"), (INFO, "drain"), (INFO, "remove")]


def test_a_forced_removal_whose_requests_were_recovered_is_info(caplog):
    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup(standby=())
    o.inflight["md1"] = 2
    o._peer_closed = lambda name, peer=None, removed=None: None
    rep = asyncio.run(ms.remove("md1", force=True))
    assert (rep["forced"], rep["leaked_pages"], "error" in rep["prefix_cache"]) == (True, 0, False)
    assert _ops(caplog) == [(INFO, "remove")]


def test_a_removal_whose_flush_failed_or_that_leaked_pages_is_a_warning(caplog):
    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup(standby=())

    async def refuses(h, payload=b"", timeout=None):
        raise RuntimeError("flush refused")

    o.peers["md1"].call = refuses
    o.peers["md0"].leaked = 2  # 2 pages still in use after its flush

    async def run():
        return await ms.remove("md1"), await ms.remove("md0", force=True)

    a, b = asyncio.run(run())
    assert (a["prefix_cache"]["error"], b["leaked_pages"]) == ("RuntimeError: flush refused", 2)
    assert _ops(caplog) == [(WARNING, "remove"), (WARNING, "remove")]


def test_a_rerole_is_info_and_a_refused_one_a_warning(caplog):
    caplog.set_level(logging.DEBUG)
    o, ms = _rerole_setup()

    async def run():
        await ms.rerole("rld0", "main_decode")
        o.peers["rld0"].closed = True  # the switch back cannot be asked
        try:
            await ms.rerole("rld0", "relay_decode")
        except Exception as e:
            return getattr(e, "code", None)

    assert asyncio.run(run()) == "rerole_failed"
    assert _ops(caplog) == [(INFO, "drain"), (INFO, "rerole"), (INFO, "drain"), (WARNING, "rerole_refused")]


def test_an_instance_the_gateway_started_is_info(caplog, monkeypatch):
    import pdd.spawn

    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup()
    ready = threading.Event()
    ready.set()
    proc = types.SimpleNamespace(poll=lambda: None, pid=0)
    monkeypatch.setattr(pdd.spawn, "spawn_instance", lambda cfg, role, name, cfg_file, log_file: (proc, ready))
    assert ms._start_process(ms.members["md1"]) is proc
    assert _levels(caplog, "pdd.gateway.membership", "membership: ") == [(INFO, "started")]


def _drain_lines(caplog) -> list[tuple[int, str]]:
    """(level, the message up to its first colon) of each line of the drain."""
    return [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records if r.name == "pdd.gateway.shutdown"]


async def test_a_clean_shutdown_drain_is_info(caplog):
    caplog.set_level(logging.DEBUG)
    rep = await Drain(5).run(fake_orchestrator())
    assert (rep["ended"], rep["left"]) == (0, [])
    assert _drain_lines(caplog) == [(INFO, "shutting down"), (INFO, "shutdown")]


async def test_a_drain_whose_timeout_ended_requests_is_a_warning(caplog):
    caplog.set_level(logging.DEBUG)
    drain = Drain(0)

    class Gen:  # a request still running at the timeout: it ends as it is shut down
        def shut_down(self, msg):
            drain.in_flight -= 1
            return True

    g = Gen()
    drain.track(g)
    drain.in_flight = 1
    rep = await drain.run(fake_orchestrator())
    assert (rep["ended"], rep["left"]) == (1, [])
    assert _drain_lines(caplog) == [(INFO, "shutting down"), (WARNING, "shutdown timeout (0 s) ran out"),
                                    (WARNING, "shutdown")]
    assert caplog.records[-1].getMessage().startswith("shutdown: drained in ")


def test_an_autoscale_decision_is_info_and_a_refused_one_a_warning(caplog):
    caplog.set_level(logging.DEBUG)
    orch, a, clock = make_autoscaler()
    orch.inflight["md0"] = 4
    a.sample()
    clock.t += 1.0
    asyncio.run(a.step())  # up: md1 added
    a.sample()
    clock.t += 1.0
    asyncio.run(a.step())  # hold (cool-down)
    orch.membership.members["md1"].state = "standby"
    orch.membership.refuse = True
    a.sample()
    clock.t += 20.0
    asyncio.run(a.step())  # up, refused
    import json

    lines = [(r.levelno, json.loads(r.getMessage().removeprefix("autoscale: "))) for r in caplog.records
             if r.name == "pdd.gateway.autoscale"]
    assert [(lv, [x["action"] for x in rec["decision"]["roles"]], rec["applied"]) for lv, rec in lines] == [
        (INFO, ["up"], [{"role": "main_decode", "op": "add", "instance": "md1"}]),
        (INFO, ["hold"], []),
        (WARNING, ["up"], [{"role": "main_decode", "op": "add", "error": "instance md1 did not start"}])]


def test_an_add_that_joins_the_slots_running_process_is_info(caplog, monkeypatch):
    """``start: true`` for a slot whose instance still runs (one ``pdd serve`` started, a removal
    left running idle) joins it, as docs/SERVE.md says it does: routine, not a warning."""
    import pdd.gateway.membership as membership

    caplog.set_level(logging.DEBUG)
    o, ms, _ = _setup()
    monkeypatch.setattr(membership, "port_taken", lambda host, port: True)
    rep = asyncio.run(ms.add("main_decode", "md1", start=True))
    assert (rep["state"], rep["source"]) == ("active", "joined")
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdd.gateway.membership"][0] == (
        INFO, "membership: md1 already listens at 127.0.0.1:18071: joining it rather than starting a second process")
    assert _ops(caplog) == [(INFO, "add")]
