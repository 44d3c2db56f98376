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
import os

from pdd.config import ClusterConfig
from pdd.gateway.membership import Membership
from pdd.gateway.orchestrator import Orchestrator
from pdd.policy.membership import REMOVED
from pdd.topology import ROLE_MAIN, InstanceSpec, free_port_block, layout
from pdd.transfer.client import connect
from pdd.transfer.kv import KVSender
from pdd.types import SamplingParams
from tests.gateway.fake_peer import FakePeer

PROMPT = list(range(10, 28))  # 18 tokens = 4 whole pages of 4 + 2


async def test_forced_removal_frees_every_md_page_once_and_flushes_its_cache(tiny_model):
    from pdd.roles.main_decode import MainDecodeInstance

    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "model_preset": "tiny",
                                        "base_port": base, "gateway_port": base + 95, "request_timeout_s": 30,
                                        "security": {"tls": False, "fast_path": "plain"},
                                        "instances": {"prefill": 1, "relay_decode": 1, "main_decode": 2},
                                        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 256}})
    lay = layout(cfg)
    # a port of the free block: its metrics server (port + 10, never stopped in-process) is the block's too
    inst = MainDecodeInstance(cfg, InstanceSpec("md0", ROLE_MAIN, "B", base + 1), lay)
    await inst.start()
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
        pb = r0["page_bytes"]
        data = os.urandom(5 * pb)
        p = await connect("127.0.0.1", inst.server.port, role="prefill", instance="p0")
        KVSender(p, chunk_pages=1).submit("c0", 0, lambda i, n: data[i * pb:(i + n) * pb], 5, pb,
                                          layers=(0, inst.engine.model_cfg.num_hidden_layers),
                                          done_fields={"first_token": 5, "fin": None, "relay": True})
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
