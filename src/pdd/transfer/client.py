"""The connecting side of pdd connections: :func:`connect` opens one (TLS or plain), runs the
handshake (:mod:`pdd.transfer.handshake`) and returns a started
:class:`~pdd.transfer.peer.Peer`; :class:`PeerPool` keeps one connection per address and
reconnects when it dropped (:func:`connect_cached`: a default pool per event loop).

:func:`connect` with ``ssl`` (+ ``server_hostname``: the instance name in the server
certificate's SAN) or ``mac_key`` authenticates this side; a refused certificate or key raises
:class:`~pdd.transfer.handshake.HandshakeError` at once (never retried).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import weakref
from typing import Callable, Optional, Union

from . import wire
from .handshake import HandshakeError, cert_common_name, client_handshake, default_handshake_check, hello_header
from .peer import STREAM_LIMIT_BYTES, Peer
from .wire import WireError

__all__ = ["connect", "PeerPool", "connect_cached", "parse_addr"]


def parse_addr(addr: Union[str, tuple]) -> tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(addr, str):
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address must be 'host:port', got {addr!r}")
        return host.strip("[]"), int(port)
    host, port = addr
    return str(host), int(port)



async def connect(
    host: str,
    port: int,
    handlers: Optional[dict] = None,
    *,
    role: str = "",
    instance: str = "",
    fingerprint: Optional[dict] = None,
    handshake_check: Callable[[Optional[dict], Optional[dict]], None] = default_handshake_check,
    retries: int = 0,
    backoff_s: float = 0.1,
    max_backoff_s: float = 2.0,
    connect_timeout_s: float = 10.0,
    crc: bool = False,
    max_payload_bytes: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
    ssl: Optional[_ssl.SSLContext] = None,
    server_hostname: Optional[str] = None,
    mac_key: Optional[bytes] = None,
    heartbeat_s: Optional[float] = None,
    dead_after_s: Optional[float] = None,
) -> Peer:
    """Open a connection, do the handshake, return a started :class:`Peer`.

    ``heartbeat_s`` / ``dead_after_s``: heartbeats (:mod:`pdd.transfer.peer`), used when the server
    sends them too.

    Retries refused/unreachable connects ``retries`` times with exponential backoff
    (``backoff_s`` doubling up to ``max_backoff_s``, seconds). A :class:`HandshakeError` is never retried.
    ``ssl``: client context (mutual TLS); ``server_hostname``: the name the server's certificate
    must carry (default ``host``). ``mac_key``: authenticate every frame with the fast-path MAC.
    A server that refuses this side's certificate or key, or whose certificate does not verify,
    raises :class:`HandshakeError`.
    """
    hello = hello_header(role, instance, fingerprint, heartbeat_s)
    delay = backoff_s
    attempt = 0
    tls_kw = {} if ssl is None else {"ssl": ssl, "server_hostname": server_hostname or host,
                                     "ssl_handshake_timeout": connect_timeout_s}
    while True:
        try:
            try:
                _, stream = await asyncio.wait_for(
                    asyncio.get_running_loop().create_connection(
                        lambda: wire.FrameStream(STREAM_LIMIT_BYTES), host, port, **tls_kw
                    ),
                    connect_timeout_s,
                )
            except _ssl.SSLError as e:  # the server's certificate did not verify (or TLS refused)
                raise HandshakeError(f"TLS with {host}:{port} failed: {e}") from None
            reader = writer = stream
            peer = Peer(reader, writer, handlers, name=f"{host}:{port}", crc=crc, max_payload_bytes=max_payload_bytes,
                        heartbeat_s=heartbeat_s, dead_after_s=dead_after_s)
            try:
                await client_handshake(peer, hello, handshake_check, connect_timeout_s, mac_key)
            except HandshakeError:
                writer.close()
                raise
            except BaseException as e:
                writer.close()
                tls_err = getattr(stream, "_exc", None)
                if isinstance(tls_err, _ssl.SSLError):  # e.g. the server refused our certificate
                    raise HandshakeError(f"TLS with {host}:{port} refused: {tls_err}") from None
                if ssl is not None and (
                    isinstance(e, ConnectionResetError) or (isinstance(e, asyncio.IncompleteReadError) and not e.partial)
                ):
                    # the server closed right after our side of the TLS handshake, without a word:
                    # what asyncio's TLS server does when it refuses the client's certificate
                    raise HandshakeError(
                        f"TLS with {host}:{port} refused: the server closed the connection after the handshake "
                        "(our certificate is missing, expired or not signed by its CA)"
                    ) from None
                if isinstance(e, (asyncio.IncompleteReadError, WireError)):
                    raise ConnectionError(f"handshake with {host}:{port} failed: {e!r}") from e
                raise
            if ssl is not None:
                peer.auth = "tls"
                peer.cert_name = cert_common_name(writer.get_extra_info("peercert"))
            peer.start()
            return peer
        except HandshakeError:
            raise
        except (OSError, ConnectionError, asyncio.TimeoutError, TimeoutError) as e:
            attempt += 1
            if attempt > retries:
                if isinstance(e, ConnectionError):
                    raise
                raise ConnectionError(f"cannot connect to {host}:{port}: {e!r}") from e
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)


class PeerPool:
    """One persistent connection per address, reconnecting when it dropped.

    ``connect_kw`` go to :func:`connect` (handlers, role, instance, fingerprint, retries, ...).
    """

    def __init__(self, handlers: Optional[dict] = None, **connect_kw):
        self.handlers = handlers if handlers is not None else {}
        self.connect_kw = connect_kw
        self._peers: dict[tuple[str, int], Peer] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.connects = 0

    async def get(self, addr: Union[str, tuple]) -> Peer:
        """The open Peer for ``addr`` (``"host:port"`` or ``(host, port)``), connecting if needed."""
        key = parse_addr(addr)
        p = self._peers.get(key)
        if p is not None and not p.closed:
            return p
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            p = self._peers.get(key)
            if p is not None and not p.closed:
                return p
            p = await connect(key[0], key[1], self.handlers, **self.connect_kw)
            self.connects += 1
            self._peers[key] = p
            return p

    def peers(self) -> dict:
        return {f"{h}:{p}": peer for (h, p), peer in self._peers.items() if not peer.closed}

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in list(self._peers.values())), return_exceptions=True)
        self._peers.clear()



_default_pools: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PeerPool]" = weakref.WeakKeyDictionary()


async def connect_cached(addr: Union[str, tuple], pool: Optional[PeerPool] = None) -> Peer:
    """``pool.get(addr)``; without ``pool``, a default pool per event loop (no handlers, anonymous hello)."""
    if pool is None:
        loop = asyncio.get_running_loop()
        pool = _default_pools.get(loop)
        if pool is None:
            pool = _default_pools[loop] = PeerPool()
    return await pool.get(addr)