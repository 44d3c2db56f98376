"""MD's ``reserve {after}`` (a sibling choice, pdd.policy.siblings) waits for the first choice's
KV whatever order the two reservations are handled in: one that comes while the first choice's
own reservation is still being admitted (its reply not sent) waits for that KV too, instead of
finding the first choice "not held" and reserving with nothing cached. The real MD role
(datacenter B, no security), a gateway connection and a P stream; the order is forced (both
reservations sent back to back on one connection), not raced."""

from __future__ import annotations

import asyncio
import os

from pdd.config import ClusterConfig
from pdd.topology import ROLE_MAIN, InstanceSpec, free_port_block, layout
from pdd.transfer.kv import KVSender
from pdd.transfer.client import connect
from pdd.types import SamplingParams

PROMPT = list(range(10, 28))  # 18 tokens = 4 whole pages of 4 + 2


async def test_a_sibling_reserve_sent_beside_the_first_waits_for_its_kv(tiny_model):
    from pdd.roles.main_decode import MainDecodeInstance

    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "model_preset": "tiny",
                                        "base_port": base, "gateway_port": base + 95, "request_timeout_s": 30,
                                        "security": {"tls": False, "fast_path": "plain"},
                                        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 256}})
    # a port of the free block: its metrics server (port + 10, never stopped in-process) is the block's too
    inst = MainDecodeInstance(cfg, InstanceSpec("md0", ROLE_MAIN, "B", base + 1), layout(cfg))
    await inst.start()
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    p = None
    sp = SamplingParams(max_tokens=2, ignore_eos=True).to_dict()
    try:
        first = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c0", "prompt_ids": PROMPT, "sampling": sp}))
        sib = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c1", "prompt_ids": PROMPT, "sampling": sp,
                                             "after": "c0"}))
        r0, _ = await first
        assert r0["md_cached_pages"] == 0 and r0["n_pages"] == 5
        assert not sib.done()  # c0's KV has not arrived: c1 waits for it
        pb = r0["page_bytes"]
        data = os.urandom(5 * pb)
        p = await connect("127.0.0.1", inst.server.port, role="prefill", instance="p0")
        KVSender(p, chunk_pages=1).submit("c0", 0, lambda i, n: data[i * pb:(i + n) * pb], 5, pb,
                                          layers=(0, inst.engine.model_cfg.num_hidden_layers),
                                          done_fields={"first_token": 5, "fin": None, "relay": True})
        r1, _ = await asyncio.wait_for(sib, 30)
        assert (r1["md_cached_tokens"], r1["md_cached_pages"]) == (16, 4)  # c0's whole pages, from the DRC
    finally:
        if p is not None:
            await p.close()
        await gw.close()
        await inst.stop()
