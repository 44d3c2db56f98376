"""Streamed tokens beside grammar compiles, at ``gateway_switch_interval_ms`` 5 (Python's
default) against 1 (pdd's default): how late the event loop wakes while a GBNF grammar converts on
another thread, and a plain streamed completion's inter-token latency (ITL) while clients send
new GBNF grammars to the same gateway.

1. In this process (no topology): a 2 ms ``asyncio.sleep`` 300 times while a thread converts
   new ~26.7 KB GBNF grammars one after another (``pdd.structured``'s compile, as the gateway's
   compiler thread): how late each wakeup is, P50 / P99 (ms), per interval, alternating 5, 1, 5, 1.
2. Live (``--no-live`` skips it):
The gateway converts a GBNF grammar to Lark in Python on its compiler thread; meanwhile every
event-loop wakeup (each streamed token) waits for the interpreter lock, up to the switch interval.
per setting, a fresh colocated topology (``pdd.launch.Topology``, the ``small`` preset made in a
temporary directory): ``--compile-clients`` clients each send a new ~26.7 KB GBNF grammar
(``max_tokens`` 1) as soon as the last one answered, while ``--streams`` plain streamed
completions of ``--tokens`` tokens run one after another; then the same streams with no
grammar client (the idle reference). Printed per setting: ITL mean / P90 (ms, over every gap
between content chunks; a delayed loop sends tokens in bursts, so the median gap says little)
busy and idle. Settings alternate 5, 1, 5, 1:

    PYTHONPATH=src python scripts/gateway_switch_interval.py --streams 6 --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdd.config import ClusterConfig
from pdd.launch import Topology
from pdd.topology import free_port_block

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_queue import large_grammar  # noqa: E402 - the same grammars as scripts/compile_queue.py


def wakeup_lag(interval_s: float) -> tuple[float, float]:
    """P50 and P99 (ms) of how late a 2 ms ``asyncio.sleep`` wakes, 300 times, while a thread
    compiles new GBNF grammars, at thread switch interval ``interval_s``."""
    import threading

    from pdd.structured import _grammar_for

    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    rng = random.Random(3)
    grammars = [large_grammar(26_700, rng) for _ in range(4)]
    stop = threading.Event()

    def compiling() -> None:
        i = 0
        while not stop.is_set():
            _grammar_for("grammar", grammars[i % len(grammars)], None)
            i += 1

    async def ticks() -> list[float]:
        lags = []
        await asyncio.sleep(0.1)
        for _ in range(300):
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            lags.append(time.perf_counter() - t - 0.002)
        return lags

    th = threading.Thread(target=compiling, daemon=True)
    th.start()
    try:
        lags = asyncio.run(ticks())
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    q = statistics.quantiles(lags, n=100)
    return 1000 * statistics.median(lags), 1000 * q[98]


async def stream_gaps(client: httpx.AsyncClient, url: str, tokens: int) -> list[float]:
    """Seconds between consecutive content chunks of one plain streamed completion."""
    body = {"prompt": "The quick brown fox", "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


async def compile_client(client: httpx.AsyncClient, url: str, stop: asyncio.Event, seed: int, sent: list) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        g = large_grammar(26_700, rng)
        r = await client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "guided_grammar": g})
        sent.append(r.status_code)


async def measure(url: str, args) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        await stream_gaps(client, url, 4)  # warm
        idle: list[float] = []
        for _ in range(args.streams):
            idle += await stream_gaps(client, url, args.tokens)
        stop, sent = asyncio.Event(), []
        clients = [asyncio.create_task(compile_client(client, url, stop, k, sent)) for k in range(args.compile_clients)]
        while len(sent) < args.compile_clients:  # every client's first grammar compiled: the queue is busy
            await asyncio.sleep(0.05)
        busy: list[float] = []
        for _ in range(args.streams):
            busy += await stream_gaps(client, url, args.tokens)
        stop.set()
        await asyncio.gather(*clients)
    q = lambda xs, p: 1000 * statistics.quantiles(xs, n=100)[p - 1]  # noqa: E731
    return {"itl_idle_mean_ms": 1000 * statistics.fmean(idle), "itl_idle_p90_ms": q(idle, 90),
            "itl_busy_mean_ms": 1000 * statistics.fmean(busy), "itl_busy_p90_ms": q(busy, 90),
            "grammars": len(sent), "grammar_statuses": sorted(set(sent))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--compile-clients", type=int, default=4)
    ap.add_argument("--no-live", action="store_true", help="only part 1 (no topology)")
    args = ap.parse_args(argv)
    for ms in (5.0, 1.0, 5.0, 1.0):
        p50, p99 = wakeup_lag(ms / 1000)
        print(f"switch interval {ms:g} ms: a 2 ms timer beside a GBNF compile wakes late by P50 {p50:.2f} ms, "
              f"P99 {p99:.2f} ms", flush=True)
    if args.no_live:
        return 0
    from pdd.modelgen import make_model

    tmp = Path(tempfile.mkdtemp(prefix="pdd-switch-"))
    model = make_model(str(tmp / "small"), preset="small", seed=0)
    for ms in (5.0, 1.0, 5.0, 1.0):
        port = free_port_block()
        cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": model, "base_port": port,
                                            "gateway_port": port + 95, "gateway_switch_interval_ms": ms})
        topo = Topology(cfg, log_dir=tmp / f"logs-{ms}-{port}")
        topo.start()
        try:
            r = asyncio.run(measure(f"http://127.0.0.1:{cfg.gateway_port}", args))
        finally:
            topo.stop()
        print(f"gateway_switch_interval_ms {ms:g}: ITL mean / P90 idle {r['itl_idle_mean_ms']:.1f} / "
              f"{r['itl_idle_p90_ms']:.1f} ms, beside {args.compile_clients} GBNF clients "
              f"{r['itl_busy_mean_ms']:.1f} / {r['itl_busy_p90_ms']:.1f} ms ({r['grammars']} grammars, "
              f"status {r['grammar_statuses']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
