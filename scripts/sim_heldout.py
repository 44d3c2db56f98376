"""Re-simulate the recorded held-out runs of docs/SIM.md and print the held-out report.

    python scripts/sim_heldout.py --out runs/heldout [--runs data/validation]
                                  [--profile data/profiles/this-machine.json]

The runs directory holds ``manifest.json`` (which run is the calibration run, which are held out,
which two form each noise floor, the cluster config and MD's step profile of each heterogeneous
run) and one ``pdd sim validate --out`` directory per run. The steps are the documented method:

1. ``pdd sim calibrate-roles --run RUNS/<calibration> --profile PROFILE --out OUT/fit.json``:
   every role fit from the calibration run alone;
2. per run, ``pdd sim validate --profile OUT/fit.json --live-from RUNS/<run>`` (which takes the
   run's own workload arguments from its ``validate.json``), its ``--config`` and ``--profile-b`` (MD's
   bare engine measured with that tier's engine settings: an input, not a fit) -> ``OUT/<run>``;
3. ``pdd sim validate-report`` over them, once per noise pair: the table printed, the report
   written to ``OUT/report-<n>.json``.

Nothing live is started: the simulator is deterministic, so the same inputs give the same table
on any machine (about 10 s). Needs the runs' model checkpoint (``models/small``; made when missing,
as ``make demo`` does). A manifest or run directory it cannot use is one usage line (exit 2)
before anything runs; otherwise the exit status is that of the first step that fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from pdd.cli import main as pdd


def check_run(run: Path) -> None:
    """Raises ValueError naming the file when ``run``'s validate.json is missing, not JSON or
    lacks ``workload`` or ``config.pipeline_ttft_budget_ms`` (`pdd sim validate --live-from`
    reads the run's workload arguments from it)."""
    f = run / "validate.json"
    try:
        v = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    w = v.get("workload") if isinstance(v, dict) else None
    budget = (v.get("config") or {}).get("pipeline_ttft_budget_ms") if isinstance(v, dict) else None
    if not isinstance(w, dict) or budget is None:
        raise ValueError(f"{f}: no 'workload' object or config.pipeline_ttft_budget_ms "
                         "(not a `pdd sim validate` output)")


def check_manifest(man) -> None:
    """Raises ValueError naming the key when ``man`` is not a manifest: ``calibration`` a run name,
    ``held_out`` a non-empty list of names, ``noise`` (optional) a list of name pairs, ``config``
    and ``profile_b`` (optional) objects of run name -> path under the runs directory."""
    def name(x):
        return isinstance(x, str) and x != ""

    if not isinstance(man, dict):
        raise ValueError(f"not a JSON object ({type(man).__name__})")
    if not name(man.get("calibration")):
        raise ValueError("'calibration' must name the calibration run's directory")
    ho = man.get("held_out")
    if not (isinstance(ho, list) and ho and all(name(x) for x in ho)):
        raise ValueError("'held_out' must be a non-empty list of run directory names")
    noise = man.get("noise")
    if noise is not None and not (isinstance(noise, list)
                                  and all(isinstance(p, list) and len(p) == 2 and all(name(x) for x in p)
                                          for p in noise)):
        raise ValueError("'noise' must be a list of [run, run] pairs")
    if man["calibration"] in ho:
        raise ValueError(f"'held_out' lists the calibration run {man['calibration']!r}: a run the fit was made on "
                         "is not held out")
    for k in ("config", "profile_b"):
        if not isinstance(man.get(k, {}), dict):
            raise ValueError(f"'{k}' must be an object of run name -> path")


def check_manifest_files(man: dict, runs: Path) -> None:
    """Raises ValueError naming the file or key when a run the manifest names has no usable
    directory (a noise run is read as recorded, so it needs one too) or a ``config`` /
    ``profile_b`` entry names a run not in it or a file that does not exist."""
    known = [man["calibration"], *man["held_out"]]
    for x in dict.fromkeys(n for pair in man.get("noise") or [] for n in pair):
        if not (runs / x / "validate.json").is_file():
            raise ValueError(f"{runs / x / 'validate.json'}: cannot read it (a noise run of the manifest)")
    for k in ("config", "profile_b"):
        for n, path in man.get(k, {}).items():
            if n not in known:
                raise ValueError(f"'{k}' names {n!r}, neither the calibration run nor a held-out one")
            if not isinstance(path, str) or not (runs / path).is_file():
                raise ValueError(f"'{k}' of {n}: no such file {runs / str(path)}")


def load_runs(runs: Path) -> dict:
    """``runs``' manifest once it and every run it names pass the checks above; else ValueError
    naming the file or key (the usage line of this script and of scripts/sim_ablation.py)."""
    try:
        man = json.loads((runs / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{runs / 'manifest.json'}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        check_manifest(man)
        for n in dict.fromkeys([man["calibration"], *man["held_out"]]):
            check_run(runs / n)
        check_manifest_files(man, runs)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(str(runs)) else f"{runs / 'manifest.json'}: {e}") from None
    return man


def make_out(out: Path) -> None:
    """Makes the output directory ``out`` as `pdd sim` does its ``--out`` (parents too); ValueError
    naming ``--out`` and it when it is a file, cannot be made or is not writable (was a
    FileExistsError / NotADirectoryError traceback)."""
    from pdd.sim.cli import UsageError, check_out_dir

    try:
        check_out_dir(str(out), "--out")
    except UsageError as e:
        raise ValueError(str(e)) from None


def ensure_model(run=None) -> int:
    """Makes the runs' model checkpoint (``models/small`` under the working directory) when it is
    missing, as `make demo` does, with ``run`` (default: `pdd`'s main) as ``pdd make-model``;
    returns its exit status, 0 when there was nothing to make."""
    from pdd.config import ClusterConfig

    model = Path(ClusterConfig().model_path)
    if (model / "config.json").exists():
        return 0
    return (run or pdd)(["make-model", "--out", str(model)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the fit, the re-simulations and the reports")
    ap.add_argument("--runs", default="data/validation", help="the recorded runs and their manifest.json")
    ap.add_argument("--profile", default="data/profiles/this-machine.json",
                    help="the bare-engine profile calibrate-roles starts from")
    a = ap.parse_args(argv)
    if not Path(a.profile).is_file():  # named here, not by the calibrate-roles it runs
        ap.error(f"--profile: no such file {a.profile}")
    runs, out = Path(a.runs), Path(a.out)
    try:
        man = load_runs(runs)
    except ValueError as e:
        ap.error(f"--runs: {e}")
    try:
        make_out(out)
    except ValueError as e:
        ap.error(str(e))
    if rc := ensure_model():
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
                      "--out", str(out / name), *extra]):
            return rc
    for i, (x, y) in enumerate(man.get("noise") or [[None, None]]):
        print(f"\n== held-out report{'' if x is None else f', noise floor {x} / {y}'}", flush=True)
        noise = [] if x is None else ["--noise", str(runs / x), str(runs / y)]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = pdd(["sim", "validate-report", "--calibration", str(out / cal),
                      "--held-out", *[str(out / n) for n in man["held_out"]], *noise,
                      "--json", str(out / f"report-{i}.json")])
        # the held-out rows once; each later report adds only its noise floor, under the table's head
        lines = buf.getvalue().splitlines(keepends=True)
        print(buf.getvalue() if i == 0 or rc else
              "".join(lines[:2] + [ln for ln in lines[2:] if ln.startswith("| noise floor") or ln.startswith("wrote")]),
              end="")
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
