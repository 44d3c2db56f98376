"""Record a validation set on this machine today, the way data/validation was recorded:

    python scripts/record_validation.py --out runs/validation-today [--runs NAME,NAME,...]
                                        [--profile FILE] [--quiet-load 0.5] [--wait-s 300]
    python scripts/sim_heldout.py --runs runs/validation-today \\
                                  --profile runs/validation-today/profile.json --out runs/heldout-today

A calibration run is only good for runs of its own day on its own machine (docs/SIM.md "Fit on
one day, judged on another"), so the committed set cannot judge the simulator on another
machine; this records a set there. Each run named in data/validation's manifest (``--source``:
another set's, e.g. data/validation-400; default: all ten, in the order they were recorded) runs live again through `pdd sim validate`, with the
workload arguments and pipeline budget of its committed ``validate.json`` and its config (the
heterogeneous runs' ``cluster.yaml``), one at a time, each once the machine's one-minute load
average is below ``--quiet-load`` (after ``--wait-s`` it runs anyway, and the manifest says so).
First the bare engine is profiled (`pdd profile`, unless ``--profile`` is given), and each
heterogeneous config's MD tier with its own engine (`pdd profile --config`). ``OUT/manifest.json``
then names the calibration run, the held-out runs, the noise pairs, configs and MD profiles as
data/validation's does, with the commit recorded with and the load before each run, so
`scripts/sim_heldout.py --runs OUT` fits and judges it. About 35 minutes for all ten on the
2-core machine, nothing else running.

A ``--runs`` subset must hold the calibration run and a held-out one; a noise pair is kept when
both of its runs are recorded. Exit status 2 for a usage error (one line), else that of the first
step that fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "data" / "validation"
WORKLOAD_FLAGS = (("requests", "--requests"), ("rate_rps", "--rate"), ("block_tokens", "--block-tokens"),
                  ("session_sample", "--session-sample"), ("session_seed", "--session-seed"),
                  ("max_output_tokens", "--max-output-tokens"))


def plan(man: dict, wanted: list[str] | None) -> list[str]:
    """The runs to record, in the order the manifest's set was recorded (``recorded_with``'s
    order, then any other run it names). ValueError naming the problem for an unknown run, or a
    subset without the calibration run or any held-out one."""
    known = list(dict.fromkeys([*(man.get("recorded_with") or {}), man["calibration"], *man["held_out"],
                                *(n for pair in man.get("noise") or [] for n in pair)]))
    if wanted is None:
        return known
    bad = [n for n in wanted if n not in known]
    if bad:
        raise ValueError(f"--runs: unknown {', '.join(bad)}; the runs are {', '.join(known)}")
    if man["calibration"] not in wanted:
        raise ValueError(f"--runs: the calibration run {man['calibration']} must be one of them")
    if not any(n in man["held_out"] for n in wanted):
        raise ValueError(f"--runs: name a held-out run too ({', '.join(man['held_out'])})")
    return [n for n in known if n in wanted]


def validate_args(v: dict) -> list[str]:
    """`pdd sim validate` flags that repeat a committed run's workload and budget (its validate.json)."""
    w = v["workload"]
    args = [flag for key, flag in WORKLOAD_FLAGS if w.get(key) is not None for flag in (flag, str(w[key]))]
    return args + ["--budget-ms", str(v["config"]["pipeline_ttft_budget_ms"])]


def subset_manifest(man: dict, runs: list[str], loads: dict, commit: str, quiet_load: float) -> dict:
    """The manifest of the recorded ``runs``: data/validation's, cut to them."""
    out = {"about": ("Live runs of `pdd sim validate` recorded by scripts/record_validation.py, in this order: "
                     + ", ".join(runs) + f"; the load average before each is in 'load_before' (quiet below "
                     f"{quiet_load:g}). Judge them with: python scripts/sim_heldout.py --runs DIR "
                     "--profile DIR/profile.json --out OUT"),
           "calibration": man["calibration"],
           "held_out": [n for n in man["held_out"] if n in runs],
           "noise": [p for p in man.get("noise") or [] if all(n in runs for n in p)],
           "config": {n: c for n, c in (man.get("config") or {}).items() if n in runs},
           "profile_b": {n: p for n, p in (man.get("profile_b") or {}).items() if n in runs},
           "recorded_with": {n: commit for n in runs},
           "load_before": loads}
    return out


def wait_quiet(quiet_load: float, wait_s: float, load=os.getloadavg, sleep=time.sleep, step_s: float = 5.0) -> float:
    """Waits until the one-minute load average is below ``quiet_load``, at most ``wait_s``;
    returns the last load read."""
    deadline = time.monotonic() + wait_s
    while True:
        now = load()[0]
        if now < quiet_load or time.monotonic() >= deadline:
            return now
        sleep(step_s)


def main(argv=None, pdd=None, load=os.getloadavg, sleep=time.sleep) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the runs and their manifest.json (made)")
    ap.add_argument("--runs", default=None, help="comma-separated run names of data/validation's manifest "
                    "(default: all of them)")
    ap.add_argument("--profile", default=None, help="the bare-engine profile to use (default: measure one now "
                    "into OUT/profile.json)")
    ap.add_argument("--quiet-load", type=float, default=0.5, help="one-minute load average to wait for before each "
                    "run (0.5)")
    ap.add_argument("--wait-s", type=float, default=300.0, help="longest wait for it, seconds (300)")
    ap.add_argument("--source", default=str(SOURCE), help="the set whose workloads are recorded again: a manifest.json "
                    "and a validate.json per run, as data/validation's (default: it; data/validation-400 is the "
                    "400-request set)")
    a = ap.parse_args(argv)
    if pdd is None:
        from pdd.cli import main as pdd
    sys.path.insert(0, str(Path(__file__).parent))
    import sim_heldout

    source, out = Path(a.source), Path(a.out)
    try:
        man = sim_heldout.load_runs(source)
    except ValueError as e:
        ap.error(f"--source: {e}")
    try:
        runs = plan(man, [x.strip() for x in a.runs.split(",") if x.strip()] if a.runs else None)
    except ValueError as e:
        ap.error(str(e))
    if not (a.quiet_load > 0 and a.wait_s >= 0):
        ap.error(f"--quiet-load must be > 0 and --wait-s >= 0, got {a.quiet_load} and {a.wait_s}")
    if a.profile is not None and not Path(a.profile).is_file():
        ap.error(f"--profile: no such file {a.profile}")
    try:
        sim_heldout.make_out(out)
    except ValueError as e:
        ap.error(str(e))
    if rc := sim_heldout.ensure_model(pdd):
        return rc
    profile = out / "profile.json"
    if a.profile is not None:
        shutil.copyfile(a.profile, profile)
    elif rc := pdd(["profile", "--out", str(profile), "--force"]):
        return rc
    configs, measured = {}, set()
    for n in runs:  # each run's config beside it, and MD's own profile for each config that names one
        if n in man.get("config", {}):
            configs[n] = out / man["config"][n]  # where the manifest names it, under OUT
            configs[n].parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / man["config"][n], configs[n])
            pb = out / man["profile_b"][n] if n in man.get("profile_b", {}) else None
            if pb is not None and pb not in measured:  # today's, even where OUT holds an older one
                measured.add(pb)
                if rc := pdd(["profile", "--config", str(configs[n]), "--out", str(pb), "--force"]):
                    return rc
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    loads = {}
    for n in runs:
        v = json.loads((source / n / "validate.json").read_text())
        loads[n] = round(wait_quiet(a.quiet_load, a.wait_s, load, sleep), 2)
        print(f"== {n} (load {loads[n]:.2f}{'' if loads[n] < a.quiet_load else ', not quiet'})", flush=True)
        extra = ["--config", str(configs[n])] if n in configs else []
        if rc := pdd(["sim", "validate", "--profile", str(profile), "--out", str(out / n), *validate_args(v),
                      *extra]):
            return rc
    (out / "manifest.json").write_text(json.dumps(subset_manifest(man, runs, loads, commit, a.quiet_load),
                                                  indent=1) + "\n")
    print(f"wrote {out / 'manifest.json'}; judge the set with: python scripts/sim_heldout.py --runs {out} "
          f"--profile {profile} --out DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
