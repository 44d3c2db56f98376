"""scripts/record_validation.py: which runs it records, with which `pdd` calls, and the manifest it
writes (a fake `pdd` stands in for the live runs, which take about 35 minutes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mod():
    spec = importlib.util.spec_from_file_location("record_validation", ROOT / "scripts" / "record_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_subset_is_recorded_in_order_with_each_runs_own_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no models/small here: the fake makes it
    calls = []

    def pdd(argv):
        calls.append(argv)
        return 0

    out = tmp_path / "o"
    rc = _mod().main(["--out", str(out), "--runs", "seed4-het,seed3,cal-a"], pdd=pdd, load=lambda: (0.2, 0, 0),
                     sleep=lambda s: pytest.fail("waited on a quiet machine"))
    assert rc == 0
    assert calls[0][:1] == ["make-model"] and calls[1] == ["profile", "--out", str(out / "profile.json"), "--force"]
    # the heterogeneous run's MD profile, with its config (copied beside it)
    assert calls[2] == ["profile", "--config", str(out / "seed4-het" / "cluster.yaml"), "--out",
                        str(out / "md-bf16-profile.json"), "--force"]
    assert (out / "seed4-het" / "cluster.yaml").read_text() == \
        (ROOT / "data" / "validation" / "seed4-het" / "cluster.yaml").read_text()
    runs = [c[c.index("--out") + 1] for c in calls[3:]]
    assert runs == [str(out / n) for n in ("cal-a", "seed3", "seed4-het")]  # the order they were recorded in
    assert calls[4] == ["sim", "validate", "--profile", str(out / "profile.json"), "--out", str(out / "seed3"),
                        "--requests", "100", "--rate", "0.5", "--block-tokens", "64", "--session-sample", "50",
                        "--session-seed", "3", "--max-output-tokens", "32", "--budget-ms", "40.0"]
    assert calls[5][-2:] == ["--config", str(out / "seed4-het" / "cluster.yaml")]
    man = json.loads((out / "manifest.json").read_text())
    assert (man["calibration"], man["held_out"], man["noise"]) == ("cal-a", ["seed3", "seed4-het"], [])
    assert man["config"] == {"seed4-het": "seed4-het/cluster.yaml"}
    assert man["profile_b"] == {"seed4-het": "md-bf16-profile.json"}
    assert man["load_before"] == {"cal-a": 0.2, "seed3": 0.2, "seed4-het": 0.2}
    assert list(man["recorded_with"]) == ["cal-a", "seed3", "seed4-het"]


def test_source_records_another_committed_sets_workloads(tmp_path, monkeypatch):
    """--source data/validation-400: its five runs in its order, 400 requests from 1 in 25
    conversations, the heterogeneous run with its config; the noise pair kept."""
    monkeypatch.chdir(tmp_path)
    calls = []

    def pdd(argv):
        calls.append(argv)
        return 0

    out = tmp_path / "o"
    rc = _mod().main(["--out", str(out), "--source", str(ROOT / "data" / "validation-400")], pdd=pdd,
                     load=lambda: (0.1, 0, 0), sleep=lambda s: pytest.fail("waited on a quiet machine"))
    assert rc == 0
    validates = [c for c in calls if c[:2] == ["sim", "validate"]]
    assert [c[c.index("--out") + 1] for c in validates] == [str(out / n) for n in
                                                             ("cal", "seed5", "seed6", "seed7-het", "seed5-b")]
    assert validates[2][6:] == ["--requests", "400", "--rate", "0.8", "--block-tokens", "64", "--session-sample", "25",
                                "--session-seed", "6", "--max-output-tokens", "32", "--budget-ms", "40.0"]
    assert validates[3][-2:] == ["--config", str(out / "seed7-het" / "cluster.yaml")]
    man = json.loads((out / "manifest.json").read_text())
    assert (man["calibration"], man["noise"]) == ("cal", [["seed5", "seed5-b"]])


def test_a_noise_pair_is_kept_when_both_runs_are_recorded(tmp_path):
    mod = _mod()
    man = json.loads((ROOT / "data" / "validation" / "manifest.json").read_text())
    m = mod.subset_manifest(man, mod.plan(man, ["cal-a", "seed2-a", "seed2-b", "seed4-het"]), {}, "abc", 0.5)
    assert m["noise"] == [["seed2-a", "seed2-b"]] and m["held_out"] == ["seed2-a", "seed2-b", "seed4-het"]


def test_it_waits_for_a_quiet_machine_and_then_no_longer_than_told():
    mod = _mod()
    loads = iter([2.0, 1.1, 0.3])
    slept = []
    assert mod.wait_quiet(0.5, 60, load=lambda: (next(loads), 0, 0), sleep=slept.append) == 0.3
    assert slept == [5.0, 5.0]
    assert mod.wait_quiet(0.5, 0, load=lambda: (3.0, 0, 0), sleep=slept.append) == 3.0  # busy: runs anyway
    assert slept == [5.0, 5.0]


@pytest.mark.parametrize("runs,message", [
    ("cal-a,seed9", "--runs: unknown seed9; the runs are cal-a, seed2-a"),
    ("seed3", "--runs: the calibration run cal-a must be one of them"),
    ("cal-a,cal-b", "--runs: name a held-out run too"),
])
def test_a_bad_subset_is_one_usage_line(tmp_path, capsys, runs, message):
    with pytest.raises(SystemExit) as e:
        _mod().main(["--out", str(tmp_path / "o"), "--runs", runs], pdd=lambda argv: pytest.fail("ran"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_the_manifest_it_writes_is_one_sim_heldout_reads(tmp_path, monkeypatch):
    """The round trip: the recorded set (here the committed runs' files, put in place by a fake
    `pdd`) with the manifest the script writes passes sim_heldout.py's checks, the heterogeneous
    run's config and MD profile where the manifest names them."""
    import shutil
    import sys

    monkeypatch.chdir(tmp_path)
    src = ROOT / "data" / "validation"
    out = tmp_path / "o"

    def pdd(argv):
        if argv[:2] == ["sim", "validate"]:
            d = Path(argv[argv.index("--out") + 1])
            d.mkdir(parents=True, exist_ok=True)
            for f in ("validate.json", "requests.jsonl", "server_stats.json"):
                shutil.copyfile(src / d.name / f, d / f)
        elif argv[:1] == ["profile"]:
            shutil.copyfile(src / "md-bf16-profile.json", argv[argv.index("--out") + 1])
        return 0

    assert _mod().main(["--out", str(out), "--runs", "cal-a,seed3,seed4-het,seed4-het-b,cal-b"], pdd=pdd,
                       load=lambda: (0.1, 0, 0), sleep=lambda s: None) == 0
    sys.path.insert(0, str(ROOT / "scripts"))
    import sim_heldout

    man = sim_heldout.load_runs(out)
    assert man["noise"] == [["seed4-het", "seed4-het-b"], ["cal-a", "cal-b"]]
    assert (out / man["config"]["seed4-het-b"]).is_file() and (out / man["profile_b"]["seed4-het"]).is_file()
