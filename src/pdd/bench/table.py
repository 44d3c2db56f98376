"""``pdd bench``'s console output: the comparison table with the bench rows, then the SLO, sweep,
ratio and agreement lines."""

from __future__ import annotations

from typing import Mapping

from pdd.bench.report import _fmt, print_failure_warnings, ratio_caveat, table_rows
from pdd.bench.slo import SLA_ATTAINMENT
from pdd.bench import vllm_mode


def bench_rows(modes: Mapping[str, Mapping]) -> list[tuple[str, list[str]]]:
    """Rows bench adds under report.table_rows (label, one cell per mode)."""
    names = list(modes)

    def row(label: str, fn) -> tuple[str, list[str]]:
        return label, [fn(modes[n]) for n in names]

    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    mix = lambda m: ", ".join(f"{k} {100 * v:.0f}%" for k, v in (m.get("pipeline_mix") or {}).items()) or "-"  # noqa: E731

    def hand(m):
        h = m.get("handoff") or {}
        if not h.get("handoffs"):
            return "-"
        return f"{h['handoffs']} (" + ", ".join(f"{k} {v}" for k, v in h["by_mode"].items()) + ")"

    return [
        row("TTFT mean (ms)", lambda m: _fmt(m.get("mean_ttft_ms"))),
        row("TPOT P90 (ms)", lambda m: _fmt(m.get("p90_tpot_ms"), 2)),
        row("request_throughput (req/s)", lambda m: _fmt(m.get("request_throughput"), 2)),
        row("SLO met", lambda m: pct(m.get("slo_attainment"))),
        row("SLO missed: TTFT/TPOT/both/failed", lambda m: "-" if not m.get("slo_misses") else
            "/".join(str(m["slo_misses"][k]) for k in ("ttft", "tpot", "both", "failed"))),
        row("request_goodput (req/s)", lambda m: _fmt(m.get("request_goodput"), 2)),
        row("SLA goodput (req/s)", lambda m: _fmt(m.get("sla_goodput_rps"), 2)),
        row("pipelines", mix),
        row("handoffs", hand),
        row("handoff gap P50/P95 (ms)", lambda m: "-" if not (m.get("handoff") or {}).get("handoffs") else
            f"{_fmt(m['handoff']['gap_ms']['median'])} / {_fmt(m['handoff']['gap_ms']['p95'])}"),
        row("handoff gap P95 / median ITL", lambda m: ", ".join(
            [f"{k} x{_fmt(v['gap_over_median_itl']['p95'], 2)}" for k, v in
             ((m.get("handoff") or {}).get("gaps_by_mode") or {}).items()]
            + ([f"no switch x{_fmt(m['handoff']['baseline']['gap_over_median_itl']['p95'], 2)}"]
               if (m.get("handoff") or {}).get("handoffs") and m["handoff"].get("baseline", {}).get("n") else []))
            or "-"),
        row("RLD mode switches", lambda m: _fmt((m.get("handoff") or {}).get("mode_switches"))),
        row("P hit rate", lambda m: pct(m.get("p_hit_rate"))),
        row("MD (D) hit rate", lambda m: pct(m.get("md_hit_rate"))),
        row("cut-offs", lambda m: _fmt((m.get("cutoffs") or {}).get("requests"))),
        row("instance-seconds (mean instances)", lambda m: "-" if not m.get("autoscale") else
            f"{m['autoscale']['instance_seconds']:.1f} ({_fmt(m['autoscale']['mean_instances'], 2)})"),
        row("autoscale: up / down", lambda m: "-" if not m.get("autoscale") else
            (f"{m['autoscale']['scale_ups']} / {m['autoscale']['scale_downs']}"
             + (f" ({m['autoscale']['errors']} failed)" if m["autoscale"]["errors"] else "")
             if m["autoscale"]["enabled"] else "off")),
    ]


def autoscale_lines(modes: Mapping[str, Mapping]) -> list[str]:
    """One line per mode with an ``autoscale`` entry (docs/BENCH.md "Load ramps and autoscaling"):
    goodput, TTFT P90, whether no request failed, instance-seconds and the loop's decisions."""
    out = []
    for name, m in modes.items():
        a = m.get("autoscale")
        if not a:
            continue
        failed = int(m.get("failed") or 0)
        out.append(f"cost {name}: goodput {_fmt(m.get('request_goodput'), 2)} req/s, TTFT P90 "
                   f"{_fmt(m.get('p90_ttft_ms'))} ms, {'0 failed' if not failed else f'{failed} FAILED'}, "
                   f"{a['instance_seconds']:.1f} instance-s over {a['window_s']:.1f} s, autoscale "
                   + (f"{a['scale_ups']} up / {a['scale_downs']} down" if a["enabled"] else "off"))
    return out


def print_bench_table(report: Mapping, console=None, title: str = "pdd bench") -> None:
    """The demo's comparison table plus the bench rows, then the SLO and sweep lines."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    modes = report.get("modes") or {}
    table = Table(title=title)
    table.add_column("metric")
    for name in modes:
        table.add_column(name, justify="right")
    for label, cells in vllm_mode.mark_rows(table_rows(modes) + bench_rows(modes), modes):
        table.add_row(label, *cells)
    console.print(table)
    print_failure_warnings(modes, console)
    for line in autoscale_lines(modes):
        console.print(line, soft_wrap=True, highlight=False)
    slo = report.get("slo") or {}
    if slo.get("ttft_ms") is not None or slo.get("tpot_ms") is not None:
        console.print(f"SLO ({slo.get('source')}): TTFT <= {_fmt(slo.get('ttft_ms'))} ms, TPOT <= "
                      f"{_fmt(slo.get('tpot_ms'), 2)} ms; SLA = >= {100 * SLA_ATTAINMENT:.0f}% of requests meet it")
    sw = report.get("sweep") or {}
    for mode, s in (sw.get("modes") or {}).items():
        pts = ", ".join(f"{p['rate_rps']:g}: {100 * (p['slo_attainment'] or 0):.0f}%" for p in s["points"])
        console.print(f"sweep {mode}: {pts or 'no points'} -> SLA goodput {_fmt(s.get('sla_goodput_rps'), 2)} req/s")
    r = report.get("ratios") or {}
    if r.get("pdd_over_cross_dc_pd_p90_ttft_ms") is not None:
        console.print(f"TTFT pdd / cross_dc_pd: P50 x{_fmt(r['pdd_over_cross_dc_pd_median_ttft_ms'], 2)}, "
                      f"P90 x{_fmt(r['pdd_over_cross_dc_pd_p90_ttft_ms'], 2)}, "
                      f"P99 x{_fmt(r['pdd_over_cross_dc_pd_p99_ttft_ms'], 2)}"
                      + ratio_caveat(modes, ("pdd", "cross_dc_pd")), soft_wrap=True)
    agree = report.get("output_agreement") or {}
    if agree.get("modes"):
        console.print(f"greedy outputs identical to {agree['reference']}: "
                      + ", ".join(f"{m} {a['identical']}/{a['compared']}" for m, a in agree["modes"].items())
                      + (" (over requests completed in both)" if any((m.get("failed") or 0) for m in modes.values())
                         else ""), soft_wrap=True)
    if (line := vllm_mode.agreement_line(report.get("vllm_agreement"))) is not None:
        console.print(line)
    if report.get("mode_errors"):
        console.print(f"[red]mode errors: {report['mode_errors']}")
