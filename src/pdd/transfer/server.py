"""The accepting side of pdd connections: :class:`Server` listens on a port, runs the handshake
(:mod:`pdd.transfer.handshake`) on each connection and turns it into a started
:class:`~pdd.transfer.peer.Peer` that shares the server's handlers.

Security (``pdd.security`` builds the contexts and keys for a topology). A :class:`Server` given
``ssl`` (an ``ssl.SSLContext`` that requires client certificates) serves mutual TLS; one given
``mac_key`` also accepts plain connections whose every frame, the hellos included, carries a
keyed MAC (``wire.FrameMac``; the in-datacenter fast path, where TLS is not used); with
``allow_plain`` it accepts unauthenticated connections too (the default only when it has neither).
TLS and plain connections share the port: the first byte tells a TLS ClientHello (0x16) from a
pdd frame (``b"P"``). Anything else is refused and counted in ``Server.refused``: a plain or
MAC-less connection where authentication is required, a TLS client without a certificate or with
one the CA did not sign, a MAC'd hello under another key, and (``check_identity``) a TLS peer
whose hello names an instance other than its certificate's common name. A connection closed
before sending a single byte (a readiness probe: ``pdd launch --join`` waits for the port to
accept, a monitor's TCP check, a port scan) is not refused: it is logged at debug level and
counted in ``Server.probes``; one that stays silent until the handshake timeout is still refused.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as _ssl
from typing import Any, Callable, Optional

from . import wire
from .handshake import HANDSHAKE_TIMEOUT_S, default_handshake_check, hello_header, server_handshake
from .peer import STREAM_LIMIT_BYTES, Handler, Peer, maybe_await

__all__ = ["Server"]

log = logging.getLogger(__name__)


class Server:
    """Accepts connections; each becomes a :class:`Peer` sharing ``handlers``.

    ``port=0`` picks a free port (read ``server.port`` after ``start()``).
    ``on_connect(peer)`` / ``on_disconnect(peer)``: sync or async callbacks.
    ``handshake_check(local_fp, remote_fp)`` raises to refuse a peer.
    ``ssl``: server context (mutual TLS: it should require client certificates); ``mac_key``:
    accept plain connections authenticated by the fast-path MAC; ``allow_plain``: accept
    unauthenticated plain connections (default: only when neither ``ssl`` nor ``mac_key``);
    ``check_identity``: a TLS peer's hello must name its certificate's common name.
    Counters: ``refused`` (connections refused at TLS or hello time, a silent one at the
    handshake timeout), ``probes`` (connections closed before sending a byte: readiness checks,
    not refused), ``mac_failures`` (connections closed because a frame failed its MAC).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        handlers: Optional[dict] = None,
        *,
        on_connect: Optional[Callable[[Peer], Any]] = None,
        on_disconnect: Optional[Callable[[Peer], Any]] = None,
        role: str = "",
        instance: str = "",
        fingerprint: Optional[dict] = None,
        handshake_check: Callable[[Optional[dict], Optional[dict]], None] = default_handshake_check,
        crc: bool = False,
        max_payload_bytes: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        ssl: Optional[_ssl.SSLContext] = None,
        mac_key: Optional[bytes] = None,
        allow_plain: Optional[bool] = None,
        check_identity: bool = True,
        heartbeat_s: Optional[float] = None,
        dead_after_s: Optional[float] = None,
    ):
        self.host = host
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.port = port
        self.handlers: dict = handlers if handlers is not None else {}
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self.hello = hello_header(role, instance, fingerprint, heartbeat_s)
        self.handshake_check = handshake_check
        self.crc = crc
        self.max_payload_bytes = max_payload_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.peers: set[Peer] = set()
        self.refused = 0
        self.probes = 0
        self.mac_failures = 0
        self.ssl = ssl
        self.mac_key = bytes(mac_key) if mac_key is not None else None
        self.allow_plain = (ssl is None and mac_key is None) if allow_plain is None else bool(allow_plain)
        self.check_identity = check_identity
        self._server: Optional[asyncio.base_events.Server] = None
        self._lsock: Optional[socket.socket] = None
        self._accept_task: Optional[asyncio.Task] = None
        self._handshakes: set[asyncio.Task] = set()

    def on(self, t: str, handler: Handler) -> None:
        """Register a handler for message type ``t`` on all (current and future) connections."""
        self.handlers[t] = handler

    async def start(self) -> "Server":
        loop = asyncio.get_running_loop()
        if self.ssl is not None:  # TLS and plain (MAC) connections on one port: sniff the first byte
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]  # ::1 is IPv6
            sock = socket.create_server((self.host, self.port), family=family, backlog=128)
            sock.setblocking(False)
            self._lsock = sock
            self.port = sock.getsockname()[1]
            self._accept_task = loop.create_task(self._accept_loop(sock), name=f"rpc-accept-{self.port}")
            return self
        self._server = await loop.create_server(
            lambda: wire.FrameStream(STREAM_LIMIT_BYTES, on_made=self._made), self.host, self.port
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # e.g. out of file descriptors: keep serving
                log.warning("accept on %s failed: %r", self.addr, e)
                await asyncio.sleep(0.1)
                continue
            t = loop.create_task(self._accept_sniffed(conn, addr))
            self._handshakes.add(t)
            t.add_done_callback(self._handshakes.discard)

    def _refuse(self, addr, why) -> None:
        self.refused += 1
        log.warning("refused connection from %s: %s", addr, why)

    def _probed(self, addr) -> None:
        """A connection closed before sending a byte: a readiness probe, not a refusal."""
        self.probes += 1
        log.debug("connection from %s closed before sending a byte (a probe)", addr)

    async def _accept_sniffed(self, conn: socket.socket, addr) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                first = await asyncio.wait_for(_peek1(loop, conn), self.handshake_timeout_s)
            except (OSError, asyncio.TimeoutError, TimeoutError) as e:
                self._refuse(addr, f"nothing received: {e!r}")
                conn.close()
                return
            if not first:  # EOF before any byte: someone checked that the port accepts
                self._probed(addr)
                conn.close()
                return
            tls = first == b"\x16"  # TLS record type "handshake" (ClientHello)
            if not tls and self.mac_key is None and not self.allow_plain:
                self._refuse(addr, "plain connection where mutual TLS is required")
                conn.close()
                return
            try:
                _, stream = await loop.connect_accepted_socket(
                    lambda: wire.FrameStream(STREAM_LIMIT_BYTES),
                    conn,
                    ssl=self.ssl if tls else None,
                    ssl_handshake_timeout=self.handshake_timeout_s if tls else None,
                )
            except asyncio.CancelledError:
                conn.close()
                raise
            except Exception as e:  # TLS handshake failed: no client certificate, unknown CA, expired ...
                self._refuse(addr, f"TLS handshake failed: {e!r}")
                conn.close()
                return
        except asyncio.CancelledError:
            conn.close()
            raise
        await self._accept(stream, stream, tls=tls)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def _made(self, stream: wire.FrameStream) -> None:
        t = asyncio.get_running_loop().create_task(self._accept(stream, stream))
        self._handshakes.add(t)
        t.add_done_callback(self._handshakes.discard)

    async def _accept(self, reader: wire.FrameStream, writer: wire.FrameStream, tls: bool = False) -> None:
        peer = Peer(reader, writer, self.handlers, crc=self.crc, max_payload_bytes=self.max_payload_bytes,
                    heartbeat_s=self.heartbeat_s, dead_after_s=self.dead_after_s)
        try:
            await server_handshake(
                peer,
                self.hello,
                self.handshake_check,
                self.handshake_timeout_s,
                tls=tls,
                mac_key=self.mac_key,
                allow_plain=self.allow_plain,
                check_identity=self.check_identity,
            )
        except asyncio.CancelledError:
            writer.close()
            raise
        except Exception as e:
            if not tls and isinstance(e, asyncio.IncompleteReadError) and reader.rx_bytes == 0:
                self._probed(writer.get_extra_info("peername"))  # EOF before any byte (plain port)
            else:
                self._refuse(writer.get_extra_info("peername"), repr(e))
            writer.close()
            return
        peer.name = str(peer.remote_instance or peer.peername)
        self.peers.add(peer)

        def _gone(p: Peer) -> None:
            self.peers.discard(p)
            self.mac_failures += p.mac_failures
            if self.on_disconnect is not None:
                return self.on_disconnect(p)

        peer.on_close(_gone)
        peer.start()
        if self.on_connect is not None:
            try:
                await maybe_await(self.on_connect(peer))
            except Exception:
                log.exception("on_connect failed for %r", peer)

    async def close(self) -> None:
        """Stop accepting and close all peers."""
        if self._server is not None:
            self._server.close()
        if self._accept_task is not None:
            self._accept_task.cancel()
            try:
                await self._accept_task
            except (asyncio.CancelledError, Exception):
                pass
            self._accept_task = None
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
        for t in list(self._handshakes):
            t.cancel()
        await asyncio.gather(*(p.close() for p in list(self.peers)), return_exceptions=True)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def __aenter__(self) -> "Server":
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def _peek1(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The first byte waiting on ``sock`` without consuming it (b"" at EOF)."""
    while True:
        try:
            return sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            pass
        fut = loop.create_future()
        loop.add_reader(sock.fileno(), lambda: None if fut.done() else fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(sock.fileno())
