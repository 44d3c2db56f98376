"""`pdd plan`: size a deployment. Given a workload at a target rate, an SLO, chip profiles with
prices and WAN line options with prices, search the numbers of P, RLD and MD instances (or P
and D for the same-DC baseline) and the WAN bandwidth that minimise hardware cost while >= 90%
of requests meet the SLO; print the best few with cost, SLA goodput and BCR.

Search: for every WAN option, RLD count and MD count, bisect the smallest P count that meets
the SLO (attainment is monotone in P to within simulation noise), then rank by cost. Each
probe is one simulator run of the same recorded workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from pdd.sim.cluster import SimConfig
from pdd.sim.experiments import ATTAIN, run, sla_goodput
from pdd.sim.report import table
from pdd.workload.records import warm_start


@dataclass(frozen=True)
class WanOption:
    gbps: float
    usd_per_hour: float


def _min_p(meets: Callable[[int], bool], p_max: int) -> int | None:
    if not meets(p_max):
        return None
    lo, hi = 0, p_max  # meets(hi) is True; lo is "known to fail" (0 instances)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def search(records: list, base: SimConfig, *, md_counts: Iterable[int] = range(2, 41, 2),
           rld_counts: Sequence[int] = (1, 2, 4), wans: Sequence[WanOption] = (WanOption(100.0, 15.0),),
           p_max: int = 64, d_counts: Iterable[int] | None = None, log=None,
           progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """All feasible configurations found (each the minimal P for its other counts), cheapest
    first. ``base.mode`` selects pdd / cross_dc_pd (MD counts) or same_dc_pd (``d_counts``).
    ``log(row)`` is called with each feasible row as it is found; ``progress(done, total)`` after
    each candidate (a WAN option, RLD count and MD count, or a D count: one P bisection of up to
    log2(``p_max``) + 1 simulator runs) is evaluated, ``total`` the candidates searched."""
    ms = warm_start(records)
    found = []
    memo: dict = {}

    def meets(cfg: SimConfig) -> tuple[bool, dict]:
        key = (cfg.n_p, cfg.n_rld, cfg.n_md, cfg.n_d, cfg.wan_gbps)
        if key not in memo:
            s = run(cfg.replace(measure_from_s=ms), records)
            memo[key] = (s["slo_attainment"] >= ATTAIN, s)
        return memo[key]

    def add_cheapest(c: SimConfig) -> None:
        """Row of ``c`` with the fewest P instances that meets the SLA, if any does."""
        p = _min_p(lambda n: meets(c.replace(n_p=n))[0], p_max)
        if p is not None:
            cc = c.replace(n_p=p)
            found.append(_row(cc, meets(cc)[1]))
            if log:
                log(found[-1])

    if base.mode == "same_dc_pd":
        candidates = [base.replace(n_d=n_d) for n_d in (d_counts or range(2, 89, 2))]
    else:
        candidates = [base.replace(n_md=n_md, n_rld=max(1, n_rld), wan_gbps=w.gbps, wan_usd_per_hour=w.usd_per_hour)
                      for w in wans for n_rld in (rld_counts if base.mode == "pdd" else (0,)) for n_md in md_counts]
    for i, c in enumerate(candidates, 1):
        add_cheapest(c)
        if progress:
            progress(i, len(candidates))
    found.sort(key=lambda r: r["cost_per_hour"])
    return found


def _row(cfg: SimConfig, s: dict) -> dict:
    return {"config": cfg.describe(), "wan_gbps": cfg.wan_gbps if cfg.cross_dc() else None,
            "gpus_a": cfg.gpus()["a"], "gpus_b": cfg.gpus()["b"], "cost_per_hour": cfg.cost_per_hour(),
            "attainment_at_target": s["slo_attainment"], "p90_ttft_ms": s["p90_ttft_ms"],
            "p90_tpot_ms": s["p90_tpot_ms"], "_cfg": cfg}


def best_with_goodput(found: list[dict], make: Callable[[float], list], target_rate: float, top: int = 3,
                      progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """The ``top`` cheapest configurations with their SLA goodput (bisection up to 2x the
    target) and BCR = SLA goodput / cost. ``progress(done, total)`` after each configuration."""
    out = []
    for i, r in enumerate(found[:top], 1):
        g, _ = sla_goodput(r["_cfg"], make, max(0.1, target_rate * 0.5), target_rate * 2.0, 6)
        out.append({**{k: v for k, v in r.items() if k != "_cfg"}, "sla_goodput_rps": g,
                    "bcr": g / r["cost_per_hour"] if r["cost_per_hour"] else None})
        if progress:
            progress(i, len(found[:top]))
    return out


PLAN_COLS = ["config", "wan_gbps", "gpus_a", "gpus_b", "cost_per_hour", "attainment_at_target", "p90_ttft_ms",
             "p90_tpot_ms", "sla_goodput_rps", "bcr"]


def format_plan(rows: list[dict]) -> str:
    return table(rows, PLAN_COLS)
