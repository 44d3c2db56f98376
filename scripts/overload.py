"""Overload measurement for docs/OVERLOAD.md: capacity (SLA goodput), then 3x capacity for 60 s.

Starts a pdd topology (P -> RLD -> MD over the emulated WAN, the small model), derives an SLO
from a light-load reference run, sweeps open-loop Poisson request rates to find the capacity
(the highest rate at which >= 90% of the requests meet the SLO, as ``pdd bench --sweep-rate``
defines SLA goodput), then offers ``--factor`` x capacity for ``--overload-s`` seconds and
reports: 429 count (and Retry-After values), goodput (requests meeting the SLO per second of
offered load), peak RSS of every topology process, and the time to return to normal afterwards
(a probe load at half the capacity: the first moment after which every probe request is admitted
and meets the SLO, and the moment the gateway's in-flight count is back to the probe's level).

    .venv/bin/python scripts/overload.py --out runs/overload            # everything
    .venv/bin/python scripts/overload.py --capacity 2.0 --out runs/ov   # skip the sweep

Every request: a unique prompt of ``--prompt-tokens`` random token ids (no prefix-cache help),
``--max-tokens`` output tokens (ignore_eos), greedy, streamed. Results: ``<out>/overload.json``
and one JSON line per request in ``<out>/requests.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

SLA_ATTAINMENT = 0.9  # share of requests meeting the SLO for a rate to count (pdd.bench.slo)
TTFT_FACTOR, TPOT_FACTOR = 3.0, 1.5  # SLO = factor x the reference run's medians (pdd.bench.slo)


@dataclass
class Rec:
    phase: str
    t_arrival: float  # seconds since the phase's start
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0
    retry_after: str | None = None
    error: str | None = None
    met: bool = False


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemSampler:
    """Peak summed RSS of ``pids`` (and each one's peak), sampled every ``interval_s``."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25):
        self.pids, self.interval_s = pids, interval_s
        self.peak_total = 0
        self.peak: dict[str, int] = {n: 0 for n in pids}
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        t0 = time.monotonic()
        while not self._stop.is_set():
            tot = 0
            for n, p in self.pids.items():
                r = rss_bytes(p)
                self.peak[n] = max(self.peak[n], r)
                tot += r
            self.peak_total = max(self.peak_total, tot)
            self.samples.append((round(time.monotonic() - t0, 2), tot))
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, rec: Rec,
              timeout_s: float) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.retry_after = r.headers.get("retry-after")
                txt = (await r.aread()).decode(errors="replace")
                rec.error = txt[:200]
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    if '"error"' in line[:20]:
                        rec.error = line[:200]
                        continue
                    times.append(time.perf_counter())
    except Exception as e:  # a timeout or a dropped connection is a failure, recorded
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return
    end = time.perf_counter()
    rec.tokens = len(times)
    if times:
        rec.ttft_s = times[0] - t0
        rec.tpot_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    rec.latency_s = end - t0


async def open_loop(url: str, phase: str, rate: float, duration_s: float, args, rng: random.Random,
                    recs: list[Rec], t_base: float | None = None) -> None:
    """Poisson arrivals at ``rate`` req/s for ``duration_s``; returns when every request ended."""
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        tasks = []
        t_start = time.perf_counter()
        t = rng.expovariate(rate)
        while t < duration_s:
            now = time.perf_counter() - t_start
            if t > now:
                await asyncio.sleep(t - now)
            prompt = [rng.randrange(100, 4000) for _ in range(args.prompt_tokens)]
            rec = Rec(phase, round(t + (0.0 if t_base is None else t_base), 3))
            recs.append(rec)
            tasks.append(asyncio.ensure_future(one(client, url, prompt, args.max_tokens, rec, args.request_timeout_s)))
            t += rng.expovariate(rate)
        await asyncio.gather(*tasks)


def _worker(url, phase, rate, duration_s, args, seed, t_base, delay_s, q):
    """One client process: its share of an open-loop phase (after ``delay_s``); records on ``q``."""
    async def go():
        if delay_s:
            await asyncio.sleep(delay_s)
        recs: list[Rec] = []
        await open_loop(url, phase, rate, duration_s, args, random.Random(seed), recs, t_base)
        return recs

    q.put([asdict(r) for r in asyncio.run(go())])


def run_phases(url: str, phases: list[tuple], args) -> list[list[Rec]]:
    """Run open-loop phases ``(phase, rate, duration_s, seed, t_base, delay_s)`` at once, each split
    over ``args.client_procs`` processes (a sum of independent Poisson arrivals at rate/N is Poisson
    at the rate): one Python client process cannot drive ~100 streamed req/s without queueing
    requests itself, which would be measured as server latency."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    n = max(1, args.client_procs)
    jobs = []
    for k, (phase, rate, dur, seed, t_base, delay) in enumerate(phases):
        for i in range(n):
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(url, phase, rate / n, dur, args, seed * 1000 + i, t_base, delay, q))
            p.start()
            jobs.append((k, p, q))
    out: list[list[Rec]] = [[] for _ in phases]
    for k, p, q in jobs:
        out[k] += [Rec(**d) for d in q.get()]
        p.join()
    for recs in out:
        recs.sort(key=lambda r: r.t_arrival)
    return out


def mark_slo(recs: list[Rec], slo: dict) -> None:
    for r in recs:
        r.met = (r.status == 200 and r.error is None and r.tokens == ARGS.max_tokens and r.ttft_s is not None
                 and r.ttft_s * 1000 <= slo["ttft_ms"] and (r.tpot_s or 0) * 1000 <= slo["tpot_ms"])


def point_summary(recs: list[Rec], rate: float, duration_s: float) -> dict:
    n = len(recs)
    ok = [r for r in recs if r.status == 200 and r.error is None]
    met = sum(r.met for r in recs)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tpots = sorted(r.tpot_s for r in ok if r.tpot_s is not None)

    def pct(xs, p):
        return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1) if xs else None

    return {"rate_rps": rate, "offered": n, "ok": len(ok), "rejected_429": sum(r.status == 429 for r in recs),
            "failed": sum(1 for r in recs if r.status not in (200, 429) or (r.status == 200 and r.error)),
            "met_slo": met, "attainment": round(met / n, 3) if n else None,
            "goodput_rps": round(met / duration_s, 3), "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p90_ms": pct(ttfts, 0.9),
            "tpot_p50_ms": pct(tpots, 0.5), "tpot_p90_ms": pct(tpots, 0.9)}


def stats(url: str) -> dict:
    return httpx.get(url + "/pdd/stats", timeout=30, trust_env=False).json()


def wait_idle(url: str, timeout_s: float = 120) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        adm = stats(url).get("admission", {})
        if adm.get("inflight", 0) == 0:
            return time.monotonic() - t0
        time.sleep(0.25)
    return float("nan")


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


ARGS: argparse.Namespace


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/overload")
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--point-s", type=float, default=20.0, help="seconds of arrivals per sweep point")
    ap.add_argument("--start-rps", type=float, default=0.5)
    ap.add_argument("--step", type=float, default=1.5, help="sweep rate factor")
    ap.add_argument("--capacity", type=float, default=None, help="skip the sweep: capacity in req/s")
    ap.add_argument("--slo", default='{"ttft_ms": 1000, "tpot_ms": 100}',
                    help='absolute SLO as JSON {"ttft_ms": .., "tpot_ms": ..}; "reference": 3x / 1.5x the medians '
                    "of a light-load run (pdd bench's factors; too tight on a shared CPU: batching alone breaks it)")
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--overload-s", type=float, default=60.0)
    ap.add_argument("--probe-s", type=float, default=60.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--limits", default=None,
                    help="ClusterConfig.limits of the overload run as JSON; default: the latency targets at "
                    "--target-fraction of the SLO, the rest at their defaults")
    ap.add_argument("--target-fraction", type=float, default=0.7)
    ap.add_argument("--sweep-limits", default=None,
                    help="ClusterConfig.limits of the capacity sweep as JSON (default: the defaults: no latency "
                    "targets, so the sweep measures the system, not the admission policy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-procs", type=int, default=4, help="load-generator processes")
    ARGS = args = ap.parse_args()

    from pdd.config import ClusterConfig
    from pdd.launch import Topology
    from pdd.modelgen import make_model
    from pdd.topology import free_port_block

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not Path(args.model, "config.json").exists():
        make_model(args.model, preset="small", seed=0)
    def config(limits: dict | None):
        base = free_port_block()
        data = {"mode": "pdd", "model_path": args.model, "base_port": base, "gateway_port": base + 95}
        if limits:
            data["limits"] = limits
        return ClusterConfig.model_validate(data)

    def targets(slo: dict) -> dict:
        """The overload run's latency targets: a fraction of the SLO."""
        f = args.target_fraction
        return {"ttft_target_ms": f * slo["ttft_ms"], "tpot_target_ms": f * slo["tpot_ms"],
                "max_queue_wait_s": f * slo["ttft_ms"] / 1000, "max_wan_backlog_s": f * slo["ttft_ms"] / 1000}

    slo = json.loads(args.slo) if args.slo != "reference" else None
    over_limits = json.loads(args.limits) if args.limits else None
    if over_limits is None and slo is not None:
        over_limits = targets(slo)
    cfg = config(json.loads(args.sweep_limits) if args.sweep_limits else None)
    rng = random.Random(args.seed)
    recs: list[Rec] = []
    report: dict = {"config": {"mode": cfg.mode, "sweep_limits": cfg.limits.model_dump(),
                               "engine": cfg.engine.model_dump(), "link": cfg.link.model_dump()},
                    "workload": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens},
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    with Topology(cfg, log_dir=out / "logs-sweep") as topo:
        url = topo.url
        # -- reference (light load) -> SLO
        if slo is not None:
            slo = json.loads(args.slo)
        else:
            ref = run_phases(url, [("reference", 0.25, 24.0, args.seed, None, 0.0)], args)[0]
            ok = [r for r in ref if r.status == 200 and r.error is None and r.ttft_s is not None]
            if not ok:
                raise SystemExit(f"reference run: no request succeeded: {[(r.status, r.error) for r in ref[:3]]}")
            slo = {"ttft_ms": round(TTFT_FACTOR * statistics.median(r.ttft_s for r in ok) * 1000, 1),
                   "tpot_ms": round(TPOT_FACTOR * statistics.median(r.tpot_s for r in ok) * 1000, 1)}
            recs += ref
            report["reference"] = {"requests": len(ref), "ok": len(ok)}
            over_limits = over_limits or targets(slo)
        report["slo"] = slo
        log("SLO", slo)
        # -- capacity sweep
        capacity = args.capacity
        points = []
        if capacity is None:
            rate, passing = args.start_rps, None
            while True:
                pr = run_phases(url, [(f"sweep@{rate:g}", rate, args.point_s, args.seed + len(points) + 1, None,
                                       0.0)], args)[0]
                mark_slo(pr, slo)
                recs += pr
                s = point_summary(pr, rate, args.point_s)
                points.append(s)
                log("sweep", s)
                wait_idle(url)
                if s["attainment"] is not None and s["attainment"] >= SLA_ATTAINMENT:
                    passing = rate
                    rate = round(rate * args.step, 3)
                    if rate > 64:
                        break
                else:
                    break
            capacity = passing
            if capacity is None:
                log("no rate met the SLO; giving up")
                report["sweep"] = points
                (out / "overload.json").write_text(json.dumps(report, indent=1))
                return 1
        report["sweep"] = points
        report["capacity_rps"] = capacity
        log("capacity", capacity, "req/s")
    # -- a fresh topology with the overload run's limits
    cfg = config(over_limits)
    report["config"]["overload_limits"] = cfg.limits.model_dump()
    log("overload limits", over_limits)
    with Topology(cfg, log_dir=out / "logs-overload") as topo:
        url = topo.url
        pids = {n: p.pid for n, p in topo.procs.items()}
        report["rss_idle_bytes"] = {n: rss_bytes(p) for n, p in pids.items()}
        # warm-up at half the capacity (the adaptive limit starts low and grows while it matters)
        warm = run_phases(url, [("warmup", 0.5 * capacity, 10.0, args.seed + 100, None, 0.0)], args)[0]
        mark_slo(warm, slo)
        report["warmup"] = point_summary(warm, 0.5 * capacity, 10.0)
        log("warmup", report["warmup"])
        wait_idle(url)
        # -- overload: factor x capacity, then a probe at half the capacity
        over_rate, probe_rate = args.factor * capacity, 0.5 * capacity
        inflight: list[tuple] = []  # (s since the overload start, inflight, queued tokens, adaptive limit)
        stop = threading.Event()
        t_over = time.perf_counter()

        def poll():
            while not stop.is_set():
                try:
                    a = stats(url).get("admission", {})
                    inflight.append((round(time.perf_counter() - t_over, 2), a.get("inflight", 0),
                                     a.get("queued_prompt_tokens", 0), a.get("adaptive_limit")))
                except Exception:
                    pass
                stop.wait(0.5)

        poller = threading.Thread(target=poll, daemon=True)
        with MemSampler(pids) as mem:
            poller.start()

            ov, probe = run_phases(url, [("overload", over_rate, args.overload_s, args.seed + 200, None, 0.0),
                                         ("probe", probe_rate, args.probe_s, args.seed + 300, args.overload_s,
                                          args.overload_s)], args)
            stop.set()
            poller.join()
        mark_slo(ov, slo)
        mark_slo(probe, slo)
        recs += ov + probe
        s_over = point_summary(ov, over_rate, args.overload_s)
        s_probe = point_summary(probe, probe_rate, args.probe_s)
        # recovery: first probe arrival time after which every probe request was admitted and met the SLO
        probe_sorted = sorted(probe, key=lambda r: r.t_arrival)
        t_ok = None
        for i, r in enumerate(probe_sorted):
            if all(x.met for x in probe_sorted[i:]):
                t_ok = r.t_arrival - args.overload_s
                break
        probe_level = max(1, math.ceil(probe_rate * (statistics.median(r.latency_s for r in probe if r.latency_s)
                                                     if any(r.latency_s for r in probe) else 1.0)) * 2)
        t_drain = next((t - args.overload_s for t, n, *_ in inflight if t >= args.overload_s and n <= probe_level), None)
        retry = [int(r.retry_after) for r in ov if r.retry_after and r.retry_after.isdigit()]
        report["overload"] = {**s_over, "duration_s": args.overload_s, "factor": args.factor,
                              "goodput_over_capacity": round(s_over["goodput_rps"] / capacity, 3),
                              "retry_after_s": {"min": min(retry), "median": statistics.median(retry),
                                                "max": max(retry)} if retry else None}
        report["probe"] = {**s_probe, "recovery_s": None if t_ok is None else round(max(0.0, t_ok), 2),
                           "inflight_back_to_probe_level_s": None if t_drain is None else round(max(0.0, t_drain), 2),
                           "probe_inflight_level": probe_level}
        report["memory"] = {"peak_total_rss_bytes": mem.peak_total, "peak_rss_bytes": mem.peak,
                            "idle_total_rss_bytes": sum(report["rss_idle_bytes"].values())}
        report["gateway_admission"] = stats(url).get("admission")
        report["inflight_timeline"] = inflight
        report["load_avg_end"] = os.getloadavg()
        report["leaked_pages_after_flush"] = (wait_idle(url), topo.flush().get("leaked_pages"))[1]
    (out / "requests.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in recs))
    (out / "overload.json").write_text(json.dumps(report, indent=1))
    log("overload", json.dumps(report["overload"]))
    log("probe", json.dumps(report["probe"]))
    log("memory", json.dumps(report["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
