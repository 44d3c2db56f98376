import asyncio
import struct
import zlib

import msgpack
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from pdd.transfer import wire
from pdd.transfer.wire import CrcError, WireError


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


async def test_roundtrip_empty_and_payload():
    frames = [
        ({"t": "ping"}, b""),
        ({"t": "kv", "rid": "r1", "first_page": 3, "n_pages": 2, "layers": [0, 4], "page_bytes": 5}, bytes(range(10))),
        ({"t": "x", "nested": {"a": [1, 2, None], "b": b"\x00\xff"}}, bytearray(b"abc")),
    ]
    data = b"".join(wire.frame_bytes(h, p) for h, p in frames)
    r = reader_with(data)
    for h, p in frames:
        gh, gp = await wire.read_frame(r)
        assert gh == h
        assert bytes(gp) == bytes(p)
    with pytest.raises(asyncio.IncompleteReadError) as ei:
        await wire.read_frame(r)
    assert ei.value.partial == b""


def test_prefix_layout():
    bufs = wire.encode_frame({"t": "a"}, b"xyz")
    assert len(bufs) == 2
    magic, ver, flags, hlen, plen = struct.unpack("!2sBBIQ", bytes(bufs[0][:16]))
    assert (magic, ver, flags, plen) == (b"PD", 1, 0, 3)
    assert msgpack.unpackb(bufs[0][16:]) == {"t": "a"}
    assert hlen == len(bufs[0]) - 16
    assert bytes(bufs[1]) == b"xyz"
    # payload goes out without a copy
    payload = bytearray(b"q" * 100)
    bufs = wire.encode_frame({"t": "a"}, payload)
    assert bufs[1].obj is payload


def test_payload_view_multidim():
    mv = memoryview(bytearray(24)).cast("B", (2, 3, 4))
    bufs = wire.encode_frame({"t": "a"}, mv)
    assert bufs[1].nbytes == 24 and bufs[1].ndim == 1
    a = memoryview(bytearray(16)).cast("f")  # 4 floats
    assert wire.encode_frame({"t": "a"}, a)[1].nbytes == 16


async def test_crc_ok_and_mismatch_dropped():
    good = wire.frame_bytes({"t": "kv", "n": 1}, b"hello", crc=True)
    h, p = await wire.read_frame(reader_with(good))
    assert h["crc32"] == zlib.crc32(b"hello") and p == b"hello"
    bad = bytearray(good)
    bad[-1] ^= 0x01
    after = wire.frame_bytes({"t": "next"}, b"")
    r = reader_with(bytes(bad) + after)
    with pytest.raises(CrcError) as ei:
        await wire.read_frame(r)
    assert ei.value.header["t"] == "kv"
    assert "crc32 mismatch" in str(ei.value)
    # stream still in sync: the next frame reads fine
    h, p = await wire.read_frame(r)
    assert h == {"t": "next"}


@pytest.mark.parametrize(
    "prefix,msg",
    [
        (struct.pack("!2sBBIQ", b"XX", 1, 0, 5, 0), "bad magic"),
        (struct.pack("!2sBBIQ", b"PD", 2, 0, 5, 0), "unsupported wire version 2"),
        (struct.pack("!2sBBIQ", b"PD", 1, 0x04, 5, 0), "unsupported frame flags"),
        (struct.pack("!2sBBIQ", b"PD", 1, 0, 0, 0), "empty header"),
        (struct.pack("!2sBBIQ", b"PD", 1, 0, (1 << 20) + 1, 0), "MAX_HEADER_BYTES"),
        (struct.pack("!2sBBIQ", b"PD", 1, 0, 5, 1 << 40), "max_payload_bytes"),
    ],
)
async def test_bad_prefix(prefix, msg):
    with pytest.raises(WireError, match=msg):
        await wire.read_frame(reader_with(prefix + b"\x00" * 64))


async def test_max_payload_configurable():
    f = wire.frame_bytes({"t": "a"}, b"x" * 100)
    with pytest.raises(WireError, match="max_payload_bytes=99"):
        await wire.read_frame(reader_with(f), max_payload_bytes=99)
    h, p = await wire.read_frame(reader_with(f), max_payload_bytes=100)
    assert len(p) == 100


@pytest.mark.parametrize(
    "hb,msg",
    [
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"x": 1}), "lacks a str 't'"),
        (msgpack.packb({"t": 5}), "lacks a str 't'"),
        (msgpack.packb({"t": "a"}) + b"\x01", "undecodable"),
        (b"\xc1", "undecodable"),
        (msgpack.packb({1: 2, "t": "a"}), "undecodable"),
    ],
)
async def test_bad_header(hb, msg):
    data = struct.pack("!2sBBIQ", b"PD", 1, 0, len(hb), 0) + hb
    with pytest.raises(WireError, match=msg):
        await wire.read_frame(reader_with(data))


async def test_crc_flag_without_field():
    hb = msgpack.packb({"t": "a"})
    data = struct.pack("!2sBBIQ", b"PD", 1, wire.FLAG_CRC, len(hb), 0) + hb
    with pytest.raises(WireError, match="crc32"):
        await wire.read_frame(reader_with(data))


def test_encode_rejects_bad_header():
    with pytest.raises(WireError):
        wire.encode_frame({"x": 1})
    with pytest.raises(WireError):
        wire.encode_frame({"t": "a", "big": b"x" * (1 << 20)})
    with pytest.raises(WireError, match="not msgpack-encodable"):
        wire.encode_frame({"t": "a", "v": object()})
    with pytest.raises(WireError, match="not msgpack-encodable"):
        wire.encode_frame({"t": "a", "v": 2**64})


async def test_truncated_frame_incomplete():
    f = wire.frame_bytes({"t": "a"}, b"x" * 100)
    for cut in (1, 15, 16, 18, len(f) - 1):
        with pytest.raises(asyncio.IncompleteReadError):
            await wire.read_frame(reader_with(f[:cut]))


def test_decode_frame_sync():
    f = wire.frame_bytes({"t": "a", "v": 1}, b"pay", crc=True) + b"rest"
    h, p, n = wire.decode_frame(f)
    assert h["v"] == 1 and p == b"pay" and f[n:] == b"rest"


async def _decode_all(data: bytes) -> None:
    r = reader_with(data)
    for _ in range(len(data) + 1):
        try:
            await wire.read_frame(r, max_payload_bytes=1 << 16)
        except CrcError:
            continue
        except (WireError, asyncio.IncompleteReadError):
            return
    raise AssertionError("decoder did not terminate")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    # any input ends in WireError / IncompleteReadError (EOF), never another exception or a hang
    asyncio.run(asyncio.wait_for(_decode_all(data), 5))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5), max_size=4),
    st.binary(max_size=64),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
)
def test_fuzz_mutated_frames(extra, payload, crc, flips):
    h = dict(extra)
    h["t"] = "m"
    f = bytearray(wire.frame_bytes(h, payload, crc=crc) * 2)
    for pos, val in flips:
        if pos < len(f):
            f[pos] = val
    asyncio.run(asyncio.wait_for(_decode_all(bytes(f)), 5))


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1) | st.text() | st.none() | st.lists(st.integers(-(2**63), 2**63), max_size=3), max_size=6),
    st.binary(max_size=512),
    st.booleans(),
)
def test_roundtrip_property(extra, payload, crc):
    h = {k: v for k, v in extra.items() if k != "crc32"}  # "crc32" is the format's own key (FLAG_CRC)
    h["t"] = "p"
    got_h, got_p, n = wire.decode_frame(wire.frame_bytes(h, payload, crc=crc))
    if crc:
        got_h.pop("crc32")
    assert got_h == h and got_p == payload


async def _framestream_pair(chunks, delay=0.0):
    """A FrameStream reading what a plain server writes in ``chunks`` (then EOF)."""

    async def serve(r, w):
        for c in chunks:
            w.write(c)
            await w.drain()
            if delay:
                await asyncio.sleep(delay)
        w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    _, fs = await loop.create_connection(lambda: wire.FrameStream(limit=1 << 16), "127.0.0.1", port)
    return srv, fs


async def test_framestream_reads_frames_split_anyhow():
    import random

    rng = random.Random(5)
    frames = []
    for i in range(40):
        n = rng.choice([0, 1, 100, 5000, 40000, 70000, 300000])
        frames.append(({"t": "f", "i": i}, bytes([i]) * n))
    blob = b"".join(wire.frame_bytes(h, p, crc=(i % 3 == 0)) for i, (h, p) in enumerate(frames))
    cuts, pos = [], 0
    while pos < len(blob):
        k = rng.choice([1, 7, 16, 1000, 65536, 200000])
        cuts.append(blob[pos : pos + k])
        pos += k
    srv, fs = await _framestream_pair(cuts)
    try:
        for h, p in frames:
            gh, gp = await asyncio.wait_for(wire.read_frame(fs), 5)
            gh.pop("crc32", None)
            assert gh == h and bytes(gp) == p
        with pytest.raises(asyncio.IncompleteReadError) as ei:
            await asyncio.wait_for(wire.read_frame(fs), 5)
        assert ei.value.partial == b""
    finally:
        fs.close()
        srv.close()


async def test_framestream_eof_mid_large_payload_and_backpressure():
    f = wire.frame_bytes({"t": "big"}, b"x" * 500_000)
    srv, fs = await _framestream_pair([f[:300_000]])
    try:
        with pytest.raises(asyncio.IncompleteReadError) as ei:
            await asyncio.wait_for(wire.read_frame(fs), 5)
        assert len(ei.value.partial) == 300_000 - len(f) + 500_000
    finally:
        fs.close()
        srv.close()
    # many small frames not read yet: reading pauses at 2 x limit, resumes as they are consumed
    small = [wire.frame_bytes({"t": "s", "i": i}, b"y" * 1000) for i in range(2000)]
    srv, fs = await _framestream_pair(small)
    try:
        await asyncio.sleep(0.2)
        assert fs._read_paused and len(fs._data) <= 2 * (1 << 16) + 256 * 1024
        for i in range(2000):
            h, p = await asyncio.wait_for(wire.read_frame(fs), 5)
            assert h["i"] == i and len(p) == 1000
    finally:
        fs.close()
        srv.close()


class _FakeTransport:
    def __init__(self):
        self.paused = False

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def is_closing(self):
        return False


async def _feed_framestream(data: bytes, splits: list[int]) -> list:
    """Feed ``data`` to a FrameStream the way a transport does (get_buffer/buffer_updated), in
    pieces, while a reader decodes frames; returns the decoded headers."""
    fs = wire.FrameStream(limit=1 << 12)
    fs.connection_made(_FakeTransport())
    got = []

    async def feed():
        pos, k = 0, 0
        while pos < len(data):
            piece = splits[k % len(splits)] if splits else len(data)
            k += 1
            end = min(len(data), pos + max(1, piece))
            while pos < end:
                buf = fs.get_buffer(-1)
                n = min(len(buf), end - pos)
                assert n > 0
                buf[:n] = data[pos : pos + n]
                fs.buffer_updated(n)
                pos += n
            await asyncio.sleep(0)
        fs.eof_received()

    async def read():
        while True:
            try:
                h, p = await wire.read_frame(fs, max_payload_bytes=1 << 20)
                got.append((h, bytes(p)))
            except CrcError:
                continue
            except (WireError, asyncio.IncompleteReadError):
                return

    await asyncio.wait_for(asyncio.gather(feed(), read()), 5)
    return got


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.lists(st.integers(1, 64), max_size=5))
def test_fuzz_framestream_random_bytes(data, splits):
    asyncio.run(_feed_framestream(data, splits))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from([0, 3, 4095, 40000, 70000]), min_size=1, max_size=4),
    st.lists(st.integers(1, 50000), max_size=5),
    st.booleans(),
)
def test_framestream_roundtrip_any_split(sizes, splits, crc):
    frames = [({"t": "x", "i": i}, bytes([i % 256]) * n) for i, n in enumerate(sizes)]
    data = b"".join(wire.frame_bytes(h, p, crc=crc) for h, p in frames)
    got = asyncio.run(_feed_framestream(data, splits))
    for h, _ in got:
        h.pop("crc32", None)
    assert got == frames


async def _fed(fs, data: bytes, piece: int, hold_views: bool) -> None:
    """Feed ``data`` to ``fs`` as a transport does, ``piece`` bytes at most per receive; with
    ``hold_views`` the last receive's view is still alive at the next ``get_buffer`` (as in
    :func:`_feed_framestream`), otherwise released first (asyncio's transports)."""
    pos = 0
    while pos < len(data):
        buf = fs.get_buffer(-1)
        n = min(len(buf), piece, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        if not hold_views:
            del buf
        fs.buffer_updated(n)
        pos += n
        await asyncio.sleep(0)


async def test_a_stalled_large_frame_holds_about_what_arrived_not_what_it_announced():
    """A peer announcing a 64 MiB payload and stalling after 1.5 MiB: the reader's buffer grows as
    bytes arrive (doubling from 1 MiB), so it holds 2 MiB, not 64 (it allocated the announced
    size before any byte came: an authenticated peer could hold 256 MiB per connection)."""
    import tracemalloc

    fs = wire.FrameStream(limit=1 << 16)
    fs.connection_made(_FakeTransport())
    frame = wire.frame_bytes({"t": "kv"}, bytes(64 << 20))
    sent = frame[: len(frame) - (64 << 20) + (3 << 19)]  # the prefix, the header, 1.5 MiB of payload
    del frame
    # a whole 3 MiB frame first: the zero bytes a buffer grows by are made once per process (calloc'd,
    # so they cost no memory until written, which they never are; tracemalloc would count them)
    first = asyncio.get_running_loop().create_task(wire.read_frame(fs))
    await _fed(fs, wire.frame_bytes({"t": "kv"}, bytes(3 << 20)), 256 << 10, hold_views=False)
    assert len((await first)[1]) == 3 << 20
    rx0 = fs.rx_bytes
    tracemalloc.start()
    try:
        read = asyncio.get_running_loop().create_task(wire.read_frame(fs, max_payload_bytes=256 << 20))
        before = tracemalloc.get_traced_memory()[0]
        await _fed(fs, sent, 256 << 10, hold_views=False)
        held = tracemalloc.get_traced_memory()[1] - before
        assert not read.done() and fs.rx_bytes - rx0 == len(sent)
        assert (2 << 20) <= held < (2 << 20) + (512 << 10)  # the buffer, and at most one receive's bytes beside it
        read.cancel()
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("hold_views", [False, True], ids=["views_released", "a_view_held"])
async def test_a_large_frame_read_into_a_growing_buffer_arrives_whole(hold_views):
    """The payload (5 MiB + 3 bytes: not a power of two) is whole and in order after the buffer
    grew 1 -> 2 -> 4 -> 5 MiB, in place or (a view of it still held) into a new one; 100 bytes
    were already buffered when the read began."""
    fs = wire.FrameStream(limit=1 << 16)
    fs.connection_made(_FakeTransport())
    payload = bytes(range(251)) * ((5 << 20) // 251 + 1)
    payload = payload[: (5 << 20) + 3]
    frame = wire.frame_bytes({"t": "kv", "i": 1}, payload, crc=True)
    await _fed(fs, frame[:100], 100, hold_views)
    read = asyncio.get_running_loop().create_task(wire.read_frame(fs, max_payload_bytes=256 << 20))
    await _fed(fs, frame[100:], 300_007, hold_views)
    h, got = await asyncio.wait_for(read, 5)
    assert h["i"] == 1 and len(got) == len(payload) and bytes(got) == payload


async def test_a_read_cancelled_after_its_buffer_filled_keeps_no_reference_to_it():
    """The last bytes of a 2 MiB read arrive, then the read is cancelled before it resumes (its
    connection closing): the stream holds no reference to the filled buffer afterwards (it kept
    it, up to the reader's 256 MiB ``max_payload_bytes``, until a later large read replaced it),
    and a next large read returns its own bytes."""
    fs = wire.FrameStream(limit=1 << 16)
    fs.connection_made(_FakeTransport())
    read = asyncio.get_running_loop().create_task(fs.readexactly(2 << 20))
    await asyncio.sleep(0)
    await _fed(fs, b"\x01" * ((2 << 20) - 1), 256 << 10, hold_views=False)
    buf = fs.get_buffer(-1)
    buf[:1] = b"\x01"
    del buf
    fs.buffer_updated(1)  # filled: the read is woken, not run yet
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert fs._full is None and fs._target is None
    nxt = asyncio.get_running_loop().create_task(fs.readexactly(64 << 10))
    await asyncio.sleep(0)
    await _fed(fs, b"\x02" * (64 << 10), 8 << 10, hold_views=False)
    assert bytes(await nxt) == b"\x02" * (64 << 10)
