"""Per mode of a ``pdd bench`` output directory: TTFT P50 / P90, the *tail* of each request's TTFT
(P's first token at the gateway to the client's first token: the KV still crossing after the
prefill, then the decoder's first emission; ``pdd.events_ms``), WAN bytes = expected, leaked
pages, TPOT P50, and P's bytes per connection of each striped lane (``wan_stripe_bytes``).

    python scripts/ttft_tail.py OUT_DIR
"""

import json
import statistics
import sys
from pathlib import Path


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main(out: str) -> None:
    d = Path(out)
    rep = json.loads((d / "report.json").read_text())
    stats = json.loads((d / "server_stats.json").read_text())
    tails: dict[str, list[float]] = {}
    for line in (d / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        ev = (r.get("pdd") or {}).get("events_ms") or {}
        if r.get("ok") and "first_token" in ev and "p_first_token" in ev:
            tails.setdefault(r["mode"], []).append(ev["first_token"] - ev["p_first_token"])
    print("| mode | TTFT P50 / P90 ms | tail P50 / P90 ms | TPOT P50 ms | WAN bytes = expected | leaked pages "
          "| bytes per connection |")
    print("|---|---|---|---|---|---|---|")
    for mode, m in rep["modes"].items():
        t = tails.get(mode, [])
        p0 = next((v for k, v in stats[mode]["stats"]["instances"].items() if k.startswith("p")), {})
        stripes = "; ".join(f"{k}: {' / '.join(f'{b:,}' for b in v)}" for k, v in (p0.get("wan_stripe_bytes") or {}).items())
        print(f"| `{mode}` | {m['median_ttft_ms']:,.1f} / {m['p90_ttft_ms']:,.1f} | {pct(t, 50):,.1f} / {pct(t, 90):,.1f} "
              f"| {m['median_tpot_ms']:.1f} | {m['wan_bytes']:,} = {m['wan_bytes_expected']:,} | {m['leaked_pages']} "
              f"| {stripes or 'one connection'} |")


if __name__ == "__main__":
    main(sys.argv[1])
