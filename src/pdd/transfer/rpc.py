"""Persistent, multiplexed connections between pdd instances (asyncio streams).

One :class:`Peer` is one TCP connection shared by all requests between two instances.
Both sides can, at any time:

- ``await peer.call(header, payload, timeout=s)`` -> ``(reply_header, reply_payload)``:
  the request carries a ``"cid"`` (call id, unique per sending side); the reply carries the
  same ``"cid"`` and ``"reply": True``. A handler exception comes back as
  an ``error {cid, reply: True, error: str}`` header and raises :class:`RemoteError`.
- ``await peer.send(header, payload)``: one-way message (no ``"cid"``).
- receive: messages are dispatched by ``header["t"]`` to ``handler(peer, header, payload)``
  (sync or async). For a call, the handler's return value is the reply: ``None`` (empty reply
  ``ok``), a header dict, or ``(header, payload)``. The headers are built and read by
  :mod:`pdd.transfer.messages` (one dataclass per kind).

Ordering: one-way messages from a peer are handled **sequentially, in arrival order**, by one
dispatcher task per connection (so ``kv`` frames and the ``kv_done`` after them are seen in
order, and a slow handler back-pressures the sender through TCP). Calls are handled
concurrently, each in its own task. A one-way handler may ``await peer.call(...)`` on the same
peer (replies are read by the reader task, not the dispatcher).

Writes: one lock per connection; a frame's buffers are written back to back and the lock is
held through ``drain()``, so frames never interleave and at most about one frame is buffered
per connection beyond the transport's high-water mark. When the connection closes (EOF,
reset, protocol error or ``close()``), pending calls fail at once with ``ConnectionError``
and later ``call``/``send`` raise ``ConnectionError``.

Handshake: the connecting side sends ``hello {proto, role, instance, fingerprint}``; the
accepting side checks it with ``handshake_check(local_fp, remote_fp)``
and answers ``hello`` (its own identity) or ``error {error: reason}`` then closes;
the connecting side checks the answer the same way. A failed check raises
:class:`HandshakeError` (a ``ConnectionError``).

Security (``pdd.security`` builds the contexts and keys for a topology). A :class:`Server` given
``ssl`` (an ``ssl.SSLContext`` that requires client certificates) serves mutual TLS; one given
``mac_key`` also accepts plain connections whose every frame, the hellos included, carries a
keyed MAC (``wire.FrameMac``; the in-datacenter fast path, where TLS is not used); with
``allow_plain`` it accepts unauthenticated connections too (the default only when it has neither).
TLS and plain connections share the port: the first byte tells a TLS ClientHello (0x16) from a
pdd frame (``b"P"``). Anything else is refused and counted in ``Server.refused``: a plain or
MAC-less connection where authentication is required, a TLS client without a certificate or with
one the CA did not sign, a MAC'd hello under another key, and (``check_identity``) a TLS peer
whose hello names an instance other than its certificate's common name.
:func:`connect` with ``ssl`` (+ ``server_hostname``: the instance name in the server
certificate's SAN) or ``mac_key`` does the client side; a refused certificate or key raises
:class:`HandshakeError` at once (never retried).

Heartbeats (liveness): a side created with ``heartbeat_s`` says so in its hello (``"hb"``);
when both sides do, each sends a ``_hb`` frame every ``heartbeat_s`` seconds (consumed by the
reader, never dispatched) and closes the connection once it has received **no byte at all** for
``dead_after_s`` seconds (:class:`ConnectionError` "no sign of life"). Bytes of a slow frame count,
so a long KV transfer over a slowed line is alive; a peer that was SIGKILLed, hangs, or sits
behind a WAN outage that drops packets without a reset is found within ``dead_after_s``.

Fast-path MAC keys: each connection derives its own pair of keys (one per direction) from the
shared key and a random nonce from each side's hello, and counts frames in each direction, so
a frame replayed from another connection, or reordered or dropped within one, fails its MAC.
A frame that fails its MAC is dropped undecoded, counted (``Peer.mac_failures``,
``Server.mac_failures``) and the connection is **closed**: the sender's transfers on it fail
(P reconnects for the next request) and no later frame of the stream, e.g. the ``kv_done`` that
would complete a request whose pages were dropped, is ever delivered.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import inspect
import itertools
import logging
import os
import socket
import ssl as _ssl
import weakref
from typing import Any, Awaitable, Callable, Mapping, Optional, Union

from . import messages, wire
from .wire import CrcError, FrameMac, MacError, WireError

__all__ = [
    "PROTO",
    "RemoteError",
    "HandshakeError",
    "Handler",
    "Peer",
    "Server",
    "connect",
    "PeerPool",
    "connect_cached",
    "default_handshake_check",
    "parse_addr",
    "cert_common_name",
]

log = logging.getLogger("pdd.transfer.rpc")

PROTO = 1  # rpc protocol revision carried in "hello"
STREAM_LIMIT_BYTES = 1 << 20  # unread bytes buffered per connection before reading pauses
DEFAULT_CALL_TIMEOUT_S = 60.0
HANDSHAKE_TIMEOUT_S = 10.0

Reply = Union[None, dict, tuple]
Handler = Callable[["Peer", dict, bytes], Union[Reply, Awaitable[Reply]]]


class RemoteError(Exception):
    """The remote handler of a call raised; ``str(e)`` is the remote error text."""

    def __init__(self, msg: str, header: dict | None = None):
        super().__init__(msg)
        self.header = header or {}


class CallFailed(RuntimeError):
    """Raised by a call's handler to fail it with ``detail`` (a dict of plain values) in the error
    reply (``Error.detail``; the caller reads it in ``RemoteError.header["detail"]``)."""

    def __init__(self, msg: str, **detail):
        super().__init__(msg)
        self.detail = detail


class HandshakeError(ConnectionError):
    """The two sides refused each other at connect time (e.g. KV fingerprint mismatch)."""


def default_handshake_check(local_fp: Optional[dict], remote_fp: Optional[dict]) -> None:
    """Refuse peers whose KV fingerprints disagree.

    A side without a fingerprint (``None``, e.g. the gateway or the link control client) is
    accepted by anyone. Otherwise every key present in both dicts must have equal values
    (so adding a key on one side stays compatible). Raises :class:`HandshakeError`.
    """
    if local_fp is None or remote_fp is None:
        return
    if not isinstance(local_fp, dict) or not isinstance(remote_fp, dict):
        raise HandshakeError(f"fingerprints must be dicts, got {type(local_fp).__name__}/{type(remote_fp).__name__}")
    diffs = {k: (local_fp[k], remote_fp[k]) for k in local_fp.keys() & remote_fp.keys() if local_fp[k] != remote_fp[k]}
    if diffs:
        detail = ", ".join(f"{k}: local={a!r} remote={b!r}" for k, (a, b) in sorted(diffs.items()))
        raise HandshakeError(f"KV fingerprint mismatch ({detail})")


def parse_addr(addr: Union[str, tuple]) -> tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(addr, str):
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address must be 'host:port', got {addr!r}")
        return host.strip("[]"), int(port)
    host, port = addr
    return str(host), int(port)


async def _maybe_await(x):
    if inspect.isawaitable(x):
        return await x
    return x


def _normalize_reply(ret, req_header: dict) -> tuple[dict, Any]:
    if ret is None:
        return messages.Ok().wire(), b""
    if isinstance(ret, dict):
        return dict(ret), b""
    if isinstance(ret, tuple) and len(ret) == 2 and isinstance(ret[0], dict):
        return dict(ret[0]), ret[1]
    raise TypeError(
        f"handler for {req_header.get('t')!r} returned {type(ret).__name__}; expected None, dict or (dict, payload)"
    )


class Peer:
    """One persistent bidirectional connection to another instance.

    ``reader`` / ``writer``: a :class:`~pdd.transfer.wire.FrameStream` (both roles; what
    :func:`connect` and :class:`Server` use) or an asyncio StreamReader / StreamWriter pair.

    ``handlers`` is a shared table (e.g. a :class:`Server`'s, used by all its peers);
    :meth:`on` adds per-connection handlers that take precedence.
    ``crc``: default for the ``crc`` flag of frames this side sends (bool).
    ``max_payload_bytes``: largest payload accepted from the other side.
    ``dispatch_queue`` / ``dispatch_queue_bytes``: one-way frames / payload bytes buffered for the
    dispatcher before the reader stops reading (backpressure; one frame is always admitted).
    """

    def __init__(
        self,
        reader: Any,
        writer: Any,
        handlers: Optional[dict] = None,
        *,
        name: str = "",
        crc: bool = False,
        max_payload_bytes: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
        dispatch_queue: int = 256,
        dispatch_queue_bytes: int = 16 << 20,
        heartbeat_s: Optional[float] = None,
        dead_after_s: Optional[float] = None,
    ):
        self.reader = reader
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s if dead_after_s is not None else (
            5 * heartbeat_s if heartbeat_s else None)
        self._hb_task: Optional[asyncio.Task] = None
        self._hb_sending = False
        self.writer = writer
        self.handlers: dict = handlers if handlers is not None else {}
        self._own_handlers: dict = {}
        self.name = name
        self.crc = crc
        self.max_payload_bytes = max_payload_bytes
        self.local_hello: dict = {}
        self.remote_hello: dict = {}
        self._cids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._wlock = asyncio.Lock()
        self._q: collections.deque = collections.deque()
        self._q_bytes = 0
        self._q_max = dispatch_queue
        self._q_max_bytes = dispatch_queue_bytes
        self._q_items = asyncio.Event()
        self._q_space = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._reader_task: Optional[asyncio.Task] = None
        self._dispatch_task: Optional[asyncio.Task] = None
        self._closed = False
        self._close_reason: Optional[BaseException] = None
        self._closed_event = asyncio.Event()
        self._on_close: list[Callable[["Peer"], Any]] = []
        # counters (bytes: payload bytes only, framing excluded)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.frames_dropped = 0
        self.mac_failures = 0
        # authentication of this connection, set by the handshake: "tls", "mac" or None (plain)
        self.auth: Optional[str] = None
        self.mac_tx: Optional[FrameMac] = None  # set together when auth == "mac"
        self.mac_rx: Optional[FrameMac] = None
        self.cert_name: Optional[str] = None  # common name of the TLS peer's certificate
        self.dead_peer = False  # closed by the heartbeat (no byte for dead_after_s)

    # ---------------------------------------------------------------- identity
    @property
    def remote_role(self) -> Optional[str]:
        return self.remote_hello.get("role")

    @property
    def remote_instance(self) -> Optional[str]:
        return self.remote_hello.get("instance")

    @property
    def remote_fingerprint(self) -> Optional[dict]:
        return self.remote_hello.get("fingerprint")

    @property
    def peername(self):
        return self.writer.get_extra_info("peername")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Peer {self.name or self.remote_instance or self.peername} {state}>"

    # ---------------------------------------------------------------- lifecycle
    def on(self, t: str, handler: Handler) -> None:
        """Register ``handler(peer, header, payload)`` for message type ``t`` on this connection."""
        self._own_handlers[t] = handler

    def on_close(self, cb: Callable[["Peer"], Any]) -> None:
        """Call ``cb(peer)`` (sync, or async -> scheduled) once when the connection closes."""
        if self._closed:
            self._spawn_cb(cb)
        else:
            self._on_close.append(cb)

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start the reader and dispatcher tasks (done by ``connect``/``Server`` after the handshake)."""
        if self._reader_task is None:
            self._reader_task = asyncio.create_task(self._read_loop(), name=f"peer-read-{self.name}")
            self._dispatch_task = asyncio.create_task(self._dispatch_loop(), name=f"peer-dispatch-{self.name}")
            if self.heartbeat_s and self.remote_hello.get("hb"):
                self._hb_task = asyncio.create_task(self._heartbeat_loop(), name=f"peer-hb-{self.name}")

    def _rx_mark(self) -> int:
        """A counter that grows with every byte received (frames, for readers without a byte count)."""
        n = getattr(self.reader, "rx_bytes", None)
        return int(n) if isinstance(n, int) else self.frames_received

    async def _heartbeat_loop(self) -> None:
        """Send ``_hb`` every ``heartbeat_s``; close the connection after ``dead_after_s`` without a byte."""
        loop = asyncio.get_running_loop()
        mark, seen = self._rx_mark(), loop.time()
        while not self._closed:
            await asyncio.sleep(self.heartbeat_s)
            now = loop.time()
            m = self._rx_mark()
            if m != mark:
                mark, seen = m, now
            elif now - seen > self.dead_after_s:
                self.dead_peer = True
                log.warning("%r: nothing received for %.1f s: peer declared dead", self, now - seen)
                self._shutdown(ConnectionError(
                    f"no sign of life from {self._label()} for {now - seen:.1f} s (heartbeat)"), abort=True)
                return
            if not self._hb_sending:  # one heartbeat in flight at most (a blocked write holds it)
                self._hb_sending = True
                self._spawn(self._send_hb())

    async def _send_hb(self) -> None:
        try:
            await self._write(messages.Heartbeat().wire(), b"", None)
        except Exception:
            pass
        finally:
            self._hb_sending = False

    async def close(self, timeout_s: float = 2.0) -> None:
        """Close the connection; pending calls fail with ConnectionError. Idempotent.

        Buffered frames are flushed for up to ``timeout_s`` seconds, then the socket is aborted
        (a peer that stopped reading cannot make ``close`` hang).
        """
        self._shutdown(ConnectionError("connection closed locally"))
        try:
            await asyncio.wait_for(self.wait_closed(), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self.writer.transport.abort()

    async def wait_closed(self) -> None:
        """Wait until the connection is closed (by either side) and the socket is released."""
        await self._closed_event.wait()
        try:
            await self.writer.wait_closed()
        except Exception:
            pass

    def abort(self) -> None:
        """Drop the connection at once (RST where possible), failing pending calls."""
        self._shutdown(ConnectionError("connection aborted locally"), abort=True)

    def _shutdown(self, reason: BaseException, abort: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"connection to {self._label()} lost: {reason}"))
        self._pending.clear()
        try:
            if abort:
                self.writer.transport.abort()
            else:
                self.writer.close()
        except Exception:
            pass
        cur = asyncio.current_task()
        for t in (self._reader_task, self._dispatch_task, self._hb_task):
            if t is not None and t is not cur and not t.done():
                t.cancel()
        for t in list(self._tasks):
            if t is not cur:
                t.cancel()
        self._closed_event.set()
        for cb in self._on_close:
            self._spawn_cb(cb)
        self._on_close.clear()

    def _spawn_cb(self, cb) -> None:
        try:
            r = cb(self)
            if inspect.isawaitable(r):
                asyncio.ensure_future(r)
        except Exception:
            log.exception("on_close callback failed for %r", self)

    def _label(self) -> str:
        return self.name or str(self.remote_instance or self.peername)

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionError(f"connection to {self._label()} is closed ({self._close_reason})")

    # ---------------------------------------------------------------- sending
    async def _write(self, header: dict, payload, crc: Optional[bool]) -> None:
        self._check_open()
        crc = self.crc if crc is None else crc
        if self.mac_tx is None:
            bufs = wire.encode_frame(header, payload, crc)
        async with self._wlock:
            self._check_open()
            if self.mac_tx is not None:  # the MAC counts frames: seal in write order
                bufs = wire.encode_frame(header, payload, crc, self.mac_tx)
            try:
                for b in bufs:
                    self.writer.write(b)
                if len(bufs) > 1 and isinstance(bufs[1], memoryview):
                    self.bytes_sent += bufs[1].nbytes
                self.frames_sent += 1
                await self.writer.drain()
            except (ConnectionError, OSError, RuntimeError) as e:
                err = ConnectionError(f"send to {self._label()} failed: {e!r}")
                self._shutdown(err)
                raise err from e

    async def send(self, header: dict, payload: Any = b"", *, crc: Optional[bool] = None) -> None:
        """Send a one-way message (``header`` must have ``"t"``; any ``"cid"`` is removed).

        Returns once the frame is handed to the transport (after ``drain()``).
        Raises ConnectionError if the connection is closed.
        """
        if "cid" in header or "reply" in header:
            header = {k: v for k, v in header.items() if k not in ("cid", "reply")}
        await self._write(header, payload, crc)

    async def call(
        self,
        header: dict,
        payload: Any = b"",
        *,
        timeout: Optional[float] = DEFAULT_CALL_TIMEOUT_S,
        crc: Optional[bool] = None,
    ) -> tuple[dict, bytes]:
        """Send a request and wait for its reply; returns ``(reply_header, reply_payload)``.

        ``timeout`` in seconds (None: no limit; connection loss still fails it at once).
        Raises RemoteError (remote handler failed), ConnectionError, TimeoutError.
        """
        self._check_open()
        cid = next(self._cids)
        header = dict(header)
        header["cid"] = cid
        header.pop("reply", None)
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        try:
            async with asyncio.timeout(timeout):  # covers a write blocked by backpressure too
                await self._write(header, payload, crc)
                rh, rp = await fut
        except TimeoutError:
            raise TimeoutError(f"call {header.get('t')!r} to {self._label()} timed out after {timeout} s") from None
        finally:
            self._pending.pop(cid, None)
            if not fut.done():
                fut.cancel()
        if rh.get("t") == "error":
            raise RemoteError(str(rh.get("error", "remote error")), rh)
        return rh, rp

    # ---------------------------------------------------------------- receiving
    async def _read_loop(self) -> None:
        reason: BaseException = ConnectionError("connection closed by peer")
        try:
            while True:
                try:
                    header, payload = await wire.read_frame(self.reader, self.max_payload_bytes, self.mac_rx)
                except CrcError as e:
                    self.frames_dropped += 1
                    log.warning("%r: %s", self, e)
                    self._on_bad_crc(e)
                    continue
                self.frames_received += 1
                self.bytes_received += len(payload)
                cid = header.get("cid")
                if cid is not None and type(cid) is not int:
                    raise WireError(f"'cid' must be an int, got {type(cid).__name__}")
                if header.get("t") == "_hb" and "cid" not in header:
                    continue  # heartbeat: its bytes already counted as a sign of life
                if header.get("reply"):
                    fut = self._pending.get(header.get("cid"))
                    if fut is not None and not fut.done():
                        fut.set_result((header, payload))
                    continue
                if "cid" in header:
                    self._spawn(self._handle_call(header, payload))
                else:
                    while self._q and (len(self._q) >= self._q_max or self._q_bytes >= self._q_max_bytes):
                        self._q_space.clear()
                        await self._q_space.wait()
                    self._q.append((header, payload))
                    self._q_bytes += len(payload)
                    self._q_items.set()
        except asyncio.IncompleteReadError as e:
            if e.partial:
                reason = ConnectionError(f"connection closed mid-frame ({len(e.partial)} of {e.expected} bytes)")
        except MacError as e:
            self.frames_dropped += 1
            self.mac_failures += 1
            log.error("%r: %s; closing the connection", self, e)
            reason = ConnectionError(f"frame failed authentication, connection closed: {e}")
        except WireError as e:
            log.error("%r: protocol error, closing: %s", self, e)
            reason = ConnectionError(f"protocol error: {e}")
        except asyncio.CancelledError:
            reason = self._close_reason or ConnectionError("reader cancelled")
        except (ConnectionError, OSError) as e:
            reason = ConnectionError(f"connection lost: {e!r}")
        except Exception as e:  # pragma: no cover - defensive
            log.exception("%r: reader failed", self)
            reason = ConnectionError(f"reader failed: {e!r}")
        finally:
            self._shutdown(reason)

    def _on_bad_crc(self, e: CrcError) -> None:
        h = e.header or {}
        cid = h.get("cid")
        if not isinstance(cid, int) or isinstance(cid, bool):  # a corrupt header's cid may be anything (fuzz)
            return
        if h.get("reply"):
            fut = self._pending.get(cid)
            if fut is not None and not fut.done():
                fut.set_exception(WireError(str(e)))
        elif cid is not None:
            self._spawn(self._reply(h, messages.Error(f"frame dropped: {e}").wire(), b""))

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _handler(self, t: str):
        h = self._own_handlers.get(t)
        if h is None:
            h = self.handlers.get(t)
        if h is None:
            h = self._own_handlers.get("*") or self.handlers.get("*")
        return h

    async def _dispatch_loop(self) -> None:
        while True:
            while not self._q:
                self._q_items.clear()
                await self._q_items.wait()
            header, payload = self._q.popleft()
            self._q_bytes -= len(payload)
            self._q_space.set()
            h = self._handler(header["t"])
            if h is None:
                log.warning("%r: no handler for one-way message %r, dropped", self, header["t"])
                continue
            try:
                await _maybe_await(h(self, header, payload))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%r: handler for one-way %r failed", self, header["t"])

    async def _handle_call(self, header: dict, payload) -> None:
        h = self._handler(header["t"])
        try:
            if h is None:
                raise LookupError(f"no handler for message type {header['t']!r}")
            rh, rp = _normalize_reply(await _maybe_await(h(self, header, payload)), header)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("%r: handler for call %r raised %r", self, header["t"], e)
            detail = getattr(e, "detail", None) if isinstance(e, CallFailed) else None
            rh, rp = messages.Error(f"{type(e).__name__}: {e}", detail or messages.OMIT).wire(), b""
        await self._reply(header, rh, rp)

    async def _reply(self, req: dict, rh: dict, rp) -> None:
        rh["cid"] = req["cid"]
        rh["reply"] = True
        try:
            await self._write(rh, rp, None)
        except ConnectionError:
            pass
        except Exception as e:  # e.g. unencodable reply header
            try:
                await self._write({**messages.Error(f"bad reply: {e!r}").wire(), "cid": req["cid"], "reply": True}, b"", None)
            except ConnectionError:
                pass


# -------------------------------------------------------------------- handshake
NONCE_BYTES = 16


def _hello(role: str, instance: str, fingerprint: Optional[dict], heartbeat_s: Optional[float] = None) -> dict:
    # ``hb``: this side sends heartbeats and expects them
    return messages.Hello(PROTO, role, instance, fingerprint,
                          hb=float(heartbeat_s) if heartbeat_s else messages.OMIT).wire()


def _mac(master: bytes, label: bytes, alg: str = "hmac") -> FrameMac:
    """A direction's MAC state under a key derived from the shared fast-path key."""
    return FrameMac(hmac.new(master, b"pdd-fastpath-v1 " + label, hashlib.sha256).digest(), alg)


def _session_macs(master: bytes, cn: bytes, sn: bytes) -> tuple[FrameMac, FrameMac]:
    """(client->server, server->client) MAC states of one connection (after the hellos): AES-GMAC
    under keys that exist for this connection only (both sides' random nonces), so its counter
    nonces never repeat under a key; the hellos themselves use HMAC."""
    return _mac(master, b"c2s " + cn + sn, "gmac"), _mac(master, b"s2c " + cn + sn, "gmac")


def cert_common_name(peercert: Optional[dict]) -> Optional[str]:
    """The commonName of a certificate as ``ssl.SSLSocket.getpeercert()`` returns it."""
    for rdn in (peercert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    return None


async def _write_raw(peer: Peer, header: dict, mac: Optional[FrameMac] = None) -> None:
    for b in wire.encode_frame(header, mac=mac):
        peer.writer.write(b)
    await peer.writer.drain()


async def _client_handshake(peer: Peer, hello: dict, check, timeout: float, mac_key: Optional[bytes] = None) -> None:
    cn = os.urandom(NONCE_BYTES) if mac_key is not None else None
    if cn is not None:
        hello = {**hello, "nonce": cn}
    await _write_raw(peer, hello, _mac(mac_key, b"hello c2s") if mac_key is not None else None)

    async def read_reply():
        prefix = await peer.reader.readexactly(wire.PREFIX_BYTES)
        flags = wire.decode_prefix(prefix, wire.MAX_HEADER_BYTES)[0]
        mac = _mac(mac_key, b"hello s2c " + cn) if (mac_key is not None and flags & wire.FLAG_MAC) else None
        return await wire.read_frame_rest(peer.reader, prefix, wire.MAX_HEADER_BYTES, mac), mac

    try:
        (h, _), mac = await asyncio.wait_for(read_reply(), timeout)
    except MacError as e:
        raise HandshakeError(f"server failed fast-path authentication: {e}") from None
    if h.get("t") == "error":
        raise HandshakeError(f"peer refused connection: {h.get('error')}")
    if h.get("t") != "hello":
        raise HandshakeError(f"expected 'hello', got {h.get('t')!r}")
    if h.get("proto") != PROTO:
        raise HandshakeError(f"rpc proto mismatch: local {PROTO}, remote {h.get('proto')!r}")
    if mac_key is not None:
        sn = h.get("nonce")
        if mac is None or not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
            raise HandshakeError("server did not authenticate its hello with the fast-path key")
        peer.mac_tx, peer.mac_rx = _session_macs(mac_key, cn, sn)
        peer.auth = "mac"
    check(hello.get("fingerprint"), h.get("fingerprint"))
    peer.local_hello, peer.remote_hello = hello, h


async def _server_handshake(
    peer: Peer,
    hello: dict,
    check,
    timeout: float,
    *,
    tls: bool = False,
    mac_key: Optional[bytes] = None,
    allow_plain: bool = True,
    check_identity: bool = False,
) -> None:
    prefix = await asyncio.wait_for(peer.reader.readexactly(wire.PREFIX_BYTES), timeout)
    mac_rx = None
    try:
        flags = wire.decode_prefix(prefix, wire.MAX_HEADER_BYTES)[0]
        if flags & wire.FLAG_MAC:
            if mac_key is None:
                raise HandshakeError("this server holds no fast-path MAC key (use TLS)")
            mac_rx = _mac(mac_key, b"hello c2s")
        elif not tls and not allow_plain:
            raise HandshakeError("unauthenticated connection refused: mutual TLS or a fast-path MAC is required")
        h, _ = await asyncio.wait_for(wire.read_frame_rest(peer.reader, prefix, wire.MAX_HEADER_BYTES, mac_rx), timeout)
        if h.get("t") != "hello":
            raise HandshakeError(f"expected 'hello', got {h.get('t')!r}")
        if h.get("proto") != PROTO:
            raise HandshakeError(f"rpc proto mismatch: local {PROTO}, remote {h.get('proto')!r}")
        cn = h.get("nonce")
        if mac_rx is not None and (not isinstance(cn, bytes) or len(cn) != NONCE_BYTES):
            raise HandshakeError("fast-path hello without a valid nonce")
        if tls:
            name = cert_common_name(peer.writer.get_extra_info("peercert"))
            peer.cert_name = name
            if check_identity and name != h.get("instance"):
                raise HandshakeError(f"hello names instance {h.get('instance')!r} but the TLS certificate is {name!r}")
        check(hello.get("fingerprint"), h.get("fingerprint"))
    except Exception as e:
        if isinstance(e, WireError) and not isinstance(e, MacError):
            raise  # not a pdd stream (or out of sync): close without an answer
        if not isinstance(e, HandshakeError) and isinstance(
            e, (asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError, ConnectionError)
        ):
            raise  # the peer went away: nobody to answer
        if isinstance(e, MacError):
            e = HandshakeError(f"fast-path authentication failed: {e}")
        try:
            await _write_raw(peer, messages.Error(str(e)).wire())
        except Exception:
            pass
        raise HandshakeError(str(e)) from None
    if mac_rx is not None:
        sn = os.urandom(NONCE_BYTES)
        hello = {**hello, "nonce": sn}
        await _write_raw(peer, hello, _mac(mac_key, b"hello s2c " + cn))
        peer.mac_rx, peer.mac_tx = _session_macs(mac_key, cn, sn)
    else:
        await _write_raw(peer, hello)
    peer.auth = "tls" if tls else ("mac" if mac_rx is not None else None)
    peer.local_hello, peer.remote_hello = hello, h


# -------------------------------------------------------------------- server / client
class Server:
    """Accepts connections; each becomes a :class:`Peer` sharing ``handlers``.

    ``port=0`` picks a free port (read ``server.port`` after ``start()``).
    ``on_connect(peer)`` / ``on_disconnect(peer)``: sync or async callbacks.
    ``handshake_check(local_fp, remote_fp)`` raises to refuse a peer.
    ``ssl``: server context (mutual TLS: it should require client certificates); ``mac_key``:
    accept plain connections authenticated by the fast-path MAC; ``allow_plain``: accept
    unauthenticated plain connections (default: only when neither ``ssl`` nor ``mac_key``);
    ``check_identity``: a TLS peer's hello must name its certificate's common name.
    Counters: ``refused`` (connections refused at TLS or hello time), ``mac_failures``
    (connections closed because a frame failed its MAC).
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
        self.hello = _hello(role, instance, fingerprint, heartbeat_s)
        self.handshake_check = handshake_check
        self.crc = crc
        self.max_payload_bytes = max_payload_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.peers: set[Peer] = set()
        self.refused = 0
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
            sock = socket.create_server((self.host, self.port), backlog=128)
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

    async def _accept_sniffed(self, conn: socket.socket, addr) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                first = await asyncio.wait_for(_peek1(loop, conn), self.handshake_timeout_s)
            except (OSError, asyncio.TimeoutError, TimeoutError) as e:
                self._refuse(addr, f"nothing received: {e!r}")
                conn.close()
                return
            tls = first == b"\x16"  # TLS record type "handshake" (ClientHello)
            if not first or (not tls and self.mac_key is None and not self.allow_plain):
                self._refuse(addr, "plain connection where mutual TLS is required" if first else "closed at once")
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
            await _server_handshake(
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
                await _maybe_await(self.on_connect(peer))
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

    ``heartbeat_s`` / ``dead_after_s``: heartbeats (module docstring), used when the server
    sends them too.

    Retries refused/unreachable connects ``retries`` times with exponential backoff
    (``backoff_s`` doubling up to ``max_backoff_s``, seconds). A :class:`HandshakeError` is never retried.
    ``ssl``: client context (mutual TLS); ``server_hostname``: the name the server's certificate
    must carry (default ``host``). ``mac_key``: authenticate every frame with the fast-path MAC.
    A server that refuses this side's certificate or key, or whose certificate does not verify,
    raises :class:`HandshakeError`.
    """
    hello = _hello(role, instance, fingerprint, heartbeat_s)
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
                await _client_handshake(peer, hello, handshake_check, connect_timeout_s, mac_key)
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


_default_pools: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PeerPool]" = weakref.WeakKeyDictionary()


async def connect_cached(addr: Union[str, tuple], pool: Optional[PeerPool] = None) -> Peer:
    """``pool.get(addr)``; without ``pool``, a default pool per event loop (no handlers, anonymous hello)."""
    if pool is None:
        loop = asyncio.get_running_loop()
        pool = _default_pools.get(loop)
        if pool is None:
            pool = _default_pools[loop] = PeerPool()
    return await pool.get(addr)
