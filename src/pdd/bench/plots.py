"""Plots of benchmark records (matplotlib, Agg canvas; no pyplot global state).

Input: request record dicts as in requests.jsonl (see :mod:`pdd.bench.client`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from pdd.bench.report import MODE_ORDER, is_completed, request_latencies

TIER_COLORS = {"rld": "tab:orange", "md": "tab:blue", "d": "tab:green", "colocated": "tab:purple", None: "tab:gray"}
MODE_COLORS = {"colocated": "tab:purple", "same_dc_pd": "tab:green", "cross_dc_pd": "tab:red", "pdd": "tab:blue"}


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _mode_key(mode: str) -> tuple[int, str]:
    """Modes in :data:`pdd.bench.report.MODE_ORDER`, then any other label by name."""
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


def _finish(fig, ax, path: Path, title: str, legend_loc: str, legend: bool | None = None) -> Path:
    """Title, grid and legend (when ``legend``; None: when anything is labelled), then write the
    PNG at ``path``; returns ``path``."""
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if legend if legend is not None else ax.get_legend_handles_labels()[0]:
        ax.legend(loc=legend_loc, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _by_mode(records: Iterable[Mapping]) -> dict[str, list[Mapping]]:
    out: dict[str, list[Mapping]] = {}
    for r in records:
        out.setdefault(r.get("mode") or "", []).append(r)
    return {m: out[m] for m in sorted(out, key=_mode_key)}


def plot_ttft_cdf(
    records: Iterable[Mapping], path: str | Path, title: str = "TTFT CDF", slo_ttft_ms: float | None = None
) -> Path:
    """Empirical CDF of TTFT (ms) of completed requests, one line per mode; writes a PNG.

    The x axis turns logarithmic when TTFTs span more than 30x. Legend shows P50 / P90 (ms).
    ``slo_ttft_ms``: draw the SLO's TTFT bound as a vertical line.
    """
    path = Path(path)
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    lo, hi = np.inf, 0.0
    for mode, recs in _by_mode(records).items():
        ttft = np.sort([request_latencies(r)["ttft_ms"] for r in recs if is_completed(r)])
        if ttft.size == 0:
            continue
        y = np.arange(0, ttft.size + 1) / ttft.size
        label = f"{mode}  (P50 {np.percentile(ttft, 50):,.0f}, P90 {np.percentile(ttft, 90):,.0f} ms, n={ttft.size})"
        ax.step(np.concatenate([ttft[:1], ttft]), y, where="post", label=label, color=MODE_COLORS.get(mode), linewidth=1.6)
        lo, hi = min(lo, float(ttft[0])), max(hi, float(ttft[-1]))
    if hi > 0 and lo > 0 and hi / lo > 30:
        ax.set_xscale("log")
    ax.axhline(0.9, color="0.7", linewidth=0.8, linestyle="--")
    if slo_ttft_ms is not None:
        ax.axvline(slo_ttft_ms, color="k", linewidth=0.9, linestyle=":", label=f"SLO TTFT {slo_ttft_ms:,.0f} ms")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    return _finish(fig, ax, path, title, "lower right")


def timeline_title(title: str, shown: int, total: int) -> str:
    """The timeline's title: ``title``, and "(first ``shown`` of ``total`` requests)" when rows were
    left out (a reader of the demo's 64 rows took them for its 100 requests)."""
    return f"{title} (first {shown} of {total} requests)" if total > shown else title


def plot_token_timeline(
    records: Iterable[Mapping], path: str | Path, title: str = "token timeline", max_requests: int = 64
) -> Path:
    """One row per request: a bar from send to stream end, one dot per token at its client receive
    time (s since the replay start), colored by the tier that produced it (RLD orange, MD blue).
    Rows are the first ``max_requests`` records in order; writes a PNG."""
    path = Path(path)
    every = list(records)
    recs = every[:max_requests]
    title = timeline_title(title, len(recs), len(every))
    fig = _figure(9.0, max(2.5, 0.18 * len(recs) + 1.2))
    ax = fig.add_subplot(1, 1, 1)
    seen_tiers: set = set()
    for row, r in enumerate(recs):
        send, end = r.get("send_s"), r.get("end_s")
        if send is not None and end is not None:
            ax.plot([send, end], [row, row], color="0.8", linewidth=3, solid_capstyle="butt", zorder=1)
            ax.plot([send], [row], marker="|", color="k", markersize=7, zorder=3)
        times = r.get("token_times_s") or []
        tiers = r.get("tiers") or [None] * len(times)
        for tier in sorted(set(tiers), key=lambda t: (t is None, str(t))):
            xs = [t for t, k in zip(times, tiers) if k == tier]
            ax.scatter(xs, [row] * len(xs), s=4, color=TIER_COLORS.get(tier, "tab:gray"), zorder=2,
                       label=None if tier in seen_tiers else str(tier))
            seen_tiers.add(tier)
        if not r.get("ok", True):
            ax.plot([end if end is not None else send], [row], marker="x", color="red", zorder=4)
    ax.set_yticks(range(len(recs)))
    ax.set_yticklabels([f"{r.get('mode', '')}:{r.get('idx', i)}" for i, r in enumerate(recs)], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("time since replay start (s)")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    if seen_tiers:
        ax.legend(loc="upper right", fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def handoff_gap_profile(records: Iterable[Mapping], window: int = 10) -> dict[int, list[float]]:
    """Inter-token gaps (ms) by token offset from the handoff, pooled over handed-over requests.

    Offset ``k`` is the gap ending at token ``handoff index + k`` (offset 0: the gap into MD's
    first token). Only completed records with ``pdd.handoff_pos`` set count.
    """
    prof: dict[int, list[float]] = {k: [] for k in range(-window, window + 1)}
    for r in records:
        if not is_completed(r):
            continue
        idx = handoff_index(r)
        if idx is None:
            continue
        t = r["token_times_s"]
        for k in range(-window, window + 1):
            j = idx + k
            if 1 <= j < len(t):
                prof[k].append((t[j] - t[j - 1]) * 1000.0)
    return prof


def handoff_index(rec: Mapping) -> int | None:
    """Index in the record's token list of the first token after the handoff (None: no handoff)."""
    h = (rec.get("pdd") or {}).get("handoff_pos")
    if h is None:
        return None
    pos = rec.get("pos") or []
    if h in pos:
        return pos.index(h)
    n = len(rec.get("token_times_s") or [])
    return int(h) if 0 <= int(h) < n else None


def plot_handoff_gaps(records: Iterable[Mapping], path: str | Path, window: int = 10,
                      title: str = "inter-token gaps around the handoff") -> Path:
    """Median and P90 inter-token gap (ms) at each token offset from the handoff, one color per
    mode (modes without handoffs are left out); dotted: the mode's median ITL. Writes a PNG."""
    path = Path(path)
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    any_line = False
    for mode, recs in _by_mode(records).items():
        prof = handoff_gap_profile(recs, window)
        ks = [k for k in sorted(prof) if prof[k]]
        if not ks:
            continue
        color = MODE_COLORS.get(mode)
        n = len(prof[0]) if prof.get(0) else max(len(prof[k]) for k in ks)
        ax.plot(ks, [np.median(prof[k]) for k in ks], marker="o", markersize=3, color=color,
                label=f"{mode} median (n={n})")
        ax.plot(ks, [np.percentile(prof[k], 90) for k in ks], linestyle="--", color=color, alpha=0.7,
                label=f"{mode} P90")
        itl = [g for r in recs if is_completed(r) for g in request_latencies(r)["itl_ms"]]
        if itl:
            ax.axhline(float(np.median(itl)), color=color, linestyle=":", linewidth=0.9)
        any_line = True
    ax.axvline(0, color="0.6", linewidth=0.8)
    ax.set_xlabel("token offset from the handoff (0 = gap into MD's first token)")
    ax.set_ylabel("inter-token gap (ms)")
    return _finish(fig, ax, path, title if any_line else title + " (no handoffs)", "upper right", legend=any_line)


def plot_wan_throughput(timelines: Mapping[str, Mapping], path: str | Path, line_gbps: float | None = None,
                        title: str = "WAN line throughput") -> Path:
    """WAN throughput (Mbit/s, both directions) over time, one line per mode; writes a PNG.

    ``timelines``: ``{mode: {"t_s": [...], "bytes": [...]}}`` cumulative line bytes sampled at
    times ``t_s`` (s since the replay start). ``line_gbps``: draw the line rate.
    """
    path = Path(path)
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    drawn = False
    for mode in sorted(timelines, key=_mode_key):
        t = np.asarray(timelines[mode].get("t_s") or [], dtype=float)
        b = np.asarray(timelines[mode].get("bytes") or [], dtype=float)
        if t.size < 2:
            continue
        dt = np.diff(t)
        ok = dt > 0
        rate = np.diff(b)[ok] * 8 / dt[ok] / 1e6
        ax.step(t[1:][ok], rate, where="pre", color=MODE_COLORS.get(mode), label=mode, linewidth=1.3)
        drawn = True
    if line_gbps:
        ax.axhline(line_gbps * 1000, color="k", linestyle=":", linewidth=0.9, label=f"line {line_gbps * 1000:g} Mbit/s")
    ax.set_xlabel("time since replay start (s)")
    ax.set_ylabel("WAN throughput (Mbit/s)")
    return _finish(fig, ax, path, title if drawn else title + " (no WAN samples)", "upper right",
                   legend=bool(drawn or line_gbps))


def plot_sweep(points: Mapping[str, Iterable[Mapping]], path: str | Path, threshold: float = 0.9,
               title: str = "SLO attainment vs request rate") -> Path:
    """SLO attainment (%) against offered rate (req/s), one line per mode; ``points``:
    ``{mode: [{"rate_rps", "slo_attainment"}, ...]}``. Writes a PNG."""
    path = Path(path)
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    for mode in sorted(points, key=_mode_key):
        pts = sorted((p["rate_rps"], p["slo_attainment"]) for p in points[mode] if p.get("slo_attainment") is not None)
        if pts:
            ax.plot([x for x, _ in pts], [100 * y for _, y in pts], marker="o", color=MODE_COLORS.get(mode), label=mode)
    ax.axhline(100 * threshold, color="0.5", linestyle="--", linewidth=0.8)
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("requests meeting the SLO (%)")
    ax.set_ylim(0, 102)
    return _finish(fig, ax, path, title, "lower left")


ROLE_COLORS = {"prefill": "tab:green", "relay_decode": "tab:orange", "main_decode": "tab:blue",
               "colocated": "tab:purple"}


def plot_autoscale(autoscale: Mapping[str, Mapping], records: Iterable[Mapping], path: str | Path,
                   schedule: Iterable[Iterable[float]] | None = None, bin_s: float = 5.0) -> Path | None:
    """Instances per role and the offered load over the replay, one panel per mode; writes a PNG
    (None when no mode has an ``autoscale`` entry).

    ``autoscale``: ``{mode: report.json modes[mode]["autoscale"]}`` (its ``timeline``: members per
    role, seconds since the window start, :mod:`pdd.bench.autoscaling`); left axis: members per
    role (steps). Right axis: the requests sent per second in ``bin_s`` bins (from the records'
    ``send_s``, seconds since the replay start) and, with ``schedule`` (``[(t_s, rate_rps)]``),
    the scheduled rate (dashed)."""
    modes = [m for m in sorted(autoscale, key=_mode_key) if autoscale.get(m)]
    if not modes:
        return None
    path = Path(path)
    by_mode = _by_mode(records)
    sched = [tuple(p) for p in schedule] if schedule else None
    fig = _figure(9, 2.8 * len(modes) + 0.4)
    axes = fig.subplots(len(modes), 1, squeeze=False, sharex=True)[:, 0]
    for ax, mode in zip(axes, modes):
        a = autoscale[mode]
        end = float(a.get("window_s") or 0.0)
        styles = ((6, "-"), (3.5, "--"), (1.8, "-"), (1.2, ":"))  # overlapping counts stay visible
        for k, (role, pts) in enumerate(sorted((a.get("timeline") or {}).items())):
            ts = [float(t) for t, _ in pts] + [end]
            ns = [int(n) for _, n in pts]
            ns.append(ns[-1])
            lw, ls = styles[k % len(styles)]
            ax.step(ts, ns, where="post", color=ROLE_COLORS.get(role, "tab:gray"), lw=lw, ls=ls, alpha=0.85,
                    label=f"{role} instances")
        ax.set_ylabel("instances")
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        top = max((int(n) for pts in (a.get("timeline") or {}).values() for _, n in pts), default=1)
        ax.set_ylim(0, top + 1)
        ax2 = ax.twinx()
        sends = [float(r["send_s"]) for r in by_mode.get(mode, []) if r.get("send_s") is not None]
        if sends:
            nb = max(1, int(np.ceil(max(sends) / bin_s)))
            counts, edges = np.histogram(sends, bins=nb, range=(0, nb * bin_s))
            ax2.bar(edges[:-1], counts / bin_s, width=bin_s, align="edge", color="tab:gray", alpha=0.25,
                    label=f"sent (req/s, {bin_s:g} s bins)")
        if sched:
            ax2.plot([p[0] for p in sched], [p[1] for p in sched], "k--", lw=1, label="scheduled rate (req/s)")
        ax2.set_ylabel("req/s")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=7)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{mode}: {a.get('instance_seconds', 0):.0f} instance-s, {a.get('scale_ups', 0)} up / "
                     f"{a.get('scale_downs', 0)} down" + (" (autoscaled)" if a.get("enabled") else " (fixed)"),
                     fontsize=9)
    axes[-1].set_xlabel("seconds since the replay started")
    fig.tight_layout()
    fig.savefig(path)
    return path
