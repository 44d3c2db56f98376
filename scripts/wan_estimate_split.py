"""TTFT and pipelines of a `pdd bench` run, before and from the N-th request in arrival order (where a
`--fault cross_traffic:GBPS@prefill#N` halved the line), per mode, and the requests whose pipeline
differs between two modes. Usage: python scripts/wan_estimate_split.py OUT N [MODE_A MODE_B]
(docs/LINK.md "Live estimates that decide")."""
import json, os, sys
d, split = sys.argv[1], int(sys.argv[2])
recs = [json.loads(l) for l in open(f"{d}/requests.jsonl")]
rep = json.load(open(f"{d}/report.json")) if os.path.exists(f"{d}/report.json") else {}
def pct(xs, p):
    xs = sorted(xs)
    if not xs: return float('nan')
    k = (len(xs) - 1) * p / 100; f = int(k); c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)
modes = []
for r in recs:
    if r["mode"] not in modes: modes.append(r["mode"])
ttft = lambda r: (r["token_times_s"][0] - r["send_s"]) * 1000
byrank = {}
for m in modes:
    rs = sorted([r for r in recs if r["mode"] == m], key=lambda r: r["arrival_s"])
    byrank[m] = rs
    ok = [r for r in rs if r["ok"]]
    pre = [ttft(r) for k, r in enumerate(rs) if r["ok"] and k < split - 1]
    post = [ttft(r) for k, r in enumerate(rs) if r["ok"] and k >= split - 1]
    allt = [ttft(r) for r in ok]
    cnt = lambda xs: {p: sum(1 for r in xs if r["pdd"]["pipeline"] == p) for p in ("p_md", "p_rld_md")}
    tpot = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1) * 1000
            for r in ok if len(r["token_times_s"]) > 1]
    est = [x["inputs"]["wan_gbps_estimate"] for r in ok for x in r["pdd"]["decisions"] if x["policy"] == "pipeline"]
    inj = ((rep.get("faults") or {}).get("modes") or {}).get(m, {}).get("injections", [])
    print(f"{m}: n={len(ok)}/{len(rs)}; TTFT P50/P90 all {pct(allt, 50):.0f}/{pct(allt, 90):.0f} ms; "
          f"before the halving {pct(pre, 50):.0f}/{pct(pre, 90):.0f}; from it {pct(post, 50):.0f}/{pct(post, 90):.0f}; "
          f"TPOT P50 {pct(tpot, 50):.1f} ms; pipelines before {cnt(rs[:split - 1])} from {cnt(rs[split - 1:])}; "
          f"estimate read first/min/last {est[0]:.4f}/{min(est):.4f}/{est[-1]:.4f}; "
          f"injected at {[i.get('t_s') for i in inj]} s, lifted {[i.get('recovery', {}).get('t_s') for i in inj]} s")
if len(sys.argv) > 4:
    a, b = sys.argv[3], sys.argv[4]
    pa = {r["idx"]: r["pdd"]["pipeline"] for r in byrank[a] if r["ok"]}
    pb = {r["idx"]: r["pdd"]["pipeline"] for r in byrank[b] if r["ok"]}
    diff = {}
    for i in pa:
        if i in pb and pa[i] != pb[i]:
            k = f"{pb[i]} (config) -> {pa[i]} (live)"
            diff[k] = diff.get(k, 0) + 1
    print("same requests, pipeline changed:", diff)
