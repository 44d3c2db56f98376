"""Micro-run of the emulated line's loss and cross-traffic model: one or two connections push
2 MiB each through ``pdd.transfer.link`` at 0.05 Gbit/s and 20 ms; prints, per case, the wall-clock
time from the first byte sent to the last byte received and the model's ``N*8 / min(line - cross,
connections * mathis)`` plus half the RTT (docs/LINK.md, "Loss, cross traffic and the live estimate").

    PYTHONPATH=src python scripts/link_loss_micro.py
"""

import asyncio
import time

from pdd.policy import tcp_model as tm
from pdd.transfer.link import Link

N, GBPS, RTT = 2 << 20, 0.05, 20.0


async def one_case(loss: float, cross: float, conns: int) -> tuple[float, float]:
    done = asyncio.Event()
    got = {"n": 0, "t": 0.0}

    async def sink(r, w):
        while d := await r.read(1 << 16):
            got["n"] += len(d)
            if got["n"] == N * conns:
                got["t"] = time.monotonic()
                done.set()
        w.close()

    srv = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    cfg = {"routes": [{"listen_port": 0, "target_port": port}], "gbps": GBPS, "rtt_ms": RTT,
           "loss_rate": loss, "cross_traffic": [[0, cross]] if cross else []}
    async with Link(cfg) as link:
        ws = [(await asyncio.open_connection("127.0.0.1", link.ports[0]))[1] for _ in range(conns)]
        t0 = time.monotonic()
        for w in ws:
            w.write(bytes(N))
        await asyncio.wait_for(done.wait(), 60)
        for w in ws:
            w.close()
    srv.close()
    m = tm.mathis_gbps(1460, RTT, loss)
    return got["t"] - t0, tm.transfer_seconds(N * conns, GBPS, cross, m, conns) + RTT / 2000


async def main() -> None:
    print("loss     cross Gbit/s  connections  measured s  model s")
    for loss, cross, conns in [(0, 0, 1), (0, 0.025, 1), (1e-3, 0, 1), (1e-3, 0, 2), (0, 0, 2), (1e-2, 0, 1)]:
        got, model = await one_case(loss, cross, conns)
        print(f"{loss:<8g} {cross:<13g} {conns:<12d} {got:<11.3f} {model:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
