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


def _by_mode(records: Iterable[Mapping]) -> dict[str, list[Mapping]]:
    out: dict[str, list[Mapping]] = {}
    for r in records:
        out.setdefault(r.get("mode") or "", []).append(r)
    key = lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER), m)  # noqa: E731
    return {m: out[m] for m in sorted(out, key=key)}


def plot_ttft_cdf(records: Iterable[Mapping], path: str | Path, title: str = "TTFT CDF") -> Path:
    """Empirical CDF of TTFT (ms) of completed requests, one line per mode; writes a PNG.

    The x axis turns logarithmic when TTFTs span more than 30x. Legend shows P50 / P90 (ms).
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
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_token_timeline(
    records: Iterable[Mapping], path: str | Path, title: str = "token timeline", max_requests: int = 64
) -> Path:
    """One row per request: a bar from send to stream end, one dot per token at its client receive
    time (s since the replay start), colored by the tier that produced it (RLD orange, MD blue).
    Rows are the first ``max_requests`` records in order; writes a PNG."""
    path = Path(path)
    recs = list(records)[:max_requests]
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
