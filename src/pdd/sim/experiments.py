"""Named simulator experiments: ``pdd sim experiment NAME --out DIR``.

Each writes ``DIR/result.json`` (its parameters as ``setting``, rows, the checks against the PDD
report's anchors, and ``settings``: each deployment it simulated, every field as used, by
``pdd.sim.sim_config.settings_of``) and ``DIR/NAME.png``, and returns the result dict. Every
number comes from running the simulator; nothing here encodes an outcome.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.report import summarize, table, write_json
from pdd.sim.sim_config import settings_of
from pdd.workload.records import generate_agentic, generate_fixed, hit_histogram, prefix_hits, warm_start

ATTAIN = 0.9  # a rate "meets the SLA" when >= 90% of its requests meet TTFT and TPOT


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run(cfg: SimConfig, records) -> dict:
    return summarize(ClusterSim(cfg).run(records))


def _wan_gb(s: dict) -> float | None:
    return s["wan"]["bytes"] / 1e9 if s["wan"] else None


def _wan_util(s: dict) -> float | None:
    return s["wan"]["utilisation"] if s["wan"] else None


def pick(s: dict, cols) -> dict:
    """Columns of a run summary: each a summary key, or ``(name, function of the summary)``."""
    out = {}
    for c in cols:
        if isinstance(c, tuple):
            out[c[0]] = c[1](s)
        else:
            out[c] = s[c]
    return out


def sweep(variants, records, cols, label: str = "variant") -> tuple[list[dict], dict[str, dict]]:
    """Run every ``(name, SimConfig)`` of ``variants`` (a dict or pairs) on the same records;
    returns (one row per variant: ``{label: name, **pick(summary, cols)}``, summaries by name)."""
    rows, sums = [], {}
    items = variants.items() if isinstance(variants, dict) else variants
    for name, c in items:
        s = run(c, records)
        sums[name] = s
        rows.append({label: name, **pick(s, cols)})
    return rows, sums


def sla_goodput(cfg: SimConfig, make: Callable[[float], list], lo: float, hi: float,
                iters: int = 7, attain: float = ATTAIN) -> tuple[float, dict | None]:
    """Highest request rate in [lo, hi] at which >= ``attain`` of requests meet the SLA
    (bisection; the workload for a rate comes from ``make(rate)`` with a fixed seed).
    Returns (rate, that run's summary); (0, None) when even ``lo`` fails."""
    def ok(rate):
        recs = make(rate)
        c = cfg.replace(measure_from_s=warm_start(recs))
        s = run(c, recs)
        return s["slo_attainment"] >= attain, s

    good, s_lo = ok(lo)
    if not good:
        return 0.0, None
    best = (lo, s_lo)
    g_hi, s_hi = ok(hi)
    if g_hi:
        return hi, s_hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        g, s = ok(mid)
        if g:
            lo, best = mid, (mid, s)
        else:
            hi = mid
    return best


# ----------------------------------------------------------------------------------------------
# cost-table


def slo_batch(cfg: SimConfig, side: str, ctx_tokens: int, tpot_s: float | None = None) -> tuple[int, float]:
    """Largest decode batch (<= max_running_seqs) whose roofline step at ``ctx_tokens`` of
    context per sequence meets the TPOT SLO on chip ``side`` ("a" | "b"); returns (batch, step s).
    (0, step of one) when even one sequence misses it."""
    from pdd.sim.hardware import cost_model

    cm = cost_model(cfg.chip(side), cfg.model_profile())
    lim = cfg.slo_tpot_s if tpot_s is None else tpot_s
    best = (0, cm.decode_time(1, ctx_tokens))
    for b in range(1, cfg.max_running_seqs + 1):
        t = cm.decode_time(b, b * ctx_tokens)
        if t > lim:
            break
        best = (b, t)
    return best


def cost_bounds(cfg: SimConfig, inp: int, outl: int, hit: float, n_prefixes: int) -> list[dict]:
    """Analytic upper bounds (req/s) of each tier at the cost-table's shape: what caps the
    simulated goodput (the simulation itself never uses them).

    - P: ``n_p / prefill_time(uncached over cached)`` (one request at a time, compute roofline);
    - decoders: ``n x b / (out x step(b))`` with ``b`` = min(the TPOT-SLO batch at the mean
      context, what the KV pool holds: private ``inp + out`` per sequence without a prefix
      cache, or the unique suffix + output when a radix cache shares each prefix, one prefix
      held per ``n_prefixes / n`` share of the prefixes);
    - WAN: line bytes/s over the missing KV bytes per request (``(1 - hit) x inp``)."""
    from pdd.sim.hardware import cost_model

    m = cfg.model_profile()
    kvb = m.kv_bytes_per_token
    shared = int(hit * inp) // 512 * 512
    uncached = inp - shared
    ctx = inp + outl // 2
    rows = []
    tiers = cfg.tiers()
    if "P" in tiers:
        cm = cost_model(cfg.chip("a"), m)
        t = cm.prefill_time(uncached, shared)
        rows.append({"tier": "P", "count": tiers["P"][0], "per_request_s": t, "bound_rps": tiers["P"][0] / t,
                     "note": f"prefill {uncached} tokens over {shared} cached"})
    for role in ("D", "MD"):
        if role not in tiers:
            continue
        n, side = tiers[role]
        cm = cost_model(cfg.chip(side), m)
        b_slo, _ = slo_batch(cfg, side, ctx)
        if role == "MD" and cfg.drc:
            held = max(1, -(-n_prefixes // n))
            b_kv = max(0, (cm.kv_capacity_tokens() - held * shared) // (uncached + outl))
            how = f"DRC shares {held} prefix(es)"
        else:
            b_kv = cm.kv_capacity_tokens() // (inp + outl)
            how = "private KV per sequence"
        b = max(1, min(b_slo, b_kv, cfg.max_running_seqs))
        step = cm.decode_time(b, b * ctx)
        rows.append({"tier": role, "count": n, "per_request_s": outl * step / b, "bound_rps": n * b / (outl * step),
                     "note": f"batch {b} (TPOT-SLO {b_slo}, KV {b_kv}: {how}), step {step * 1e3:.1f} ms"})
    if cfg.cross_dc():
        per = uncached * kvb
        rows.append({"tier": "WAN", "count": 1, "per_request_s": per * 8 / (cfg.wan_gbps * 1e9),
                     "bound_rps": cfg.wan_gbps * 1e9 / 8 / per,
                     "note": f"{per / 1e6:.0f} MB missing KV per request at {cfg.wan_gbps:g} Gbps"})
    return rows


def cost_ceiling(cfg: SimConfig, inp: int, outl: int, hit: float, n_prefixes: int, n_a_base: int = 88,
                 n_a_pdd: int = 43, n_md: int = 32, min_rld: int = 2) -> dict:
    """Analytic BCR ceiling of the cost-table's two fixed fleets (no simulation): each side's
    best split of its GPU-A by the lowest tier bound of :func:`cost_bounds` -- same-DC PD on
    ``n_a_base`` A (P + D), PDD on ``n_a_pdd`` A (P + at least ``min_rld`` RLD, the range the
    experiment searches) + ``n_md`` B + the line. Prices come from ``cfg`` (``price_a``,
    ``price_b``, ``wan_usd_per_hour``)."""
    def best(c0, splits):
        top = None
        for c in splits:
            b = min(cost_bounds(c, inp, outl, hit, n_prefixes), key=lambda r: r["bound_rps"])
            if top is None or b["bound_rps"] > top[1]["bound_rps"]:
                top = (c, b)
        return top

    base = cfg.replace(mode="same_dc_pd")
    pdd = cfg.replace(mode="pdd", n_md=n_md)
    cb, bb = best(base, [base.replace(n_p=k, n_d=n_a_base - k) for k in range(1, n_a_base)])
    cp, bp = best(pdd, [pdd.replace(n_p=k, n_rld=n_a_pdd - k) for k in range(1, n_a_pdd - min_rld + 1)])
    cost_b, cost_p = cb.cost_per_hour(), cp.cost_per_hour()
    return {"chip_a": cfg.chip_a, "chip_b": cfg.chip_b, "tpot_ms": cfg.slo_tpot_s * 1e3,
            "kv_bytes_per_token": cfg.model_profile().kv_bytes_per_token,
            "baseline": cb.describe(), "baseline_bound_rps": bb["bound_rps"], "baseline_binding": bb["tier"],
            "baseline_cost_per_hour": cost_b,
            "pdd": cp.describe(), "pdd_bound_rps": bp["bound_rps"], "pdd_binding": bp["tier"],
            "pdd_cost_per_hour": cost_p,
            "bcr_ceiling": (bp["bound_rps"] / cost_p) / (bb["bound_rps"] / cost_b)}


# (GPU-A, GPU-B): the report's pair -- A strong at compute, B strong at memory bandwidth and
# capacity -- and three more for comparison (docs/SIM.md, cost-table). Datasheet numbers in
# data/hardware/chips.json.
CHIP_PAIRS = (("A100-SXM4-80GB", "H20-96GB"), ("H100-SXM5-80GB", "H200-SXM-141GB"), ("H100-SXM5-80GB", "H20-96GB"),
              ("H100-PCIe-80GB", "H200-SXM-141GB"))


def _cost_cfg(model, chip_a, chip_b, price_a, premium, wan_gbps, wan_usd_per_hour, slo_ttft_s, slo_tpot_s,
              kv_bytes_per_token=None) -> SimConfig:
    """The cost-table's deployment settings. GPU-A costs ``price_a`` (default: chip A's
    illustrative profile price), GPU-B ``price_a x (1 + premium)`` -- the premium, not chip B's
    profile price, prices B. The policy is the runtime's defaults (SimConfig's; until 2026-12-07
    the simulator's own: ps WAN order, no express lane, 250 ms budget, none chosen for this
    workload)."""
    from pdd.sim.hardware import get_chip

    pa = get_chip(chip_a).usd_per_hour if price_a is None else price_a
    return SimConfig(mode="same_dc_pd", model=model, kv_bytes_per_token=kv_bytes_per_token, chip_a=chip_a,
                     chip_b=chip_b, price_a=pa, price_b=pa * (1 + premium), wan_gbps=wan_gbps,
                     wan_usd_per_hour=wan_usd_per_hour, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                     warmup_frac=0.5)


def _csv(v, conv) -> list:
    """A comma list (``--set tpot_ms=50,100``), one number, or a sequence."""
    if isinstance(v, str):
        return [conv(x) for x in v.split(",")]
    return [conv(x) for x in v] if isinstance(v, (list, tuple)) else [conv(v)]


def cost_ceilings(out: Path, quick: bool = False, model: str = "qwen3-30b-a3b-fp8kv", pairs=None,
                  tpot_ms="50,100", kv_bytes="49152,24576,12288", price_a: float | None = None,
                  premium: float = 0.25, wan_gbps: float = 100.0, wan_usd_per_hour: float = 15.0,
                  hit: float = 0.9, slo_ttft_s: float = 3.0) -> dict:
    """The cost-table's analytic BCR ceilings (:func:`cost_ceiling`, no simulation) per chip
    pair, TPOT SLO and KV bytes per token. ``pairs``: ``"A/B,A/B"`` (default :data:`CHIP_PAIRS`);
    ``tpot_ms``, ``kv_bytes``: comma lists."""
    inp, outl = 63 * 1024, 1024
    prs = [tuple(x.split("/")) for x in pairs.split(",")] if isinstance(pairs, str) else list(pairs or CHIP_PAIRS)
    rows, cfgs = [], {}
    for a, b in prs:
        for t in _csv(tpot_ms, float):
            for kv in _csv(kv_bytes, int):
                cfg = _cost_cfg(model, a, b, price_a, premium, wan_gbps, wan_usd_per_hour, slo_ttft_s, t / 1e3, kv)
                cfgs[f"{a}/{b} tpot {t:g} ms kv {kv} B"] = cfg
                rows.append({**cost_ceiling(cfg, inp, outl, hit, 48), "price_a": cfg.price_a,
                             "price_b": cfg.price_b})
    res = {"experiment": "cost-ceiling", "rows": rows,
           "setting": {"model": model, "premium": premium, "price_a": price_a or "chip A's profile price",
                       "input_tokens": inp, "output_tokens": outl, "prefix_hit": hit, "wan_gbps": wan_gbps,
                       "wan_usd_per_hour": wan_usd_per_hour, "fleets": "88 A vs 43 A + 32 B + line"}}
    cols = ["chip_a", "chip_b", "tpot_ms", "kv_bytes_per_token", "baseline", "baseline_bound_rps",
            "baseline_binding", "pdd", "pdd_bound_rps", "pdd_binding", "price_a", "bcr_ceiling"]
    res["table"] = table(rows, cols)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(range(len(rows)), [r["bcr_ceiling"] for r in rows])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['chip_a'].split('-')[0]}/{r['chip_b'].split('-')[0]}\n{r['tpot_ms']:g} ms "
                        f"{r['kv_bytes_per_token'] // 1024}K" for r in rows], fontsize=6)
    ax.axhline(1.3, color="r", alpha=0.4)
    ax.set_ylabel(f"BCR ceiling, premium {premium:.0%}")
    _save(fig, res, out, "cost-ceiling", cfgs,
          {"n_p, n_d, n_rld, n_md": "the analytic bound's fleets (cost_ceiling: 88 A same-DC PD split, 43 A + 32 B "
           "PDD split; the rows name the best)"})
    return res


def cost_table(out: Path, quick: bool = False, model: str = "qwen3-30b-a3b-fp8kv",
               chip_a: str = CHIP_PAIRS[0][0], chip_b: str = CHIP_PAIRS[0][1],
               price_a: float | None = None, premium: float = 0.25, wan_gbps: float = 100.0,
               wan_usd_per_hour: float = 15.0, hit: float = 0.9, slo_ttft_s: float = 10.0,
               slo_tpot_s: float = 0.05) -> dict:
    """The report's setting: 64K total length (63K in + 1K out), cache hit ``hit``.

    1. Same-DC homogeneous PD on 88 GPU-A: best P:D split and its SLA goodput G (the load at
       which 88 GPU-A are needed to meet the SLA).
    2. PDD on 43 GPU-A (P + RLD, best split) + 32 GPU-B + one WAN line: goodput, cost, BCR. MD
       routing is capped at the decode batch that meets the TPOT SLO at the mean decode context
       (``md_load_cap`` = :func:`slo_batch` of chip B at 63.5K tokens; recorded in the settings).
    3. The cheapest PDD configuration that meets the SLA at rate G.
    4. GPU-B price premium 20 / 25 / 30 % over GPU-A (``price_a``, default chip A's profile
       price); ``premium`` picks the row the checks and the plot use.

    Default pair: A100 (GPU-A, compute-strong) and H20 (GPU-B, 2x A100's HBM bandwidth at under
    half its compute), the report's roles; ``--set chip_a=... --set chip_b=...`` for others.
    SLA: TTFT <= 10 s, TPOT <= 50 ms for >= 90% of requests. An A100 prefills one of these
    requests (6.6K new tokens over 57.9K cached) in 1.79 s, so 10 s is the ~5x headroom over
    the unloaded prefill that 3 s gives an H100 (0.57 s); the H100 / H200 result in docs/SIM.md
    uses ``--set slo_ttft_s=3``.
    """
    import sys

    t0 = time.time()
    # A request lives ~30 s (1K tokens at ~25-30 ms): runs must be several lifetimes long so
    # that decode memory fills and an overload shows as a growing backlog; only the second
    # half of each run's requests is measured.
    n_req = 1500 if quick else 3000
    inp, outl = 63 * 1024, 1024

    def log(msg):
        print(f"[cost-table {time.time() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def make(rate):
        return generate_fixed(n_req, rate, inp, outl, hit, n_prefixes=48, seed=7, warm_s=40.0)

    base_cfg = _cost_cfg(model, chip_a, chip_b, price_a, premium, wan_gbps, wan_usd_per_hour, slo_ttft_s, slo_tpot_s)
    price_a = base_cfg.price_a
    hi = 60.0
    iters = 5 if quick else 6
    # 1. baseline split over 88 GPU-A
    def best_split(cfg_of, label_of, coarse, step: int, total: int) -> tuple[int, dict]:
        """SLA goodput of the ``n_p`` P-instance split of ``total`` (``cfg_of(n_p)``) over
        ``coarse``, then ``step`` either side of the best; returns (best n_p, {n_p: goodput})."""
        splits: dict = {}

        def measure(n_p: int) -> None:
            splits[n_p] = sla_goodput(cfg_of(n_p), make, 1.0, hi, iters)[0]
            log(f"{label_of(n_p)}: SLA goodput {splits[n_p]:.2f}")

        for n_p in coarse:
            measure(n_p)
        best = max(splits, key=splits.get)
        for n_p in (best - step, best + step):
            if 1 <= n_p < total and n_p not in splits:
                measure(n_p)
        return max(splits, key=splits.get), splits

    best_p, splits = best_split(lambda n_p: base_cfg.replace(n_p=n_p, n_d=88 - n_p),
                                lambda n_p: f"baseline {n_p}P+{88 - n_p}D",
                                range(12, 49, 12) if quick else range(12, 49, 6), 3, 88)
    g_base, s_base = sla_goodput(base_cfg.replace(n_p=best_p, n_d=88 - best_p), make, 1.0, hi, iters + 2)
    base = base_cfg.replace(n_p=best_p, n_d=88 - best_p)
    log(f"baseline best {best_p}P+{88 - best_p}D: {g_base:.2f} req/s")

    # 2. PDD on 43 A + 32 B; an MD takes no more requests than the batch that meets the TPOT SLO
    # at the mean decode context (md_load_cap), while another MD has fewer
    md_cap = slo_batch(base_cfg, "b", inp + outl // 2)[0]
    pdd_cfg = base_cfg.replace(mode="pdd", n_md=32, md_load_cap=md_cap)
    bp, psplits = best_split(lambda n_p: pdd_cfg.replace(n_p=n_p, n_rld=43 - n_p),
                             lambda n_p: f"pdd {n_p}P+{43 - n_p}RLD+32MD",
                             range(17, 42, 8) if quick else range(17, 42, 4), 2, 43)
    pdd = pdd_cfg.replace(n_p=bp, n_rld=43 - bp)
    g_pdd, s_pdd = sla_goodput(pdd, make, 1.0, hi, iters + 2)
    log(f"pdd best {bp}P+{43 - bp}RLD+32MD: {g_pdd:.2f} req/s")

    # 3. cheapest PDD meeting the SLA at the baseline's goodput
    recs = make(g_base)
    ms = warm_start(recs)
    evaluated = []

    def meets(c):
        s = run(c.replace(measure_from_s=ms), recs)
        evaluated.append({"n_p": c.n_p, "n_rld": c.n_rld, "n_md": c.n_md, "attainment": s["slo_attainment"]})
        return s["slo_attainment"] >= ATTAIN

    md_range = range(16, 41, 8) if quick else range(16, 41, 4)
    rld_opts = (2,) if quick else (1, 2, 4)
    for n_md in md_range:
        for n_rld in rld_opts:
            lo_p, hi_p = 1, 60
            if not meets(pdd_cfg.replace(n_p=hi_p, n_rld=n_rld, n_md=n_md)):
                continue
            while hi_p - lo_p > 1:
                mid = (lo_p + hi_p) // 2
                if meets(pdd_cfg.replace(n_p=mid, n_rld=n_rld, n_md=n_md)):
                    hi_p = mid
                else:
                    lo_p = mid
            log(f"cheapest search: {n_md}MD {n_rld}RLD needs {hi_p}P")
    feasible = [e for e in evaluated if e["attainment"] >= ATTAIN]

    def cost_of(e, prem):
        c = pdd_cfg.replace(n_p=e["n_p"], n_rld=e["n_rld"], n_md=e["n_md"], price_b=price_a * (1 + prem))
        return c.cost_per_hour()

    rows = []
    sens = []
    for prem in (0.20, 0.25, 0.30):
        b = base.replace(price_b=price_a * (1 + prem))
        p = pdd.replace(price_b=price_a * (1 + prem))
        cb, cp = b.cost_per_hour(), p.cost_per_hour()
        cheapest = min(feasible, key=lambda e: cost_of(e, prem)) if feasible else None
        cc = cost_of(cheapest, prem) if cheapest else None
        row = {
            "premium": prem,
            "baseline": f"88A ({best_p}P+{88 - best_p}D)",
            "baseline_goodput_rps": g_base,
            "baseline_cost_per_hour": cb,
            "baseline_bcr": g_base / cb,
            "pdd": f"43A ({bp}P+{43 - bp}RLD)+32B+line",
            "pdd_goodput_rps": g_pdd,
            "pdd_cost_per_hour": cp,
            "pdd_bcr": g_pdd / cp,
            "goodput_gain": g_pdd / g_base if g_base else None,
            "cost_change": cp / cb - 1,
            "bcr_gain": (g_pdd / cp) / (g_base / cb) if g_base else None,
            "cheapest_pdd_matching": (f"{cheapest['n_p']}P+{cheapest['n_rld']}RLD+{cheapest['n_md']}MD"
                                      if cheapest else None),
            "cheapest_cost_per_hour": cc,
            "cheapest_vs_43A32B": (cc / cp) if cc else None,
            "cheapest_bcr_gain": ((g_base / cc) / (g_base / cb)) if cc else None,
        }
        sens.append(row)
        rows.append(row)
    main = min(sens, key=lambda r: abs(r["premium"] - premium))
    checks = {
        f"bcr_gain_ge_1.3_at_{main['premium']:.0%}": main["bcr_gain"] is not None and main["bcr_gain"] >= 1.3,
        "cheapest_matching_le_43A32B": main["cheapest_vs_43A32B"] is not None and main["cheapest_vs_43A32B"] <= 1.0,
    }
    res = {
        "experiment": "cost-table",
        "setting": {
            "model": model, "chip_a": chip_a, "chip_b": chip_b, "price_a_usd_h": price_a,
            "price_b_usd_h": {f"{p:.0%}": price_a * (1 + p) for p in (0.20, 0.25, 0.30)},
            "input_tokens": inp, "output_tokens": outl, "prefix_hit": hit,
            "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "attainment": ATTAIN},
            "wan_gbps": wan_gbps, "wan_usd_per_hour": wan_usd_per_hour, "requests_per_run": n_req,
            "md_load_cap": md_cap,
        },
        "baseline_splits_goodput": splits,
        "pdd_43A_splits_goodput": psplits,
        "baseline_summary": s_base,
        "pdd_summary": s_pdd,
        "cheapest_search": evaluated,
        "rows": rows,
        "checks": checks,
        "wall_s": time.time() - t0,
    }
    cols = ["premium", "baseline", "baseline_goodput_rps", "baseline_cost_per_hour", "baseline_bcr", "pdd",
            "pdd_goodput_rps", "pdd_cost_per_hour", "pdd_bcr", "goodput_gain", "cost_change", "bcr_gain",
            "cheapest_pdd_matching", "cheapest_cost_per_hour", "cheapest_vs_43A32B", "cheapest_bcr_gain"]
    res["table"] = table(rows, cols)
    bounds = ([{"config": base.describe(), **r} for r in cost_bounds(base, inp, outl, hit, 48)]
              + [{"config": pdd.describe(), **r} for r in cost_bounds(pdd, inp, outl, hit, 48)])
    res["bounds"] = bounds
    res["bounds_table"] = table(bounds, ["config", "tier", "count", "per_request_s", "bound_rps", "note"])
    res["ceiling"] = [cost_ceiling(base_cfg.replace(price_b=price_a * (1 + p)), inp, outl, hit, 48) | {"premium": p}
                      for p in (0.20, 0.25, 0.30)]
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(list(splits), list(splits.values()), "o-", label=f"same-DC PD, 88 {chip_a} (x = P)")
    ax[0].plot(list(psplits), list(psplits.values()), "s-", label=f"PDD, 43 {chip_a} + 32 {chip_b} (x = P)")
    ax[0].set_xlabel("P instances")
    ax[0].set_ylabel("SLA goodput (req/s)")
    ax[0].legend(fontsize=7)
    names = ["88A baseline", "43A+32B PDD", "cheapest PDD"]
    vals = [main["baseline_bcr"], main["pdd_bcr"], main["cheapest_bcr_gain"] * main["baseline_bcr"]
            if main["cheapest_bcr_gain"] else 0]
    ax[1].bar(names, vals)
    ax[1].set_ylabel("BCR (req/s per $/h)")
    ax[1].set_title(f"A = {chip_a} ${price_a:g}/h, B = {chip_b} +{main['premium']:.0%}, {model}", fontsize=8)
    _save(fig, res, out, "cost-table", {"baseline": base, "pdd": pdd},
          {"measure_from_s": "each run's workload's warm-up end (warm_start)",
           "n_p, n_d, n_rld, n_md": "the split searches and the cheapest search (baseline_splits_goodput, "
           "pdd_43A_splits_goodput, cheapest_search); the deployments above are the best splits",
           "price_b": "price_a x (1 + premium) of each row"})
    return res


def _save(fig, res: dict, out: Path, name: str, configs: dict[str, SimConfig],
          per_run: dict[str, str] | None = None) -> None:
    """Lay ``fig`` out and write it as ``out/<name>.png``, and ``res`` as ``out/result.json`` with
    ``settings``: each deployment of ``configs`` (name -> SimConfig as simulated) as
    :func:`pdd.sim.sim_config.settings_of` gives it, and ``settings_per_run`` (``per_run``): the
    fields the experiment sets run by run over those (field -> how)."""
    res["settings"] = {k: settings_of(c) for k, c in configs.items()}
    if per_run:
        res["settings_per_run"] = dict(per_run)
    fig.tight_layout()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / f"{name}.png", dpi=110)
    write_json(res, out / "result.json")


# ----------------------------------------------------------------------------------------------
# ttft


def _agentic_cluster(wan_gbps: float = 15.0, **kw) -> dict[str, SimConfig]:
    """Four modes on the same 12 GPUs of the calibrated 8B model (colocated 12 A; same-DC PD
    6 P + 6 D; cross-DC PD 6 P + 6 MD; PDD 6 P + 2 RLD + 4 MD), each with the runtime's policy
    defaults (SimConfig's: WAN order fifo, 2-BDP express lane, 50 ms pipeline budget, ...)."""
    base = SimConfig(model="llama-3.1-8b", wan_gbps=wan_gbps, wan_rtt_ms=30.0, slo_ttft_s=2.0, slo_tpot_s=0.05,
                     max_batch_tokens=8192, prefill_chunk_tokens=8192, **kw)
    return {
        "colocated": base.replace(mode="colocated", n_c=12),
        "same_dc_pd": base.replace(mode="same_dc_pd", n_p=6, n_d=6),
        "cross_dc_pd": base.replace(mode="cross_dc_pd", n_p=6, n_md=6),
        "pdd": base.replace(mode="pdd", n_p=6, n_rld=2, n_md=4),
    }


def ttft(out: Path, quick: bool = False, rate: float = 2.0, wan_gbps: float = 15.0) -> dict:
    n = 1500 if quick else 4000
    recs = generate_agentic(n, seed=3, rate=rate)
    cfgs = _agentic_cluster(wan_gbps)
    # every row but these runs the runtime's defaults (SimConfig's); these change one setting on
    # purpose: cross-DC PD without MD's cache, the runtime's other send order (srf), processor
    # sharing of the line (ps: an idealisation no runtime mode implements, what the simulator
    # defaulted to before 2026-12-07) and the catch-up handoff
    extra = {
        "cross_dc_pd (no DRC)": cfgs["cross_dc_pd"].replace(drc=False),
        "pdd (srf WAN order)": cfgs["pdd"].replace(wan_order="srf"),
        "pdd (ps WAN order, idealised)": cfgs["pdd"].replace(wan_order="ps"),
        "pdd (catch-up)": cfgs["pdd"].replace(handoff_mode="catch_up"),
    }
    rows, sums = sweep({**cfgs, **extra}, recs,
                       ["config", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                        "slo_attainment", ("wan_GB", _wan_gb)], label="mode")
    ratio = sums["pdd"]["p90_ttft_ms"] / sums["cross_dc_pd"]["p90_ttft_ms"]
    sens, sens_cfgs = [], {}
    for w in (10.0, 20.0, 25.0, 40.0):
        c = _agentic_cluster(w)
        sens_cfgs.update({f"cross_dc_pd at {w:g} Gbit/s": c["cross_dc_pd"], f"pdd at {w:g} Gbit/s": c["pdd"]})
        a, b = run(c["cross_dc_pd"], recs), run(c["pdd"], recs)
        sens.append({"wan_gbps": w, "cross_dc_p90_ttft_ms": a["p90_ttft_ms"], "pdd_p90_ttft_ms": b["p90_ttft_ms"],
                     "ratio": b["p90_ttft_ms"] / a["p90_ttft_ms"], "cross_dc_wan_util": a["wan"]["utilisation"],
                     "pdd_wan_util": b["wan"]["utilisation"]})
    res = {
        "experiment": "ttft",
        "workload": {"generator": "generate_agentic", "requests": n, "rate": rate, "histogram": hit_histogram(recs)},
        "setting": {"model": "llama-3.1-8b", "wan_gbps": wan_gbps, "wan_rtt_ms": 30.0, "chip_a": cfgs["pdd"].chip_a,
                    "chip_b": cfgs["pdd"].chip_b},
        "rows": rows,
        "pdd_over_cross_dc_p90": ratio,
        "wan_sensitivity": sens,
        "wan_sensitivity_table": table(sens, list(sens[0].keys())),
        "checks": {"pdd_p90_le_0.6x_cross_dc": ratio <= 0.6},
        "summaries": sums,
    }
    res["table"] = table(rows, list(rows[0].keys()))
    plt = _plt()
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("colocated", "same_dc_pd", "cross_dc_pd", "pdd"):
        s = sums[name]
        ax.bar(name, s["p90_ttft_ms"], alpha=0.5, label=f"{name} p90")
        ax.plot([name], [s["median_ttft_ms"]], "k_", markersize=20)
        ax.plot([name], [s["p99_ttft_ms"]], "r_", markersize=20)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT ms (bar p90, black p50, red p99)")
    ax.set_title(f"agentic workload, {n} requests at {rate} req/s")
    _save(fig, res, out, "ttft", {**cfgs, **extra, **sens_cfgs})
    return res


# ----------------------------------------------------------------------------------------------
# drc


# the drc experiment's variants: (name, MD's decode-side radix cache on, share of MD's pool it may keep)
DRC_VARIANTS = (("drc", True, 0.5), ("drc_tight", True, 0.25), ("no_drc", False, 1.0))


def drc(out: Path, quick: bool = False) -> dict:
    """WAN bytes of cross-DC PD with vs without the decode-side radix cache, at average prefix
    hit rates 50-95%, with MD caches that hold only part of the working set (they evict)."""
    hits = (0.5, 0.7, 0.9, 0.95) if quick else (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    n = 400 if quick else 800
    rows = []
    base = SimConfig(mode="cross_dc_pd", model="llama-3.1-8b", n_p=4, n_md=4, wan_gbps=100.0, warmup_frac=0.0)
    for h in hits:
        # 48 shared prefixes of 20K-token prompts (40 blocks, so every hit rate is whole
        # blocks), caches warmed first (one request per prefix). MD's DRC may keep 50%
        # ("ample": the shared working set fits, unique suffixes evict) or 25% ("tight": shared
        # prefixes evict too) of its KV pool.
        recs = generate_fixed(n, 4.0, 20480, 128, h, n_prefixes=48, seed=11, warm_s=20.0)
        meas = [x for x in recs if not x.get("warmup")]
        r = {"hit": h, "workload_hit": float(
            (prefix_hits(recs)[-len(meas):] * [x["input_length"] for x in meas]).sum()
            / sum(x["input_length"] for x in meas))}
        for key, drc_on, frac in DRC_VARIANTS:
            s = run(base.replace(drc=drc_on, md_cache_frac=frac, measure_from_s=warm_start(recs)), recs)
            r[f"{key}_wan_GB"] = s["wan"]["bytes_measured_requests"] / 1e9
            if drc_on:
                r[f"{key}_md_hit"] = s["md_hit_token_weighted"]
            r[f"{key}_p90_ttft_ms"] = s["p90_ttft_ms"]
        r["bytes_ratio"] = r["drc_wan_GB"] / r["no_drc_wan_GB"]
        r["bytes_ratio_tight"] = r["drc_tight_wan_GB"] / r["no_drc_wan_GB"]
        rows.append(r)
    r90 = next(r for r in rows if abs(r["hit"] - 0.9) < 1e-9)
    res = {"experiment": "drc", "rows": rows, "checks": {"bytes_ratio_at_90_le_0.15": r90["bytes_ratio"] <= 0.15},
           "setting": {"model": "llama-3.1-8b", "prompt": 20480, "output": 128, "prefixes": 48,
                       "md_cache_frac": {"drc": 0.5, "drc_tight": 0.25}, "requests": n, "n_p": 4, "n_md": 4,
                       "wan_gbps": 100.0}}
    res["table"] = table(rows, list(rows[0].keys()))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["hit"] for r in rows], [r["drc_wan_GB"] for r in rows], "o-", label="with DRC (ample cache)")
    ax.plot([r["hit"] for r in rows], [r["drc_tight_wan_GB"] for r in rows], "^-", label="with DRC (tight cache)")
    ax.plot([r["hit"] for r in rows], [r["no_drc_wan_GB"] for r in rows], "s-", label="without DRC")
    ax.set_xlabel("average prefix hit rate")
    ax.set_ylabel("WAN GB")
    ax.legend()
    _save(fig, res, out, "drc",
          {key: base.replace(drc=drc_on, md_cache_frac=frac) for key, drc_on, frac in DRC_VARIANTS},
          {"measure_from_s": "each hit rate's workload's warm-up end (warm_start)"})
    return res


# ----------------------------------------------------------------------------------------------
# goodput


def goodput(out: Path, quick: bool = False) -> dict:
    rates = (1.0, 2.0, 3.0, 4.0, 5.0) if quick else (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
    n = 1000 if quick else 2500
    cfgs = _agentic_cluster()
    rows = []
    curves = {m: [] for m in cfgs}
    for r in rates:
        _, sums = sweep(cfgs, generate_agentic(n, seed=5, rate=r), [])
        row = {"rate": r}
        for m, s in sums.items():
            row[f"{m}_attain"] = s["slo_attainment"]
            row[f"{m}_goodput"] = s["goodput_rps"]
            curves[m].append(s["goodput_rps"])
        rows.append(row)
    sla = {}
    for m, c in cfgs.items():
        sla[m] = max([r["rate"] for r in rows if r[f"{m}_attain"] >= ATTAIN], default=0.0)
    res = {"experiment": "goodput", "rows": rows, "sla_goodput_rps": sla,
           "cost_per_hour": {m: c.cost_per_hour() for m, c in cfgs.items()}}
    res["table"] = table(rows, list(rows[0].keys()))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in cfgs:
        ax.plot(rates, curves[m], "o-", label=m)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("goodput within SLA (req/s)")
    ax.legend()
    _save(fig, res, out, "goodput", cfgs)
    return res


# ----------------------------------------------------------------------------------------------
# bathtub


def bathtub(out: Path, quick: bool = False, model: str = "qwen3-30b-a3b-fp8kv", inp: int = 8192,
            chunk: int = 2048) -> dict:
    """Prefill throughput against prefix hit rate: the report's tail-chunk dips and their remedy.

    One P instance, saturated (offered load 3x its one-request-at-a-time roofline capacity at
    that hit rate), warm prefix cache; every batch is formed by ``pdd.engine.scheduler.schedule``
    (chunks of ``chunk`` tokens, at most ``chunk`` tokens per step). The uncached part of a
    prompt, ``U = (1 - hit) x inp``, runs as ``ceil(U / chunk)`` chunks; the last holds
    ``U mod chunk`` tokens. A step costs a floor (all expert weights read, launch overhead, the
    extend path) plus its tokens' compute, so a small chunk alone wastes most of a step.

    - ``tail``: at most one request in prefill per P (``max_prefill_inflight=1``, as engines that
      chunk one request at a time): the scheduler has nothing to put beside a tail chunk, which
      runs alone -- dips at hit rates where the tail is small;
    - ``packed`` (remedy, better chunk packing): any number in prefill; the scheduler fills the
      rest of a tail's step with the next request's first chunk.

    Metrics per variant: ``*_tok_s`` uncached prompt tokens computed per second of P busy time
    (prefill throughput, the report's "throughput"), ``*_rps`` prefills per P-busy-second,
    ``*_fill`` mean tokens per step / chunk; ``tail_vs_packed`` the tail variant's throughput
    as a share of packing's at the same hit rate. ``dips``: its local minima below 0.99.
    Defaults: 8K-token prompts in 2,048-token chunks put the 512-token tails at 18.75%, 43.75%,
    68.75% and 93.75% hit (the report saw dips "around 20%, 40%, 70%"); other shapes with
    ``--set inp=... --set chunk=...``.
    """
    from pdd.sim.hardware import cost_model

    # one point per uncached length the trace's 512-token blocks allow (every other one if quick)
    hits = [round(min(1.0, i * 512 / inp), 6) for i in range(0, inp // 512 + 1, 2 if quick else 1)]
    n = 150 if quick else 300
    outl = 16
    base = SimConfig(mode="pdd", model=model, n_p=1, n_rld=2, n_md=2, wan_gbps=400.0,
                     prefill_chunk_tokens=chunk, max_batch_tokens=chunk, warmup_frac=0.2)
    cm = cost_model(base.chip_a, base.model_profile())
    rows = []
    for h in hits:
        hh = min(h, 0.999)
        shared = int(hh * inp) // 512 * 512
        t, s0 = 0.0, shared
        while s0 < inp:  # one request's prefill alone: P's capacity at this hit rate
            k = min(chunk, inp - s0)
            t += cm.step_time([(s0, k)])
            s0 += k
        offered = 3.0 * base.n_p / t
        recs = generate_fixed(n, offered, inp, outl, hh, n_prefixes=4, seed=13, warm_s=5.0)
        row = {"hit": h, "uncached": inp - shared, "tail_tokens": (inp - shared) % chunk or chunk}
        for name, c in (("tail", base.replace(max_prefill_inflight=1)), ("packed", base)):
            sim = ClusterSim(c.replace(measure_from_s=warm_start(recs))).run(recs)
            p = sim.tiers["P"][0]
            computed = sum(r.prompt - r.p_hit for r in sim.reqs)
            row[f"{name}_tok_s"] = computed / p.busy_s
            row[f"{name}_rps"] = len(recs) / p.busy_s
            row[f"{name}_fill"] = computed / p.steps / chunk
        rows.append(row)
    for r in rows:
        r["tail_vs_packed"] = r["tail_tok_s"] / r["packed_tok_s"]
    eff = [r["tail_vs_packed"] for r in rows]
    # dips: local minima of the tail variant's throughput relative to packing the same load
    dips = [rows[i]["hit"] for i in range(1, len(rows) - 1)
            if eff[i] < 0.99 and eff[i] <= eff[i - 1] and eff[i] <= eff[i + 1]]
    non_monotone = [rows[i]["hit"] for i in range(1, len(rows)) if rows[i]["tail_rps"] < rows[i - 1]["tail_rps"]]
    tok_drops = [rows[i]["hit"] for i in range(1, len(rows)) if rows[i]["tail_tok_s"] < rows[i - 1]["tail_tok_s"]]

    def spread(key):  # mean relative drop below the running max (the sawtooth's depth)
        drops, top = [], 0.0
        for r in rows:
            top = max(top, r[key])
            drops.append(1 - r[key] / top)
        return sum(drops) / len(drops)

    res = {"experiment": "bathtub", "rows": rows, "dips_tail": dips,
           "hit_rates_where_raising_hit_lowers_tail_rps": non_monotone,
           "hit_rates_where_raising_hit_lowers_tail_tok_s": tok_drops,
           "min_tail_vs_packed": min(eff[:-1]), "min_packed_fill_below_full_hit": min(r["packed_fill"] for r in rows[:-1]),
           "checks": {"tail_has_dips": len(dips) >= 3,
                      "packed_flat": min(r["packed_fill"] for r in rows[:-1]) >= 0.98},
           "setting": {"prompt": inp, "output": outl, "chunk": chunk, "max_batch_tokens": chunk, "model": model,
                       "chip": base.chip_a, "n_p": base.n_p, "requests": n,
                       "metric": "uncached prompt tokens per second of P busy time, P saturated (3x capacity)"}}
    res["table"] = table(rows, list(rows[0].keys()))
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(hits, [r["tail_tok_s"] for r in rows], "o-", ms=3, label="one prefill at a time (tail chunks alone)")
    ax[0].plot(hits, [r["packed_tok_s"] for r in rows], "s-", ms=3, label="packed chunks (remedy)")
    ax[0].set_xlabel("prefix hit rate")
    ax[0].set_ylabel("prefill tokens / P-busy-second")
    ax[0].legend(fontsize=8)
    ax[1].plot(hits, eff, "o-", ms=3, label="tail chunks alone / packed")
    ax[1].plot(hits, [r["packed_fill"] for r in rows], "s-", ms=3, label="packed: step fill")
    for d in dips:
        ax[1].axvline(d, color="r", alpha=0.2)
    ax[1].set_xlabel("prefix hit rate")
    ax[1].set_ylabel("relative prefill throughput")
    ax[1].legend(fontsize=8)
    _save(fig, res, out, "bathtub", {"tail": base.replace(max_prefill_inflight=1), "packed": base},
          {"measure_from_s": "each hit rate's workload's warm-up end (warm_start)"})
    return res


# ----------------------------------------------------------------------------------------------
# p-rld-collapse


def p_rld_collapse(out: Path, quick: bool = False) -> dict:
    """The excluded pipeline allowed: low-hit requests finish on RLD, MD never receives their
    KV, MD's hit rate drifts below P's, more requests become low-hit and land on RLD."""
    n = 1500 if quick else 4000
    recs = generate_agentic(n, seed=9, rate=2.0)
    # the experiment's own pipeline budget (400 ms since it was written, both rows alike; not
    # the runtime's 50 ms): the drift it shows is P->RLD's, and its figures are at this budget
    base = _agentic_cluster(15.0)["pdd"].replace(ttft_budget_ms=400.0)
    t_on = recs[len(recs) // 4]["timestamp"] / 1000.0  # warm, aligned caches first
    rows = []
    series = {}
    variants = {"pdd": base, "allow P->RLD": base.replace(allow_p_rld=True, allow_p_rld_after_s=t_on)}
    for name, c in variants.items():
        sim = ClusterSim(c).run(recs)
        s = summarize(sim)
        reqs = sorted(sim.reqs, key=lambda r: r.arrival)
        k = max(1, len(reqs) // 10)
        md_hit, p_hit, rld_share = [], [], []
        for i in range(0, len(reqs) - k + 1, k):
            w = reqs[i:i + k]
            tot = sum(r.prompt for r in w)
            md_hit.append(sum(r.md_hit for r in w) / tot)
            p_hit.append(sum(r.p_hit for r in w) / tot)
            rld_share.append(sum(1 for r in w if r.pipeline.value == "p_rld") / len(w))
        series[name] = {"md_hit": md_hit, "p_hit": p_hit, "p_rld_share": rld_share}
        rows.append({"variant": name, "md_hit": s["md_hit_token_weighted"], "p_hit": s["p_hit_token_weighted"],
                     "rld_util": s["instances"]["RLD"]["utilisation"], "p90_ttft_ms": s["p90_ttft_ms"],
                     "p90_tpot_ms": s["p90_tpot_ms"], "slo_attainment": s["slo_attainment"],
                     "pipelines": str(s["pipelines"]), "rld_token_share": s["decode_token_share"].get("RLD", 0.0)})
    res = {"experiment": "p-rld-collapse", "rows": rows, "series": series,
           "setting": {"allow_p_rld_after_s": t_on, "note": "the ablation starts after the first quarter of "
                       "the requests, so both runs begin with aligned P and MD caches"}}
    res["table"] = table(rows, list(rows[0].keys()))
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, sr in series.items():
        ax[0].plot(sr["md_hit"], "o-", label=f"MD hit, {name}")
        ax[0].plot(sr["p_hit"], "--", label=f"P hit, {name}")
        ax[1].plot(sr["p_rld_share"], "o-", label=name)
    ax[0].set_xlabel("time decile")
    ax[0].set_ylabel("token-weighted hit")
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("time decile")
    ax[1].set_ylabel("share of requests finishing on RLD")
    ax[1].legend()
    _save(fig, res, out, "p-rld-collapse", variants)
    return res


# ----------------------------------------------------------------------------------------------
# cutoff


def cutoff(out: Path, quick: bool = False) -> dict:
    """The anomaly cut-off on (the runtime's 0.5 s minimum remainder, and 0 s) and off at 2 req/s;
    then off and on at 3 req/s, where relayed turns follow their KV still crossing the WAN
    (``md_wait_claims``: without it each such turn sent its whole prompt again and the line ran
    away)."""
    n = 1500 if quick else 4000
    recs = generate_agentic(n, seed=21, rate=2.0)
    base = _agentic_cluster(15.0)["pdd"]
    variants = [(f"cut-off on (min remaining {base.cutoff_min_remaining_s:g} s)", base),
                ("cut-off on (min remaining 0 s)", base.replace(cutoff_min_remaining_s=0.0)),
                ("cut-off off", base.replace(cutoff=False))]
    cols = [("wan_GB", _wan_gb), ("wan_util", _wan_util), "cutoffs", "late_cutoffs", "median_ttft_ms", "p90_ttft_ms",
            "p99_ttft_ms", "slo_attainment", ("md_hit", lambda s: s["md_hit_token_weighted"])]
    rows, _ = sweep(variants, recs, cols)
    fast_variants = [("cut-off off, 3 req/s", base.replace(cutoff=False)),
                     (f"cut-off on (min remaining {base.cutoff_min_remaining_s:g} s), 3 req/s", base)]
    fast, _ = sweep(fast_variants, generate_agentic(n, seed=21, rate=3.0), cols)
    res = {"experiment": "cutoff", "rows": rows + fast,
           "setting": {"workload": "generate_agentic", "requests": n, "rate": 2.0, "rate_last_rows": 3.0,
                       "config": base.describe(), "wan_gbps": base.wan_gbps,
                       "cutoff_min_remaining_s": base.cutoff_min_remaining_s},
           "wan_bytes_ratio": rows[0]["wan_GB"] / rows[-1]["wan_GB"] if rows[-1]["wan_GB"] else None}
    rows = rows + fast
    res["table"] = table(rows, list(rows[0].keys()))
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["variant"].replace(" (", "\n(") for r in rows]
    ax[0].bar(names, [r["wan_GB"] for r in rows])
    ax[0].set_ylabel("WAN GB")
    ax[1].bar(names, [r["p90_ttft_ms"] for r in rows])
    ax[1].set_ylabel("P90 TTFT ms")
    for a in ax:
        a.tick_params(axis="x", labelsize=7)
    _save(fig, res, out, "cutoff", dict(variants + fast_variants))
    return res


# ----------------------------------------------------------------------------------------------
# calibration (roofline vs the H200 measurements)


def calibrate(out: Path, quick: bool = False, profile: str | None = None) -> dict:
    from pdd.sim.hardware import DEFAULT_CALIBRATION, calibration_report

    rep = calibration_report(profile or DEFAULT_CALIBRATION)
    rows = [{"row": r["row"], "measured_ms": r["measured_s"] * 1e3, "model_ms": r["model_s"] * 1e3,
             "rel_err": r["rel_err"]} for r in rep["rows"]]
    res = {"experiment": "calibrate", **rep, "table": table(rows, list(rows[0].keys()))}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.loglog([r["measured_ms"] for r in rows], [r["model_ms"] for r in rows], "o")
    lim = [min(r["measured_ms"] for r in rows) * 0.8, max(r["measured_ms"] for r in rows) * 1.2]
    ax.plot(lim, lim, "k--")
    ax.set_xlabel("measured ms (H200)")
    ax.set_ylabel("roofline ms")
    _save(fig, res, out, "calibrate", {})  # the step model alone: no deployment simulated
    return res


EXPERIMENTS: dict[str, Callable[..., dict]] = {
    "cost-table": cost_table,
    "cost-ceiling": cost_ceilings,
    "ttft": ttft,
    "goodput": goodput,
    "drc": drc,
    "bathtub": bathtub,
    "p-rld-collapse": p_rld_collapse,
    "cutoff": cutoff,
    "calibrate": calibrate,
}


def run_experiment(name: str, out: str | Path, quick: bool = False, **kw) -> dict:
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name](Path(out), quick=quick, **kw)
