"""Frame format of every pdd connection (KV pages, control messages, link control port).

A frame is::

    prefix  16 bytes, struct "!2sBBIQ":
              magic        b"PD"
              version      u8   (VERSION = 1)
              flags        u8   (bit 0 FLAG_CRC: header carries "crc32" of the payload;
                                 bit 1 FLAG_MAC: a MAC_BYTES tag follows the payload;
                                 other bits reserved, must be 0)
              header_len   u32  bytes of the msgpack header
              payload_len  u64  bytes of the raw payload
    header  msgpack map (str keys), always with a "t" key: the message type (str)
    payload raw bytes, never re-encoded (KV pages go out as the pool's own bytes)
    tag     only with FLAG_MAC: MAC_BYTES (16) bytes over prefix || header || payload and the
            frame's number in its direction (see :class:`FrameMac`; not counted in payload_len)

Decoding is strict: a bad magic, an unknown version or flag bit, a header over
``MAX_HEADER_BYTES`` (1 MiB), a payload over the reader's ``max_payload_bytes``
(default 256 MiB) or a header that is not a msgpack map with a str "t" raises
:class:`WireError`; after such an error the stream is out of sync and must be closed.
A CRC mismatch raises :class:`CrcError` (a WireError) *after* the whole frame was
consumed: the stream is still in sync, only that frame is dropped.

Authenticated frames (``FLAG_MAC``, the in-datacenter fast path that stands in for RDMA,
where TLS is not used): a reader given a :class:`FrameMac` requires the flag on every frame,
a reader without one refuses it. The tag covers the prefix, the raw header bytes, the payload
and an implicit per-direction frame counter (so a replayed, reordered or removed frame fails
too) and is checked *before* the header is decoded, so nothing of a forged frame is parsed.
A mismatch raises :class:`MacError` after the frame was consumed; unlike a CRC mismatch the
connection must then be closed (``peer.Peer`` does): nothing after a forged frame can be
trusted, e.g. the ``kv_done`` that would complete a request whose pages were dropped.

Future fields fit without a version bump: new header keys are ignored by old readers
(e.g. ``"layers"`` ranges, ``"deadline_ms"``) and new message types are dispatched by
``"t"`` (``"kv_cancel"`` ...); old readers refuse frames carrying unknown flag bits rather
than trusting them.
"""

from __future__ import annotations

import asyncio
import socket
import hashlib
import hmac
import struct
import sys
import zlib
from typing import Any, Optional

import msgpack

__all__ = [
    "MAGIC",
    "VERSION",
    "PREFIX",
    "PREFIX_BYTES",
    "FLAG_CRC",
    "FLAG_MAC",
    "KNOWN_FLAGS",
    "MAX_HEADER_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAC_BYTES",
    "WireError",
    "CrcError",
    "MacError",
    "FrameMac",
    "read_frame_rest",
    "encode_frame",
    "frame_bytes",
    "decode_prefix",
    "decode_header",
    "decode_frame",
    "read_frame",
    "write_frame",
    "payload_view",
    "FrameStream",
]

MAGIC = b"PD"
VERSION = 1
PREFIX = struct.Struct("!2sBBIQ")
PREFIX_BYTES = PREFIX.size  # 16

FLAG_CRC = 0x01  # header["crc32"] = zlib.crc32(payload)
FLAG_MAC = 0x02  # a MAC_BYTES tag follows the payload (FrameMac)
KNOWN_FLAGS = FLAG_CRC | FLAG_MAC
MAC_BYTES = 16  # AES-GMAC tag, or HMAC-SHA256 truncated to 128 bits

MAX_HEADER_BYTES = 1 << 20  # 1 MiB
DEFAULT_MAX_PAYLOAD_BYTES = 256 << 20  # 256 MiB

_EMPTY = b""


class WireError(Exception):
    """Malformed or refused frame. Unless it is a :class:`CrcError`, the stream is out of sync."""


class CrcError(WireError):
    """Payload CRC mismatch. The frame was fully consumed (stream still in sync) and is dropped.

    ``header`` is the decoded header of the dropped frame (so a call can be answered with an error).
    """

    def __init__(self, msg: str, header: dict | None = None):
        super().__init__(msg)
        self.header = header


class MacError(WireError):
    """A frame failed its MAC (forged, corrupted, replayed or out of order). The frame was
    consumed and is dropped; nothing of it (not even its header) was decoded. Close the
    connection: later frames on it cannot be trusted."""


_SEQ = struct.Struct("!Q")


class FrameMac:
    """The MAC state of ONE direction of one connection; ``seq`` counts its frames from 0.

    ``alg="gmac"``: AES-128-GMAC (AES-GCM over no plaintext, the frame as associated data) with
    the frame counter as nonce, ~20x cheaper than HMAC-SHA256 on AES-NI/CLMUL CPUs. A nonce must
    never repeat under a key, so a "gmac" key must belong to this one direction of one
    connection (``handshake`` derives such keys from the shared key and both hellos' random nonces).
    ``alg="hmac"``: HMAC-SHA256 over ``seq_u64 || frame``, truncated to 128 bits: safe under a
    long-lived key (``handshake`` uses it for the hellos). Every :meth:`seal` / :meth:`verify` advances
    the counter, so frames must be verified in the order they were sealed.
    """

    __slots__ = ("key", "alg", "seq", "failures", "_aead")

    def __init__(self, key: bytes, alg: str = "hmac"):
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise ValueError("MAC key must be at least 16 bytes")
        if alg not in ("hmac", "gmac"):
            raise ValueError(f"unknown MAC algorithm {alg!r} (hmac | gmac)")
        self.key = bytes(key)
        self.alg = alg
        self.seq = 0
        self.failures = 0
        self._aead = None
        if alg == "gmac":
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self.key[:16])

    def _tag(self, parts) -> bytes:
        if self._aead is not None:
            data = b"".join(p for p in parts if p is not None)  # one copy: AESGCM takes one buffer
            tag = self._aead.encrypt(self.seq.to_bytes(12, "big"), b"", data)
        else:
            h = hmac.new(self.key, _SEQ.pack(self.seq), hashlib.sha256)
            for p in parts:
                if p is not None:
                    h.update(p)
            tag = h.digest()[:MAC_BYTES]
        self.seq += 1
        return tag

    def seal(self, *parts) -> bytes:
        """Tag for the next outgoing frame made of ``parts`` (prefix+header, payload)."""
        return self._tag(parts)

    def verify(self, tag: bytes, *parts) -> bool:
        """Check the next incoming frame's ``tag``; False (counted in ``failures``) on mismatch."""
        ok = hmac.compare_digest(self._tag(parts), bytes(tag))
        if not ok:
            self.failures += 1
        return ok


def payload_view(payload: Any) -> memoryview:
    """A flat byte view (format "B", 1-D) of any C-contiguous buffer, without copying."""
    mv = payload if isinstance(payload, memoryview) else memoryview(payload)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")  # raises TypeError on non-contiguous buffers
    return mv


def encode_frame(header: dict, payload: Any = _EMPTY, crc: bool = False, mac: "FrameMac | None" = None) -> list:
    """Encode one frame as a list of buffers to write in order (no copy of ``payload``).

    ``header``: dict with a str ``"t"``; it is not modified (a copy gets ``"crc32"`` when ``crc``).
    ``payload``: any bytes-like / buffer object (bytes, bytearray, memoryview, numpy array).
    ``mac``: the sending direction's :class:`FrameMac` (sets FLAG_MAC, appends the tag and
    advances its counter: encode frames in the order they are written).
    Returns ``[prefix + header_bytes]`` or ``[prefix + header_bytes, payload_view]``, then the
    tag as a last buffer when ``mac``.
    """
    t = header.get("t") if isinstance(header, dict) else None
    if not isinstance(t, str):
        raise WireError(f"header must be a dict with a str 't' (message type), got {header!r:.200}")
    flags = 0
    if payload is None or (isinstance(payload, bytes) and not payload):
        pv = None
        plen = 0
    else:
        pv = payload_view(payload)
        plen = pv.nbytes
        if plen == 0:
            pv = None
    if crc:
        header = dict(header)
        header["crc32"] = zlib.crc32(pv) if pv is not None else 0
        flags |= FLAG_CRC
    if mac is not None:
        flags |= FLAG_MAC
    try:
        hb = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"header for t={t!r} is not msgpack-encodable: {e}") from None
    if len(hb) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(hb)} bytes exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    first = PREFIX.pack(MAGIC, VERSION, flags, len(hb), plen) + hb
    out = [first] if pv is None else [first, pv]
    if mac is not None:
        out.append(mac.seal(first, pv))
    return out


def frame_bytes(header: dict, payload: Any = _EMPTY, crc: bool = False, mac: "FrameMac | None" = None) -> bytes:
    """The whole frame as one bytes object (copies; for tests and small messages)."""
    return b"".join(bytes(b) for b in encode_frame(header, payload, crc, mac))


def decode_prefix(prefix: bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[int, int, int]:
    """Validate the 16-byte prefix; returns ``(flags, header_len, payload_len)`` in bytes."""
    if len(prefix) != PREFIX_BYTES:
        raise WireError(f"frame prefix must be {PREFIX_BYTES} bytes, got {len(prefix)}")
    magic, version, flags, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (expected {MAGIC!r}): not a pdd stream or stream out of sync")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"unsupported frame flags 0x{flags:02x} (known: 0x{KNOWN_FLAGS:02x})")
    if hlen == 0:
        raise WireError("empty header (every frame needs a msgpack header with 't')")
    if hlen > MAX_HEADER_BYTES:
        raise WireError(f"header length {hlen} exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    if plen > max_payload_bytes:
        raise WireError(f"payload length {plen} exceeds max_payload_bytes={max_payload_bytes}")
    return flags, hlen, plen


def decode_header(raw: bytes, flags: int = 0) -> dict:
    """Decode and validate a msgpack header (a map with a str ``"t"``)."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
        raise WireError(f"undecodable msgpack header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise WireError(f"header is a {type(header).__name__}, expected a map")
    if not isinstance(header.get("t"), str):
        raise WireError(f"header lacks a str 't' (message type): {header!r:.200}")
    if flags & FLAG_CRC and not isinstance(header.get("crc32"), int):
        raise WireError("FLAG_CRC set but header has no int 'crc32'")
    return header


def _check_crc(header: dict, flags: int, payload) -> None:
    if flags & FLAG_CRC:
        got = zlib.crc32(payload)
        if got != header["crc32"]:
            raise CrcError(
                f"payload crc32 mismatch for frame t={header.get('t')!r}: header says "
                f"{header['crc32']:#010x}, payload has {got:#010x} ({len(payload)} bytes); frame dropped",
                header,
            )


def _check_mac_flag(flags: int, mac: "FrameMac | None") -> None:
    if mac is not None and not flags & FLAG_MAC:
        raise WireError("frame without a MAC on an authenticated connection (FLAG_MAC required)")
    if mac is None and flags & FLAG_MAC:
        raise WireError("frame with FLAG_MAC but this side holds no MAC key for the connection")


def _verify_mac(mac: "FrameMac", prefix, raw_header, payload, tag) -> None:
    if not mac.verify(tag, prefix, raw_header, payload):
        raise MacError(
            f"frame #{mac.seq - 1} failed its MAC ({len(raw_header)} header + {len(payload)} payload bytes): "
            "forged, corrupted, replayed or reordered; dropped undecoded"
        )


def decode_frame(
    buf: bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, mac: "FrameMac | None" = None
) -> tuple[dict, bytes, int]:
    """Decode one frame from the start of ``buf``; returns ``(header, payload, bytes_consumed)``.

    ``mac``: the receiving direction's :class:`FrameMac` (then FLAG_MAC is required).
    Raises :class:`asyncio.IncompleteReadError` when ``buf`` holds only part of a frame.
    """
    if len(buf) < PREFIX_BYTES:
        raise asyncio.IncompleteReadError(bytes(buf), PREFIX_BYTES)
    prefix = bytes(buf[:PREFIX_BYTES])
    flags, hlen, plen = decode_prefix(prefix, max_payload_bytes)
    _check_mac_flag(flags, mac)
    end = PREFIX_BYTES + hlen + plen
    tag_end = end + (MAC_BYTES if flags & FLAG_MAC else 0)
    if len(buf) < tag_end:
        raise asyncio.IncompleteReadError(bytes(buf), tag_end)
    raw = bytes(buf[PREFIX_BYTES : PREFIX_BYTES + hlen])
    payload = bytes(buf[PREFIX_BYTES + hlen : end])
    if mac is not None:
        _verify_mac(mac, prefix, raw, payload, buf[end:tag_end])
    header = decode_header(raw, flags)
    _check_crc(header, flags, payload)
    return header, payload, tag_end


async def read_frame(
    reader: Any, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, mac: "FrameMac | None" = None
) -> tuple[dict, Any]:
    """Read one frame; returns ``(header, payload)``: payload is bytes-like (``bytes``, or a
    ``bytearray`` for large payloads read by a :class:`FrameStream`; ``b""`` when empty).
    ``reader``: anything with ``async readexactly(n)`` (StreamReader, FrameStream).
    ``mac``: the receiving direction's :class:`FrameMac` (then every frame must carry FLAG_MAC).

    Raises :class:`asyncio.IncompleteReadError` on EOF (clean EOF between frames: ``partial == b""``),
    :class:`WireError` on a malformed frame (close the stream), :class:`CrcError` on a CRC mismatch
    (frame consumed and dropped; the stream may be read on), :class:`MacError` on a MAC mismatch
    (frame consumed and dropped undecoded; close the stream).
    """
    prefix = await reader.readexactly(PREFIX_BYTES)
    return await read_frame_rest(reader, prefix, max_payload_bytes, mac)


async def read_frame_rest(
    reader: Any, prefix: bytes, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, mac: "FrameMac | None" = None
) -> tuple[dict, Any]:
    """:func:`read_frame` once its 16-byte ``prefix`` was read (e.g. to pick ``mac`` by its flags)."""
    flags, hlen, plen = decode_prefix(prefix, max_payload_bytes)
    _check_mac_flag(flags, mac)
    raw = await reader.readexactly(hlen)
    payload = await reader.readexactly(plen) if plen else _EMPTY
    if mac is not None:
        _verify_mac(mac, prefix, raw, payload, await reader.readexactly(MAC_BYTES))
    header = decode_header(raw, flags)
    _check_crc(header, flags, payload)
    return header, payload


def write_frame(
    writer: asyncio.StreamWriter | asyncio.WriteTransport,
    header: dict,
    payload: Any = _EMPTY,
    crc: bool = False,
    mac: "FrameMac | None" = None,
) -> int:
    """Write one frame to a StreamWriter/transport without awaiting; returns bytes written (framing incl.).

    The caller must serialise writers (see ``peer.Peer``) and ``await writer.drain()`` for backpressure.
    """
    n = 0
    for b in encode_frame(header, payload, crc, mac):
        writer.write(b)
        n += len(b) if isinstance(b, bytes) else b.nbytes
    return n


# --------------------------------------------------------------------------- stream
_LARGE_READ_BYTES = 32 << 10  # readexactly(n >= this) receives straight into its own buffer
_SCRATCH_BYTES = 256 << 10
_GROW_FROM_BYTES = 1 << 20  # a large read's buffer starts at this (or n) and doubles as bytes arrive


_zero_source = b""


def _zeros(n: int) -> memoryview:
    """``n`` zero bytes to grow a buffer with, without a fresh allocation each time: one shared
    ``bytes``, calloc'd, so its pages are the kernel's zero page until written (never)."""
    global _zero_source
    if len(_zero_source) < n:
        _zero_source = bytes(max(n, 2 * len(_zero_source)))
    return memoryview(_zero_source)[:n]


def _tcp_socket(transport) -> Optional[socket.socket]:
    """The TCP socket under a transport (plain or TLS), or None (no socket, or not TCP)."""
    get = getattr(transport, "get_extra_info", None)
    sock = get("socket") if get is not None else None
    return sock if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) else None


def set_nodelay(transport) -> None:
    """Disable Nagle's algorithm on a TCP transport (plain or TLS). Small control frames (a
    handoff call, its reply) otherwise wait for the ACK of earlier data, which the peer delays
    by up to 40 ms: measured as a 42 ms handoff round trip between two busy instances."""
    sock = _tcp_socket(transport)
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def set_socket_buffer(transport, nbytes: int, send: bool = True) -> Optional[int]:
    """Cap a TCP transport's kernel send (``send``) or receive buffer at about ``nbytes`` bytes
    (SO_SNDBUF / SO_RCVBUF; this also turns the kernel's autotuning off for the socket). Linux
    doubles the value it is given (socket(7): the extra is for its bookkeeping, and a stream of
    large writes uses most of it for data), so half of ``nbytes`` is asked for there. Returns the
    size the kernel reports, or None when the transport has no TCP socket or the option is
    refused."""
    sock = _tcp_socket(transport)
    if sock is None:
        return None
    opt = socket.SO_SNDBUF if send else socket.SO_RCVBUF
    ask = int(nbytes) // 2 if sys.platform.startswith("linux") else int(nbytes)
    try:
        sock.setsockopt(socket.SOL_SOCKET, opt, ask)
        return int(sock.getsockopt(socket.SOL_SOCKET, opt))
    except OSError:
        return None


def limit_write_buffers(transport, high: int = 1) -> None:
    """Keep a transport's user-space write buffers at about ``high`` bytes (default 1: the writer
    pauses, and ``drain()`` waits, while anything written has not reached the kernel). Under TLS
    this covers both buffers asyncio keeps: the TLS layer's (records not yet handed down; 512 KiB
    by default in CPython's ``asyncio.sslproto``) and the raw transport's under it (64 KiB).
    With the kernel's send buffer capped too (:func:`set_socket_buffer`), a sender's choice of
    what to write next reaches the line within about that buffer's worth of bytes, instead of
    ~0.8 MB later. ``high`` is at least 1: the TLS layer pauses when its buffer is ``>= high``,
    so 0 would pause a writer with nothing buffered, and nothing would resume it.
    A transport without write-buffer limits is left as it is."""
    high = max(1, int(high))
    # the raw transport under TLS is CPython's private ``_ssl_protocol._transport``; where it is
    # absent (another event loop), only the outer transport's limit is set
    for t in (transport, getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)):
        setter = getattr(t, "set_write_buffer_limits", None)
        if setter is not None:
            try:
                setter(high=high, low=0)
            except (ValueError, RuntimeError, AttributeError):
                pass


class FrameStream(asyncio.BufferedProtocol):
    """A socket stream for frames with fewer copies than StreamReader/StreamWriter.

    Acts as both reader (``readexactly``, what :func:`read_frame` needs) and writer (``write``,
    ``drain``, ``close``, ``wait_closed``, ``transport``, ``get_extra_info``). A large
    ``readexactly(n)`` (KV payloads) is received by ``recv_into`` directly into a fresh
    ``bytearray``, which is returned as is (no further copy). That buffer starts at 1 MiB (or
    ``n``) and doubles, in place, as bytes arrive, up to ``n``: a peer that announces a large frame
    and stalls holds at most twice what it sent, not the ``n`` it announced (up to the reader's
    ``max_payload_bytes``). Paired reads of 64 MiB frames over loopback took the same time as into
    a buffer of ``n`` allocated at once (median ratio 0.99-1.01; ``scripts/frame_read_micro.py``).
    Reading pauses while more than ``limit`` bytes are buffered unread; ``drain()`` waits while the
    transport's write buffer is over its high-water mark.
    """

    def __init__(self, limit: int = 1 << 20, on_made=None):
        self.limit = limit
        self.transport: Any = None
        self._on_made = on_made
        self._scratch = bytearray(_SCRATCH_BYTES)
        # a memoryview, not the bytearray: asyncio's SSL transport (3.11) fills ``buf[offset:]``
        # of what get_buffer returns, and a bytearray slice would be a copy (bytes lost)
        self._scratch_view = memoryview(self._scratch)
        self._data = bytearray()
        self._target: Any = None  # bytearray being filled by a large readexactly
        self._tpos = 0
        self._twant = 0  # bytes that read wants (its buffer grows to this)
        self._full: Any = None  # its buffer once filled
        self._waiter: Any = None  # future of the (single) pending readexactly
        self._want = 0
        self._eof = False
        self._exc: Any = None
        self._read_paused = False
        self._write_paused = False
        self._drain_waiters: list = []
        self._closed: Any = None
        self.rx_bytes = 0  # bytes received so far (liveness: a slow stream is alive)

    # -- protocol callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        set_nodelay(transport)
        self._closed = asyncio.get_running_loop().create_future()
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int):
        if self._target is not None:
            if self._tpos == len(self._target):
                self._grow()
            return memoryview(self._target)[self._tpos :]
        return self._scratch_view

    def _grow(self) -> None:
        """The large read's buffer is full but short of the ``_twant`` bytes announced: double it
        (at most to ``_twant``). In place where no view of it is held (the transport's view from
        the last :meth:`get_buffer` is gone by now): a resize of a large block is a remap, not a
        copy; otherwise into a new buffer."""
        t = self._target
        add = min(len(t), self._twant - len(t))
        try:
            t.extend(_zeros(add))
        except BufferError:
            self._target = bytearray(len(t) + add)
            self._target[: len(t)] = t

    def buffer_updated(self, nbytes: int) -> None:
        self.rx_bytes += nbytes
        if self._target is not None:
            self._tpos += nbytes
            if self._tpos == self._twant:
                self._full, self._target = self._target, None  # full: later bytes go to the scratch buffer
                self._wake()
            return
        self._data += self._scratch_view[:nbytes]
        if self._waiter is not None and len(self._data) >= self._want:
            self._wake()
        if len(self._data) > 2 * self.limit and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def eof_received(self):
        self._eof = True
        self._wake()
        return False  # close the transport (we never half-close)

    def connection_lost(self, exc) -> None:
        self._eof = True
        self._exc = exc
        self._wake()
        err = ConnectionResetError("connection lost") if exc is None else exc
        for w in self._drain_waiters:
            if not w.done():
                w.set_exception(err)
        self._drain_waiters.clear()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _resume_reading(self) -> None:
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            try:
                self.transport.resume_reading()
            except Exception:
                pass

    # -- reader
    async def readexactly(self, n: int):
        """``n`` bytes (bytes, or a bytearray for large reads); IncompleteReadError at EOF."""
        if self._waiter is not None:
            raise RuntimeError("readexactly() called while another read is pending")
        if n == 0:
            return b""
        if len(self._data) >= n:
            out = bytes(memoryview(self._data)[:n])
            del self._data[:n]
            if len(self._data) <= self.limit:
                self._resume_reading()
            return out
        loop = asyncio.get_running_loop()
        if n >= _LARGE_READ_BYTES:
            # the buffer grows as bytes arrive (doubling from _GROW_FROM_BYTES), so a peer that
            # announces a large frame and stalls holds about what it sent, not what it announced
            have = len(self._data)
            target = bytearray(min(n, max(_GROW_FROM_BYTES, have)))
            target[:have] = self._data
            self._data.clear()
            self._target, self._tpos, self._twant = target, have, n
            self._resume_reading()
            try:
                while self._target is not None:
                    if self._eof:
                        raise asyncio.IncompleteReadError(bytes(memoryview(self._target)[: self._tpos]), n)
                    self._waiter = loop.create_future()
                    await self._waiter
            except BaseException:
                self._full = None  # cancelled after its buffer filled: the stream keeps no reference to it
                raise
            finally:
                self._waiter = None
                self._target = None
            out, self._full = self._full, None
            return out
        self._resume_reading()
        try:
            while len(self._data) < n:
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(self._data), n)
                self._want = n
                self._waiter = loop.create_future()
                await self._waiter
        finally:
            self._waiter = None
        out = bytes(memoryview(self._data)[:n])
        del self._data[:n]
        if len(self._data) <= self.limit:
            self._resume_reading()
        return out

    # -- writer
    def write(self, data) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        if self._closed is not None and self._closed.done():
            raise ConnectionResetError("connection lost")
        if self.transport.is_closing():
            await asyncio.sleep(0)  # let connection_lost run
            if self._closed.done():
                raise ConnectionResetError("connection lost")
        if self._write_paused:
            w = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(w)
            await w

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await asyncio.shield(self._closed)

    def get_extra_info(self, name: str, default=None):
        return self.transport.get_extra_info(name, default) if self.transport is not None else default
