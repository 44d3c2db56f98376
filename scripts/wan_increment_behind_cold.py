"""Micro-run behind docs/LINK.md ("Under TLS, asyncio buffered 0.5 MB more"): a P->MD request
with a small KV increment whose prefill ends just after a cold prompt's WAN transfer started.

    .venv/bin/python scripts/wan_increment_behind_cold.py [--no-tls] [--model models/small]

Starts a pdd topology (srf send order, 50 ms TTFT budget). Per trial: caches a 400-token prefix
on P and MD, times the prefix + 40 new tokens alone, then sends a cold 1,900-token prompt
(relayed; its KV crosses the WAN) and, ``off`` seconds later, another cached prefix + 40 tokens.
Prints each request's gateway events (ms after its arrival): ``prefilled`` (P's first token and
the plan) and ``first_token`` (MD's stream); the increment's wait is their difference.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from pdd.config import ClusterConfig
from pdd.launch import Topology
from pdd.topology import free_port_block


async def run(url: str, model: str, offsets: list[float], seed: int) -> None:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    async def req(c: httpx.AsyncClient, prompt: list[int], n: int) -> dict:
        r = await c.post(url, json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                    "ignore_eos": True})
        r.raise_for_status()
        return r.json()["pdd"]

    def wait_ms(pd: dict) -> str:
        ev = pd["events_ms"]
        return f"{pd['pipeline']}: prefilled {ev['prefilled']:.0f} ms, first token {ev['first_token']:.0f} ms " \
               f"(+{ev['first_token'] - ev['prefilled']:.0f})"

    async with httpx.AsyncClient(timeout=60) as c:
        for off in offsets:
            x = tokens(400)
            await req(c, x, 2)
            await asyncio.sleep(0.3)
            alone = await req(c, x + tokens(40), 2)
            x2 = tokens(400)
            await req(c, x2, 2)
            await asyncio.sleep(0.5)
            cold = asyncio.ensure_future(req(c, tokens(1900), 16))
            await asyncio.sleep(off)
            behind = await req(c, x2 + tokens(40), 2)
            big = await cold
            print(f"off {off:.2f} s: alone {wait_ms(alone)}")
            print(f"            behind the cold prompt {wait_ms(behind)}")
            print(f"            cold prompt: {wait_ms(big)}, {big['wan_bytes_expected']} WAN bytes")
            await asyncio.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--no-tls", action="store_true", help="plain TCP on every link")
    ap.add_argument("--offsets", default="0.20,0.23,0.26,0.29,0.32,0.35")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    base = free_port_block()
    cfg = ClusterConfig.model_validate({
        "mode": "pdd", "model_path": a.model, "base_port": base, "gateway_port": base + 95,
        "policy": {"wan_order": "srf", "pipeline_ttft_budget_ms": 50, "handoff_mode": "catch_up"},
        "limits": {"max_inflight_requests": 0, "max_queue_wait_s": 0, "max_queued_prompt_tokens": 0},
        "security": {"tls": not a.no_tls}})
    topo = Topology(cfg)
    topo.start()
    try:
        t0 = time.perf_counter()
        asyncio.run(run(f"http://127.0.0.1:{cfg.gateway_port}/v1/completions", cfg.served_model_name,
                        [float(x) for x in a.offsets.split(",")], a.seed))
        print(f"{time.perf_counter() - t0:.0f} s")
    finally:
        topo.stop()


if __name__ == "__main__":
    main()
