"""Prompt cancellation under load: a share of clients disconnect during prefill, before their first
byte; what the remaining requests get with ``policy.cancel_on_disconnect`` on vs off.

One trace (seeded: Poisson arrivals, long prompts, which requests disconnect and when) is replayed
twice, once per setting, each on a fresh pdd topology (``pdd.launch.Topology``) with the same
config otherwise: P prefills in chunks held to ``--min-step-ms`` (``engine.min_step_ms``, an
emulated accelerator step), so P is the bottleneck and prefill compute spent on abandoned requests
delays the others. A disconnecting client sends its request and closes the connection
``--disconnect-after-ms`` later; the others stream to the end. Printed (and written to ``--out``
as JSON) per setting: the kept requests' TTFT p50 / p90 (ms), goodput (kept requests completed
with TTFT <= ``--slo-ttft-ms``, per second of the run), and P's own counters (prefill chunks run,
prefills cancelled, chunks run after a cancel reached P).

    PYTHONPATH=src python scripts/bench_cancel.py --requests 32 --rate 1.6 --disconnect-share 0.5 \\
        --disconnect-after-ms 100 --prompt-tokens 800 1600 --prefill-chunk 64 --min-step-ms 30
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
from pdd.launch import LaunchError, Topology
from pdd.topology import free_port_block


def make_trace(n: int, rate: float, share: float, after_ms: float, prompt_min: int, prompt_max: int,
               max_tokens: int, seed: int) -> list[dict]:
    """``n`` requests: ``arrival_s`` (Poisson at ``rate`` per second), ``prompt`` (token ids, length
    uniform in [prompt_min, prompt_max]; ids in [5, 1000), inside either preset's vocabulary), ``max_tokens``, and ``disconnect_ms`` (None for a kept
    request; ``after_ms`` after its send for a share ``share`` of them, chosen by the seed)."""
    rng = random.Random(seed)
    gone = set(rng.sample(range(n), round(share * n)))
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate) if i else 0.0
        out.append({"idx": i, "arrival_s": t, "max_tokens": max_tokens,
                    "prompt": [rng.randrange(5, 1000) for _ in range(rng.randint(prompt_min, prompt_max))],
                    "disconnect_ms": after_ms if i in gone else None})
    return out


async def _kept(client: httpx.AsyncClient, url: str, req: dict, t0: float) -> dict:
    """Stream one request to its end: TTFT (ms, from its send), tokens, ok."""
    body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    rec = {"idx": req["idx"], "ttft_ms": None, "tokens": 0, "ok": False, "end_s": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}"
                return rec
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"choices": [{' in line:
                    if rec["ttft_ms"] is None:
                        rec["ttft_ms"] = (time.perf_counter() - sent) * 1000
                    rec["tokens"] += 1
                elif line == "data: [DONE]":
                    rec["ok"] = rec["tokens"] == req["max_tokens"]
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end_s"] = time.perf_counter() - t0
    return rec


async def _leaver(url: str, req: dict) -> dict:
    """Send one request over a plain connection and close it ``disconnect_ms`` later."""
    u = httpx.URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port)
    payload = json.dumps({"prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
                          "ignore_eos": True, "stream": True}).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {u.host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    await asyncio.sleep(req["disconnect_ms"] / 1000)
    early = reader.at_eof() or bool(reader._buffer)  # noqa: SLF001 (anything arrived before leaving?)
    writer.close()
    await writer.wait_closed()
    return {"idx": req["idx"], "left": True, "bytes_before_leaving": early}


async def replay(url: str, trace: list[dict]) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=len(trace) + 4),
                                 trust_env=False) as client:
        async def one(req: dict) -> dict:
            await asyncio.sleep(max(0.0, req["arrival_s"] - (time.perf_counter() - t0)))
            return await (_leaver(url, req) if req["disconnect_ms"] is not None else _kept(client, url, req, t0))

        recs = await asyncio.gather(*(one(r) for r in trace))
    return list(recs), time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _started(base: dict, cancel: bool, log_dir: Path, tries: int = 3) -> Topology:
    """A started topology of ``base`` with ``policy.cancel_on_disconnect = cancel``; a port block
    taken between its check and the bind (another process's connection) is replaced, ``tries``
    times at most. Raises LaunchError otherwise."""
    for k in range(tries):
        port = free_port_block()
        cfg = ClusterConfig.model_validate({**base, "base_port": port, "gateway_port": port + 95,
                                            "policy": {**base.get("policy", {}), "cancel_on_disconnect": cancel}})
        topo = Topology(cfg, log_dir=log_dir / f"cancel_{'on' if cancel else 'off'}-{k}")
        try:
            topo.start()
            return topo
        except LaunchError as e:
            if "Address already in use" not in str(e) or k == tries - 1:
                raise
    raise AssertionError("unreachable")


def run_setting(base: dict, cancel: bool, trace: list[dict], slo_ms: float, log_dir: Path) -> dict:
    t_start = time.monotonic()
    topo = _started(base, cancel, log_dir)
    try:
        print(f"cancel_on_disconnect={cancel}: topology up in {time.monotonic() - t_start:.0f} s", file=sys.stderr)
        # one short request first: connections and the engines' first steps warmed, then a clean cache
        httpx.post(topo.url + "/v1/completions", json={"prompt": [7] * 16, "max_tokens": 2}, timeout=120)
        assert topo.wait_idle(timeout_s=60)
        topo.flush()
        p0 = topo.stats()["instances"]["p0"]
        recs, span = asyncio.run(replay(topo.url, trace))
        assert topo.wait_idle(timeout_s=120), "the topology did not drain"
        st = topo.stats()
        p1 = st["instances"]["p0"]
        fl = topo.flush()
    finally:
        topo.stop()
    kept = [r for r in recs if not r.get("left")]
    ttft = [r["ttft_ms"] for r in kept if r["ttft_ms"] is not None]
    good = [r for r in kept if r["ok"] and r["ttft_ms"] is not None and r["ttft_ms"] <= slo_ms]
    c0, c1 = p0.get("counters", {}), p1.get("counters", {})
    return {
        "cancel_on_disconnect": cancel,
        "kept": len(kept), "kept_completed": sum(r["ok"] for r in kept),
        "kept_errors": sorted({r["error"] for r in kept if r.get("error")}),
        "left": len(recs) - len(kept), "left_after_first_byte": sum(bool(r.get("bytes_before_leaving")) for r in recs),
        "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p90_ms": _pct(ttft, 0.9),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "goodput_rps": len(good) / span, "good": len(good), "span_s": span,
        # the same at other TTFT SLOs (ms), so no one SLO decides the comparison
        "goodput_rps_by_slo_ms": {int(s): sum(1 for r in kept if r["ok"] and r["ttft_ms"] is not None
                                              and r["ttft_ms"] <= s) / span for s in (500, 1000, 2000, 4000)},
        "p_prefill_chunks_run": p1["prefill_chunks_run"] - p0["prefill_chunks_run"],
        "p_prefill_cancelled": c1.get("prefill_cancelled", 0) - c0.get("prefill_cancelled", 0),
        "p_chunks_after_cancel": c1.get("prefill_chunks_after_cancel", 0) - c0.get("prefill_chunks_after_cancel", 0),
        "outcomes": {k: st["totals"].get(k, 0) for k in ("completed", "failed", "cancelled", "rejected")},
        "leaked_pages": fl["leaked_pages"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.6, help="arrivals per second (Poisson)")
    ap.add_argument("--disconnect-share", type=float, default=0.5, help="share of clients that leave, 0..1")
    ap.add_argument("--disconnect-after-ms", type=float, default=100.0, help="a leaver closes this long after its send")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(800, 1600), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--min-step-ms", type=float, default=30.0, help="engine.min_step_ms of every engine")
    ap.add_argument("--prefill-chunk", type=int, default=64, help="engine.prefill_chunk_tokens (= max_batch_tokens)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0,
                    help="goodput counts kept requests completed with TTFT at most this (ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: one generated from --preset)")
    ap.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                    help="generated checkpoint when no --model: tiny keeps the CPU's share of a step under "
                    "--min-step-ms, so the emulated step sets P's pace")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if not 0 <= a.disconnect_share <= 1:
        ap.error("--disconnect-share: must be in [0, 1]")
    if a.requests < 1 or a.rate <= 0 or a.disconnect_after_ms < 0:
        ap.error("--requests must be >= 1, --rate > 0, --disconnect-after-ms >= 0")
    tmp = Path(tempfile.mkdtemp(prefix="pdd-bench-cancel-"))
    model = a.model
    if model is None:
        from pdd.modelgen import make_model

        model = make_model(str(tmp / a.preset), preset=a.preset, seed=0)
    base = {"mode": "pdd", "model_path": model,
            "engine": {"min_step_ms": a.min_step_ms, "prefill_chunk_tokens": a.prefill_chunk,
                       "max_batch_tokens": a.prefill_chunk},
            "link": {"wan_gbps": 0.5, "wan_rtt_ms": 20.0, "wan_jitter_ms": 0.0},
            "limits": {"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, "request_timeout_s": 120.0}
    trace = make_trace(a.requests, a.rate, a.disconnect_share, a.disconnect_after_ms, *a.prompt_tokens,
                       a.max_tokens, a.seed)
    res = [run_setting(base, cancel, trace, a.slo_ttft_ms, tmp) for cancel in (True, False)]
    for r in res:
        print(json.dumps(r))
    on, off = res
    if on["ttft_p50_ms"] is None or off["ttft_p50_ms"] is None:
        print("no kept request got a first token: see kept_errors", file=sys.stderr)
        return 1
    print(f"kept requests: TTFT p50 {on['ttft_p50_ms']:.0f} vs {off['ttft_p50_ms']:.0f} ms, "
          f"p90 {on['ttft_p90_ms']:.0f} vs {off['ttft_p90_ms']:.0f} ms; goodput {on['goodput_rps']:.2f} vs "
          f"{off['goodput_rps']:.2f} req/s; P prefill chunks {on['p_prefill_chunks_run']} vs "
          f"{off['p_prefill_chunks_run']} (cancellation on vs off)")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
