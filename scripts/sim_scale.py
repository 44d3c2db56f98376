#!/usr/bin/env python3
"""How fast the cluster simulator replays a trace, and whether its cost is linear in requests.

    python scripts/sim_scale.py                       # 3k / 6k / 12k requests, 30 P + 13 RLD + 32 MD
    python scripts/sim_scale.py --sizes 1000,2000 --n-p 4 --n-rld 2 --n-md 4 --json out.json

For each size N it simulates the first N requests of the Mooncake trace (`pdd sim run --trace
... --limit N`, the same SimConfig defaults) in this process and prints the CPU seconds of the
simulation alone (trace loading excluded), wall seconds, requests simulated per CPU second,
CPU microseconds per request and that cost relative to the smallest size (1.00 = linear), and
the summary's completed count and median TTFT (so two code versions can be seen to give the same
results; `pdd.sim.report.summarize` leaves out the first `int(0.1 x N)` requests by arrival, the
simulator's warm-up `SimConfig.warmup_frac`, so with every request finished it reads 90% of N
completed; the CPU time and rates are of all N). CPU time is this process's (`time.process_time`): one core, less sensitive than wall
time to other work on a shared machine. Sizes above the trace's length tile it (each copy
shifted by the trace's span, its block hashes offset, so copies share no prefixes).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time


def tiled(records: list[dict], n: int) -> list[dict]:
    """The first ``n`` requests of ``records`` repeated end to end (see the module doc)."""
    if n <= len(records):
        return records[:n]
    span = records[-1]["timestamp"] - records[0]["timestamp"] + 1000.0
    top = 1 + max((h for r in records for h in r["hash_ids"]), default=0)
    out = []
    k = 0
    while len(out) < n:
        for r in records:
            if len(out) >= n:
                break
            out.append({**r, "timestamp": r["timestamp"] + k * span,
                        "hash_ids": [h + k * top for h in r["hash_ids"]]})
        k += 1
    return out


def measure(sizes, *, mode="pdd", n_p=30, n_rld=13, n_md=32, n_d=None, n_c=None, trace=None, log=None) -> list[dict]:
    from pdd.sim.cluster import ClusterSim, SimConfig
    from pdd.sim.report import summarize
    from pdd.workload.records import MOONCAKE_TRACE, load_trace

    base = load_trace(trace or MOONCAKE_TRACE)
    kw = dict(mode=mode, n_p=n_p, n_rld=n_rld, n_md=n_md)
    if n_d is not None:
        kw["n_d"] = n_d
    if n_c is not None:
        kw["n_c"] = n_c
    cfg = SimConfig(**kw)
    rows = []
    for n in sizes:
        recs = tiled(base, n)
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        sim = ClusterSim(cfg).run(recs)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        s = summarize(sim)
        rows.append({"requests": n, "instances": sum(len(t) for t in sim.tiers.values()),
                     "cpu_s": cpu, "wall_s": wall, "requests_per_s": n / cpu if cpu > 0 else None,
                     "us_per_request": 1e6 * cpu / n,
                     "steps": int(sum(i.steps for t in sim.tiers.values() for i in t)),
                     "traffic_s": s["duration_s"], "completed": s["completed"],
                     "median_ttft_ms": s["median_ttft_ms"]})
        if log:
            log(rows[-1])
    first = rows[0]["us_per_request"] if rows else None
    for r in rows:
        r["cost_ratio"] = r["us_per_request"] / first if first else None
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| requests | instances | CPU s | wall s | requests/s | us/request | cost/request vs first | "
            "engine steps | completed | median TTFT ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['requests']:,} | {r['instances']} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | "
                     f"{r['requests_per_s']:,.0f} | {r['us_per_request']:.0f} | {r['cost_ratio']:.2f} | "
                     f"{r['steps']:,} | {r['completed']:,} | {r['median_ttft_ms']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3000,6000,12000", help="request counts, comma-separated")
    ap.add_argument("--mode", default="pdd")
    ap.add_argument("--n-p", type=int, default=30)
    ap.add_argument("--n-rld", type=int, default=13)
    ap.add_argument("--n-md", type=int, default=32)
    ap.add_argument("--n-d", type=int, default=None)
    ap.add_argument("--n-c", type=int, default=None)
    ap.add_argument("--trace", default=None, help="Mooncake JSONL (the bundled conversation trace)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes {a.sizes!r}: expected integers like 3000,6000,12000")
    if not sizes or min(sizes) <= 0:
        ap.error("--sizes: give at least one positive request count")
    rows = measure(sizes, mode=a.mode, n_p=a.n_p, n_rld=a.n_rld, n_md=a.n_md, n_d=a.n_d, n_c=a.n_c, trace=a.trace,
                   log=lambda r: print(f"{r['requests']:>7,} requests: {r['cpu_s']:.2f} s CPU, "
                                       f"{r['requests_per_s']:,.0f} requests/s", file=sys.stderr))
    print(format_table(rows))
    last = rows[-1]
    print(f"largest: {last['requests']:,} requests on {last['instances']} instances in {last['cpu_s']:.2f} s CPU "
          f"({last['requests_per_s']:,.0f} requests/s); cost per request {last['cost_ratio']:.2f}x the smallest size's")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
