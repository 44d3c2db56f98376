"""Liveness: heartbeats find a peer behind a WAN outage (no reset) in seconds; a slow KV transfer, or
one waiting its turn, is never timed out; a chunk that stops moving while it is being sent is."""

import asyncio
import time

from pdd.transfer.kv import KVReceiver, KVSender
from pdd.transfer.link import Link
from pdd.transfer.client import connect
from pdd.transfer.server import Server

HB, DEAD = 0.05, 0.4  # heartbeat interval and silence limit, seconds
STALL = 1.2  # KV chunk-stall limit of the slow-transfer test (see there)


def link_cfg(port, **kw):
    c = {"routes": [{"listen_port": 0, "target_host": "127.0.0.1", "target_port": port}], "control_port": 0}
    c.update(kw)
    return c


async def wait_for(cond, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_heartbeat_keeps_idle_connection_and_finds_peer_behind_outage():
    closed = []
    server = await Server(port=0, heartbeat_s=HB, dead_after_s=DEAD, on_disconnect=closed.append).start()
    async with Link(link_cfg(server.port, gbps=1.0, rtt_ms=2)) as link:
        peer = await connect("127.0.0.1", link.ports[0], heartbeat_s=HB, dead_after_s=DEAD)
        try:
            # idle for 3x the silence limit: the heartbeats keep it open on both sides
            await asyncio.sleep(3 * DEAD)
            assert not peer.closed and not closed
            link.set(outage=True)  # packets dropped, nothing reset
            await wait_for(lambda: peer.closed and closed)
            assert peer.dead_peer and closed[0].dead_peer
            assert "no sign of life" in str(peer._close_reason)
            try:
                await peer.call({"t": "x"})
            except ConnectionError as e:
                assert "no sign of life" in str(e)
            else:
                raise AssertionError("call on a dead connection succeeded")
        finally:
            link.set(outage=False)
            await peer.close()
    await server.close()


async def test_no_heartbeat_unless_both_sides_send_them():
    server = await Server(port=0, heartbeat_s=HB, dead_after_s=DEAD).start()
    peer = await connect("127.0.0.1", server.port)  # an old / plain client: no "hb" in its hello
    try:
        await asyncio.sleep(3 * DEAD)
        assert not peer.closed
        assert peer.frames_received == 0  # the server sent it no heartbeat frame
        (sp,) = server.peers
        assert not sp.closed and sp._hb_task is None
    finally:
        await peer.close()
        await server.close()


async def test_slow_and_queued_transfers_are_not_timed_out():
    """Through a slow line the transfer lasts many times the silence limit and the chunk-stall
    limit; the second transfer waits its turn (FIFO) as long. Both complete, byte-exact."""
    got, done = {}, {}

    def on_pages(rid, first, n, layers, payload):
        got.setdefault(rid, bytearray()).extend(payload)

    async def on_done(rid, h):
        done[rid] = h

    recv = KVReceiver(on_pages, on_done)
    server = await Server(port=0, handlers=recv.handlers(), heartbeat_s=HB, dead_after_s=DEAD).start()
    pb, n = 16000, 250  # 4 MB per transfer: more than the socket buffers hold, so writes block
    blobs = {r: bytes([r]) * (pb * n) for r in (1, 2)}
    # the chunk-stall limit is 1.2 s, not DEAD: once the socket buffers are full, the kernel wakes a
    # blocked writer only after a large share of its send buffer (MBs on loopback) has drained,
    # so one 64 KB write legitimately waits ~0.5 s at this rate (0.4 s failed about half the runs)
    async with Link(link_cfg(server.port, gbps=0.02, rtt_ms=2)) as link:  # 2.5 MB/s: ~3.2 s for both
        peer = await connect("127.0.0.1", link.ports[0], heartbeat_s=HB, dead_after_s=DEAD)
        sender = KVSender(peer, order="fifo", chunk_pages=4, stall_timeout_s=STALL)
        t0 = time.monotonic()
        trs = [sender.submit(r, 0, lambda i, k, r=r: memoryview(blobs[r])[i * pb:(i + k) * pb], n, pb)
               for r in (1, 2)]
        res = await asyncio.gather(*trs)
        await wait_for(lambda: len(done) == 2)
        elapsed = time.monotonic() - t0
        assert [r.cancelled for r in res] == [False, False]
        assert [r.bytes_sent for r in res] == [pb * n, pb * n]
        assert bytes(got[1]) == blobs[1] and bytes(got[2]) == blobs[2]
        assert elapsed > 2 * STALL > 2 * DEAD  # the test means something: longer than both limits
        assert sender.stalls == 0 and not peer.closed
        await peer.close()
    await server.close()


async def test_chunk_that_stops_moving_fails_the_transfers():
    """An outage mid-transfer, heartbeats off: the chunk being written makes no progress for
    stall_timeout_s, the connection is closed and every transfer on it fails (ConnectionError)."""
    recv = KVReceiver(lambda *a: None)
    server = await Server(port=0, handlers=recv.handlers()).start()
    pb, n = 64 * 1024, 400  # 26 MB: far more than the socket buffers hold
    blob = bytes(pb * n)
    async with Link(link_cfg(server.port, gbps=1.0, rtt_ms=2)) as link:
        peer = await connect("127.0.0.1", link.ports[0])
        sender = KVSender(peer, order="fifo", chunk_pages=4, stall_timeout_s=0.3)
        t1 = sender.submit("a", 0, lambda i, k: memoryview(blob)[i * pb:(i + k) * pb], n, pb)
        t2 = sender.submit("b", 0, lambda i, k: memoryview(blob)[i * pb:(i + k) * pb], n, pb)  # waits its turn
        await wait_for(lambda: t1.pages_sent > 0)
        link.set(outage=True)
        for t in (t1, t2):
            try:
                await asyncio.wait_for(t.done, 20)
            except ConnectionError as e:
                assert "stalled" in str(e) or "aborted" in str(e)
            else:
                raise AssertionError("a stalled transfer completed")
        assert sender.stalls == 1 and peer.closed
        assert 0 < t1.pages_sent < n and t2.pages_sent == 0
        link.set(outage=False)
    await server.close()


async def test_a_dialled_peer_declared_dead_is_named_by_its_instance(caplog):
    """The dialling side (the gateway, P) names a connection by the address it dialled; its
    dead-peer line also names the instance behind it (``md0 at 127.0.0.1:PORT``): the gateway's
    one line for a WAN outage said only the link's address."""
    server = await Server(port=0, heartbeat_s=HB, dead_after_s=DEAD, role="main_decode", instance="md0").start()
    async with Link(link_cfg(server.port, gbps=1.0, rtt_ms=2)) as link:
        peer = await connect("127.0.0.1", link.ports[0], heartbeat_s=HB, dead_after_s=DEAD)
        try:
            link.set(outage=True)
            await peer.wait_closed()
            lines = [r.getMessage() for r in caplog.records if "peer declared dead" in r.getMessage()]
            assert [x for x in lines if x.startswith(f"<Peer md0 at 127.0.0.1:{link.ports[0]} ")], lines
        finally:
            link.set(outage=False)
            await peer.close()
    await server.close()


async def test_a_frame_slower_than_the_silence_limit_does_not_kill_the_connection():
    """At 0.4 Mbit/s one 48 KiB frame takes about 1 s on the line, more than twice the silence
    limit, and the heartbeats queue behind it. The line delivers its bytes as it serialises
    them (``pdd.transfer.link.SLICE_S``), so the receiver sees them arrive and the call
    completes; when the emulator handed a chunk over whole at its end, the receiver declared
    the sender dead first."""

    async def echo(peer, h, p):
        return {"t": "echo_r", "n": len(p)}, b""

    server = await Server(port=0, handlers={"echo": echo}, heartbeat_s=HB, dead_after_s=DEAD).start()
    async with Link(link_cfg(server.port, gbps=4e-4, rtt_ms=2)) as link:
        peer = await connect("127.0.0.1", link.ports[0], heartbeat_s=HB, dead_after_s=DEAD)
        try:
            n = 48 << 10
            assert n * 8 / 4e5 > 2 * DEAD  # the test means something: the frame outlasts the limit
            h, _ = await peer.call({"t": "echo"}, bytes(n), timeout=10.0)
            assert h["n"] == n
            (sp,) = server.peers
            assert not peer.closed and not sp.closed and not sp.dead_peer and not peer.dead_peer
        finally:
            await peer.close()
    await server.close()
