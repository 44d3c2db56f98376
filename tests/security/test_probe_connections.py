"""A connection closed before sending a byte (``pdd launch --join`` checking that the instance
listens, a monitor's TCP check) is a probe: counted in ``Server.probes``, logged at debug level,
not refused. Refusals are unchanged: on the same server a bad handshake (garbage, a plain
connection where TLS is required) is still counted in ``Server.refused`` with its warning, and
good peers still connect. Covered on each kind of port: unauthenticated, fast-path MAC, mutual TLS
(which also accepts MAC'd connections on the same port)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from pdd.security import server_context
from pdd.transfer.client import connect
from pdd.transfer.server import Server

from .helpers import wait_for

KEY = bytes(range(32))


def _server(kind: str, certs) -> Server:
    handlers = {"echo": lambda p, h, b: {"t": "echo_ok"}}
    if kind == "plain":
        return Server("127.0.0.1", 0, handlers, role="md", instance="srv")
    if kind == "mac":
        return Server("127.0.0.1", 0, handlers, role="md", instance="srv", mac_key=KEY)
    return Server("127.0.0.1", 0, handlers, role="md", instance="srv", ssl=server_context(certs, "srv"), mac_key=None)


def _connect_and_close(port: int) -> None:
    """What pdd.gateway.join does while it waits for the instance to listen."""
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


async def _bad_handshake(port: int) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET / HTTP/1.1\r\n\r\n")
    try:
        await asyncio.wait_for(r.read(), 5)  # until the server closes it
    except ConnectionResetError:
        pass  # a TLS port resets it (the junk was never read)
    w.close()


@pytest.mark.parametrize("kind", ["plain", "mac", "tls"])
async def test_connect_and_close_is_a_probe_not_a_refusal(kind, certs, caplog):
    caplog.set_level(logging.DEBUG, logger="pdd.transfer.server")
    server = await _server(kind, certs).start()
    try:
        await asyncio.to_thread(_connect_and_close, server.port)
        assert await wait_for(lambda: server.probes + server.refused == 1)  # the server saw it close
        assert (server.probes, server.refused) == (1, 0) and not server.peers
        msgs = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "pdd.transfer.server"]
        assert [lvl for lvl, _ in msgs] == ["DEBUG"]
        assert msgs[0][1].endswith("closed before sending a byte (a probe)")
        assert not any("refused" in m for _, m in msgs)

        caplog.clear()
        await _bad_handshake(server.port)
        assert await wait_for(lambda: server.refused == 1)
        assert server.probes == 1 and not server.peers
        warned = [r.getMessage() for r in caplog.records if r.name == "pdd.transfer.server" and r.levelname == "WARNING"]
        assert len(warned) == 1 and warned[0].startswith("refused connection from ")
        if kind == "tls":
            assert warned[0].endswith(": plain connection where mutual TLS is required")

        if kind != "tls":  # the port still serves a good peer
            peer = await connect("127.0.0.1", server.port, instance="cli", mac_key=KEY if kind == "mac" else None)
            assert (await peer.call({"t": "echo"}))[0]["t"] == "echo_ok"
            await peer.close()
        assert (server.refused, server.probes) == (1, 1)
    finally:
        await server.close()


async def test_silent_connection_is_still_refused_at_the_handshake_timeout():
    """Open and silent (not closed) until the handshake timeout: refused, not a probe."""
    server = await Server("127.0.0.1", 0, {}, handshake_timeout_s=0.2).start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the server at the timeout
        w.close()
        assert await wait_for(lambda: server.refused == 1)
        assert server.probes == 0
    finally:
        await server.close()
