"""n choices per request, with and without shipping the prompt's KV once (policy.sibling_kv_once),
side by side in A B B A order on fresh topologies: WAN bytes and TTFT of every choice.

Usage: .venv/bin/python scripts/bench_siblings.py [--mode pdd] [--requests 16] [--n 4] [--rate 1]
       [--out runs/siblings.json]
Cold prompts of 200-1,000 random tokens (no shared prefixes: every choice's KV is missing on
MD), greedy, 16 output tokens, Poisson arrivals. Prints one line per run and the summary.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from pdd.config import ClusterConfig
from pdd.launch import Topology
from pdd.topology import free_port_block


async def one(client, url, model, prompt, n, out):
    t0 = time.perf_counter()
    firsts: dict[int, float] = {}
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "n": n,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:]).get("choices") or []
                for c in ch:
                    if c.get("text") and c["index"] not in firsts:
                        firsts[c["index"]] = (time.perf_counter() - t0) * 1000
    out.append(firsts)


async def drive(url, model, prompts, n, rate, seed):
    rng = random.Random(seed)
    out: list = []
    async with httpx.AsyncClient() as client:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one(client, url, model, p, n, out)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return out


def run(mode, once, prompts, n, rate, model_path):
    base = free_port_block()
    cfg = ClusterConfig.model_validate({
        "mode": mode, "model_path": model_path, "base_port": base, "gateway_port": base + 95,
        "policy": {"sibling_kv_once": once, "wan_order": "srf"},
        "limits": {"max_inflight_requests": 0, "max_queue_wait_s": 0, "max_queued_prompt_tokens": 0}})
    with Topology(cfg) as t:
        res = asyncio.run(drive(t.url, cfg.served_model_name, prompts, n, rate, 1))
        t.wait_idle(30)
        tot = t.stats()["totals"]
    first0 = [f[0] for f in res]
    others = [v for f in res for k, v in f.items() if k > 0]
    return {"mode": mode, "sibling_kv_once": once, "wan_bytes_sent": tot["wan_bytes_sent"],
            "wan_bytes_expected": tot["wan_bytes_expected"],
            "ttft_choice0_p50_ms": statistics.median(first0), "ttft_others_p50_ms": statistics.median(others),
            "ttft_all_p90_ms": sorted(first0 + others)[int(0.9 * (len(first0) + len(others)))]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="pdd")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--out", default="runs/siblings.json")
    a = ap.parse_args()
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randrange(200, 1000))] for _ in range(a.requests)]
    rows = []
    for once in (True, False, False, True):
        r = run(a.mode, once, prompts, a.n, a.rate, a.model)
        print(json.dumps(r), flush=True)
        rows.append(r)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
