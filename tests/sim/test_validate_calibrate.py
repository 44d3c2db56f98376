"""`pdd sim validate --calibrate`: the committed calibration workload run live first, fitted, and the
held-out run judged with that fit. The live runs are the committed recordings (data/validation),
handed back by a stand-in for the live topology, so the fit and the errors are exactly those of
`scripts/sim_heldout.py` on the same recordings (tests/sim/test_heldout_runs.py pins those)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "data" / "validation"
PROFILE = ROOT / "data" / "profiles" / "this-machine.json"
SEED3 = ["--requests", "100", "--rate", "0.5", "--session-seed", "3", "--max-output-tokens", "32",
         "--budget-ms", "40"]


def _recorded(name: str) -> dict:
    return json.loads((RUNS / name / "validate.json").read_text())


def test_the_calibration_workload_is_the_committed_calibration_runs():
    from pdd.bench.live_validate import CALIBRATION_ARGS

    v = _recorded(json.loads((RUNS / "manifest.json").read_text())["calibration"])
    w = v["workload"]
    assert CALIBRATION_ARGS == {"requests": w["requests"], "rate": w["rate_rps"], "block_tokens": w["block_tokens"],
                                "session_sample": w["session_sample"], "session_seed": w["session_seed"],
                                "max_output_tokens": w["max_output_tokens"],
                                "budget_ms": v["config"]["pipeline_ttft_budget_ms"]}


@pytest.fixture
def replayed_live(monkeypatch, tmp_path, small_model):
    """The live topology replaced by the committed recordings (cal-a for the calibration workload,
    seed3 for the held-out one), in a working directory holding the runs' model."""
    import pdd.bench.live_validate as lv

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "small").symlink_to(small_model)
    monkeypatch.chdir(tmp_path)
    ran, held_out = [], []  # held_out: the recordings the 100-request runs hand back, in order

    def live_run(cfg, requests, out, seed, console):
        name = "cal-a" if len(requests) == 150 else held_out.pop(0)
        ran.append((name, cfg.policy.pipeline_ttft_budget_ms, dict(cfg.tiers)))
        for f in ("requests.jsonl", "server_stats.json"):
            shutil.copy(RUNS / name / f, Path(out) / f)
        live = [json.loads(x) for x in (RUNS / name / "requests.jsonl").read_text().splitlines() if x.strip()]
        return live, json.loads((RUNS / name / "server_stats.json").read_text())

    monkeypatch.setattr(lv, "live_run", live_run)
    return tmp_path, ran, held_out


def test_calibrate_fits_on_the_calibration_run_and_judges_both_runs_and_the_noise_floor(replayed_live, capsys):
    """--calibrate fits the calibration run (the committed recording of cal-a: the committed fit)
    and judges the held-out run with it; --noise-floor runs the workload again (OUT/repeat), judges
    it too and compares the pair: here the committed pair seed2-a / seed2-b, so every figure is
    docs/SIM.md's (tests/sim/test_heldout_runs.py DOCUMENTED and NOISE)."""
    from pdd.cli import main as pdd

    from pdd.topology import free_port_block

    work, ran, held_out = replayed_live
    held_out.extend(["seed2-a", "seed2-b"])
    out = work / "v"
    # the recordings ran before policy.cutoff_max_sent_fraction: the cut-off read the remaining
    # time alone (1), so the stand-in topology is configured as they ran
    base = free_port_block()
    (work / "as-recorded.yaml").write_text(f"base_port: {base}\ngateway_port: {base + 95}\n"
                                           "policy: {cutoff_max_sent_fraction: 1.0}\n")
    assert pdd(["sim", "validate", "--calibrate", "--noise-floor", "--profile", str(PROFILE), "--out", str(out),
                "--config", str(work / "as-recorded.yaml"), "--requests", "100", "--rate", "0.8", "--session-seed", "2", "--max-output-tokens", "16",
                "--budget-ms", "40"]) == 0
    assert [r[0] for r in ran] == ["cal-a", "seed2-a", "seed2-b"] and ran[0][1] == 40.0
    # the fit is the committed profile's (fitted on the same recording of cal-a)
    fit, committed = json.loads((out / "fit.json").read_text()), json.loads(PROFILE.read_text())
    for k in ("role_step_scale", "role_step_overhead_s", "prefill_interference", "decode_interference",
              "p_reply_lag_s_per_token", "wan_written_lead_bytes", "gateway_rtt_ms"):
        assert fit.get(k) == pytest.approx(committed.get(k), rel=1e-9), k
    assert Path(fit["role_overhead_from"]["run"]).resolve() == (out / "calibration").resolve()
    for d in (out, out / "repeat", out / "calibration"):
        v = json.loads((d / "validate.json").read_text())
        assert Path(v["profile"]["path"]).resolve() == (out / "fit.json").resolve()
    rep = json.loads((out / "report.json").read_text())
    got = [(round(r["decision_match_share"], 4), round(r["err_p50_ttft_ms"], 3), round(r["err_p90_ttft_ms"], 3))
           for r in rep["held_out"]]
    assert got == [(0.98, -0.03, 0.035), (0.94, 0.081, 0.052)]
    assert rep["judged"]["ttft_p50"]["met"] == 1 and rep["judged"]["ttft_p90"]["met"] == 1
    nf = rep["noise_floor"]
    assert Path(nf["runs"][1]).resolve() == (out / "repeat").resolve()
    assert (round(nf["err_p50_ttft_ms"], 3), round(nf["err_p90_ttft_ms"], 3)) == (-0.239, -0.009)
    printed = capsys.readouterr().out
    assert "noise floor" in printed and f"wrote {out}/report.json" in printed


def test_calibration_runs_every_tier_on_the_top_level_engine():
    """A heterogeneous config's calibration run drops its ``tiers`` blocks (the fit is over the
    top-level engine's profile); the held-out run keeps them."""
    from pdd.bench.live_validate import calibration_config
    from pdd.config import ClusterConfig

    cfg = ClusterConfig.load(RUNS / "seed4-het" / "cluster.yaml")
    assert cfg.engine_for("md0").dtype == "bfloat16"
    cal = calibration_config(cfg)
    assert cal.tiers == {} and cal.engine_for("md0").dtype == cfg.engine.dtype
    assert calibration_config(None) is None


@pytest.mark.parametrize("argv,msg", [
    (["--live-from", str(RUNS / "seed3")], "--calibrate runs a calibration workload live before this one; "
                                           "--live-from re-simulates a recorded run: give one of them"),
    (["--requests", "150", "--rate", "1", "--session-seed", "1", "--max-output-tokens", "64", "--budget-ms", "40"],
     "--calibrate: 150 of this workload's 150 requests are the calibration run's own (its conversations: "
     "--session-seed 1, --session-sample 50): not held out; give another --session-seed (the rate, output cap and "
     "budget do not change which requests run)"),
    # found by a new user: another rate, output cap or budget passed as held out, with the same requests
    (["--requests", "30", "--rate", "0.8", "--session-seed", "1", "--max-output-tokens", "16", "--budget-ms", "250"],
     "--calibrate: 30 of this workload's 30 requests are the calibration run's own"),
    (["--profile-b", "nowhere.json", *SEED3], "--profile-b: nowhere.json: no such file"),
    (["--profile", "nowhere.json", *SEED3], "--profile: nowhere.json: no such file"),
])
def test_calibrate_refuses_in_one_line_before_anything_runs(monkeypatch, tmp_path, capsys, argv, msg):
    assert msg in _refused(monkeypatch, tmp_path, capsys, ["--calibrate", *argv])


def _refused(monkeypatch, tmp_path, capsys, argv: list[str]) -> str:
    """``pdd sim validate --out DIR argv`` exits 2 before any live run starts; its stderr."""
    import pdd.bench.live_validate as lv
    from pdd.cli import main as pdd

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lv, "live_run", lambda *a, **k: pytest.fail("a live run started"))
    with pytest.raises(SystemExit) as ex:
        pdd(["sim", "validate", "--out", str(tmp_path / "v"), *argv])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    # one line; nothing said to start and no --out made (found by a new user: a bad --profile printed
    # "calibration run: ..." first and left an empty directory)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "v").exists()
    return err


def test_noise_floor_needs_calibrate(monkeypatch, tmp_path, capsys):
    assert "--noise-floor judges two runs of the workload against a calibration run of the same day: give it " \
           "with --calibrate" in _refused(monkeypatch, tmp_path, capsys, ["--noise-floor", *SEED3])


def test_a_held_out_workload_shares_requests_with_the_calibration_run_only_by_chance():
    """Which trace records a run replays is chosen by its session seed and sample: seed 3's 100
    share none of the calibration run's 150, seed 5's two (another seed keeps a conversation by
    chance); a slice of seed 1's is all the calibration's."""
    from pdd.bench.live_validate import calibration_overlap

    w = {"requests": 100, "rate": 0.5, "block_tokens": 64, "session_sample": 50, "session_seed": 3,
         "max_output_tokens": 32, "budget_ms": 40.0}
    assert calibration_overlap(None, w) == 0
    assert calibration_overlap(None, {**w, "session_seed": 5}) == 2  # by chance: accepted (docs/SIM.md's example)
    assert calibration_overlap(None, {**w, "session_seed": 1, "requests": 30}) == 30
    assert calibration_overlap(None, {**w, "session_seed": 1, "requests": 200}) == 150


def test_ctrl_c_during_the_live_run_is_one_line_and_status_130(replayed_live, monkeypatch, capsys):
    """Found by a new user: Ctrl-C during `pdd sim validate --calibrate` printed a traceback (the
    topology's instances still exited: ``with Topology``); it ends as pdd bench's does."""
    import pdd.bench.live_validate as lv
    from pdd.cli import main as pdd

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(lv, "live_run", interrupted)
    work, _, _ = replayed_live
    assert pdd(["sim", "validate", "--calibrate", "--profile", str(PROFILE), "--out", str(work / "v"), *SEED3]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "pdd sim validate: stopped by SIGINT; its instances have exited"
    assert "Traceback" not in err
