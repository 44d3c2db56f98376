"""Large framed reads: a buffer that grows as bytes arrive (``wire.FrameStream`` now) against one
allocated at the announced size before any byte came (its ``readexactly`` until 2026-12-06), in
one process, over loopback TCP: one connection each, fed by its own sender thread, read batch by
batch in alternation (so the machine's load hits both alike): batches of 200 frames of 64 KiB,
20 of 1 MiB, 1 of 64 MiB. Prints, per size, the median seconds per frame of each, the median of
the batch pairs' ratios (grown / preallocated) and their quartiles, and the bytes a reader holds
for a frame announced at 64 MiB whose sender stalled after 1 MiB. Below 1 MiB both read the same
way (their ratio there is the measurement's noise).

    PYTHONPATH=src python scripts/frame_read_micro.py --pairs 40
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time

from pdd.transfer import wire


class Preallocated(wire.FrameStream):
    """``FrameStream`` with its former large read: ``bytearray(n)`` at once, filled in place."""

    def get_buffer(self, sizehint: int):
        if self._target is not None:
            return memoryview(self._target)[self._tpos:]
        return self._scratch_view

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self.rx_bytes += nbytes
            self._tpos += nbytes
            if self._tpos == len(self._target):
                self._target = None
                self._wake()
            return
        super().buffer_updated(nbytes)

    async def readexactly(self, n: int):
        if n < wire._LARGE_READ_BYTES or len(self._data) >= n:
            return await super().readexactly(n)
        loop = asyncio.get_running_loop()
        target = bytearray(n)
        have = len(self._data)
        target[:have] = self._data
        self._data.clear()
        self._target, self._tpos = target, have
        self._resume_reading()
        try:
            while self._target is not None:
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(target[: self._tpos]), n)
                self._waiter = loop.create_future()
                await self._waiter
        finally:
            self._waiter = None
            self._target = None
        return target


def _sender(srv: socket.socket, frame: bytes) -> None:
    """Serve one connection: for each 4-byte count read, send that many frames."""
    conn, _ = srv.accept()
    srv.close()
    with conn:
        while True:
            req = conn.recv(4)
            if len(req) < 4:
                return
            for _ in range(int.from_bytes(req, "big")):
                conn.sendall(frame)


class _Reader:
    """One receiving connection of stream class ``cls`` to its own sender thread of ``frame``."""

    async def open(self, cls, port: int, frame: bytes):
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        self.th = threading.Thread(target=_sender, args=(srv, frame), daemon=True)
        self.th.start()
        _, self.proto = await asyncio.get_running_loop().create_connection(lambda: cls(1 << 20), "127.0.0.1", port)
        return self

    async def batch(self, frames: int, size: int) -> float:
        """Seconds to ask for and read ``frames`` frames of ``size`` payload bytes."""
        t0 = time.perf_counter()
        self.proto.write(frames.to_bytes(4, "big"))
        for _ in range(frames):
            _, payload = await wire.read_frame(self.proto)
            assert len(payload) == size
        return time.perf_counter() - t0

    async def close(self) -> None:
        self.proto.close()
        await self.proto.wait_closed()
        await asyncio.get_running_loop().run_in_executor(None, self.th.join)


async def _stalled_peak(cls, port: int) -> int:
    """Bytes of the buffer a reader holds for a 64 MiB frame whose sender stopped after 1 MiB."""
    head = wire.frame_bytes({"t": "kv"}, bytes(64 << 20))[: wire.PREFIX_BYTES + 16 + (1 << 20)]
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: cls(1 << 20), "127.0.0.1", port)
    conn, _ = await loop.run_in_executor(None, srv.accept)
    read = loop.create_task(wire.read_frame(proto))
    await loop.run_in_executor(None, conn.sendall, head)
    while proto.rx_bytes < len(head):
        await asyncio.sleep(0.01)
    held = len(proto._target) if proto._target is not None else 0
    read.cancel()
    conn.close()
    srv.close()
    proto.close()
    return held


async def main(args) -> None:
    port = args.port
    print(f"{'size':>8} {'batch':>5} {'pairs':>5} {'prealloc ms':>12} {'grown ms':>9} {'ratio':>6} "
          f"{'pair ratio p25-p75':>19}")
    for size, frames in ((64 << 10, 200), (1 << 20, 20), (64 << 20, 1)):
        frame = wire.frame_bytes({"t": "kv"}, bytes(size))
        a = await _Reader().open(Preallocated, port, frame)
        b = await _Reader().open(wire.FrameStream, port + 1, frame)
        port += 2
        ta, tb, ratios = [], [], []
        await a.batch(frames, size), await b.batch(frames, size)  # warm
        for i in range(args.pairs):  # alternating batch by batch: the machine's load hits both alike
            if i % 2:
                y, x = await b.batch(frames, size), await a.batch(frames, size)
            else:
                x, y = await a.batch(frames, size), await b.batch(frames, size)
            ta.append(x / frames)
            tb.append(y / frames)
            ratios.append(y / x)
        await a.close()
        await b.close()
        q = statistics.quantiles(ratios, n=4)
        print(f"{size >> 10:>6}Ki {frames:>5} {args.pairs:>5} {statistics.median(ta) * 1e3:>12.3f} "
              f"{statistics.median(tb) * 1e3:>9.3f} {statistics.median(ratios):>6.3f} {q[0]:>9.3f}-{q[2]:.3f}")
    for cls in (Preallocated, wire.FrameStream):
        held = await _stalled_peak(cls, port)
        port += 1
        print(f"stalled 64 MiB frame after 1 MiB: {cls.__name__} holds {held >> 20} MiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40, help="batches of each reader per size, alternating (default 40)")
    ap.add_argument("--port", type=int, default=9450, help="first of 8 loopback ports used (default 9450)")
    asyncio.run(main(ap.parse_args()))
