"""Test helpers: a TCP proxy that corrupts bytes on the wire (after the sender's MAC or TLS
record), free ports."""

from __future__ import annotations

import asyncio
import socket
import struct

from pdd.transfer import wire

REGIONS = ("prefix", "header", "payload", "tag")


class FlipProxy:
    """Forwards client -> server and back; corrupts one client -> server byte (XOR ``mask``).

    ``flip_at``: absolute offset in the client -> server stream (any protocol, e.g. TLS), or
    ``flip_frame=(k, region, i)``: byte ``i`` (negative: from the end) of ``region`` (prefix,
    header, payload, tag) of the k-th pdd frame (0 = the hello) of a plain/MAC'd stream.
    ``sent`` keeps the client's bytes as the client sent them (for replays); ``flipped`` tells
    whether the corruption happened. Only the first connection is corrupted.
    """

    def __init__(self, target_port: int, flip_at: int | None = None, flip_frame=None, mask: int = 0x01):
        self.target_port = target_port
        self.flip_at = flip_at
        self.flip_frame = flip_frame
        self.mask = mask
        self.flipped = False
        self.sent = bytearray()
        self.port = 0
        self._server = None
        self._tasks: set = set()
        self._conns = 0

    async def start(self) -> "FlipProxy":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, cr, cw):
        first = self._conns == 0
        self._conns += 1
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        up = asyncio.ensure_future(self._up(cr, sw, first))
        down = asyncio.ensure_future(self._pipe(sr, cw))
        for t in (up, down):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (cw, sw):
            w.close()

    async def _pipe(self, r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()

    def _corrupt_frame(self, frame: bytearray) -> None:
        _, _, flags, hlen, plen = wire.PREFIX.unpack(frame[: wire.PREFIX_BYTES])
        spans = {"prefix": (0, 16), "header": (16, 16 + hlen), "payload": (16 + hlen, 16 + hlen + plen),
                 "tag": (16 + hlen + plen, len(frame))}
        _, region, i = self.flip_frame
        a, b = spans[region]
        assert b > a, f"frame has no {region}"
        frame[(a + i) if i >= 0 else (b + i)] ^= self.mask
        self.flipped = True

    async def _up(self, r, w, first: bool):
        pos = 0
        pending = bytearray()
        k = 0
        while data := await r.read(65536):
            if first:
                self.sent += data
            if not first or (self.flip_at is None and self.flip_frame is None):
                w.write(data)
            elif self.flip_at is not None:
                buf = bytearray(data)
                if pos <= self.flip_at < pos + len(buf):
                    buf[self.flip_at - pos] ^= self.mask
                    self.flipped = True
                pos += len(buf)
                w.write(bytes(buf))
            else:  # frame mode: forward whole frames, corrupting the chosen one
                pending += data
                while len(pending) >= wire.PREFIX_BYTES:
                    _, _, flags, hlen, plen = wire.PREFIX.unpack(pending[: wire.PREFIX_BYTES])
                    n = wire.PREFIX_BYTES + hlen + plen + (wire.MAC_BYTES if flags & wire.FLAG_MAC else 0)
                    if len(pending) < n:
                        break
                    frame = bytearray(pending[:n])
                    del pending[:n]
                    if k == self.flip_frame[0]:
                        self._corrupt_frame(frame)
                    k += 1
                    w.write(bytes(frame))
            await w.drain()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for(cond, timeout: float = 60.0, step: float = 0.01) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if cond():
            return True
        await asyncio.sleep(step)
    return bool(cond())


__all__ = ["FlipProxy", "REGIONS", "free_port", "wait_for", "struct"]
