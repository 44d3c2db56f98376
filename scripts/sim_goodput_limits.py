#!/usr/bin/env python3
"""What limits pdd in `pdd sim experiment goodput`: where its requests wait, which SLO they miss.

    python scripts/sim_goodput_limits.py                    # 5 and 6 req/s, 2,500 requests each
    python scripts/sim_goodput_limits.py --rates 6 --json out.json

Runs the goodput experiment's pdd cluster (`pdd.sim.experiments._agentic_cluster`: 6 P + 2 RLD +
4 MD, 15 Gbit/s WAN, SLO TTFT <= 2 s, TPOT <= 50 ms) on its workload (`generate_agentic(n,
seed=5, rate)`) and prints, per rate:

- the run's summary: SLO attainment, P50 / P90 TTFT, WAN GB, cut-offs, each tier's and the
  line's utilisation over the whole run (what `pdd sim run` reports);
- the measured requests by pipeline and outcome (ok, TTFT missed, TPOT missed, both);
- for relayed requests (P->RLD->MD) that missed TTFT: seconds from P's prefill end to RLD's
  admission (the fast path's send starts when RLD has the pages), and MD's KV arrival;
- a table per 20 s of arrival time: arrivals per second, the line's and each tier's utilisation
  in that window, RLD's KV pool occupancy and queued admissions at its end, and of the pipeline
  decisions made in it the relayed share, the median live WAN estimate (Gbit/s) and the share
  whose MD prefix ended in a claim (KV still crossing, judged on the landed part:
  `SimConfig.md_wait_claims`), and the KV of the prompt blocks no earlier request carried
  (plus each prompt's partial last block) of the session requests arriving in it as a share of
  what the line carries in the window: what must cross even with a perfect decode-side cache.
  The generator's anomalies (a prompt sharing no block with any earlier one and at most 24
  output tokens) are left out: the cut-off keeps most of theirs off the line.

Then, at the highest rate, the attainment of what-if variants of the same cluster (RLD's pool
x4, a 30 Gbit/s line, the `srf` send order) unless `--no-variants`. The agentic generator
scales a session workload to the nominal rate over its whole span; its sessions overlap most
early, so the windows show the rate the tiers actually see.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import numpy as np

WINDOW_S = 20.0


def _pct(v) -> str:
    v = np.asarray([x for x in v if x is not None], dtype=float)
    if len(v) == 0:
        return "-"
    return f"n={len(v)} p50 {np.median(v):.2f} p90 {np.percentile(v, 90):.2f} max {v.max():.2f}"


def _new_session_kv(reqs, block: int, kv_bytes_per_token: int) -> dict[int, float]:
    """Request id -> bytes of KV of its prompt's whole blocks no earlier request (by arrival)
    held, plus its partial last block; 0 for an anomaly (no block shared with an earlier
    request, at most 24 output tokens: ``generate_agentic``'s long-input / short-output ones)."""
    seen: set = set()
    out = {}
    for r in sorted(reqs, key=lambda q: (q.arrival, q.rid)):
        full = r.blocks[: r.n_full]
        new = sum(1 for h in full if h not in seen)
        anomaly = r.out_len <= 24 and new == len(full) and new > 0
        seen.update(full)
        out[r.rid] = 0.0 if anomaly else (new * block + r.prompt - r.n_full * block) * kv_bytes_per_token
    return out


def analyse(rate: float, n: int, cfg=None) -> dict:
    """Simulate the goodput experiment's pdd cluster (or ``cfg``) at ``rate`` req/s on ``n``
    requests; returns the figures this script prints (see the module doc)."""
    from pdd.sim.cluster import ClusterSim
    from pdd.sim.experiments import _agentic_cluster
    from pdd.sim.report import summarize
    from pdd.workload.records import generate_agentic

    cfg = cfg or _agentic_cluster()["pdd"]
    recs = generate_agentic(n, seed=5, rate=rate)
    sim = ClusterSim(cfg)
    sim.record_decisions = True
    samples = []

    def sampler():
        env = sim.env
        while not (sim.reqs and all(r.finished for r in sim.reqs)):
            row = {"t": env.now, "wan_bytes": sim.wan.bytes_sent}
            for role, insts in sim.tiers.items():
                row[f"{role}_busy"] = sum(i.busy_s for i in insts) / len(insts)
            rld = sim.tiers["RLD"]
            row["rld_occ"] = sum(i.used for i in rld) / sum(i.pool for i in rld)
            row["rld_queued"] = sum(len(i.waiting) for i in rld)
            samples.append(row)
            yield env.timeout(WINDOW_S)

    sim.env.process(sampler())
    sim.run(recs)
    s = summarize(sim)
    reqs = sorted(sim.reqs, key=lambda r: r.arrival)
    meas = reqs[int(len(reqs) * cfg.warmup_frac):]
    outcome = Counter()
    for r in meas:
        pl = r.pipeline.value if r.pipeline is not None else "none"
        if not r.finished or r.t_first is None:
            outcome[(pl, "unfinished")] += 1
            continue
        t1 = r.t_first - r.arrival
        tp = (r.t_done - r.t_first) / (r.n_emitted - 1) if r.n_emitted > 1 else 0.0
        miss = ("ttft" if t1 > cfg.slo_ttft_s else "") + ("+tpot" if tp > cfg.slo_tpot_s else "")
        outcome[(pl, miss.lstrip("+") or "ok")] += 1
    relayed = [r for r in meas if r.pipeline is not None and r.pipeline.value == "p_rld_md"]
    late = [r for r in relayed if r.t_first is None or r.t_first - r.arrival > cfg.slo_ttft_s]
    rld_wait = [r.fast_flow.t_start - r.t_prefill_done for r in late
                if r.fast_flow is not None and r.t_prefill_done is not None]
    md_kv = [r.t_md_kv - r.arrival for r in relayed if r.t_md_kv is not None]
    new_kv = _new_session_kv(sim.reqs, sim.block, sim.model.kv_bytes_per_token)
    windows = []
    for a, b in zip(samples, samples[1:]):
        lo, hi = a["t"], b["t"]
        dt = hi - lo
        arr = [r for r in sim.reqs if lo <= r.arrival < hi]
        dec = [(r, e) for r in arr for e in sim.decision_log.get(r.rid, []) if e["policy"] == "pipeline"]
        windows.append({
            "t_s": lo, "arrivals_per_s": len(arr) / dt,
            "wan_util": (b["wan_bytes"] - a["wan_bytes"]) / (sim.wan.rate * dt),
            **{f"{role}_util": (b[f"{role}_busy"] - a[f"{role}_busy"]) / dt for role in sim.tiers},
            "rld_pool_occ": b["rld_occ"], "rld_queued": b["rld_queued"],
            "relayed_share": (sum(e["result"] == "p_rld_md" for _, e in dec) / len(dec)) if dec else None,
            "wan_estimate_gbps": float(np.median([e["inputs"]["wan_gbps_estimate"] for _, e in dec])) if dec else None,
            "claim_share": (sum((r.md_landed or 0) < (r.md_held or 0) for r, _ in dec) / len(dec)) if dec else None,
            "new_kv_line_share": sum(new_kv[r.rid] for r in arr) / (sim.wan.rate * dt),
        })
    return {
        "rate": rate, "requests": n,
        "summary": {k: s[k] for k in ("slo_attainment", "median_ttft_ms", "p90_ttft_ms", "cutoffs", "late_cutoffs",
                                      "pipelines")},
        "wan_GB": s["wan"]["bytes"] / 1e9, "wan_util": s["wan"]["utilisation"],
        "util": {role: i["utilisation"] for role, i in s["instances"].items()},
        "outcome": {f"{pl} {o}": c for (pl, o), c in sorted(outcome.items())},
        "relayed_ttft_missed": len(late),
        "relayed_ttft_missed_rld_wait_s": _pct(rld_wait),
        "relayed_md_kv_after_arrival_s": _pct(md_kv),
        "windows": windows,
    }


def variants(rate: float, n: int) -> list[dict]:
    """Attainment and WAN GB of what-if variants of the pdd cluster at ``rate``."""
    from pdd.sim.experiments import _agentic_cluster, run
    from pdd.workload.records import generate_agentic

    base = _agentic_cluster()["pdd"]
    recs = generate_agentic(n, seed=5, rate=rate)
    rld_pool = 4 * base.engine_of("RLD").kv_pool_tokens if base.engine_of("RLD").kv_pool_tokens else None
    out = []
    vs = {"as is": base, "WAN 30 Gbit/s": base.replace(wan_gbps=30.0), "wan_order srf": base.replace(wan_order="srf")}
    if rld_pool is None:  # the step model's pool: read it off one simulator instance
        from pdd.sim.cluster import ClusterSim

        rld_pool = 4 * ClusterSim(base).tiers["RLD"][0].pool
    vs["RLD pool x4"] = base.replace(tier_engines={"RLD": {"kv_pool_tokens": rld_pool}})
    for name, c in vs.items():
        s = run(c, recs)
        out.append({"variant": name, "slo_attainment": s["slo_attainment"], "p90_ttft_ms": s["p90_ttft_ms"],
                    "p90_tpot_ms": s["p90_tpot_ms"], "wan_GB": s["wan"]["bytes"] / 1e9})
    return out


def main(argv=None) -> int:
    from pdd.sim.report import table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="5,6", help="comma-separated request rates, req/s (default 5,6)")
    ap.add_argument("--requests", type=int, default=2500, help="requests per rate (the experiment's 2,500)")
    ap.add_argument("--no-variants", action="store_true", help="skip the what-if variants")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
    try:
        rates = [float(x) for x in a.rates.split(",")]
    except ValueError:
        ap.error(f"--rates must be comma-separated numbers, got {a.rates!r}")
    if not rates or any(not (r > 0) for r in rates) or a.requests < 10:
        ap.error("--rates must be > 0 and --requests at least 10")
    res = {"runs": [analyse(r, a.requests) for r in rates]}
    for x in res["runs"]:
        print(f"## {x['rate']:g} req/s: attainment {x['summary']['slo_attainment']:.3f}, TTFT P50 / P90 "
              f"{x['summary']['median_ttft_ms']:.0f} / {x['summary']['p90_ttft_ms']:.0f} ms, WAN {x['wan_GB']:.0f} GB, "
              f"cut-offs {x['summary']['cutoffs']} ({x['summary']['late_cutoffs']} late)")
        print("whole-run utilisation: " + ", ".join(f"{k} {v:.2f}" for k, v in x["util"].items())
              + f", WAN {x['wan_util']:.2f}")
        print("outcome: " + ", ".join(f"{k} {v}" for k, v in x["outcome"].items()))
        print(f"relayed, TTFT missed ({x['relayed_ttft_missed']}): prefill end -> RLD admission s "
              f"{x['relayed_ttft_missed_rld_wait_s']}")
        print(f"relayed: MD's KV complete after arrival s {x['relayed_md_kv_after_arrival_s']}")
        print(table(x["windows"], list(x["windows"][0].keys())) if x["windows"] else "(no windows)")
        print()
    if not a.no_variants:
        res["variants"] = variants(max(rates), a.requests)
        print(f"## variants at {max(rates):g} req/s")
        print(table(res["variants"], list(res["variants"][0].keys())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
