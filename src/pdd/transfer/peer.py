"""One persistent, multiplexed connection between two pdd instances (asyncio streams).

One :class:`Peer` is one TCP connection shared by all requests between two instances; it is
opened by :func:`pdd.transfer.client.connect` or accepted by :class:`pdd.transfer.server.Server`,
both of which run :mod:`pdd.transfer.handshake` first. Both sides can, at any time:

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

Close: :attr:`Peer.closed` turns true as soon as the connection ends (and ``call``/``send``
raise ``ConnectionError`` from then on); the close is *reported* (``on_close`` callbacks
called, :meth:`Peer.wait_closed` / :meth:`Peer.wait_close_reported` return) once the one-way
messages already read are dealt with:

- The connection ended **from the remote side** (EOF between or in the middle of a frame, a
  reset or other socket error while reading, a write that failed, or the heartbeat finding the
  peer dead): the one-way messages read before the end (queued, and the one being handled) are
  still handed to their handlers, in order, for at most ``drain_timeout_s`` seconds in all (a
  handler still running then is cancelled and the rest dropped, counted in
  ``Peer.oneway_dropped``), and only then is the close reported. E.g. an instance's last tokens,
  sent just before it died, reach the gateway before it declares the instance lost. A handler
  running during this drain sees ``peer.closed`` true; its ``send``/``call`` on this connection
  fail at once with ``ConnectionError``.
- **Protocol or MAC error** (the stream can no longer be trusted) and **local** ``close()`` /
  ``abort()``: the queued one-way messages are dropped (the running handler is cancelled) and
  the close is reported at once. A ``close()``/``abort()`` during a drain ends it the same way.

A reply is still delivered as soon as it is read, even when one-way messages read before it
wait in the queue (a reply held behind them would deadlock a one-way handler awaiting a call on
the same connection).

Heartbeats (liveness): a side created with ``heartbeat_s`` says so in its hello (``"hb"``);
when both sides do, each sends a ``_hb`` frame every ``heartbeat_s`` seconds (consumed by the
reader, never dispatched) and closes the connection once it has received **no byte at all** for
``dead_after_s`` seconds (:class:`ConnectionError` "no sign of life"). Bytes of a slow frame count,
so a long KV transfer over a slowed line is alive; a peer that was SIGKILLed, hangs, or sits
behind a WAN outage that drops packets without a reset is found within ``dead_after_s``.

Fast-path MAC failures: on a connection authenticated by the fast-path MAC (per-connection,
per-direction keys and frame counters, set by the handshake: :mod:`pdd.transfer.handshake`), a
frame that fails its MAC is dropped undecoded, counted (``Peer.mac_failures``,
``Server.mac_failures``) and the connection is **closed**: the sender's transfers on it fail
(P reconnects for the next request) and no later frame of the stream, e.g. the ``kv_done`` that
would complete a request whose pages were dropped, is ever delivered.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import math
from typing import Any, Awaitable, Callable, Optional, Union

from . import messages, wire
from .wire import CrcError, FrameMac, MacError, WireError

__all__ = ["RemoteError", "CallFailed", "Handler", "Peer", "STREAM_LIMIT_BYTES", "DEFAULT_CALL_TIMEOUT_S",
           "DEFAULT_DRAIN_TIMEOUT_S"]

log = logging.getLogger(__name__)

STREAM_LIMIT_BYTES = 1 << 20  # unread bytes buffered per connection before reading pauses
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_DRAIN_TIMEOUT_S = 2.0  # remote close: seconds to handle the one-way messages already read

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


async def maybe_await(x):
    """``await x`` when it is awaitable, else ``x`` (handlers and callbacks may be sync or async)."""
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
    :func:`~pdd.transfer.client.connect` and :class:`~pdd.transfer.server.Server` use) or an
    asyncio StreamReader / StreamWriter pair.

    ``handlers`` is a shared table (e.g. a ``Server``'s, used by all its peers);
    :meth:`on` adds per-connection handlers that take precedence.
    ``crc``: default for the ``crc`` flag of frames this side sends (bool).
    ``max_payload_bytes``: largest payload accepted from the other side.
    ``dispatch_queue`` / ``dispatch_queue_bytes``: one-way frames / payload bytes buffered for the
    dispatcher before the reader stops reading (backpressure; one frame is always admitted).
    ``drain_timeout_s``: when the remote side ends the connection, the most seconds spent handing
    the one-way messages already read to their handlers before the close is reported (module
    doc, "Close"); 0 drops them at once. Raises ValueError unless finite and >= 0.
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
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ):
        if not (isinstance(drain_timeout_s, (int, float)) and math.isfinite(drain_timeout_s)
                and drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number of seconds >= 0, got {drain_timeout_s!r}")
        self.reader = reader
        self.drain_timeout_s = float(drain_timeout_s)
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
        self._drain_task: Optional[asyncio.Task] = None
        self._handling = False  # the dispatcher is inside a one-way handler
        self._closed = False  # the connection ended: nothing more is sent or read
        self._draining = False  # ended by the remote side; the one-way messages read are being handled
        self._reported = False  # the close was reported (on_close callbacks called)
        self._close_reason: Optional[BaseException] = None
        self._closed_here = False  # ended by this side's close() / abort(), not by the remote or the line
        self._closed_event = asyncio.Event()
        self._on_close: list[Callable[["Peer"], Any]] = []
        # counters (bytes: payload bytes only, framing excluded)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.frames_dropped = 0
        self.mac_failures = 0
        self.oneway_dropped = 0  # one-way messages read but never handled: dropped at the close
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
        who, inst = self.name or self.remote_instance or self.peername, self.remote_instance
        if inst and inst != who:  # a dialled peer is named by its address: say which instance it is
            who = f"{inst} at {who}"
        return f"<Peer {who} {state}>"

    # ---------------------------------------------------------------- lifecycle
    def on(self, t: str, handler: Handler) -> None:
        """Register ``handler(peer, header, payload)`` for message type ``t`` on this connection."""
        self._own_handlers[t] = handler

    def on_close(self, cb: Callable[["Peer"], Any]) -> None:
        """Call ``cb(peer)`` (sync, or async -> scheduled) once when the connection's close is
        reported: after the one-way messages read before a remote close were handled (module
        doc, "Close"); at once if it already was."""
        if self._reported:
            self._spawn_cb(cb)
        else:
            self._on_close.append(cb)

    @property
    def closed(self) -> bool:
        """Whether the connection ended (``call``/``send`` raise ConnectionError). It turns true
        at once; the close may be reported (``on_close``) up to ``drain_timeout_s`` later."""
        return self._closed

    @property
    def close_reason(self) -> Optional[str]:
        """Why the connection ended, in words (None while it is open): ``connection closed by
        peer`` (EOF), ``connection lost: ConnectionResetError(...)``, ``no sign of life from ...
        for 5.1 s (heartbeat)``, ``connection closed locally``, ..."""
        return None if self._close_reason is None else str(self._close_reason)

    @property
    def closed_locally(self) -> bool:
        """Whether this side ended the connection (:meth:`close` / :meth:`abort` while it was
        open), rather than the remote side, the line or the heartbeat."""
        return self._closed_here

    @property
    def draining(self) -> bool:
        """Whether the connection ended from the remote side and the one-way messages read
        before the end are still being handled (``closed`` is true, the close not reported yet)."""
        return self._draining

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
                # the peer is gone as on a reset: the one-way messages read before are handled
                self._shutdown(ConnectionError(
                    f"no sign of life from {self._label()} for {now - seen:.1f} s (heartbeat)"),
                    abort=True, drain=True)
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
        self._closed_here = self._closed_here or not self._closed
        self._shutdown(ConnectionError("connection closed locally"))
        self._report_close()  # a drain under way ends: what is still queued is dropped
        try:
            await asyncio.wait_for(self.wait_closed(), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self.writer.transport.abort()

    async def wait_closed(self) -> None:
        """Wait until the connection is closed (by either side), its close reported (``on_close``
        callbacks called) and the socket released."""
        await self._closed_event.wait()
        try:
            await self.writer.wait_closed()
        except Exception:
            pass

    async def wait_close_reported(self) -> None:
        """Wait until the connection is closed and its close reported (``on_close`` callbacks
        called: at most about ``drain_timeout_s`` after ``closed`` turned true); unlike
        :meth:`wait_closed` it does not wait for the socket to be released."""
        await self._closed_event.wait()

    def abort(self) -> None:
        """Drop the connection at once (RST where possible), failing pending calls; the one-way
        messages queued (or still being drained after a remote close) are dropped."""
        self._closed_here = self._closed_here or not self._closed
        self._shutdown(ConnectionError("connection aborted locally"), abort=True)
        self._report_close()

    def _shutdown(self, reason: BaseException, abort: bool = False, drain: bool = False) -> None:
        """End the connection: pending calls fail, the socket is closed (``abort``: reset), the
        reader, heartbeat and call handlers are cancelled. ``drain`` (the remote side ended it):
        the one-way messages already read are handled first, for at most ``drain_timeout_s``,
        then the close is reported (:meth:`_report_close`); otherwise it is reported at once."""
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
        for t in (self._reader_task, self._hb_task):
            if t is not None and t is not cur and not t.done():
                t.cancel()
        for t in list(self._tasks):
            if t is not cur:
                t.cancel()
        d = self._dispatch_task
        if (drain and self.drain_timeout_s > 0 and d is not None and not d.done()
                and (self._q or self._handling)):
            self._draining = True
            self._q_items.set()  # the dispatcher ends once the queue is empty
            self._drain_task = asyncio.get_running_loop().create_task(
                self._drain(d), name=f"peer-drain-{self.name}")
            return
        self._report_close()

    async def _drain(self, dispatch: asyncio.Task) -> None:
        """Let the dispatcher hand the queued one-way messages to their handlers (it ends when
        the queue is empty) for at most ``drain_timeout_s``, then report the close."""
        try:
            await asyncio.wait({dispatch}, timeout=self.drain_timeout_s)
            if not dispatch.done():
                log.warning("%r: one-way handlers still busy %.1f s after the connection ended; "
                            "%d queued message(s) dropped", self, self.drain_timeout_s, len(self._q))
        finally:
            self._report_close()

    def _report_close(self) -> None:
        """Report the close (idempotent; only once the connection is closed): the dispatcher
        (a handler still running) is cancelled, the one-way messages still queued are dropped
        (``oneway_dropped``), :meth:`wait_closed` returns and the ``on_close`` callbacks run."""
        if self._reported or not self._closed:
            return
        self._reported = True
        self._draining = False
        cur = asyncio.current_task()
        for t in (self._dispatch_task, self._drain_task):
            if t is not None and t is not cur and not t.done():
                t.cancel()
        if self._q:
            self.oneway_dropped += len(self._q)
            log.debug("%r: %d one-way message(s) dropped at the close", self, len(self._q))
            self._q.clear()
            self._q_bytes = 0
        self._q_space.set()
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
                self._shutdown(err, drain=True)  # the socket failed: what was read is handled
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
        drain = False  # ended by the remote side (EOF, reset): the one-way messages read are handled
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
            drain = True  # the frames before the cut were read whole (and checked)
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
            drain = True
            reason = ConnectionError(f"connection lost: {e!r}")
        except Exception as e:  # pragma: no cover - defensive
            log.exception("%r: reader failed", self)
            reason = ConnectionError(f"reader failed: {e!r}")
        finally:
            self._shutdown(reason, drain=drain)

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
        """Hand the queued one-way messages to their handlers, one at a time, in order; after a
        remote close (draining) it ends once the queue is empty."""
        while not self._reported:
            while not self._q:
                if self._closed:  # draining, and nothing left (nothing more is read)
                    return
                self._q_items.clear()
                await self._q_items.wait()
            header, payload = self._q.popleft()
            self._q_bytes -= len(payload)
            self._q_space.set()
            h = self._handler(header["t"])
            if h is None:
                log.warning("%r: no handler for one-way message %r, dropped", self, header["t"])
                continue
            self._handling = True
            try:
                await maybe_await(h(self, header, payload))
            except asyncio.CancelledError:
                raise
            except messages.MessageError as e:  # a malformed message: its sender's bug, one line
                log.warning("%r: dropped a malformed one-way %r: %s", self, header["t"], e)
            except Exception:
                log.exception("%r: handler for one-way %r failed", self, header["t"])
            finally:
                self._handling = False

    async def _handle_call(self, header: dict, payload) -> None:
        h = self._handler(header["t"])
        try:
            if h is None:
                raise LookupError(f"no handler for message type {header['t']!r}")
            rh, rp = _normalize_reply(await maybe_await(h(self, header, payload)), header)
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

