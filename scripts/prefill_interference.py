"""P's prefill beside decoding, on the recorded live runs (docs/SIM.md "Prefill beside decoding"):

    python scripts/prefill_interference.py [--runs data/validation] [--profile data/profiles/this-machine.json]

Per run of the manifest (calibration and held out): P's isolated prefills (no other prefill
overlapping, ``pdd.sim.live_measures.isolated_prefills``), each's live time over the profile's
bare-engine time and the share of it in which other requests were streaming tokens, and
``live_prefill_beside_decode``'s medians and fit; then all runs pooled. Reads files only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdd.sim.live_measures import isolated_prefills, live_prefill_beside_decode
from pdd.sim.recorded import RecordedRunError, load_profile_checked, read_run
from pdd.step_profile import MeasuredStepModel


def _row(name: str, m: dict | None) -> str:
    if m is None:
        return f"| {name} | too few isolated prefills | | | |"
    q, b, f = m["quiet"], m["busy"], m["fit"]

    def med(x):
        return "-" if x["median_ratio"] is None else f"{x['median_ratio']:.2f} (n={x['n']})"
    fac = "-" if f["factor"] is None else f"{f['factor']:.2f}"
    return f"| {name} | {m['samples']} | {m['mean_busy_frac'] * 100:.0f}% | {med(q)} | {med(b)} | {fac} |"


def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="data/validation",
                    help="a directory of recorded runs with their manifest.json (default: data/validation)")
    ap.add_argument("--profile", default="data/profiles/this-machine.json",
                    help="a `pdd profile` JSON (default: data/profiles/this-machine.json)")
    ap.add_argument("--chunk-tokens", type=_positive_int, default=512, help="P's prefill chunk (the runs': 512)")
    a = ap.parse_args(argv)
    runs = Path(a.runs)
    try:
        mf = runs / "manifest.json"
        if not mf.is_file():
            raise ValueError(f"{runs}: not a directory of recorded runs (no manifest.json; "
                             "the committed ones are data/validation)")
        try:
            man = json.loads(mf.read_text())
            names = [man["calibration"], *man["held_out"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{mf}: not a runs manifest (an object with 'calibration' and 'held_out'): "
                             f"{type(e).__name__}: {e}") from None
        model = MeasuredStepModel(load_profile_checked(a.profile))
        recs = {n: read_run(runs / n)[1] for n in names}
    except (OSError, ValueError, KeyError, RecordedRunError) as e:
        print(f"prefill_interference: {e}", file=sys.stderr)
        return 2
    print("| run | isolated prefills | mean share decoded beside | live / profile, decoders quiet (<5%) | "
          "decoders busy (>= 30%) | fitted factor (all busy) |")
    print("|---|---|---|---|---|---|")
    pooled = []
    for n in names:
        pf = isolated_prefills(recs[n], model, a.chunk_tokens)
        pooled += pf
        print(_row(n + (" (calibration)" if n == man["calibration"] else ""), live_prefill_beside_decode(pf)))
    print(_row("all runs pooled", live_prefill_beside_decode(pooled)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
