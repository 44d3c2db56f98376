"""Fuzzing the KV wire decoder with hypothesis: random bytes and mutated valid frames (bit flips,
truncation, insertion, splices; plain, CRC and MAC'd) must either decode to a well-formed frame
or raise WireError / IncompleteReadError: never another exception (a crash) and never a hang.

Three targets: ``decode_frame`` (buffer), ``read_frame`` over a ``FrameStream`` fed in random
chunks (the socket path, large reads straight into their buffer included), and a whole
``Peer`` read loop (``pdd.transfer.peer``) (decoded frames dispatched to handlers, replies written).

Examples per target: ``PDD_FUZZ_EXAMPLES`` (default 100, for CI; run with e.g. 2500 for the
full campaign: ``PDD_FUZZ_EXAMPLES=2500 pytest tests/transfer/test_wire_fuzz.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.transfer import wire
from pdd.transfer.peer import Peer
from pdd.transfer.wire import FrameMac, FrameStream, WireError

EXAMPLES = int(os.environ.get("PDD_FUZZ_EXAMPLES", "100"))
HANG_S = 5.0
KEY = b"k" * 32
MAX_PAYLOAD = 1 << 20

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                     st.text(max_size=20), st.binary(max_size=20))
_values = st.recursive(_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), c, max_size=4)),
                       max_leaves=12)
_header = st.fixed_dictionaries(
    {"t": st.one_of(st.sampled_from(["kv", "kv_done", "kv_cancel", "hello", "x"]), st.text(max_size=10))},
    optional={"rid": _values, "first_page": _values, "n_pages": _values, "page_bytes": _values,
              "layers": _values, "cid": st.one_of(st.integers(0, 3), _values), "reply": _values,
              "crc32": _values},
)


@st.composite
def frames(draw):
    """A byte string: one or more frames (valid, then mutated), or pure noise; and the MAC mode."""
    mac = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=4096)), mac
    tx = FrameMac(KEY) if mac else None
    buf = bytearray()
    for _ in range(draw(st.integers(1, 3))):
        h = draw(_header)
        if draw(st.integers(0, 15)) == 0:  # large: FrameStream reads it straight into its own buffer
            payload = bytes(range(256)) * draw(st.integers(130, 280))
        else:
            payload = draw(st.binary(max_size=300))
        try:
            buf += wire.frame_bytes(h, payload, crc=draw(st.booleans()), mac=tx)
        except WireError:  # e.g. an unencodable header: encode refuses it, fine
            buf += wire.frame_bytes({"t": "x"}, payload, mac=tx)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "flip", "trunc", "insert", "raw_header"]))
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] ^= draw(st.integers(1, 255))
        elif op == "trunc":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:  # a frame whose header is arbitrary msgpack (or not msgpack at all)
            raw = draw(st.one_of(st.binary(min_size=1, max_size=64),
                                 st.builds(lambda v: msgpack.packb(v, use_bin_type=True), _values)))
            buf = bytearray(wire.PREFIX.pack(wire.MAGIC, wire.VERSION, 0, len(raw), 0) + raw) + buf
            mac = False
    return bytes(buf), mac


def _check_frame(header, payload) -> None:
    assert isinstance(header, dict) and isinstance(header["t"], str)
    assert isinstance(payload, (bytes, bytearray))


@SETTINGS
@given(frames())
def test_fuzz_decode_frame(case):
    buf, mac = case
    rx = FrameMac(KEY) if mac else None
    pos = 0
    while True:
        try:
            h, p, n = wire.decode_frame(buf[pos:], MAX_PAYLOAD, rx)
        except (WireError, asyncio.IncompleteReadError):
            return
        _check_frame(h, p)
        assert 0 < n <= len(buf) - pos
        pos += n


class _FakeTransport:
    def __init__(self):
        self.out = bytearray()
        self.closed = False

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def write(self, b):
        self.out += b

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def abort(self):
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default


async def _feed(stream: FrameStream, buf: bytes, cuts: list[int]) -> None:
    pos = 0
    for c in sorted(set(cuts)) + [len(buf)]:
        while pos < c:
            target = stream.get_buffer(c - pos)
            n = min(len(target), c - pos)
            target[:n] = buf[pos:pos + n]
            stream.buffer_updated(n)
            pos += n
        await asyncio.sleep(0)
    stream.eof_received()


def _run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, HANG_S))  # a hang fails with TimeoutError
    finally:
        loop.close()


@SETTINGS
@given(frames(), st.lists(st.integers(0, 80_000), max_size=6))
def test_fuzz_read_frame_over_framestream(case, cuts):
    buf, mac = case
    cuts = [c for c in cuts if c < len(buf)]

    async def go():
        stream = FrameStream(limit=1 << 16)
        stream.connection_made(_FakeTransport())
        rx = FrameMac(KEY) if mac else None
        feeder = asyncio.ensure_future(_feed(stream, buf, cuts))
        try:
            while True:
                try:
                    h, p = await wire.read_frame(stream, MAX_PAYLOAD, rx)
                except (WireError, asyncio.IncompleteReadError):
                    return
                _check_frame(h, p)
        finally:
            await feeder

    _run(go())


class _Crashes(logging.Handler):
    """Log records that carry a traceback: an exception the reader did not expect."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        if record.exc_info:
            self.records.append(record)


@SETTINGS
@given(frames())
def test_fuzz_peer_read_loop(case):
    """A Peer fed hostile bytes: handlers see only well-formed frames, calls get replies, the
    connection closes cleanly at the end; no task dies of an unexpected exception."""
    buf, mac = case

    async def go():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        crashed = _Crashes()
        logging.getLogger("pdd.transfer.peer").addHandler(crashed)
        reader = asyncio.StreamReader()
        reader.feed_data(buf)
        reader.feed_eof()
        stream = FrameStream()
        stream.connection_made(_FakeTransport())
        seen = []

        def any_handler(peer, h, p):
            _check_frame(h, p)
            seen.append(h["t"])
            return {"t": "ok"}

        peer = Peer(reader, stream, {"*": any_handler}, max_payload_bytes=MAX_PAYLOAD)
        if mac:
            peer.mac_rx, peer.mac_tx = FrameMac(KEY), FrameMac(KEY)
        peer.start()
        try:
            await peer._closed_event.wait()
            await asyncio.sleep(0)
        finally:
            logging.getLogger("pdd.transfer.peer").removeHandler(crashed)
        assert not errors, errors
        assert not crashed.records, [r.getMessage() for r in crashed.records]  # "reader failed" & co

    _run(go())


def test_mac_frames_roundtrip_and_counter():
    tx, rx = FrameMac(KEY), FrameMac(KEY)
    buf = b"".join(wire.frame_bytes({"t": "kv", "i": i}, bytes([i]) * 100, mac=tx) for i in range(3))
    pos = 0
    for i in range(3):
        h, p, n = wire.decode_frame(buf[pos:], mac=rx)
        assert h["i"] == i and p == bytes([i]) * 100
        pos += n
    # the same frames again (a replay) or out of order fail: the counter moved on
    rx2 = FrameMac(KEY)
    first = wire.frame_bytes({"t": "kv"}, b"a", mac=FrameMac(KEY))
    wire.decode_frame(first, mac=rx2)
    try:
        wire.decode_frame(first, mac=rx2)
        raise AssertionError("replayed frame accepted")
    except wire.MacError:
        pass
    # a MAC'd frame where none is expected, and the reverse, are refused
    for b, m in ((first, None), (wire.frame_bytes({"t": "kv"}, b"a"), FrameMac(KEY))):
        try:
            wire.decode_frame(b, mac=m)
            raise AssertionError("accepted")
        except wire.WireError as e:
            assert "MAC" in str(e)
