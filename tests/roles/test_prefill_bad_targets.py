"""P refuses a ``prefill`` whose ``targets`` it could not stream to (an instance not in the
topology, a negative or missing ``first_page``), before any work, with an error naming the entry;
and a malformed one-way message (``target`` without ``first_page``) is dropped with one log line.
Before, P prefilled the request and each such stream failed with a logged traceback (KeyError
``'first_page'``, or the unknown name), a negative ``first_page`` streamed pages counted from the
prompt's end, and a malformed ``target`` logged "handler for one-way 'target' failed" with a
traceback. P (the tiny model's engine, in process, no security) and the gateway's connection;
ordered by replies (a connection's one-way messages are handled before a later call's reply)."""

from __future__ import annotations

import pytest

from pdd.transfer.client import connect
from pdd.transfer.peer import RemoteError
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, start_instance

SP = SamplingParams(max_tokens=8, ignore_eos=True).to_dict()


@pytest.mark.parametrize("target, why", [
    ({"name": "zz", "first_page": 0}, "no instance named 'zz' in the pdd topology"),
    ({"name": "rld0", "first_page": -3}, "first_page -3 is negative"),
    ({"name": "rld0"}, "a planned target needs a str 'name' and an int 'first_page' (or 'slot' with 'deferred': true)"),
    ({"name": "rld0", "first_page": 0, "relay": 1}, "'relay' must be bool, got int"),
    ({"deferred": True}, "a deferred slot needs a str 'slot'"),
], ids=["unknown_name", "negative_first_page", "no_first_page", "relay_not_bool", "slot_missing"])
async def test_a_prefill_with_a_bad_target_is_refused_before_any_work(tiny_model, caplog, target, why):
    _, inst = await start_instance(tiny_model, "p0")
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    try:
        with pytest.raises(RemoteError) as err:
            await gw.call({"t": "prefill", "rid": "c0", "prompt_ids": PROMPT, "sampling": SP,
                           "targets": [{"slot": "md", "deferred": True}, target]})
        assert str(err.value) == f"MessageError: message 'prefill': targets[1]: {why}"
        assert (inst.counters["requests"], inst.engine.prefill_chunks, inst.reqs) == (0, 0, {})
        assert "Traceback" not in caplog.text
    finally:
        await gw.close()
        await inst.stop()


async def test_a_malformed_one_way_target_is_dropped_with_one_line(tiny_model, caplog):
    _, inst = await start_instance(tiny_model, "p0")
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    try:
        rep, _ = await gw.call({"t": "prefill", "rid": "c0", "prompt_ids": PROMPT, "sampling": SP,
                                "targets": [{"slot": "md", "deferred": True}]})
        assert rep["t"] == "prefill_ok"
        await gw.send({"t": "target", "rid": "c0", "slot": "md", "name": "rld0"})  # no first_page
        await gw.send({"t": "target", "rid": "c0", "slot": "md", "name": "rld0", "first_page": -1})
        await gw.call({"t": "stats"})  # after both one-way messages were handled
        lines = [r.getMessage() for r in caplog.records if "malformed one-way 'target'" in r.getMessage()]
        assert [ln.split(": ", 1)[1] for ln in lines] == [
            "dropped a malformed one-way 'target': message 'target': a planned slot needs 'name' and 'first_page' "
            "(Target(rid='c0', slot='md', name='rld0', first_page=OMIT, last_page=OMIT, relay=OMIT, cancelled=OMIT, "
            "skip=OMIT))",
            "dropped a malformed one-way 'target': message 'target': first_page -1 is negative (Target(rid='c0', "
            "slot='md', name='rld0', first_page=-1, last_page=OMIT, relay=OMIT, cancelled=OMIT, skip=OMIT))"]
        assert "Traceback" not in caplog.text
        await gw.send({"t": "cancel", "rid": "c0", "name": None})  # the slot never planned: released
        rep, _ = await gw.call({"t": "wait_idle", "timeout_s": 20})
        rep, _ = await gw.call({"t": "flush"})
        assert (rep["pages_free"], rep["live_requests"]) == (64, 0)
    finally:
        await gw.close()
        await inst.stop()
