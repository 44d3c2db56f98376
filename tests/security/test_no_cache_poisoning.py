"""No cache poisoning, on the real decode role: a D instance (``same_dc_pd``, datacenter A, the
fast path with its keyed MAC) whose KV stream from P has one byte flipped on the wire never puts
the prompt into its radix cache (MD inserts a prompt's pages when ``kv_done`` arrives); the same
stream unflipped does. Security on as ``pdd serve`` sets it up (certificates made by the
launcher's ``prepare_security``, mutual TLS for the gateway's control connection)."""

from __future__ import annotations

import asyncio
import os

import pytest

from pdd.config import ClusterConfig
from pdd.launch import prepare_security
from pdd.security import link_security
from pdd.topology import ROLE_MAIN, InstanceSpec, layout
from pdd.transfer.kv import KVSender
from pdd.transfer.messages import Reserve
from pdd.transfer.client import connect
from pdd.transfer.handshake import HandshakeError
from pdd.types import SamplingParams

from .helpers import FlipProxy, wait_for

PROMPT = list(range(10, 26))  # 16 tokens = 4 pages of 4


async def test_flipped_kv_stream_never_enters_the_radix_cache(tiny_model, tmp_path):
    from pdd.roles.main_decode import MainDecodeInstance

    from pdd.topology import free_port_block

    base = free_port_block()  # its metrics port too: the default ports may be taken (a running demo, a CI beside)
    cfg = ClusterConfig.model_validate({"mode": "same_dc_pd", "model_path": tiny_model, "model_preset": "tiny",
                                        "base_port": base, "gateway_port": base + 95,
                                        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 256}})
    cfg = prepare_security(cfg, tmp_path)
    assert cfg.security.tls and cfg.security.fast_path == "mac" and os.path.isdir(cfg.security.cert_dir)
    # a port of the free block: its metrics server (port + 10, never stopped in-process) is the block's too
    inst = MainDecodeInstance(cfg, InstanceSpec("d0", ROLE_MAIN, "A", base + 1), layout(cfg))
    await inst.start()
    port = inst.server.port
    toks: list[dict] = []
    gw = await connect("127.0.0.1", port, {"tok": lambda p, h, b: toks.append(h),
                                           "toks": lambda p, h, b: toks.extend(h["msgs"]),  # one engine step's
                                           "*": lambda p, h, b: None},
                       role="gateway", instance="gateway", **link_security(cfg, "gateway").client("d0"))
    n_layers = inst.engine.model_cfg.num_hidden_layers
    sp = SamplingParams(max_tokens=2, ignore_eos=True).to_dict()
    proxy = None
    try:
        assert gw.auth == "tls"

        async def stream(rid: str, via_port: int):
            r, _ = await gw.call(Reserve(rid, PROMPT, sp).wire())
            assert r["md_cached_pages"] == 0 and r["n_pages"] == 4
            pb = r["page_bytes"]
            data = os.urandom(4 * pb)
            p = await connect("127.0.0.1", via_port, role="prefill", instance="p0",
                              **link_security(cfg, "p0").client("d0", fast=True))
            assert p.auth == "mac"
            KVSender(p, chunk_pages=1).submit(rid, 0, lambda i, n: data[i * pb:(i + n) * pb], 4, pb,
                                              layers=(0, n_layers),
                                              done_fields={"first_token": 5, "fin": None, "relay": False})
            return p

        async def cached_pages() -> int:
            return await inst.worker.call(lambda e: e.radix.peek(PROMPT))

        # 1. a byte of the second KV chunk flipped after P's MAC
        proxy = await FlipProxy(port, flip_frame=(2, "payload", 100)).start()
        p1 = await stream("r1", proxy.port)
        assert await wait_for(lambda: p1.closed and proxy.flipped)
        # p1's connection is closed (the MAC failure closed it): every frame it carried has been
        # handled; a control round trip and the engine thread's queue (cached_pages) come after them
        await gw.call({"t": "stats"})
        assert inst.server.mac_failures == 1
        assert await cached_pages() == 0  # the poisoned prompt never entered the radix cache
        assert not [t for t in toks if t["rid"] == "r1"]  # and D never decoded on it
        await gw.call({"t": "abort", "rid": "r1"})
        assert await wait_for(lambda: inst.engine.pool.num_free == inst.engine.pool.num_pages)

        # 2. an unauthenticated P is refused outright
        with pytest.raises(HandshakeError):
            await connect("127.0.0.1", port, role="prefill", instance="p0", mac_key=os.urandom(32))

        # 3. control: the same stream unflipped (P reconnected) is decoded and cached
        p2 = await stream("r2", port)
        assert await wait_for(lambda: any(t["rid"] == "r2" and t.get("fin") for t in toks), 10)
        assert await cached_pages() == 4
        await p2.close()
    finally:
        if proxy is not None:
            await proxy.close()
        await gw.close()
        await inst.stop()
