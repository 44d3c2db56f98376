"""TTFT and pipelines of a `pdd bench` run, before and from the N-th request in arrival order (where a
`--fault cross_traffic:GBPS@prefill#N` halved the line), per mode, and the requests whose pipeline
differs between two modes. Usage: python scripts/wan_estimate_split.py OUT N [MODE_A MODE_B]
(docs/LINK.md "Live estimates that decide").

Reads OUT/requests.jsonl (and OUT/report.json's faults when there is one). The WAN estimate of a
request is the ``inputs.wan_gbps_estimate`` of its ``pipeline`` decision (a completed request of a
pdd mode has one); a mode with none reads "estimate read: no samples". Exit status 0; 2 with one
line on stderr for bad arguments, a missing or unreadable OUT/requests.jsonl, a MODE not in the
run, or a run with no WAN-estimate sample in any mode (nothing to split: e.g. only baseline modes,
or no request completed)."""
from __future__ import annotations

import json
import os
import sys

PROG = "wan_estimate_split.py"
USAGE = f"usage: {PROG} OUT N [MODE_A MODE_B]"
PIPELINES = ("p_md", "p_rld_md")


class Refused(Exception):
    """Why the run cannot be read (one line, printed with exit status 2)."""


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (linear interpolation); NaN when empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def read_run(d: str) -> tuple[list[dict], dict]:
    """OUT's request records and report.json (``{}`` when absent). Raises Refused naming the file."""
    path = os.path.join(d, "requests.jsonl")
    recs = []
    try:
        with open(path) as f:
            for k, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise Refused(f"{path} line {k}: not JSON ({e.msg})") from None
                missing = [x for x in ("mode", "arrival_s", "ok") if not isinstance(r, dict) or x not in r]
                if missing:
                    raise Refused(f"{path} line {k}: no {missing[0]!r} field (not a pdd bench requests.jsonl?)")
                recs.append(r)
    except FileNotFoundError:
        raise Refused(f"{path}: not found (OUT is the directory a `pdd bench --out OUT` run wrote)") from None
    except OSError as e:
        raise Refused(f"{path}: {e.strerror or e}") from None
    if not recs:
        raise Refused(f"{path}: no request records")
    rep_path = os.path.join(d, "report.json")
    rep: dict = {}
    if os.path.exists(rep_path):
        try:
            with open(rep_path) as f:
                rep = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise Refused(f"{rep_path}: unreadable ({e})") from None
    return recs, rep


def ttft_ms(r: dict) -> float | None:
    t = r.get("token_times_s") or []
    return (t[0] - r["send_s"]) * 1000 if t and r.get("send_s") is not None else None


def estimates(rs: list[dict]) -> list[float]:
    """The WAN estimates (Gbit/s) the pipeline decisions of the completed requests ``rs`` read, in order."""
    return [x["inputs"]["wan_gbps_estimate"] for r in rs if r["ok"]
            for x in (r.get("pdd") or {}).get("decisions") or []
            if x.get("policy") == "pipeline" and "wan_gbps_estimate" in (x.get("inputs") or {})]


def pipeline(r: dict) -> str | None:
    return (r.get("pdd") or {}).get("pipeline")


def mode_line(m: str, rs: list[dict], split: int, rep: dict) -> str:
    """One mode's line: ``rs`` its records in arrival order, ``split`` the 1-based first request "from"."""
    ok = [r for r in rs if r["ok"]]

    def ttfts(xs):
        return [t for t in (ttft_ms(r) for r in xs if r["ok"]) if t is not None]

    pre, post, allt = ttfts(rs[:split - 1]), ttfts(rs[split - 1:]), ttfts(rs)

    def cnt(xs):
        return {p: sum(1 for r in xs if pipeline(r) == p) for p in PIPELINES}

    tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1) * 1000
            for r in ok if len(r.get("token_times_s") or []) > 1]
    est = estimates(rs)
    est_s = f"estimate read first/min/last {est[0]:.4f}/{min(est):.4f}/{est[-1]:.4f}" if est else \
        "estimate read: no samples"
    inj = ((rep.get("faults") or {}).get("modes") or {}).get(m, {}).get("injections", [])
    return (f"{m}: n={len(ok)}/{len(rs)}; TTFT P50/P90 all {pct(allt, 50):.0f}/{pct(allt, 90):.0f} ms; "
            f"before the halving {pct(pre, 50):.0f}/{pct(pre, 90):.0f}; from it {pct(post, 50):.0f}/{pct(post, 90):.0f}; "
            f"TPOT P50 {pct(tpot, 50):.1f} ms; pipelines before {cnt(rs[:split - 1])} from {cnt(rs[split - 1:])}; "
            f"{est_s}; "
            f"injected at {[i.get('t_s') for i in inj]} s, lifted {[i.get('recovery', {}).get('t_s') for i in inj]} s")


def pipeline_changes(a_recs: list[dict], b_recs: list[dict]) -> dict[str, int]:
    """``"<B's pipeline> (config) -> <A's> (live)"`` -> how many requests (same idx, both completed) changed."""
    pa = {r["idx"]: pipeline(r) for r in a_recs if r["ok"]}
    pb = {r["idx"]: pipeline(r) for r in b_recs if r["ok"]}
    diff: dict[str, int] = {}
    for i in pa:
        if i in pb and pa[i] != pb[i]:
            k = f"{pb[i]} (config) -> {pa[i]} (live)"
            diff[k] = diff.get(k, 0) + 1
    return diff


def run(argv: list[str]) -> list[str]:
    """The lines printed for ``argv`` (OUT N [MODE_A MODE_B]). Raises Refused."""
    if len(argv) not in (2, 4):
        raise Refused(f"expected OUT N or OUT N MODE_A MODE_B, got {len(argv)} argument(s); {USAGE}")
    d, n = argv[0], argv[1]
    try:
        split = int(n)
    except ValueError:
        split = 0
    if split < 1:
        raise Refused(f"N: {n!r} is not a whole number >= 1 (the request, in arrival order, the halving fell at)")
    recs, rep = read_run(d)
    modes: list[str] = []
    for r in recs:
        if r["mode"] not in modes:
            modes.append(r["mode"])
    byrank = {m: sorted((r for r in recs if r["mode"] == m), key=lambda r: r["arrival_s"]) for m in modes}
    for m in argv[2:]:
        if m not in byrank:
            raise Refused(f"mode {m!r}: not in {os.path.join(d, 'requests.jsonl')} (its modes: {', '.join(modes)})")
    if not any(estimates(rs) for rs in byrank.values()):
        raise Refused(f"{os.path.join(d, 'requests.jsonl')}: no WAN-estimate samples in any mode "
                      f"({', '.join(modes)}): no completed request has a pipeline decision reading "
                      "inputs.wan_gbps_estimate (only a pdd mode's requests do)")
    lines = [mode_line(m, byrank[m], split, rep) for m in modes]
    if len(argv) == 4:
        lines.append(f"same requests, pipeline changed: {pipeline_changes(byrank[argv[2]], byrank[argv[3]])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    try:
        lines = run(sys.argv[1:] if argv is None else list(argv))
    except Refused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
