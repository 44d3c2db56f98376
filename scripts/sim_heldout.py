"""Re-simulate the recorded held-out runs of docs/SIM.md and print the held-out report.

    python scripts/sim_heldout.py --out runs/heldout [--runs data/validation]
                                  [--profile data/profiles/this-machine.json]

The runs directory holds ``manifest.json`` (which run is the calibration run, which are held out,
which two form each noise floor, the cluster config and MD's step profile of each heterogeneous
run) and one ``pdd sim validate --out`` directory per run. The steps are the documented method:

1. ``pdd sim calibrate-roles --run RUNS/<calibration> --profile PROFILE --out OUT/fit.json``:
   every role fit from the calibration run alone;
2. per run, ``pdd sim validate --profile OUT/fit.json --live-from RUNS/<run>`` with the run's own
   workload arguments (from its ``validate.json``), its ``--config`` and ``--profile-b`` (MD's
   bare engine measured with that tier's engine settings: an input, not a fit) -> ``OUT/<run>``;
3. ``pdd sim validate-report`` over them, once per noise pair -> ``OUT/report-<n>.md`` / ``.json``.

Nothing live is started: the simulator is deterministic, so the same inputs give the same table
on any machine (about 15 s). Needs the runs' model checkpoint (``models/small``; made when missing,
as ``make demo`` does). Exit status: that of the first step that fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdd.cli import main as pdd

WORKLOAD_FLAGS = (("requests", "--requests"), ("rate_rps", "--rate"), ("block_tokens", "--block-tokens"),
                  ("session_sample", "--session-sample"), ("session_seed", "--session-seed"),
                  ("max_output_tokens", "--max-output-tokens"))


def run_args(run: Path) -> list[str]:
    """The workload and budget flags a run was recorded with (its validate.json)."""
    v = json.loads((run / "validate.json").read_text())
    w = v["workload"]
    out = []
    for k, flag in WORKLOAD_FLAGS:
        if w.get(k) is not None:
            out += [flag, str(w[k])]
    return out + ["--budget-ms", str(v["config"]["pipeline_ttft_budget_ms"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the fit, the re-simulations and the reports")
    ap.add_argument("--runs", default="data/validation", help="the recorded runs and their manifest.json")
    ap.add_argument("--profile", default="data/profiles/this-machine.json",
                    help="the bare-engine profile calibrate-roles starts from")
    a = ap.parse_args(argv)
    runs, out = Path(a.runs), Path(a.out)
    try:
        man = json.loads((runs / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        ap.error(f"--runs {runs}: cannot read manifest.json ({e})")
    out.mkdir(parents=True, exist_ok=True)
    from pdd.config import ClusterConfig

    model = Path(ClusterConfig().model_path)
    if not (model / "config.json").exists():
        if rc := pdd(["make-model", "--out", str(model)]):
            return rc
    cal = man["calibration"]
    fit = out / "fit.json"
    if rc := pdd(["sim", "calibrate-roles", "--run", str(runs / cal), "--profile", a.profile, "--out", str(fit)]):
        return rc
    for name in [cal, *man["held_out"]]:
        extra = []
        if name in man.get("config", {}):
            extra += ["--config", str(runs / man["config"][name])]
        if name in man.get("profile_b", {}):
            extra += ["--profile-b", str(runs / man["profile_b"][name])]
        print(f"\n== {name}", flush=True)
        if rc := pdd(["sim", "validate", "--profile", str(fit), "--live-from", str(runs / name),
                      "--out", str(out / name), *run_args(runs / name), *extra]):
            return rc
    for i, (x, y) in enumerate(man.get("noise") or [[None, None]]):
        print(f"\n== held-out report{'' if x is None else f', noise floor {x} / {y}'}", flush=True)
        noise = [] if x is None else ["--noise", str(runs / x), str(runs / y)]
        if rc := pdd(["sim", "validate-report", "--calibration", str(out / cal),
                      "--held-out", *[str(out / n) for n in man["held_out"]], *noise,
                      "--json", str(out / f"report-{i}.json")]):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
