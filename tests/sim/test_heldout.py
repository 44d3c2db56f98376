"""Held-out validation and the noise floor (`pdd sim validate-report`), on the recorded
calibration run (data/profiles/calibration-run) and copies of it changed in known ways."""

import copy
import json
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main
from pdd.sim.heldout import format_report, held_out_report, live_vs_live, read_records
from pdd.sim.validate import error_distribution

RUN = Path(__file__).resolve().parents[2] / "data" / "profiles" / "calibration-run"


def _small(n=30):
    return read_records(RUN)[:n]


def _slower(recs, factor):
    """Each request's tokens all later by (factor - 1) x its TTFT: TTFT x factor, TPOT unchanged."""
    out = copy.deepcopy(recs)
    for r in out:
        if r.get("ok") and r.get("token_times_s"):
            d = (factor - 1) * (r["token_times_s"][0] - r["send_s"])
            r["token_times_s"] = [t + d for t in r["token_times_s"]]
    return out


def _refused(cal, ho, capsys) -> str:
    """`pdd sim validate-report` on ``cal`` and ``ho``: exit 2; its stderr."""
    with pytest.raises(SystemExit) as ex:
        pdd_main(["sim", "validate-report", "--calibration", str(cal), "--held-out", str(ho)])
    assert ex.value.code == 2
    return capsys.readouterr().err


def test_error_distribution_exact():
    e = error_distribution([-0.5, 0.0, 0.125, 0.25])
    # |e| sorted 0, 0.125, 0.25, 0.5 (linear interpolation: P90 at 2.7, P99 at 2.97)
    assert e == pytest.approx({"requests": 4, "median": 0.0625, "abs_p50": 0.1875, "abs_p90": 0.425,
                               "abs_p99": 0.4925, "within_5pct": 0.25, "within_10pct": 0.25, "within_25pct": 0.75},
                              rel=1e-12)
    assert error_distribution([]) is None


def test_noise_floor_of_a_run_against_itself_is_zero():
    a = _small()
    nf = live_vs_live(a, copy.deepcopy(a))
    assert nf["requests_compared"] == 30
    assert all(nf[f"err_{k}"] == 0.0 for k in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_tpot_ms"))
    assert nf["ttft_error_per_request"]["abs_p99"] == 0.0 and nf["ttft_error_per_request"]["within_5pct"] == 1.0
    assert nf["decision_match_share"] == 1.0 and nf["pipeline_match_share"] == 1.0


def test_noise_floor_sees_a_uniformly_slower_run_and_a_changed_decision():
    a = _small()
    b = _slower(a, 1.25)
    first = b[0]["pdd"]["decisions"]
    pipe = next(d for d in first if d["policy"] == "pipeline")
    pipe["result"] = "p_md" if pipe["result"] != "p_md" else "p_rld_md"
    nf = live_vs_live(a, b)
    assert nf["err_p50_ttft_ms"] == pytest.approx(0.25, rel=1e-9)
    assert nf["err_p90_ttft_ms"] == pytest.approx(0.25, rel=1e-9)
    assert nf["err_p50_tpot_ms"] == pytest.approx(0.0, abs=1e-9)
    per = nf["ttft_error_per_request"]
    assert per["median"] == pytest.approx(0.25, rel=1e-9) and per["within_25pct"] in (0.0, 1.0)
    assert nf["decision_match_share"] == pytest.approx(29 / 30) and nf["pipeline_match_share"] == pytest.approx(29 / 30)


def test_noise_floor_refuses_different_workloads():
    a = _small()
    with pytest.raises(ValueError, match="hold 30 and 29 requests"):
        live_vs_live(a, a[:29])
    b = copy.deepcopy(a)
    b[3]["prompt_tokens"] += 1
    with pytest.raises(ValueError, match="request 3: prompt_tokens"):
        live_vs_live(a, b)


def _run_dir(tmp_path, name, workload=None, live=None, sim=None, dm=None, records=None):
    v = json.loads((RUN / "validate.json").read_text())
    v["workload"].update(workload or {})
    v["live"].update(live or {})
    v["sim"].update(sim or {})
    for k in ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms"):
        v[f"err_{k}"] = v["sim"][k] / v["live"][k] - 1
    if dm is not None:
        v["decision_match_share"] = dm
    d = tmp_path / name
    d.mkdir()
    (d / "validate.json").write_text(json.dumps(v))
    if records is not None:
        (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (d / "server_stats.json").write_text((RUN / "server_stats.json").read_text())
    return d


def test_held_out_report_judges_each_run_against_the_goals(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    good = _run_dir(tmp_path, "seed2", {"session_seed": 2}, {"p50_ttft_ms": 100.0, "p90_ttft_ms": 400.0},
                    {"p50_ttft_ms": 104.0, "p90_ttft_ms": 390.0}, dm=0.96)
    bad = _run_dir(tmp_path, "rate12", {"rate_rps": 1.2}, {"p50_ttft_ms": 100.0, "p90_ttft_ms": 400.0},
                   {"p50_ttft_ms": 90.0, "p90_ttft_ms": 410.0}, dm=0.9)
    rep = held_out_report(cal, [good, bad])
    r1, r2 = rep["held_out"]
    assert r1["changed"] == ["session_seed"] and r2["changed"] == ["rate_rps"]
    assert r1["workload"]["budget_ms"] == 250.0
    assert r1["err_p50_ttft_ms"] == pytest.approx(0.04) and r1["err_p90_ttft_ms"] == pytest.approx(-0.025)
    assert r1["meets"] == {"ttft_p50": True, "ttft_p90": True, "decision_match": True}
    assert r2["meets"] == {"ttft_p50": False, "ttft_p90": True, "decision_match": False}
    assert rep["all_meet"] is False
    assert held_out_report(cal, [good])["all_meet"] is True
    text = format_report(rep)
    assert "| 100.0 / 104.0 (+4.0%) | 400.0 / 390.0 (-2.5%) |" in text
    assert "| ttft_p50, ttft_p90, decision_match |" in text and text.count("| ttft_p90 |") == 1
    assert "on every held-out run: not met" in text


def test_a_run_with_the_calibration_workload_is_not_held_out(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    same = _run_dir(tmp_path, "same")
    with pytest.raises(ValueError, match="the same workload as the calibration run"):
        held_out_report(cal, [same])
    other_budget = _run_dir(tmp_path, "budget40")
    v = json.loads((other_budget / "validate.json").read_text())
    v["config"]["pipeline_ttft_budget_ms"] = 40.0
    (other_budget / "validate.json").write_text(json.dumps(v))
    assert held_out_report(cal, [other_budget])["held_out"][0]["changed"] == ["budget_ms"]


def test_noise_floor_in_the_report_needs_one_workload(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    recs = _small()
    n1 = _run_dir(tmp_path, "n1", {"session_seed": 3}, records=recs)
    n2 = _run_dir(tmp_path, "n2", {"session_seed": 3}, records=_slower(recs, 1.25))
    rep = held_out_report(cal, [ho], (n1, n2))
    assert rep["noise_floor"]["err_p50_ttft_ms"] == pytest.approx(0.25, rel=1e-9)
    assert "| noise floor: live run 2 vs run 1 |" in format_report(rep)
    n3 = _run_dir(tmp_path, "n3", {"session_seed": 4}, records=recs)
    with pytest.raises(ValueError, match="different workloads"):
        held_out_report(cal, [ho], (n1, n3))


def test_cli_validate_report(tmp_path, capsys):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2}, {"p50_ttft_ms": 100.0}, {"p50_ttft_ms": 104.0}, dm=1.0)
    out = tmp_path / "r.json"
    assert pdd_main(["sim", "validate-report", "--calibration", str(cal), "--held-out", str(ho), "--json", str(out)]) == 0
    assert "100.0 / 104.0 (+4.0%)" in capsys.readouterr().out
    assert json.loads(out.read_text())["held_out"][0]["changed"] == ["session_seed"]
    with pytest.raises(SystemExit) as ex:
        pdd_main(["sim", "validate-report", "--calibration", str(cal), "--held-out", str(tmp_path / "nope")])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "nope/validate.json: cannot read a validate result" in err and "Traceback" not in err


def test_live_failures_are_shown_beside_each_run(tmp_path):
    """A held-out run compared on its completed requests only says how many failed live, and so
    does the noise floor (each run's count): a run that lost requests is not read as a clean one."""
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["live_failed"], v["requests_compared"] = 3, 208
    (ho / "validate.json").write_text(json.dumps(v))
    recs = _small()
    lost = copy.deepcopy(recs)
    lost[5].update(ok=False, error="ConnectionResetError")
    n1 = _run_dir(tmp_path, "n1", {"session_seed": 3}, records=recs)
    n2 = _run_dir(tmp_path, "n2", {"session_seed": 3}, records=lost)
    rep = held_out_report(cal, [ho], (n1, n2))
    assert rep["held_out"][0]["live_failed"] == 3 and rep["noise_floor"]["live_failed"] == [0, 1]
    assert rep["noise_floor"]["requests_compared"] == 29
    text = format_report(rep)
    assert "| session_seed=2 | 208 (3 failed live) |" in text
    assert "| none | 29 (0 / 1 failed live) |" in text


def test_a_run_judged_must_be_simulated_as_the_calibration_and_not_fitted_on_itself(tmp_path):
    """A held-out validate.json simulated with another profile fit (a recorded run's stale
    simulated half) or with a profile fitted on that very run is refused, naming the run."""
    cal = _run_dir(tmp_path, "cal")
    other = _run_dir(tmp_path, "other", {"session_seed": 2})
    v = json.loads((other / "validate.json").read_text())
    v["profile"]["role_step_overhead_s"] = {"P": 0.001}
    (other / "validate.json").write_text(json.dumps(v))
    with pytest.raises(ValueError, match=r"other: simulated with another profile fit than the calibration run .*"
                                         r"\(role_step_overhead_s differ\)"):
        held_out_report(cal, [other])
    # the calibration's profile says it was fitted on this run's live records
    fitted = json.loads((cal / "validate.json").read_text())["profile"]["role_overhead_from"]
    selfish = _run_dir(tmp_path, "selfish", {"session_seed": 3})
    v = json.loads((selfish / "validate.json").read_text())
    v["live_from"] = fitted
    (selfish / "validate.json").write_text(json.dumps(v))
    with pytest.raises(ValueError, match=r"selfish: its profile was fitted on this run"):
        held_out_report(cal, [selfish])


def test_noise_floor_needs_two_runs_of_one_topology(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    recs = _small()
    n1 = _run_dir(tmp_path, "n1", {"session_seed": 3}, records=recs)
    with pytest.raises(ValueError, match="one directory twice"):
        held_out_report(cal, [ho], (n1, n1))
    n2 = _run_dir(tmp_path, "n2", {"session_seed": 3}, records=recs)
    st = json.loads((n2 / "server_stats.json").read_text())
    st["stats"]["instances"]["md0"]["hardware"] = {"device": "cpu", "dtype": "bfloat16", "page_size": 32}
    (n2 / "server_stats.json").write_text(json.dumps(st))
    with pytest.raises(ValueError, match="different topologies"):
        held_out_report(cal, [ho], (n1, n2))
    bad = copy.deepcopy(recs)
    bad[3]["send_s"] = "abc"
    n3 = _run_dir(tmp_path, "n3", {"session_seed": 3}, records=bad)
    with pytest.raises(ValueError, match=r"requests.jsonl line 4: send_s must be a number"):
        held_out_report(cal, [ho], (n1, n3))


def test_a_run_that_lost_an_instance_is_not_judged(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["live_faults"] = {"degraded": 3, "unreachable": []}
    (ho / "validate.json").write_text(json.dumps(v))
    with pytest.raises(ValueError, match=r"ho: its live run lost an instance \(3 of .* requests degraded"):
        held_out_report(cal, [ho])


def test_at_live_p_speed_needs_a_fitted_p_step():
    """No fitted P step in the profile, or no live P step in the run: nothing to re-simulate."""
    from pdd.sim.p_speed import at_live_p_speed

    assert at_live_p_speed(None, "x", {}, 64, [], [], 0.09, {}) is None
    assert at_live_p_speed(None, "x", {"role_step_scale": {"P": 1.3}}, 64, [], [], None, {}) is None


def test_at_live_speed_needs_a_fitted_p_step_and_every_roles_live_step():
    from pdd.sim.p_speed import at_live_speed

    steps = {"P": 0.09, "RLD": 0.006, "MD": 0.005}
    assert at_live_speed(None, "x", {}, 64, [], [], steps, {}) is None
    for role in steps:  # a role without a live mean step: nothing to set its speed to
        assert at_live_speed(None, "x", {"role_step_scale": {"P": 1.3}}, 64, [], [], {**steps, role: None}, {}) is None


def test_the_report_shows_every_role_at_its_own_speed(tmp_path):
    from pdd.sim.heldout import format_report, held_out_report

    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["at_live_p_speed"] = {"level": 0.95, "err_p50_ttft_ms": 0.061, "err_p90_ttft_ms": -0.008}
    v["at_live_speed"] = {"factors": {"P": 0.95, "RLD": 0.9, "MD": 1.1}, "err_p50_ttft_ms": 0.062,
                          "err_p90_ttft_ms": -0.006}
    (ho / "validate.json").write_text(json.dumps(v))
    assert "| +6.1% / -0.8% (x0.950); every role: +6.2% / -0.6% |" in format_report(held_out_report(cal, [ho]))


def test_noise_floor_intervals_of_a_copy_and_of_a_uniformly_slower_run(tmp_path):
    """The noise floor carries each error's paired-bootstrap interval (pdd.sim.uncertainty): zero
    wide at zero for a copy of the run; for every TTFT x1.25, +25% at both ends and TPOT at 0."""
    a = _small()
    same = live_vs_live(a, copy.deepcopy(a))["err_ci"]
    assert all(same[k] == [0.0, 0.0] for k in ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms"))
    slow = live_vs_live(a, _slower(a, 1.25))["err_ci"]
    for k in ("p50_ttft_ms", "p90_ttft_ms"):
        assert slow[k] == [pytest.approx(0.25, rel=1e-9), pytest.approx(0.25, rel=1e-9)]
    assert slow["p50_tpot_ms"] == [pytest.approx(0.0, abs=1e-9), pytest.approx(0.0, abs=1e-9)]
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    n1 = _run_dir(tmp_path, "n1", {"session_seed": 3}, records=a)
    n2 = _run_dir(tmp_path, "n2", {"session_seed": 3}, records=_slower(a, 1.25))
    text = format_report(held_out_report(cal, [ho], (n1, n2)))
    assert "(+25.0% [+25, +25])" in text and "95% interval: the error's paired bootstrap" in text


def test_a_held_out_runs_interval_is_shown_beside_its_error(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2}, {"p50_ttft_ms": 100.0}, {"p50_ttft_ms": 104.0})
    v = json.loads((ho / "validate.json").read_text())
    v["err_ci"] = {"p50_ttft_ms": [-0.123, 0.402], "p90_ttft_ms": [-0.003, 0.1], "p99_ttft_ms": None,
                   "p50_tpot_ms": None}
    (ho / "validate.json").write_text(json.dumps(v))
    rep = held_out_report(cal, [ho])
    assert rep["held_out"][0]["err_ci"]["p50_ttft_ms"] == [-0.123, 0.402]
    text = format_report(rep)
    assert "100.0 / 104.0 (+4.0% [-12, +40])" in text
    assert "[-0.3, +10])" in text  # under 1%: one decimal, so a bound just below 0 shows as one


@pytest.mark.parametrize("bad", [{"p50_ttft_ms": "x"}, [1], "abc", 5, {"p50_ttft_ms": [1]},
                                 {"p90_ttft_ms": [None, None]}, {"p50_ttft_ms": ["a", "b"]},
                                 {"p50_ttft_ms": [True, False]}, {"p50_ttft_ms": [1, 2, 3]},
                                 {"p50_tpot_ms": [0.2, -0.1]}])
def test_a_malformed_err_ci_is_one_line_naming_the_field(tmp_path, capsys, bad):
    """A validate.json whose err_ci is not what `pdd sim validate` writes (hand-edited, truncated):
    exit 2 and one line naming the file and the field, never a traceback from the formatting."""
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["err_ci"] = bad
    (ho / "validate.json").write_text(json.dumps(v))
    err = _refused(cal, ho, capsys)
    assert "ho/validate.json: err_ci" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_non_finite_err_ci_bound_is_refused(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["err_ci"] = {"p50_ttft_ms": [float("nan"), 1.0]}
    (ho / "validate.json").write_text(json.dumps(v))  # NaN, as Python's json writes it
    with pytest.raises(ValueError, match="err_ci.p50_ttft_ms must be null or"):
        held_out_report(cal, [ho])


def test_an_err_ci_absent_or_null_is_read_as_none_recorded(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["err_ci"] = {"p50_ttft_ms": None, "level": 0.95, "resamples": 2000}
    (ho / "validate.json").write_text(json.dumps(v))
    assert "[" not in format_report(held_out_report(cal, [ho])).splitlines()[2].split("|")[4]
    v.pop("err_ci")
    (ho / "validate.json").write_text(json.dumps(v))
    held_out_report(cal, [ho])


def test_noise_on_a_re_simulation_names_the_live_run_to_give(tmp_path):
    """`pdd sim validate --live-from RUN --out DIR` writes DIR/validate.json alone: given as a
    noise-floor run, DIR is refused naming RUN (whose live requests the noise floor reads)."""
    a = _small()
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    n1 = _run_dir(tmp_path, "n1", {"session_seed": 3}, records=a)
    re1 = _run_dir(tmp_path, "re1", {"session_seed": 3})
    v = json.loads((re1 / "validate.json").read_text())
    v["live_from"] = str(n1)
    (re1 / "validate.json").write_text(json.dumps(v))
    n2 = _run_dir(tmp_path, "n2", {"session_seed": 3}, records=a)
    with pytest.raises(ValueError, match=f"a re-simulation of the live run {n1}.*give --noise the live run's"):
        held_out_report(cal, [ho], (re1, n2))
    held_out_report(cal, [ho], (n1, n2))


def test_an_interval_for_p99_in_an_older_validate_json_is_not_shown(tmp_path):
    """P99 gets no interval (pdd.sim.uncertainty.METRICS); a validate.json that carries one (written
    before it was dropped, or by hand, malformed) is neither checked nor printed."""
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v["err_ci"] = {"p50_ttft_ms": [-0.1, 0.2], "p99_ttft_ms": "x"}
    (ho / "validate.json").write_text(json.dumps(v))
    row = next(ln for ln in format_report(held_out_report(cal, [ho])).splitlines() if ln.startswith(f"| {ho} |"))
    p50, p90, p99 = row.split(" | ")[3:6]
    assert p50.endswith("[-10, +20])") and "[" not in p90 and "[" not in p99


def _with_ci(d, ci, n=None):
    v = json.loads((d / "validate.json").read_text())
    v["err_ci"] = ci
    if n is not None:
        v["requests_compared"] = n
    (d / "validate.json").write_text(json.dumps(v))
    return d


def test_each_goal_is_judged_against_the_runs_interval(tmp_path):
    """Issue 25's goal "judged against the noise": met; not met but the 95% interval reaches the
    goal band (the run cannot tell its error from one that meets it); missed beyond the interval."""
    cal = _run_dir(tmp_path, "cal")
    live = {"p50_ttft_ms": 100.0, "p90_ttft_ms": 400.0}
    # P50 +8% with [-11, +39] (reaches +5%); P90 +12% with [+6, +20] (wholly above +5%); 92 of 100 decided alike
    a = _with_ci(_run_dir(tmp_path, "a", {"session_seed": 2}, live, {"p50_ttft_ms": 108.0, "p90_ttft_ms": 448.0},
                          dm=0.92), {"p50_ttft_ms": [-0.11, 0.39], "p90_ttft_ms": [0.06, 0.20]}, n=100)
    # P50 -7.5% with [-16, -5.5] (wholly below -5%); P90 +1% (met); 80 of 100 alike (Wilson [71, 87]: below 95)
    b = _with_ci(_run_dir(tmp_path, "b", {"session_seed": 3}, live, {"p50_ttft_ms": 92.5, "p90_ttft_ms": 404.0},
                          dm=0.80), {"p50_ttft_ms": [-0.16, -0.055], "p90_ttft_ms": [-0.07, 0.05]}, n=100)
    # no intervals recorded (an older validate.json): the misses cannot be judged against one
    c = _run_dir(tmp_path, "c", {"session_seed": 4}, live, {"p50_ttft_ms": 120.0, "p90_ttft_ms": 400.0}, dm=0.5)
    v = json.loads((c / "validate.json").read_text())
    v.pop("err_ci", None)
    v["requests_compared"] = 0
    (c / "validate.json").write_text(json.dumps(v))
    rep = held_out_report(cal, [a, b, c])
    ra, rb, rc = rep["held_out"]
    assert ra["decision_match_ci"] == pytest.approx([0.8500189229905127, 0.9589065385156194])
    assert ra["judged"] == {"ttft_p50": "within the interval", "ttft_p90": "missed beyond the interval",
                            "decision_match": "within the interval"}
    assert rb["decision_match_ci"] == pytest.approx([0.7112, 0.8666], abs=1e-4)
    assert rb["judged"] == {"ttft_p50": "missed beyond the interval", "ttft_p90": "met",
                            "decision_match": "missed beyond the interval"}
    assert rc["decision_match_ci"] is None
    assert rc["judged"] == {"ttft_p50": None, "ttft_p90": "met", "decision_match": None}
    assert rep["judged"] == {
        "ttft_p50": {"met": 0, "within the interval": 1, "missed beyond the interval": 1},
        "ttft_p90": {"met": 2, "within the interval": 0, "missed beyond the interval": 1},
        "decision_match": {"met": 0, "within the interval": 1, "missed beyond the interval": 1}}
    text = format_report(rep)
    assert "| 92.0% [85, 96] |" in text
    assert ("of 3 held-out run(s): TTFT P50 0 / 1 / 1; TTFT P90 2 / 0 / 1; decision match 0 / 1 / 1") in text


def test_a_band_edge_on_the_interval_counts_as_reached(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    a = _with_ci(_run_dir(tmp_path, "a", {"session_seed": 2}, {"p50_ttft_ms": 100.0}, {"p50_ttft_ms": 110.0}),
                 {"p50_ttft_ms": [0.05, 0.2]})
    assert held_out_report(cal, [a])["held_out"][0]["judged"]["ttft_p50"] == "within the interval"


@pytest.mark.parametrize("field, bad", [("live.p50_ttft_ms", "x"), ("sim.p90_ttft_ms", -1.0),
                                        ("sim.p50_tpot_ms", float("nan")), ("err_p50_ttft_ms", "x"),
                                        ("err_p90_ttft_ms", float("nan")), ("pipeline_match_share", "x"),
                                        ("pipeline_match_share", 1.5), ("live_failed", -1),
                                        ("ttft_error_per_request", 0.5), ("ttft_error_per_request.median", "x"),
                                        ("at_live_p_speed", "x"), ("at_live_p_speed.level", None),
                                        ("at_live_speed", "x"), ("at_live_speed.factors.P", 0),
                                        ("at_live_speed.err_p50_ttft_ms", float("inf")),
                                        ("decision_match_share", "x"), ("decision_match_share", 1.5),
                                        ("decision_match_share", True), ("requests_compared", -1),
                                        ("requests_compared", 2.5), ("requests_compared", "100")])
def test_every_number_the_report_reads_is_checked(tmp_path, capsys, field, bad):
    """A hand-edited validate.json with a bad value in any field the report reads (not only the
    decision match, the count and err_ci): exit 2 and one line naming the file and the field,
    never a traceback from the arithmetic or the formatting, nor a NaN judged as a miss."""
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    v = json.loads((ho / "validate.json").read_text())
    v.setdefault("ttft_error_per_request", {"median": 0.0, "abs_p50": 0.1, "abs_p90": 0.2})
    v.setdefault("at_live_p_speed", {"level": 1.0, "err_p50_ttft_ms": 0.0, "err_p90_ttft_ms": 0.0})
    v.setdefault("at_live_speed", {"factors": {"P": 1.0, "RLD": 1.0, "MD": 1.0}, "err_p50_ttft_ms": 0.0,
                                   "err_p90_ttft_ms": 0.0})
    *parents, leaf = field.split(".")
    d = v
    for k in parents:
        d = d[k]
    d[leaf] = bad
    (ho / "validate.json").write_text(json.dumps(v))
    err = _refused(cal, ho, capsys)
    assert f"ho/validate.json: {field} must be" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_validate_warns_when_the_run_stepped_at_another_speed_than_the_fit():
    """``pdd sim validate`` says so when the run's own P speed is more than 15% off the fit's (a
    profile fitted on another day: the committed fit judged on a run of the next day was x0.774,
    P90 +74%), naming the calibration run and the errors at the run's own speed; within 15% (the
    recorded runs of one day: x0.950-x1.011) it says nothing."""
    import json
    from pathlib import Path

    from pdd.sim.p_speed import SPEED_WARN, speed_warning
    from pdd.sim.validate import format_validate

    ps = {"level": 0.774, "live_p_step_ms": 59.1, "sim_p_step_ms": 59.1, "err_p50_ttft_ms": -0.061,
          "err_p90_ttft_ms": 0.067}
    line = speed_warning(ps, "data/validation/cal-a")
    assert line.startswith("WARNING: this run's P stepped faster than the profile's calibration run "
                           "(data/validation/cal-a) predicts (P's step x0.774: mean 59.1 ms live)")
    assert "(at the run's own P speed: P50 -6.1%, P90 +6.7%)" in line
    assert "slower" in speed_warning({**ps, "level": 1.2})
    assert SPEED_WARN == 0.15
    for level in (0.85, 0.95, 1.0, 1.011, 1.15):
        assert speed_warning({**ps, "level": level}) is None
    assert speed_warning(None) is None

    v = json.loads((Path(__file__).resolve().parents[2] / "data" / "validation" / "seed4" / "validate.json")
                   .read_text())
    assert "WARNING: this run's P" not in format_validate(v)  # recorded the day of its fit
    v["at_live_p_speed"] = ps
    v.setdefault("profile", {})["role_overhead_from"] = "data/validation/cal-a"
    assert format_validate(v).endswith(line)


def test_validate_warns_when_the_profile_has_no_live_run_fit():
    """A profile without a live-run fit (``role_overhead_from`` None: a bare engine's steps, as
    ``pdd sim validate`` without ``--profile`` measures one) gets a WARNING line naming the fit
    to run or give; a fitted profile's run (every committed held-out run) none."""
    import json
    from pathlib import Path

    from pdd.sim.p_speed import unfitted_warning
    from pdd.sim.validate import format_validate

    v = json.loads((Path(__file__).resolve().parents[2] / "data" / "validation" / "seed4" / "validate.json")
                   .read_text())
    assert unfitted_warning(v["profile"]) is None and "WARNING" not in format_validate(v)
    v["profile"] = {**v["profile"], "path": "/tmp/x/profile.json", "role_overhead_from": None}
    line = unfitted_warning(v["profile"])
    assert line.startswith("WARNING: the profile carries no live-run fit")
    assert "pdd sim calibrate-roles --run OUT --profile /tmp/x/profile.json" in line
    assert "--profile (data/profiles/this-machine.json for the committed runs)" in line
    assert format_validate(v).endswith(line)
    assert unfitted_warning(None) is None


def test_the_report_lists_each_run_s_ttft_phase_errors(tmp_path):
    cal = _run_dir(tmp_path, "cal")
    run = _run_dir(tmp_path, "seed2", {"session_seed": 2})
    old = _run_dir(tmp_path, "seed3", {"session_seed": 3})  # a validate.json written before phases were reported
    v = json.loads((run / "validate.json").read_text())
    v["ttft_phases"] = [{"prompt_tokens_computed": "0-127", "requests": 5, "to_p_reply_ms": {"live": 20.0, "sim": 18.5},
                         "after_p_reply_ms": {"live": 15.0, "sim": 21.25}},
                        {"prompt_tokens_computed": ">=1024", "requests": 2, "to_p_reply_ms": {"live": 500.0, "sim": 540.0},
                         "after_p_reply_ms": {"live": 30.0, "sim": 29.0}}]
    (run / "validate.json").write_text(json.dumps(v))
    rep = held_out_report(cal, [run, old])
    assert rep["held_out"][0]["ttft_phases"] == v["ttft_phases"] and rep["held_out"][1]["ttft_phases"] is None
    lines = format_report(rep).splitlines()
    assert f"- {run}: to P's reply 0-127 -1.5, >=1024 +40.0; after it +6.2, -1.0" in lines
    assert not any(line.startswith(f"- {old}:") for line in lines)
    assert "TTFT phases" not in format_report(held_out_report(cal, [old]))


_PHASE = {"prompt_tokens_computed": "0-127", "requests": 5, "to_p_reply_ms": {"live": 20.0, "sim": 18.5},
          "after_p_reply_ms": {"live": 15.0, "sim": 21.0}}


@pytest.mark.parametrize("field,value,named", [
    ("ttft_phases", "oops", 'ttft_phases must be null or a list, got "oops"'),
    ("ttft_phases", [7], "ttft_phases[0] must be an object with a prompt_tokens_computed bucket name, got 7"),
    ("ttft_phases", [{**_PHASE, "requests": "5"}], 'ttft_phases[0].requests must be a whole number >= 0, got "5"'),
    ("ttft_phases", [{**_PHASE, "to_p_reply_ms": {"live": "x", "sim": 1.0}}],
     'ttft_phases[0].to_p_reply_ms.live must be a finite number of ms, got "x"'),
    ("ttft_phases", [{**_PHASE, "after_p_reply_ms": 3.0}], "ttft_phases[0].after_p_reply_ms.live must be a finite "
                                                           "number of ms, got 3.0"),
    ("config", "c", "config must be an object, got 'c'"),
])
@pytest.mark.parametrize("which", ["cal", "ho"])
def test_a_malformed_phase_or_config_is_one_line_naming_the_field(tmp_path, capsys, field, value, named, which):
    """Hand-edited: exit 2, one line naming the file and field, in the calibration run's file too
    (it was a TypeError traceback from the report's formatting, or read on)."""
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    d = cal if which == "cal" else ho
    v = json.loads((d / "validate.json").read_text())
    v[field] = value
    (d / "validate.json").write_text(json.dumps(v))
    err = _refused(cal, ho, capsys)
    assert f"{which}/validate.json: {named}" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_held_out_run_given_twice_is_refused(tmp_path, capsys):
    cal = _run_dir(tmp_path, "cal")
    ho = _run_dir(tmp_path, "ho", {"session_seed": 2})
    with pytest.raises(ValueError, match=f"--held-out: {ho}/ is given twice; each held-out run once"):
        held_out_report(cal, [ho, f"{ho}/"])
    with pytest.raises(SystemExit) as ex:
        pdd_main(["sim", "validate-report", "--calibration", str(cal), "--held-out", str(ho), str(ho)])
    assert ex.value.code == 2 and "is given twice" in capsys.readouterr().err
