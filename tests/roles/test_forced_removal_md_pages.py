"""``DELETE /pdd/instances/md0?force=true`` on a real MD (the tiny model's engine, in process,
no security) with two requests there: one whose KV arrived (its 4 whole pages in MD's prefix
cache) and one reserved on that prefix, waiting for the rest of its KV. The gateway's real
membership removes it: the requests are aborted on MD once (its owner's connection closed) and
the cache, the pages the waiting request locked included, is flushed over a fresh connection:
every page is free again, none freed twice (the pool raises DoubleFree), and the answer counts
the 4 cache pages dropped. Before, nothing was flushed (the 4 pages stayed cached) while the
answer said "flushed". Ordered by events (MD's kv_ready, the replies), not by a clock."""

from __future__ import annotations

import asyncio

from pdd.gateway.membership import Membership
from pdd.gateway.orchestrator import Orchestrator
from pdd.policy.membership import REMOVED
from pdd.topology import layout
from pdd.transfer.client import connect
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer
from tests.roles.md_tiny import PROMPT, send_prompt_kv, start_md


async def test_forced_removal_frees_every_md_page_once_and_flushes_its_cache(tiny_model):
    cfg, inst = await start_md(tiny_model, {"prefill": 1, "relay_decode": 1, "main_decode": 2})
    lay = layout(cfg)
    o = Orchestrator(cfg, lay)
    ms = Membership(o, lay, cfg.standby)
    landed = asyncio.Event()
    opened = []

    async def on_kv_ready(peer, h, payload):
        landed.set()

    async def connect_md0(name, retries):  # as Orchestrator._connect, to this MD's port
        assert name == "md0"
        peer = await connect("127.0.0.1", inst.server.port, {**o.handlers(), "kv_ready": on_kv_ready},
                             role="gateway", instance="gateway", retries=retries)
        peer.on_close(lambda p, n=name: o._peer_closed(n, p))
        opened.append(peer)
        return peer

    o._connect = connect_md0
    o.peers = {s.name: FakePeer() for s in o.layout.engines}
    gw = o.peers["md0"] = await connect_md0("md0", 0)
    p = None
    sp = SamplingParams(max_tokens=8, ignore_eos=True).to_dict()
    pool = inst.engine.pool
    try:
        r0, _ = await gw.call({"t": "reserve", "rid": "c0", "prompt_ids": PROMPT, "sampling": sp})
        p = await connect("127.0.0.1", inst.server.port, role="prefill", instance="p0")
        send_prompt_kv(p, inst, "c0", r0["page_bytes"])
        await asyncio.wait_for(landed.wait(), 30)  # c0's KV is in MD's cache
        r1, _ = await gw.call({"t": "reserve", "rid": "c1", "prompt_ids": PROMPT, "sampling": sp})
        assert r1["md_cached_pages"] == 4  # c1 locks c0's 4 whole pages and waits for the rest
        assert (len(inst.reqs), pool.num_used) == (2, 5 + 1)
        o.inflight["md0"] = 2
        rep = await ms.remove("md0", force=True)
        assert (rep["state"], rep["forced"], rep["leaked_pages"]) == (REMOVED, True, 0)
        pc = rep["prefix_cache"]
        assert (pc["flushed"], pc["pages_dropped"], pc["tokens_dropped"]) == (True, 4, 16), pc
        assert inst.reqs == {} and inst.counters.get("orphaned") == 2  # aborted there as their owner left
        assert pool.num_free == 64 and sorted(pool._free) == list(range(64))  # each page free, once
        assert gw.closed and len(opened) == 2 and opened[1].closed  # the flush's own connection, closed after
    finally:
        if p is not None:
            await p.close()
        for c in opened:
            await c.close()
        await inst.stop()
