"""P's ``cancel`` with no target name (``Cancel(rid, None)``): the gateway sends it when a relayed
request's MD leg is lost before an MD was chosen (the MD route's peek across the WAN failed, e.g.
during a WAN outage: ``Recovery._md_leg_lost`` with ``st.names`` holding no MD). P (the tiny
model's engine, in process, no security) must cancel the request's deferred slots (reported
under the slot's name in ``xfer_done``) without its handler failing; before, ``_senders_of(None)``
raised TypeError (``None + EXPRESS``) and P logged "handler for one-way 'cancel' failed" with a
traceback. Ordered by messages (P dispatches a connection's frames in order, so the ``stats``
reply comes after the ``cancel`` ran) and by P's ``xfer_done``, not by a clock."""

from __future__ import annotations

import asyncio
import logging

from pdd.transfer.client import connect
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, start_instance


async def test_cancel_without_a_target_name_cancels_the_deferred_slots(tiny_model, caplog):
    _, inst = await start_instance(tiny_model, "p0")
    done = asyncio.get_running_loop().create_future()

    async def on_xfer_done(peer, h, payload):
        if not done.done():
            done.set_result(h)

    gw = await connect("127.0.0.1", inst.server.port, {"xfer_done": on_xfer_done}, role="gateway",
                       instance="gateway")
    sp = SamplingParams(max_tokens=8, ignore_eos=True).to_dict()
    try:
        caplog.set_level(logging.ERROR)
        rep, _ = await gw.call({"t": "prefill", "rid": "c0", "prompt_ids": PROMPT, "sampling": sp,
                                "targets": [{"slot": "md", "deferred": True}]})
        assert "c0" in inst.reqs  # prefilled; its KV waits for MD's slot to be planned
        await gw.send({"t": "cancel", "rid": "c0", "name": None})
        await gw.call({"t": "stats"})
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        h = await asyncio.wait_for(done, 30)  # the slot cancelled: nothing sent, the request released
        assert (h["rid"], h["bytes"]) == ("c0", {"md": 0})  # keyed by the slot: a None key does not encode
        assert inst.reqs == {}
        await gw.call({"t": "flush"})
        assert inst.engine.pool.num_free == 64  # every page back, none freed twice (DoubleFree)
    finally:
        await gw.close()
        await inst.stop()
