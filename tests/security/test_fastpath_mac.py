"""Keyed MAC on the in-datacenter fast path (P -> RLD): peers without the key are refused; a
byte flipped on the wire after the sender's MAC drops the frame, closes the connection and
nothing of it (nor any later frame, e.g. the ``kv_done`` that would cache the pages) reaches a
handler, so nothing enters a radix cache."""

from __future__ import annotations

import asyncio
import os

import pytest

from pdd.engine.config import ModelConfig
from pdd.engine.kv_pool import KVPool
from pdd.engine.radix_cache import RadixCache
from pdd.transfer import wire
from pdd.transfer.kv import KVSender
from pdd.transfer.client import connect
from pdd.transfer.handshake import HandshakeError
from pdd.transfer.server import Server

from .helpers import FlipProxy, wait_for

KEY = bytes(range(32))


async def mac_server(handlers=None, key=KEY, **kw) -> Server:
    s = Server("127.0.0.1", 0, handlers or {"echo": lambda p, h, b: ({"t": "echo_ok"}, bytes(b))},
               role="relay_decode", instance="rld0", mac_key=key, **kw)
    return await s.start()


async def test_mac_connection_works_and_every_frame_is_tagged():
    server = await mac_server()
    proxy = await FlipProxy(server.port).start()  # no flip: records what the client sent
    try:
        peer = await connect("127.0.0.1", proxy.port, role="prefill", instance="p0", mac_key=KEY)
        assert peer.auth == "mac" and peer.mac_tx is not None
        for n in (0, 10, 70_000):
            h, p = await peer.call({"t": "echo"}, b"z" * n)
            assert h["t"] == "echo_ok" and p == b"z" * n
        (sp,) = server.peers
        assert sp.auth == "mac" and sp.remote_instance == "p0"
        await peer.close()
        # every client frame, the hello included, carries FLAG_MAC and a tag
        buf, frames = bytes(proxy.sent), 0
        while buf:
            _, _, flags, hlen, plen = wire.PREFIX.unpack(buf[:16])
            assert flags & wire.FLAG_MAC
            buf = buf[16 + hlen + plen + wire.MAC_BYTES:]
            frames += 1
        assert frames == 4
    finally:
        await proxy.close()
        await server.close()


@pytest.mark.parametrize("client_kw,match", [
    ({"mac_key": os.urandom(32)}, "authentication failed"),  # wrong key
    ({}, "mutual TLS or a fast-path MAC is required"),  # no key at all
])
async def test_peer_without_the_key_refused(client_kw, match):
    server = await mac_server()
    try:
        with pytest.raises(HandshakeError, match=match):
            await connect("127.0.0.1", server.port, instance="p0", retries=20, **client_kw)
        assert server.refused == 1 and not server.peers
    finally:
        await server.close()


async def test_server_without_the_key_is_not_trusted():
    impostor = await mac_server(key=os.urandom(32))
    plain = await Server("127.0.0.1", 0, {}).start()  # answers plain hellos: cannot authenticate
    try:
        with pytest.raises(HandshakeError):
            await connect("127.0.0.1", impostor.port, instance="p0", mac_key=KEY)
        with pytest.raises(HandshakeError):
            await connect("127.0.0.1", plain.port, instance="p0", mac_key=KEY)
    finally:
        await impostor.close()
        await plain.close()


async def test_replayed_session_is_refused():
    """Bytes of a whole recorded session replayed on a new connection: the hello is accepted
    (it is genuine), but the session keys depend on the server's fresh nonce, so the first
    replayed frame fails its MAC and nothing reaches a handler."""
    got = []
    server = await mac_server({"kv": lambda p, h, b: got.append(h["n"])})
    proxy = await FlipProxy(server.port).start()
    try:
        peer = await connect("127.0.0.1", proxy.port, instance="p0", mac_key=KEY)
        for i in range(3):
            await peer.send({"t": "kv", "n": i}, b"k" * 1000)
        assert await wait_for(lambda: len(got) == 3)
        await peer.close()
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(bytes(proxy.sent))
        await w.drain()
        assert await asyncio.wait_for(r.read(), 5) is not None  # server answers its hello, then closes
        w.close()
        assert await wait_for(lambda: server.mac_failures == 1)
        assert got == [0, 1, 2]
    finally:
        await proxy.close()
        await server.close()


# ---------------------------------------------------------------- byte flips vs the radix cache
PAGE_SIZE = 4
N_PAGES = 4


def small_pool() -> tuple[KVPool, RadixCache]:
    mc = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    pool = KVPool(mc, num_pages=16, page_size=PAGE_SIZE, dtype="float32", device="cpu")
    return pool, RadixCache(pool)


class DecodeSide:
    """The receiving side of a KV stream as MD / D do it: ``kv`` imports pages into the
    request's pages, ``kv_done`` inserts the prompt's whole pages into the radix cache."""

    def __init__(self):
        self.pool, self.radix = small_pool()
        self.prompt = list(range(N_PAGES * PAGE_SIZE))
        self.pages = self.pool.alloc(N_PAGES)
        self.kv_frames: list[int] = []
        self.done = False

    def handlers(self) -> dict:
        return {"kv": self.on_kv, "kv_done": self.on_done}

    def on_kv(self, peer, h, payload):
        first, n = h["first_page"], h["n_pages"]
        self.pool.import_pages(self.pages[first:first + n], payload)
        self.kv_frames.append(first)

    def on_done(self, peer, h, payload):
        self.done = True
        self.radix.insert(self.prompt, self.pages)


async def stream_through(proxy_kw: dict):
    side = DecodeSide()
    server = await mac_server(side.handlers())
    proxy = await FlipProxy(server.port, **proxy_kw).start()
    peer = await connect("127.0.0.1", proxy.port, role="prefill", instance="p0", mac_key=KEY)
    pb = side.pool.page_bytes
    data = os.urandom(N_PAGES * pb)
    sender = KVSender(peer, chunk_pages=1)
    tr = sender.submit("r1", 0, lambda i, n: data[i * pb:(i + n) * pb], N_PAGES, pb,
                       done_fields={"first_token": 7, "fin": None})
    try:
        res = await asyncio.wait_for(asyncio.shield(tr.done), 5)
    except ConnectionError as e:
        res = e
    return side, server, proxy, peer, res, data


async def test_unflipped_stream_is_cached():
    """Control: the same stream without a flip completes and its pages enter the radix cache."""
    side, server, proxy, peer, res, data = await stream_through({})
    try:
        assert not isinstance(res, Exception) and res.pages_sent == N_PAGES
        assert await wait_for(lambda: side.done)
        assert side.kv_frames == [0, 1, 2, 3]
        assert side.radix.peek(side.prompt) == N_PAGES
        assert bytes(side.pool.export_pages(side.pages)) == data
    finally:
        await proxy.close()
        await server.close()


@pytest.mark.parametrize("region,i", [
    ("payload", 0), ("payload", -1), ("payload", 1000),  # the KV bytes
    ("header", 3), ("header", -1),  # e.g. first_page / page_bytes: the frame would land elsewhere
    ("prefix", 3), ("prefix", 7),  # flags; header length (the stream would be out of step)
    ("prefix", 0),  # magic
    ("tag", 0), ("tag", -1),  # the MAC itself
])
async def test_byte_flip_drops_frame_never_cached(region, i):
    """Frame 2 (the second ``kv`` chunk, after the hello and chunk 0) has one byte flipped
    after the sender's MAC. It is dropped, the connection closes, chunks 2-3 and ``kv_done``
    never arrive: the radix cache never holds the prompt."""
    side, server, proxy, peer, res, data = await stream_through({"flip_frame": (2, region, i)})
    try:
        assert proxy.flipped
        # the receiver closes the connection: P sees it (its transfer fails if it was still
        # writing, else the peer is closed) and reconnects for the next request
        assert await wait_for(lambda: not server.peers and peer.closed)
        # at most the authentic chunk before the flip (it may still sit in the dispatch queue
        # when the connection closes, and then it is discarded too)
        assert side.kv_frames in ([], [0])
        if side.kv_frames:
            pb = side.pool.page_bytes
            assert bytes(side.pool.export_pages(side.pages[:1])) == data[:pb]
        assert not side.done
        assert side.radix.peek(side.prompt) == 0
        if region != "prefix" or i != 0:  # a bad magic is refused before any MAC is computed
            assert server.mac_failures == 1
    finally:
        await proxy.close()
        await server.close()
