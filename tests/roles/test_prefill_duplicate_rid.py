"""P refuses a ``prefill`` whose rid it already holds, as RLD's ``expect`` and MD's ``reserve``
do. Before, two prefills of one rid sent together (the second while the first was being added)
made the second take the first's first-token waiter: the second failed in the engine ("duplicate
seq_id"), the first's call never answered and its pages stayed held until an abort came (10
pages held after the cancel). P (the tiny model's engine, in process, no security) and the gateway's
connection; ordered by the replies and P's ``xfer_done``, not by a clock."""

from __future__ import annotations

import asyncio

from pdd.transfer.client import connect
from pdd.transfer.peer import RemoteError
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, start_instance


async def test_a_second_prefill_of_a_held_rid_is_refused_and_the_first_goes_on(tiny_model):
    _, inst = await start_instance(tiny_model, "p0")
    done = asyncio.Queue()
    gw = await connect("127.0.0.1", inst.server.port, {"xfer_done": lambda p, h, b: done.put_nowait(h)},
                       role="gateway", instance="gateway")
    sp = SamplingParams(max_tokens=8, ignore_eos=True).to_dict()
    prefill = {"t": "prefill", "rid": "c0", "prompt_ids": PROMPT, "sampling": sp,
               "targets": [{"slot": "md", "deferred": True}]}  # its KV waits for the slot: held
    try:
        first, second = await asyncio.wait_for(asyncio.gather(gw.call(prefill), gw.call(prefill),
                                                              return_exceptions=True), 20)
        assert (first[0]["t"], first[0]["rid"], first[0]["n_pages"]) == ("prefill_ok", "c0", 5)
        assert isinstance(second, RemoteError) and str(second) == "RuntimeError: request c0 is already held here"
        again = await asyncio.gather(gw.call(prefill), return_exceptions=True)  # while it streams: refused too
        assert str(again[0]) == "RuntimeError: request c0 is already held here"
        assert list(inst.reqs) == ["c0"] and inst.engine.pool.num_used == 5
        await gw.send({"t": "cancel", "rid": "c0", "name": None})
        h = await asyncio.wait_for(done.get(), 20)
        assert (h["rid"], h["bytes"]) == ("c0", {"md": 0}) and inst.reqs == {}
        rep, _ = await gw.call({"t": "flush"})
        assert (rep["pages_free"], rep["live_requests"], done.qsize()) == (64, 0, 0)
    finally:
        await gw.close()
        await inst.stop()
