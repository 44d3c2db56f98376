"""Measure what link security costs, on loopback without the link emulator's rate limit (not a
test; run by hand):

    .venv/bin/python tests/transfer/bench_tls.py [--mb 1000] [--chunk-kb 512] [--reps 2]

For each mode (plain, fast-path MAC, mutual TLS 1.3) a receiver process runs a ``pdd.transfer.server.Server``
whose ``kv`` handler only counts bytes, and this process streams ``--mb`` MB of KV-sized one-way
frames (``--chunk-kb``, default 512 KiB = one 16-page KV chunk of the demo model) over one
``pdd.transfer.client.connect`` connection, as P does. Prints MB/s (payload, first byte sent -> last byte handled) and
CPU seconds per GB in the sender and in the receiver (getrusage of each process); best of
``--reps``. Also HMAC-SHA256 alone on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pdd.security import client_context, make_certs, server_context  # noqa: E402
from pdd.transfer.client import connect  # noqa: E402
from pdd.transfer.server import Server  # noqa: E402

KEY = os.urandom(32)


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def receiver(mode: str, certs: str, conn) -> None:
    async def main():
        state = {"bytes": 0, "cpu0": None}

        def on_kv(peer, h, p):
            if state["cpu0"] is None:
                state["cpu0"] = cpu()
            state["bytes"] += len(p)

        def on_done(peer, h, p):
            return {"t": "done_ok", "bytes": state["bytes"], "cpu_s": cpu() - state["cpu0"]}

        kw = {}
        if mode == "tls":
            kw["ssl"] = server_context(certs, "rld0")
        elif mode == "mac":
            kw["mac_key"] = KEY
        srv = await Server("127.0.0.1", 0, {"kv": on_kv, "done": on_done}, instance="rld0", **kw).start()
        conn.send(srv.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await srv.close()

    asyncio.run(main())


async def send_all(mode: str, certs: str, port: int, total: int, chunk: int) -> dict:
    kw = {}
    if mode == "tls":
        kw = {"ssl": client_context(certs, "p0"), "server_hostname": "rld0"}
    elif mode == "mac":
        kw = {"mac_key": KEY}
    peer = await connect("127.0.0.1", port, instance="p0", **kw)
    data = memoryview(os.urandom(chunk))
    n = total // chunk
    c0, t0 = cpu(), time.perf_counter()
    for i in range(n):
        await peer.send({"t": "kv", "rid": "r", "first_page": i, "n_pages": 16, "page_bytes": chunk // 16}, data)
    h, _ = await peer.call({"t": "done"})
    wall, c = time.perf_counter() - t0, cpu() - c0
    await peer.close()
    assert h["bytes"] == n * chunk
    gb = n * chunk / 1e9
    return {"mb_s": n * chunk / wall / 1e6, "send_cpu_s_per_gb": c / gb, "recv_cpu_s_per_gb": h["cpu_s"] / gb}


def run_mode(mode: str, certs: str, total: int, chunk: int) -> dict:
    parent, child = mp.Pipe()
    p = mp.get_context("fork").Process(target=receiver, args=(mode, certs, child), daemon=True)
    p.start()
    port = parent.recv()
    try:
        return asyncio.run(send_all(mode, certs, port, total, chunk))
    finally:
        parent.send("stop")
        p.join(10)


def hmac_rate(chunk: int) -> float:
    buf = os.urandom(chunk)
    n = max(1, (256 << 20) // chunk)
    t0 = time.process_time()
    for _ in range(n):
        hmac.new(KEY, buf, hashlib.sha256).digest()
    return n * chunk / (time.process_time() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1000)
    ap.add_argument("--chunk-kb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    certs = tempfile.mkdtemp(prefix="pdd-bench-tls-")
    make_certs(certs, ["p0", "rld0"])
    total, chunk = a.mb * 1_000_000, a.chunk_kb << 10
    rows = {}
    for mode in ("plain", "mac", "tls"):
        best = None
        for _ in range(a.reps):
            r = run_mode(mode, certs, total, chunk)
            if best is None or r["mb_s"] > best["mb_s"]:
                best = r
        rows[mode] = best
    print(f"{a.mb} MB in {a.chunk_kb} KiB frames over one loopback connection, best of {a.reps}")
    print(f"{'mode':8} {'MB/s':>8} {'sender CPU-s/GB':>16} {'receiver CPU-s/GB':>18}")
    for mode, r in rows.items():
        print(f"{mode:8} {r['mb_s']:8.0f} {r['send_cpu_s_per_gb']:16.2f} {r['recv_cpu_s_per_gb']:18.2f}")
    for mode in ("mac", "tls"):
        d = {k: rows[mode][k] - rows["plain"][k] for k in ("send_cpu_s_per_gb", "recv_cpu_s_per_gb")}
        print(f"{mode} over plain: +{d['send_cpu_s_per_gb']:.2f} CPU-s/GB sending, "
              f"+{d['recv_cpu_s_per_gb']:.2f} receiving")
    print(f"HMAC-SHA256 alone: {hmac_rate(chunk):.0f} MB/s per core ({1000 / hmac_rate(chunk):.2f} CPU-s/GB)")


if __name__ == "__main__":
    main()
