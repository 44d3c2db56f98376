"""RLD frees a request's pages on P's ``kv_cancel``, as docs/LINK.md says every receiver does
("every transfer sends `kv_cancel`; the receivers free what arrived"). Before, RLD had no
handler for it: each P -> RLD stream cut by an abort mid-prefill (a client gone early) logged
``no handler for one-way message 'kv_cancel', dropped`` in RLD's log and the pages stayed held
until the gateway's abort came (found by serving a heterogeneous topology and cancelling streams
after their first chunk). The message is one-way, so the test sends a marker one-way after it on
the same connection and waits for the marker: one connection's one-way messages are handled in
order, each to its end."""

from __future__ import annotations

import asyncio

from pdd.transfer.client import connect
from pdd.transfer.messages import Expect, KvCancel
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, start_instance


async def test_kv_cancel_frees_the_pages_of_a_request_waiting_for_its_kv(tiny_model, caplog):
    _, inst = await start_instance(tiny_model, "rld0")
    marked = asyncio.Event()
    inst.server.on("test_mark", lambda p, h, b: marked.set())
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    try:
        free0 = await inst.worker.call(lambda e: e.pool.num_free)
        sp = SamplingParams(max_tokens=4, ignore_eos=True).to_dict()
        rep, _ = await gw.call(Expect("r0", PROMPT, sp).wire())
        assert rep["n_pages"] == 5  # 18 prompt tokens on 4-token pages
        assert await inst.worker.call(lambda e: e.pool.num_free) == free0 - 5
        await gw.send(KvCancel("r0", 4096, 2).wire())
        await gw.send({"t": "test_mark"})
        await marked.wait()
        assert "r0" not in inst.reqs
        assert await inst.worker.call(lambda e: e.pool.num_free) == free0
        assert "no handler" not in caplog.text
    finally:
        await gw.close()
        await inst.stop()
