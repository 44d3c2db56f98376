import json

from pdd.sim.cli import main
from pdd.sim.cluster import SimConfig
from pdd.sim.plan import WanOption, search
from pdd.workload.records import generate_agentic


def test_plan_finds_cheapest_feasible():
    recs = generate_agentic(150, seed=3, rate=1.0)
    base = SimConfig(mode="pdd", wan_gbps=25.0, slo_ttft_s=3.0, slo_tpot_s=0.1, warmup_frac=0.0)
    found = search(recs, base, md_counts=(1, 2), rld_counts=(1,), wans=(WanOption(10.0, 5.0), WanOption(25.0, 9.0)),
                   p_max=4)
    assert found
    costs = [r["cost_per_hour"] for r in found]
    assert costs == sorted(costs)
    assert all(r["attainment_at_target"] >= 0.9 for r in found)


def test_cli_run_and_agentic(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["sim", "run", "--mode", "pdd", "--agentic", "120", "--rate", "1", "--n-p", "1", "--n-rld", "1",
                 "--n-md", "1", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["completed"] > 0 and "p90_ttft_ms" in s
    trace = tmp_path / "a.jsonl"
    assert main(["sim", "agentic", "--n", "300", "--out", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 300
    assert "99.5-100%" in capsys.readouterr().out


def test_search_reports_each_candidate_evaluated():
    """``pdd plan`` ran 100 s and more without a line; the search now reports (done, total) after
    each candidate (WAN option x RLD count x MD count), which the CLI's progress bar shows."""
    recs = generate_agentic(60, seed=3, rate=1.0)
    base = SimConfig(mode="pdd", wan_gbps=25.0, slo_ttft_s=3.0, slo_tpot_s=0.1, warmup_frac=0.0)
    calls = []
    search(recs, base, md_counts=(1, 2), rld_counts=(1,), wans=(WanOption(10.0, 5.0), WanOption(25.0, 9.0)),
           p_max=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


PLAN = ["plan", "--requests", "60", "--rate", "1", "--md-min", "1", "--md-max", "2", "--md-step", "1", "--rld", "1",
        "--wan", "25:9", "--p-max", "2", "--top", "1", "--slo-ttft", "3", "--slo-tpot", "0.1"]


def test_plan_shows_a_progress_bar_on_a_terminal_only_and_leaves_stdout_alone(capsys, monkeypatch):
    import sys

    rc = main(PLAN)  # stderr is not a terminal here (captured): no bar, as with --no-progress
    plain = capsys.readouterr()
    assert "candidates evaluated" not in plain.err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(PLAN) == rc
    shown = capsys.readouterr()
    assert "candidates evaluated" in shown.err and shown.out == plain.out
    assert main(PLAN + ["--no-progress"]) == rc
    quiet = capsys.readouterr()
    assert "candidates evaluated" not in quiet.err and quiet.out == plain.out


def _small_trace(tmp_path):
    from pdd.workload.records import write_trace

    path = tmp_path / "t.jsonl"
    write_trace(generate_agentic(60, seed=5, rate=1.0), path)
    return str(path)


def test_plan_trace_without_workload_replays_the_trace(tmp_path, monkeypatch, capsys):
    """``pdd plan --trace FILE`` ran the default agentic workload and never read FILE; a --trace
    given with no --workload now means --workload trace."""
    from pdd.workload import records as W

    path, read = _small_trace(tmp_path), []
    real = W.load_trace
    monkeypatch.setattr(W, "load_trace", lambda p, limit=None: read.append(p) or real(p, limit=limit))
    no_count = [x for x in PLAN if x not in ("--requests", "60")]  # a trace's requests are its records
    assert main(no_count + ["--trace", path, "--no-progress"]) == 0
    assert read and set(read) == {path}


def test_plan_requests_with_a_trace_is_refused_naming_both_flags(tmp_path, capsys):
    """``pdd plan --trace FILE --requests 60`` replayed the whole trace: --requests sizes a
    generated workload only, and was ignored silently."""
    import pytest

    path = _small_trace(tmp_path)
    for extra in (["--trace", path], ["--workload", "trace"]):
        with pytest.raises(SystemExit) as e:
            main(PLAN + extra)
        assert e.value.code == 2
        assert capsys.readouterr().err == (
            "pdd plan: error: --requests and --workload trace exclude each other: --requests N sizes a generated "
            "workload (agentic or fixed); a trace's first N records: --limit N\n")


def test_plan_trace_with_another_workload_is_refused_naming_both_flags(tmp_path, capsys):
    import pytest

    path = _small_trace(tmp_path)
    for w in ("agentic", "fixed"):
        with pytest.raises(SystemExit) as e:
            main(PLAN + ["--trace", path, "--workload", w])
        assert e.value.code == 2
        assert capsys.readouterr().err == (
            f"pdd plan: error: --trace and --workload {w} exclude each other: --trace FILE replays a trace "
            "(--workload trace, which --trace alone implies)\n")


def test_sim_run_trace_with_agentic_is_refused_naming_both_flags(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["sim", "run", "--trace", _small_trace(tmp_path), "--agentic", "50"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "pdd sim run: error: --trace and --agentic exclude each other: --agentic N generates the requests, "
        "--trace FILE replays a file\n")


def _generated_counts(monkeypatch):
    """Spy on the agentic generator: the request counts ``pdd plan`` asked it for."""
    from pdd.workload import records as W

    counts, real = [], W.generate_agentic
    monkeypatch.setattr(W, "generate_agentic", lambda n, **k: counts.append(n) or real(n, **k))
    return counts


def test_plan_agentic_n_generates_n_requests(monkeypatch, capsys):
    """``pdd plan --agentic 40`` generated ``--requests``' count (its default, 1500) instead:
    ``a.agentic`` was overwritten. N holds, with or without --workload agentic, and with
    --requests N (the same count)."""
    base = [x for x in PLAN if x not in ("--requests", "60")] + ["--no-progress"]
    for extra in ([], ["--workload", "agentic"], ["--requests", "40"]):
        counts = _generated_counts(monkeypatch)
        assert main(base + ["--agentic", "40"] + extra) in (0, 1)
        assert counts and set(counts) == {40}
    counts = _generated_counts(monkeypatch)  # --requests alone still sizes it
    assert main(base + ["--requests", "30"]) in (0, 1)
    assert counts and set(counts) == {30}


def test_plan_agentic_refuses_a_conflicting_flag_naming_both(tmp_path, capsys):
    import pytest

    path = _small_trace(tmp_path)
    cases = [
        (["--agentic", "40", "--requests", "60"],
         "--agentic 40 and --requests 60 disagree: both give the agentic workload's request count (give one)"),
        (["--agentic", "40", "--workload", "fixed"],
         "--agentic and --workload fixed exclude each other: --agentic N generates N agentic requests "
         "(--workload agentic, which --agentic alone implies)"),
        (["--agentic", "40", "--workload", "trace"],
         "--agentic and --workload trace exclude each other: --agentic N generates N agentic requests "
         "(--workload agentic, which --agentic alone implies)"),
        (["--agentic", "40", "--trace", path],
         "--trace and --agentic exclude each other: --agentic N generates the requests, --trace FILE replays a file"),
    ]
    base = [x for x in PLAN if x not in ("--requests", "60")]
    for extra, line in cases:
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        assert e.value.code == 2
        assert capsys.readouterr().err == f"pdd plan: error: {line}\n"


def _refused(capsys, argv) -> str:
    """The one error line of ``argv`` (exit 2), without its ``PROG: error: `` head."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    prog = "pdd plan" if argv[0] == "plan" else "pdd sim run"
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1
    return err[len(f"{prog}: error: "):-1]


def test_plan_refuses_a_workload_flag_its_workload_does_not_read(tmp_path, capsys):
    """``pdd plan`` took --limit and --scale-rate with a generated workload, --input-len /
    --output-len / --hit with any but the fixed one, and --max-input with the fixed one, and ran
    without them. Each is refused naming the flag; its default (not typed) is not."""
    path = _small_trace(tmp_path)
    no_count = [x for x in PLAN if x not in ("--requests", "60")]
    trace_only = ("--limit: only with a trace workload (--trace FILE or --workload trace): it takes the trace's "
                  "first N records; the {w} workload is generated (its count: --requests N)")
    fixed_only = ("{f}: only with --workload fixed (the fixed workload's prompt tokens, output tokens and prefix "
                  "hit rate); the {w} workload's requests are its own")
    cases = [
        (PLAN + ["--limit", "10"], trace_only.format(w="agentic")),
        (PLAN + ["--workload", "fixed", "--limit", "10"], trace_only.format(w="fixed")),
        (PLAN + ["--input-len", "2048"], fixed_only.format(f="--input-len", w="agentic")),
        (PLAN + ["--output-len", "64", "--hit", "0.5"], fixed_only.format(f="--output-len, --hit", w="agentic")),
        (no_count + ["--trace", path, "--hit", "0.5"], fixed_only.format(f="--hit", w="trace")),
        (PLAN + ["--workload", "fixed", "--max-input", "4096"],
         "--max-input and --workload fixed exclude each other: --max-input caps the agentic or trace workload's "
         "prompts; the fixed workload's prompt is --input-len"),
    ]
    for scaled in (PLAN, no_count + ["--trace", path], PLAN + ["--workload", "fixed"]):
        cases.append((scaled + ["--scale-rate", "2"],
                      "--scale-rate: pdd plan runs its workload at --rate (and at each rate its goodput search "
                      "tries), a trace retimed to it: a scale factor would not be read (give --rate)"))
    for argv, line in cases:
        assert _refused(capsys, argv) == line, argv


def test_plan_flags_of_the_workload_run_hold(tmp_path, monkeypatch, capsys):
    """The flags each workload reads still apply: --limit to a trace, --input-len / --output-len /
    --hit to the fixed workload."""
    from pdd.workload import records as W

    path, limits = _small_trace(tmp_path), []
    real = W.load_trace
    monkeypatch.setattr(W, "load_trace", lambda p, limit=None: limits.append(limit) or real(p, limit=limit))
    no_count = [x for x in PLAN if x not in ("--requests", "60")] + ["--no-progress"]
    assert main(no_count + ["--trace", path, "--limit", "30"]) in (0, 1)
    assert limits and set(limits) == {30}
    import pdd.workload.records as R

    fixed, real_fixed = [], R.generate_fixed
    monkeypatch.setattr(R, "generate_fixed", lambda *a, **k: fixed.append(a[2:5]) or real_fixed(*a, **k))
    assert main(PLAN + ["--no-progress", "--workload", "fixed", "--input-len", "2048", "--output-len", "64",
                        "--hit", "0.5"]) in (0, 1)
    assert fixed and set(fixed) == {(2048, 64, 0.5)}
    fixed.clear()
    assert main(PLAN + ["--no-progress", "--workload", "fixed"]) in (0, 1)  # the defaults
    assert fixed and set(fixed) == {(63 * 1024, 1024, 0.9)}


RUN = ["sim", "run", "--mode", "pdd", "--n-p", "1", "--n-rld", "1", "--n-md", "1"]


def test_sim_run_refuses_a_workload_flag_its_workload_does_not_read(tmp_path, capsys):
    """``pdd sim run --agentic N`` ignored --limit and --scale-rate; a trace replay ignored --rate
    (unless it is --load-profile ramp's peak) and --seed (unless a schedule draws arrivals); a
    rate schedule ignored --scale-rate. Each is refused naming the flag."""
    path = _small_trace(tmp_path)
    cases = [
        (RUN + ["--agentic", "50", "--limit", "10"],
         "--limit and --agentic exclude each other: --limit N takes a trace's first N records; --agentic N "
         "generates N requests"),
        (RUN + ["--agentic", "50", "--scale-rate", "2"],
         "--scale-rate and --agentic exclude each other: --scale-rate replays a trace faster; generated requests "
         "arrive at --rate"),
        (RUN + ["--trace", path, "--rate", "4"],
         "--rate: a trace replays at its own timestamps (faster or slower: --scale-rate); --rate is a generated "
         "workload's (--agentic N) or --load-profile ramp's default peak"),
        (RUN + ["--trace", path, "--load-profile", "ramp", "--peak-rate", "3", "--rate", "4"],
         "--rate: a trace replays at its own timestamps (faster or slower: --scale-rate); --rate is a generated "
         "workload's (--agentic N) or --load-profile ramp's default peak"),
        (RUN + ["--trace", path, "--seed", "3"],
         "--seed: a trace replays as recorded; --seed draws a generated workload (--agentic N) or a load "
         "profile's arrivals"),
        (RUN + ["--rate-schedule", "0:1,10:2", "--scale-rate", "2"],
         "--scale-rate and --rate-schedule exclude each other: the schedule sets every arrival time"),
        (RUN + ["--agentic", "50", "--load-profile", "ramp", "--scale-rate", "2"],
         "--scale-rate and --agentic exclude each other: --scale-rate replays a trace faster; generated requests "
         "arrive at --rate"),
        (RUN + ["--load-profile", "ramp", "--scale-rate", "2"],
         "--scale-rate and --load-profile exclude each other: the schedule sets every arrival time"),
        # generated requests on a schedule: --rate changed nothing (the same output at 0.5, 3 and 50 req/s)
        (RUN + ["--agentic", "20", "--rate", "3", "--rate-schedule", "0:1,4:2"],
         "--rate: --rate-schedule sets every arrival time of the generated requests; --rate is read only as "
         "--load-profile ramp's peak when --peak-rate is not given"),
        (RUN + ["--agentic", "20", "--rate", "3", "--load-profile", "ramp", "--peak-rate", "2"],
         "--rate: --load-profile sets every arrival time of the generated requests; --rate is read only as "
         "--load-profile ramp's peak when --peak-rate is not given"),
    ]
    for argv, line in cases:
        assert _refused(capsys, argv) == line, argv


def test_sim_run_workload_flags_that_apply_hold(tmp_path, capsys):
    """--rate as a trace ramp's peak, --seed with a schedule, --scale-rate and --limit on a trace:
    each runs, and the summary's arguments hold what ran (the defaults where none was typed)."""
    path = _small_trace(tmp_path)
    out = tmp_path / "s.json"
    for extra in (["--trace", path, "--load-profile", "ramp", "--phase-seconds", "1:1:1:1", "--rate", "4",
                   "--seed", "2"],
                  ["--trace", path, "--limit", "20", "--scale-rate", "2"],
                  ["--agentic", "30", "--load-profile", "ramp", "--phase-seconds", "1:1:1:1", "--rate", "3"],
                  ["--agentic", "30", "--rate", "3", "--seed", "1"]):
        assert main(RUN + extra + ["--json", str(out)]) == 0
    args = json.loads(out.read_text())["arguments"]
    assert (args["agentic"], args["rate"], args["seed"], args["scale_rate"], args["limit"]) == (30, 3.0, 1, 1.0, None)
    assert main(RUN + ["--trace", path, "--json", str(out)]) == 0
    args = json.loads(out.read_text())["arguments"]
    assert (args["rate"], args["seed"], args["scale_rate"]) == (2.0, 0, 1.0)
