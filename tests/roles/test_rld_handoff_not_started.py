"""RLD's handoff round for a request it holds but has not started decoding (admitted with
``expect``, P's ``kv_done`` not come) answers ``not_started``, not ``finished``: nothing
finished, and no round is applied (no decision, no mode switch counted). It answered
``finished`` (found in a review); the gateway no longer asks then, but a ``finished`` reply
would have made it tell MD to finish while RLD went on to decode the whole request alone. A
request RLD holds no more, or stopped after a one-shot final round, still answers ``finished``."""

from __future__ import annotations

from pdd.transfer.client import connect
from pdd.transfer.messages import Expect, Handoff
from pdd.types import SamplingParams
from tests.roles.md_tiny import start_instance


async def test_a_handoff_round_before_decoding_started_answers_not_started(tiny_model):
    _, inst = await start_instance(tiny_model, "rld0", policy={"handoff_mode": "auto"})
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    try:
        sp = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()
        await gw.call(Expect("r0", list(range(10, 28)), sp).wire())
        mode, counters = inst.current_mode, dict(inst.counters)
        rep, _ = await gw.call(Handoff("r0", 0, 0).wire())
        assert {k: v for k, v in rep.items() if k not in ("cid", "reply")} == {
            "t": "handoff_ok", "rid": "r0", "finished": False, "token_ids": [], "mode": None, "final": False,
            "not_started": True}
        assert (inst.current_mode, inst.counters) == (mode, counters) and "r0" in inst.reqs
        inst.reqs["r0"].extra["kv_done"] = True  # as after a one-shot final round stopped it: out of the engine
        rep, _ = await gw.call(Handoff("r0", 0, 1).wire())
        assert rep["finished"] is True and "not_started" not in rep, rep
        rep, _ = await gw.call(Handoff("nope", 0, 0).wire())  # not held here
        assert rep["finished"] is True and "not_started" not in rep, rep
    finally:
        await gw.close()
        await inst.stop()
