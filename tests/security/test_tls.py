"""Mutual TLS on pdd connections: good peers talk; unauthenticated or wrongly-certified peers
are refused at once (never retried); TLS runs end to end through the WAN emulator."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from pdd.security import client_context, server_context
from pdd.transfer import peer as peer_module
from pdd.transfer.link import Link
from pdd.transfer.client import connect
from pdd.transfer.handshake import HandshakeError
from pdd.transfer.server import Server
from tests.net import ipv6_loopback

from .helpers import FlipProxy, wait_for


async def tls_server(certs, handlers=None, name="srv", **kw) -> Server:
    s = Server("127.0.0.1", 0, handlers or {"echo": lambda p, h, b: ({"t": "echo_ok"}, bytes(b))},
               role="md", instance=name, ssl=server_context(certs, name), **kw)
    return await s.start()


def tls_client(certs, name="cli", target="srv") -> dict:
    return {"ssl": client_context(certs, name), "server_hostname": target, "instance": name}


async def test_mutual_tls_call_and_identities(certs):
    server = await tls_server(certs)
    try:
        peer = await connect("127.0.0.1", server.port, role="gw", **tls_client(certs))
        h, p = await peer.call({"t": "echo"}, b"x" * 100_000)
        assert h["t"] == "echo_ok" and p == b"x" * 100_000
        assert peer.auth == "tls" and peer.cert_name == "srv"
        assert peer.writer.get_extra_info("ssl_object").version() == "TLSv1.3"
        (sp,) = server.peers
        assert sp.auth == "tls" and sp.cert_name == "cli" and sp.remote_instance == "cli"
        await peer.close()
    finally:
        await server.close()
    assert server.refused == 0


async def test_plain_client_refused_by_tls_server(certs):
    server = await tls_server(certs)
    try:
        with pytest.raises(ConnectionError):
            await connect("127.0.0.1", server.port, instance="cli", connect_timeout_s=2)
        assert await wait_for(lambda: server.refused == 1)
        assert not server.peers
        # raw junk too, and the server keeps serving good peers
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(b"GET / HTTP/1.1\r\n\r\n")
        try:
            assert await asyncio.wait_for(r.read(), 3) == b""  # closed by the server ...
        except ConnectionResetError:
            pass  # ... or reset (it never read the junk)
        w.close()
        assert await wait_for(lambda: server.refused == 2)
        peer = await connect("127.0.0.1", server.port, **tls_client(certs))
        assert (await peer.call({"t": "echo"}))[0]["t"] == "echo_ok"
        await peer.close()
    finally:
        await server.close()


async def test_client_without_certificate_refused(certs):
    server = await tls_server(certs)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(certs / "ca.pem"))  # trusts the server, shows no certificate
    proxy = await FlipProxy(server.port).start()  # counts the TCP connections the client opens
    try:
        with pytest.raises(HandshakeError, match="TLS"):
            await connect("127.0.0.1", proxy.port, ssl=ctx, server_hostname="srv", instance="cli", retries=50)
        assert proxy._conns == 1, "a refused certificate must not be retried"
        assert await wait_for(lambda: server.refused == 1)
        assert not server.peers
    finally:
        await proxy.close()
        await server.close()


async def test_client_certified_by_another_ca_refused(certs, foreign_certs):
    server = await tls_server(certs)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(foreign_certs / "cli.pem", foreign_certs / "cli.key")  # right name, wrong CA
    try:
        with pytest.raises(HandshakeError, match="TLS"):
            await connect("127.0.0.1", server.port, ssl=ctx, server_hostname="srv", instance="cli", retries=50)
        assert await wait_for(lambda: server.refused == 1)
        assert not server.peers
    finally:
        await server.close()


async def test_server_certified_by_another_ca_refused(certs, foreign_certs):
    server = await tls_server(foreign_certs)  # an impostor server
    proxy = await FlipProxy(server.port).start()
    try:
        with pytest.raises(HandshakeError, match="certificate verify failed"):
            await connect("127.0.0.1", proxy.port, retries=50, **tls_client(certs))
        assert proxy._conns == 1, "an unverified server must not be retried"
        assert not server.peers
    finally:
        await proxy.close()
        await server.close()


async def test_server_with_another_instances_certificate_refused(certs):
    # rld0's certificate is valid, but the client dialled md0: hostname check fails
    server = await tls_server(certs, name="rld0")
    try:
        with pytest.raises(HandshakeError, match="md0"):
            await connect("127.0.0.1", server.port, **tls_client(certs, target="md0"))
    finally:
        await server.close()


async def test_hello_must_name_the_certificate(certs):
    server = await tls_server(certs)
    try:
        with pytest.raises(HandshakeError, match="certificate is 'cli'"):
            await connect("127.0.0.1", server.port, ssl=client_context(certs, "cli"), server_hostname="srv",
                          instance="p0")  # cli's certificate, claims to be p0
        assert await wait_for(lambda: server.refused == 1)
    finally:
        await server.close()


async def test_tls_end_to_end_through_the_wan_emulator(certs):
    got = []
    server = await tls_server(certs, {"kv": lambda p, h, b: got.append(len(b)),
                                      "echo": lambda p, h, b: {"t": "echo_ok"}})
    link = Link({"routes": [{"listen_port": 0, "target_host": "127.0.0.1", "target_port": server.port}],
                 "gbps": 10.0, "rtt_ms": 2.0})
    await link.start()
    try:
        peer = await connect("127.0.0.1", link.ports[0], **tls_client(certs))
        for _ in range(4):
            await peer.send({"t": "kv"}, b"\x07" * 300_000)
        assert (await peer.call({"t": "echo"}))[0]["t"] == "echo_ok"
        assert got == [300_000] * 4 and peer.auth == "tls"
        await peer.close()
    finally:
        await link.close()
        await server.close()


async def test_tls_byte_flip_drops_frame_and_connection(certs):
    """A byte flipped inside a TLS record (after the sender sealed it): the record fails its
    AEAD tag, the connection dies, the frame never reaches a handler."""
    got = []
    server = await tls_server(certs, {"kv": lambda p, h, b: got.append(bytes(b[:4]))})
    proxy = await FlipProxy(server.port, flip_at=150_000).start()
    try:
        peer = await connect("127.0.0.1", proxy.port, **tls_client(certs))
        await peer.send({"t": "kv"}, b"good" * 10_000)  # ~40 KB, before the flip
        with pytest.raises(ConnectionError):
            for _ in range(20):
                await peer.send({"t": "kv"}, b"evil" * 50_000)  # the flip lands in the first of these
                await asyncio.sleep(0.01)
        assert proxy.flipped
        assert await wait_for(lambda: peer.closed and not server.peers)
        assert got == [b"good"]
    finally:
        await proxy.close()
        await server.close()


def test_link_security_server_and_client_kwargs(certs):
    from pdd.config import ClusterConfig
    from pdd.security import SecurityError, link_security

    cfg = ClusterConfig.model_validate({"mode": "pdd", "security": {"cert_dir": str(certs)}})
    rld = link_security(cfg, "rld0").server()
    assert rld["ssl"] is not None and len(rld["mac_key"]) == 32 and rld["allow_plain"] is False
    md = link_security(cfg, "md0").server()
    assert md["ssl"] is not None and "mac_key" not in md and md["allow_plain"] is False  # datacenter B: TLS only
    p = link_security(cfg, "p0")
    assert set(p.client("rld0", fast=True)) == {"mac_key"}
    assert p.client("md0")["server_hostname"] == "md0" and p.client("md0")["ssl"] is not None
    assert link_security(cfg, "gateway").client("rld0")["server_hostname"] == "rld0"

    off = ClusterConfig.model_validate({"security": {"tls": False, "fast_path": "plain"}})
    assert link_security(off, "rld0").server() == {"allow_plain": True}
    assert link_security(off, "p0").client("md0") == {} and link_security(off, "p0").client("rld0", fast=True) == {}

    missing = ClusterConfig()  # TLS on by default, but no cert dir: a clear error
    with pytest.raises(SecurityError, match="pdd certs"):
        link_security(missing, "md0").server()


def test_peer_module_documents_mac_close_policy():
    assert "connection is **closed**" in peer_module.__doc__


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
async def test_a_tls_server_listens_on_an_ipv6_host(certs):
    """`host: "::1"` (valid in the config) made every engine die at start: the TLS listener was an
    IPv4 socket ("Address family for hostname not supported")."""
    s = Server("::1", 0, {"echo": lambda p, h, b: ({"t": "echo_ok"}, bytes(b))}, role="md", instance="srv",
               ssl=server_context(certs, "srv"))
    server = await s.start()
    try:
        peer = await connect("::1", server.port, role="gw", **tls_client(certs))
        h, p = await peer.call({"t": "echo"}, b"x")
        assert (h["t"], bytes(p), peer.auth) == ("echo_ok", b"x", "tls")
        await peer.close()
    finally:
        await server.close()
