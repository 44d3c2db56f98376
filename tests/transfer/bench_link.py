"""Measure the WAN emulator's max throughput and CPU cost (not a test; run by hand).

    .venv/bin/python tests/transfer/bench_link.py [--mb 1000] [--gbps 1000] [--chunk 65536] [--flows 1]

Starts ``python -m pdd.transfer.link`` as its own process, pushes bytes through it with blocking
sockets (C-speed sender/sink threads in this process) and reads the proxy's CPU time from
/proc/<pid>/stat. Prints MB/s through the proxy and proxy CPU seconds per GB.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1000, help="MB to push (total, all flows)")
    ap.add_argument("--gbps", type=float, default=1000.0, help="line rate (high = unthrottled)")
    ap.add_argument("--rtt", type=float, default=0.0)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--flows", type=int, default=1)
    a = ap.parse_args()

    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(16)
    sport = sink.getsockname()[1]
    lport = free_port()
    cport = free_port()
    conf = {"control_port": cport, "routes": [{"listen_port": lport, "target_host": "127.0.0.1", "target_port": sport}],
            "gbps": a.gbps, "rtt_ms": a.rtt, "chunk_bytes": a.chunk}
    proc = subprocess.Popen([sys.executable, "-m", "pdd.transfer.link", "--config", json.dumps(conf)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline().strip() == "LINK READY"
    total = a.mb * 1_000_000
    per = total // a.flows
    got = [0] * a.flows

    def recv_all(i, c):
        buf = bytearray(1 << 20)
        while True:
            n = c.recv_into(buf)
            if not n:
                break
            got[i] += n
        c.close()

    def accept_loop():
        for i in range(a.flows):
            c, _ = sink.accept()
            threading.Thread(target=recv_all, args=(i, c), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    block = b"\x5a" * (1 << 20)

    def send(i):
        s = socket.create_connection(("127.0.0.1", lport))
        left = per
        while left > 0:
            n = min(left, len(block))
            s.sendall(memoryview(block)[:n])
            left -= n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        s.close()

    c0 = cpu_s(proc.pid)
    t0 = time.perf_counter()
    th = [threading.Thread(target=send, args=(i,)) for i in range(a.flows)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    while sum(got) < per * a.flows:
        time.sleep(0.001)
    el = time.perf_counter() - t0
    c1 = cpu_s(proc.pid)
    import asyncio
    from pdd.transfer.link import query_stats
    st = asyncio.run(query_stats("127.0.0.1", cport))
    proc.terminate()
    proc.wait(10)
    mb = per * a.flows / 1e6
    print(json.dumps({"mb": mb, "s": round(el, 3), "MB_per_s": round(mb / el, 1),
                      "proxy_cpu_s": round(c1 - c0, 3), "proxy_cpu_s_per_GB": round((c1 - c0) / (mb / 1000), 3),
                      "proxy_cpu_util": round((c1 - c0) / el, 2), "chunk": a.chunk, "flows": a.flows, "gbps": a.gbps,
                      "line_busy_frac": round(st["busy_s_a_to_b"] / el, 3), "ideal_s": round(mb * 8e6 / (a.gbps * 1e9) + a.rtt / 2000, 3)}))


if __name__ == "__main__":
    main()
