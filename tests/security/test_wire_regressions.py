"""Regressions found by the wire fuzz campaign (docs/SECURITY.md, "Fuzzing")."""

from __future__ import annotations

import asyncio
import logging

from pdd.transfer import wire
from pdd.transfer.peer import Peer
from pdd.transfer.wire import FrameStream
from tests.transfer.test_wire_fuzz import _Crashes, _FakeTransport, _run


def test_crc_failure_of_a_reply_with_an_unhashable_cid_is_dropped_not_a_crash():
    """A CRC'd reply frame whose payload fails its CRC and whose header's ``cid`` is a map once
    killed the reader (TypeError: unhashable type) instead of dropping the frame."""
    for cid in ({"a": 1}, [1, 2], "7", 2.5, True):
        frame = bytearray(wire.frame_bytes({"t": "hello", "cid": cid, "reply": True}, b"p" * 16, crc=True))
        frame[-1] ^= 0xFF  # corrupt the payload: the CRC check fails with the header decoded

        async def go():
            crashed = _Crashes()
            logging.getLogger("pdd.transfer.peer").addHandler(crashed)
            try:
                reader = asyncio.StreamReader()
                reader.feed_data(bytes(frame))
                reader.feed_eof()
                stream = FrameStream()
                stream.connection_made(_FakeTransport())
                peer = Peer(reader, stream, {"*": lambda p, h, b: {"t": "ok"}})
                peer.start()
                await peer._closed_event.wait()
                await asyncio.sleep(0)
            finally:
                logging.getLogger("pdd.transfer.peer").removeHandler(crashed)
            assert not crashed.records, (cid, [r.getMessage() for r in crashed.records])

        _run(go())
