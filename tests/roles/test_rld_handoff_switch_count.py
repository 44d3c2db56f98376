"""RLD counts a handoff mode switch only for a round it applies. A handoff call that finds its
request already finished on RLD (``finished``: no round, no decision sent back) leaves RLD's mode
and its ``mode_switches`` counter as they were, so the gateway, which counts switches from the
decisions it gets back (``pdd.gateway.live_counters``), and RLD agree. Before, RLD counted the
switch and moved its mode before finding the request gone: a handoff call that came just as RLD
finished a request made the two counts differ (tests/e2e/test_live_counters.py asserts them
equal). The finished request is forced, not raced: admitted (``expect``), marked in the engine,
but never added to it, so RLD's engine thread finds it not running."""

from __future__ import annotations

from pdd.transfer.client import connect
from pdd.transfer.messages import Expect, Handoff
from pdd.types import SamplingParams
from tests.roles.md_tiny import start_instance


async def test_a_handoff_call_on_a_finished_request_counts_no_switch(tiny_model):
    _, inst = await start_instance(tiny_model, "rld0", policy={"handoff_mode": "auto"})
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    try:
        sp = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()
        await gw.call(Expect("r0", list(range(10, 28)), sp).wire())
        inst.reqs["r0"].in_engine = True  # as if decoding: the round is decided, then finds it gone
        inst.current_mode = "one_shot"  # an idle RLD (load 0) in one-shot: auto would switch to catch-up
        before = inst.counters.get("mode_switches", 0)
        rep, _ = await gw.call(Handoff("r0", 0, 0).wire())
        assert rep["finished"] is True and "inputs" not in rep, rep  # no round, no decision for the gateway
        assert inst.counters.get("mode_switches", 0) == before, inst.counters
        assert inst.current_mode == "one_shot"
    finally:
        await gw.close()
        await inst.stop()
