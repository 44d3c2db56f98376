"""Per-run metrics (vllm bench names), tables and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

PCTS = (50, 90, 99)


def _stats(name: str, v: np.ndarray, scale: float = 1000.0) -> dict:
    out = {}
    if len(v) == 0:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None,
                **{f"p{p}_{name}_ms": None for p in PCTS if p != 50}}
    out[f"mean_{name}_ms"] = float(v.mean() * scale)
    out[f"median_{name}_ms"] = float(np.median(v) * scale)
    for p in PCTS:
        if p != 50:
            out[f"p{p}_{name}_ms"] = float(np.percentile(v, p) * scale)
    return out


def _weighted_pct(values: np.ndarray, weights: np.ndarray, pcts) -> list[float]:
    if len(values) == 0:
        return [None for _ in pcts]
    o = np.argsort(values)
    v, w = values[o], weights[o]
    c = np.cumsum(w)
    c = c / c[-1]
    return [float(v[min(len(v) - 1, np.searchsorted(c, p / 100.0))]) for p in pcts]


def summarize(sim, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
    """Metrics of one finished run (requests after the warm-up fraction)."""
    cfg = sim.cfg
    slo_ttft_s = cfg.slo_ttft_s if slo_ttft_s is None else slo_ttft_s
    slo_tpot_s = cfg.slo_tpot_s if slo_tpot_s is None else slo_tpot_s
    reqs = sorted(sim.reqs, key=lambda r: r.arrival)
    reqs_m = [r for r in reqs if r.arrival >= cfg.measure_from_s - 1e-9]
    w = int(len(reqs_m) * cfg.warmup_frac)
    meas = reqs_m[w:]
    done = [r for r in meas if r.finished and r.t_first is not None]
    arr = np.array([r.arrival for r in meas]) if meas else np.zeros(1)
    span = float(arr.max() - arr.min()) if len(meas) > 1 else 1.0
    ttft = np.array([r.t_first - r.arrival for r in done])
    e2e = np.array([r.t_done - r.arrival for r in done])
    tpot = np.array([(r.t_done - r.t_first) / (r.n_emitted - 1) for r in done if r.n_emitted > 1])
    ok = 0
    for r in done:
        t1 = r.t_first - r.arrival
        tp = (r.t_done - r.t_first) / (r.n_emitted - 1) if r.n_emitted > 1 else 0.0
        if t1 <= slo_ttft_s and tp <= slo_tpot_s:
            ok += 1
    itl_v = np.frombuffer(sim.itl_v, dtype=float) if len(sim.itl_v) else np.zeros(0)
    itl_n = np.frombuffer(sim.itl_n, dtype=float) if len(sim.itl_n) else np.zeros(0)
    itl = _weighted_pct(itl_v, itl_n, PCTS)
    end = max((r.t_done for r in reqs if r.t_done is not None), default=sim.env.now) or 1.0
    inst = {}
    for role, insts in sim.tiers.items():
        inst[role] = {
            "count": len(insts),
            "chip": insts[0].cm.chip.name,
            "gpus_per_instance": insts[0].cm.gpus,
            "kv_capacity_tokens": insts[0].pool,
            "utilisation": float(np.mean([i.busy_s for i in insts]) / end),
            "steps": int(sum(i.steps for i in insts)),
        }
    wan = None
    if sim.wan is not None:
        wan = {
            "gbps": cfg.wan_gbps,
            "rtt_ms": cfg.wan_rtt_ms,
            "order": cfg.wan_order,
            "bytes": float(sim.wan.bytes_sent),
            "utilisation": float(sim.wan.bytes_sent / (sim.wan.rate * end)),
            "busy_frac": float(sim.wan.busy_s / end),
            "cutoff_saved_bytes": float(sim.wan_saved_bytes),
            "bytes_measured_requests": float(sum(r.wan_bytes for r in meas)),
        }
    cost = cfg.cost_per_hour()
    goodput = ok / span if span > 0 else 0.0
    hit_p = np.array([r.p_hit / r.prompt for r in meas]) if meas else np.zeros(1)
    hit_md = np.array([r.md_hit / r.prompt for r in meas if r.md is not None or r.md_hit]) if meas else np.zeros(0)
    tok = sim.decode_tokens
    dec_total = sum(tok.values()) or 1
    out = {
        "config": cfg.describe(),
        "mode": cfg.mode,
        "requests": len(meas),
        "completed": len(done),
        "request_rate": (len(meas) - 1) / span if span > 0 else None,
        "duration_s": float(end),
        **_stats("ttft", ttft),
        **_stats("tpot", tpot),
        "median_itl_ms": itl[0] * 1000 if itl[0] is not None else None,
        "p90_itl_ms": itl[1] * 1000 if itl[1] is not None else None,
        "p99_itl_ms": itl[2] * 1000 if itl[2] is not None else None,
        **_stats("e2el", e2e),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "slo_attainment": ok / len(meas) if meas else 0.0,
        "goodput_rps": goodput,
        "cost_per_hour": cost,
        "bcr": goodput / cost if cost > 0 else None,
        "gpus": cfg.gpus(),
        "wan": wan,
        "instances": inst,
        "pipelines": dict(sim.pipelines),
        "handoffs": dict(sim.handoffs),
        "cutoffs": sim.cutoffs,
        "late_cutoffs": getattr(sim, "late_cutoffs", 0),  # of them, on a progress report after RLD finished
        "p_hit_token_weighted": float(sum(r.p_hit for r in meas) / max(1, sum(r.prompt for r in meas))),
        "md_hit_token_weighted": (float(sum(r.md_hit for r in meas) / max(1, sum(r.prompt for r in meas)))
                                  if sim.cfg.cross_dc() else None),
        "decode_token_share": {k: v / dec_total for k, v in tok.items() if v},
        "md_predicted_sends": getattr(sim, "md_predicted_sends", 0),
        "early_handoffs": getattr(sim, "early_handoffs", 0),
        "max_stall_ms_p99": float(np.percentile([r.max_gap for r in done], 99) * 1000) if done else None,
    }
    return out


def write_json(obj, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


def table(rows: Sequence[dict], cols: Sequence[str], title: str | None = None) -> str:
    """Plain-text table (also fine as Markdown)."""
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            if abs(v) >= 1000:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for x in cells:
        lines.append("| " + " | ".join(v.ljust(w) for v, w in zip(x, widths)) + " |")
    return "\n".join(lines)


def print_summary(s: dict, file=None) -> None:
    cols = ["config", "requests", "completed", "request_rate", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p90_tpot_ms", "p99_itl_ms", "slo_attainment", "goodput_rps", "cost_per_hour", "bcr"]
    print(table([s], cols), file=file)
    if s.get("wan"):
        w = s["wan"]
        print(f"WAN {w['gbps']} Gbps: {w['bytes'] / 1e9:.2f} GB, utilisation {w['utilisation']:.1%}, "
              f"cut-off saved {w['cutoff_saved_bytes'] / 1e9:.2f} GB", file=file)
    for role, i in s["instances"].items():
        print(f"{role}: {i['count']} x {i['chip']} (x{i['gpus_per_instance']}), KV {i['kv_capacity_tokens']:,} tok, "
              f"utilisation {i['utilisation']:.1%}", file=file)
    md_hit = s["md_hit_token_weighted"]
    print(f"pipelines {s['pipelines']}  handoffs {s['handoffs']}  cut-offs {s['cutoffs']}  "
          f"P hit {s['p_hit_token_weighted']:.1%}  MD hit {'-' if md_hit is None else format(md_hit, '.1%')}",
          file=file)
    share = s.get("decode_token_share") or {}
    if "RLD" in share:
        print(f"decode tokens: RLD {share['RLD']:.1%}, MD {share.get('MD', 0.0):.1%}  "
              f"predicted MD sends {s.get('md_predicted_sends', 0)}  early handoffs {s.get('early_handoffs', 0)}",
              file=file)
