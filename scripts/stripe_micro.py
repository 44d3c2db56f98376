"""Micro-run of a KV transfer striped over N connections (``KVSender(peers=...)``, ``KVReorder``)
through the emulated WAN line (``pdd.transfer.link``): a 2 MiB transfer (64 pages of 32 KiB,
frames of at most half a BDP, P's socket caps), submit to the receiver's ``kv_done``, against the model's
``bytes*8 / min(line, N * mathis)`` plus half the RTT (docs/LINK.md, "Parallel connections").

    PYTHONPATH=src python scripts/stripe_micro.py
"""

import asyncio
import time

from pdd.policy import tcp_model as tm
from pdd.policy.wan_order import send_buffer_bytes
from pdd.transfer.kv import KVReceiver, KVReorder, KVSender
from pdd.transfer.link import Link
from pdd.transfer.client import connect
from pdd.transfer.server import Server
from pdd.transfer.wire import limit_write_buffers, set_socket_buffer

PAGE, PAGES, RTT = 32 << 10, 64, 20.0


async def one_case(gbps: float, loss: float, conns: int) -> tuple[float, float, int]:
    done = asyncio.Event()
    got = {"bytes": 0}

    def on_pages(rid, first, n, layers, payload):
        got["bytes"] += len(payload)

    recv = KVReceiver(on_pages, lambda rid, h: done.set())
    srv = Server("127.0.0.1", 0, KVReorder().wrap(recv.handlers()))
    await srv.start()
    cfg = {"routes": [{"listen_port": 0, "target_port": srv.port}], "gbps": gbps, "rtt_ms": RTT,
           "jitter_ms": 0.0, "loss_rate": loss}
    async with Link(cfg) as link:
        peers = [await connect("127.0.0.1", link.ports[0]) for _ in range(conns)]
        cap = send_buffer_bytes(gbps, RTT, 1.0)  # as P's WAN senders (roles.prefill): 1 BDP, frames of half
        for p in peers:
            set_socket_buffer(p.writer, cap)
            limit_write_buffers(p.writer.transport)
        s = KVSender(peers[0], peers=peers[1:], chunk_pages=2, max_frame_bytes=cap // 2)
        t0 = time.monotonic()
        s.submit("r", 0, lambda i, n: bytes(n * PAGE), PAGES, PAGE)
        await asyncio.wait_for(done.wait(), 120)
        took = time.monotonic() - t0
        await s.close()
        for p in peers:
            await p.close()
    await srv.close()
    m = tm.mathis_gbps(1460, RTT, loss)
    return took, tm.transfer_seconds(PAGES * PAGE, gbps, 0.0, m, conns) + RTT / 2000, s.bytes_by_connection


async def main() -> None:
    print("line Gbit/s  loss     connections  measured s  model s  bytes per connection")
    for gbps, loss, conns in [(0.05, 1e-3, 1), (0.05, 1e-3, 2), (0.05, 1e-3, 4), (0.025, 0, 1), (0.025, 0, 4)]:
        took, model, nbytes = await one_case(gbps, loss, conns)
        print(f"{gbps:<12g} {loss:<8g} {conns:<12d} {took:<11.3f} {model:<8.3f} {nbytes}")


if __name__ == "__main__":
    asyncio.run(main())
