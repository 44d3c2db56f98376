"""`pdd sim ...` / `pdd workload ...`: bad input is an argparse-style `error: ...` naming the flag
(exit 2), never a traceback or a silently different run. Found by a new user; none of these
simulates anything (they fail before), so they are fast."""

import json
from pathlib import Path

import pytest

from pdd.cli import main as pdd_main
from pdd.sim.cli import UsageError, experiment_params
from pdd.sim.cli import main as sim_main
from pdd.workload.records import load_trace
from tests.cli_usage import usage_error


def _refused(capsys, argv, *names, entry=pdd_main):
    err = usage_error(capsys, entry, argv)
    for n in names:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("args,names", [
    (["--trace", "/nonexistent.jsonl"], ["--trace", "no such file: /nonexistent.jsonl"]),
    (["--model", "nosuch"], ["--model", "unknown model 'nosuch'", "llama-3.1-8b"]),
    (["--chip-a", "NOPE"], ["--chip-a", "unknown chip 'NOPE'", "H100-SXM5-80GB"]),
    (["--chip-b", "NOPE"], ["--chip-b", "unknown chip 'NOPE'"]),
    (["--wan-gbps", "0", "--limit", "5"], ["--wan-gbps", "must be a finite number > 0, got 0"]),
    (["--wan-gbps", "nan"], ["--wan-gbps", "must be a finite number > 0, got nan"]),
    (["--rate", "-1", "--agentic", "5"], ["--rate", "must be a finite number > 0, got -1"]),
    (["--limit", "-3"], ["--limit", "must be >= 1"]),
    (["--limit", "0"], ["--limit", "must be >= 1"]),
    (["--agentic", "-5"], ["--agentic", "must be >= 1"]),
    (["--agentic", "0"], ["--agentic", "must be >= 1"]),  # ran the whole bundled trace (12,031 requests)
    (["--scale-rate", "0"], ["--scale-rate", "must be a finite number > 0, got 0"]),
    # passed "> 0": with --autoscale the simulated span's decision ticks never ended
    (["--rate", "1e-9", "--agentic", "5"], ["argument --rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"]),
    (["--scale-rate", "1e-9"], ["argument --scale-rate: must be >= 0.001 (a replay at most 1000 times slower than "
                                "the trace; a slower one's run would not end), got 1e-09"]),
    (["--n-md", "-1"], ["--n-md", "must be >= 0"]),
    (["--slo-ttft", "0"], ["--slo-ttft", "must be a finite number > 0, got 0"]),
    (["--limit", "abc"], ["--limit", "not an integer: 'abc'"]),
    (["--budget-ms", "inf"], ["--budget-ms", "must be a finite number >= 0, got inf"]),
    # an instance count or a generated workload past these took minutes and gigabytes before the run
    # (99999999999999999999: a hang)
    (["--n-md", "10001", "--limit", "3"], ["argument --n-md: must be at most 10,000 (instances of one tier), got 10001"]),
    (["--agentic", "1000001"], ["argument --agentic: must be at most 1,000,000 (requests of a generated workload), "
                                "got 1000001"]),
    (["--agentic", "3", "--autoscale", "md=10001"], ["--autoscale: 'md=10001': at most 10,000 instances of one tier"]),
    # said "the model's weights leave no KV room", as if the weights did not fit
    (["--kv-bytes-per-token", "99999999999999999999", "--limit", "3"],
     ["P0: no KV room on H100-SXM5-80GB: what the model's weights leave holds no token of "
      "99,999,999,999,999,999,999 KV bytes"]),
])
def test_sim_run_refuses_bad_flags(capsys, args, names):
    _refused(capsys, ["sim", "run"] + args, "pdd sim run: error:", *names)


def test_sim_run_names_the_file_and_line_of_a_bad_trace(capsys, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# pdd\n\nnot a trace\n")
    _refused(capsys, ["sim", "run", "--trace", str(readme)], "--trace", f"{readme}, line 1", "not a JSON record")
    t = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
    t.write_text(json.dumps(good) + "\n\n" + json.dumps({"timestamp": 1}) + "\n")
    _refused(capsys, ["sim", "run", "--trace", str(t)], f"{t}, line 3", "'input_length'")
    t.write_text("[1, 2]\n")
    _refused(capsys, ["sim", "run", "--trace", str(t)], f"{t}, line 1", "not a JSON object")
    t.write_bytes(b"\x87\xff\x00binary")
    _refused(capsys, ["sim", "run", "--trace", str(t)], f"{t}: not UTF-8 text")
    _refused(capsys, ["sim", "run", "--trace", str(tmp_path)], "--trace", "is a directory, not a file")
    # the stand-alone entry (python -m pdd.sim.cli) and pdd plan say the same
    _refused(capsys, ["sim", "run", "--trace", str(readme)], f"{readme}, line 1", entry=sim_main)
    _refused(capsys, ["plan", "--workload", "trace", "--trace", str(readme)], "pdd plan: error:",
             f"{readme}, line 1")


def test_load_trace_errors_name_file_and_line(tmp_path):
    t = tmp_path / "x.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}\n{oops\n')
    assert len(load_trace(t, limit=1)) == 1  # stops before the bad line
    with pytest.raises(ValueError, match=r"x\.jsonl, line 2: not a JSON record"):
        load_trace(t)


def test_sim_run_refusal_by_the_simulator_is_a_usage_error(capsys):
    _refused(capsys, ["sim", "run", "--n-p", "0", "--limit", "3"], "pdd sim run: error: --n-p 0: pdd mode needs at least one P")


@pytest.mark.parametrize("argv,line", [
    (["sim", "run", "--n-md", "0"], "pdd sim run: error: --n-md 0: pdd mode needs at least one MD instance"),
    (["sim", "run", "--mode", "pdd", "--n-rld", "0"], "pdd sim run: error: --n-rld 0: pdd mode needs at least one "
                                                      "RLD instance"),
    (["sim", "run", "--mode", "colocated", "--n-c", "0"], "pdd sim run: error: --n-c 0: colocated mode needs at "
                                                          "least one C instance"),
])
def test_an_instance_count_of_zero_names_its_flag(capsys, argv, line):
    """Found by a new user: ``--n-md 0`` was "MD needs at least one instance", naming no flag."""
    assert usage_error(capsys, pdd_main, argv) == line + "\n"


@pytest.mark.parametrize("argv,prog,message", [
    (["sim", "run", "--n-md", "x"], "pdd sim run", "argument --n-md: not an integer: 'x'"),
    (["plan", "--wan-gbps", "fast"], "pdd plan", "argument --wan-gbps: "),
    # an unknown flag is the sub-command's (it was "pdd: error: unrecognized arguments")
    (["sim", "run", "--bogus"], "pdd sim run", "unrecognized arguments: --bogus"),
    (["plan", "--bogus", "1"], "pdd plan", "unrecognized arguments: --bogus 1"),
    (["serve", "--port", "x"], "pdd serve", "argument --port: invalid int value: 'x'"),
])
def test_an_argparse_refusal_is_one_usage_line_then_the_error(capsys, argv, prog, message):
    """Found by a new user: ``pdd sim run`` and ``pdd plan`` printed their whole usage (30-37
    lines) before the line naming the flag; ``pdd bench`` and ``pdd demo`` print one line pointing
    at --help (``cli_args.ShortUsageParser``, now ``pdd``'s parser and so every sub-command's)."""
    usage, err = usage_error(capsys, pdd_main, argv).splitlines()
    assert usage == f"usage: {prog} [-h] [options]  (see {prog} --help)"
    assert err.startswith(f"{prog}: error: {message}"), err


@pytest.mark.parametrize("sets,names", [
    (["foo=bar"], ["unknown key 'foo' for experiment ttft", "valid keys: rate, wan_gbps"]),
    (["noequals"], ["'noequals': expected KEY=VALUE", "valid keys: rate, wan_gbps"]),
    (["rate=abc"], ["'rate=abc': rate takes a number, got 'abc'"]),
])
def test_sim_experiment_refuses_bad_set(capsys, tmp_path, sets, names):
    argv = ["sim", "experiment", "ttft", "--quick", "--out", str(tmp_path / "x")]
    for s in sets:
        argv += ["--set", s]
    _refused(capsys, argv, "pdd sim experiment: error: --set", *names)
    assert not (tmp_path / "x").exists()  # nothing ran


@pytest.mark.parametrize("name,kv,message", [
    # each ran: a ZeroDivisionError / ValueError / KeyError traceback, chunk=0 never ended, and
    # premium=-2 / hit=2 printed tables of negative prices and KV
    ("ttft", "rate=0", "rate must be a finite number > 0, got 0"),
    ("ttft", "rate=-1", "rate must be a finite number > 0, got -1"),
    ("ttft", "rate=1e-9", "rate must be >= 0.001 req/s"),
    ("ttft", "wan_gbps=0", "wan_gbps must be a finite number > 0, got 0"),
    ("ttft", "wan_gbps=nan", "wan_gbps must be a finite number > 0, got nan"),
    ("bathtub", "inp=0", "inp must be a finite number > 0, got 0"),
    ("bathtub", "chunk=0", "chunk must be a finite number > 0, got 0"),
    ("bathtub", "model=nosuch", "model 'nosuch' is not a known model; known: llama-3.1-70b, "),
    ("cost-table", "chip_b=NOPE", "chip_b 'NOPE' is not a known chip; known: A100-SXM4-80GB, "),
    ("cost-table", "premium=-2", "premium must be a finite number > -1 (GPU-B's price is GPU-A's x (1 + premium)), got -2"),
    ("cost-table", "hit=2", "hit must be in [0, 1], got 2"),
    ("cost-table", "price_a=-1", "price_a must be a finite number >= 0, got -1"),
    ("cost-ceiling", "pairs=garbage", "pairs takes comma-separated CHIP_A/CHIP_B pairs of known chips, got 'garbage'"),
    ("cost-ceiling", "kv_bytes=0", "kv_bytes must be a finite number > 0, got 0"),
    ("cost-ceiling", "tpot_ms=50,0", "tpot_ms takes comma-separated numbers > 0, got '0'"),
    ("calibrate", "profile=/nonexistent", "profile is not a file: /nonexistent"),
])
def test_sim_experiment_refuses_a_set_value_it_cannot_run(capsys, tmp_path, name, kv, message):
    out = tmp_path / "x"
    err = _refused(capsys, ["sim", "experiment", name, "--quick", "--out", str(out), "--set", kv])
    assert err.strip().splitlines()[-1].startswith(f"pdd sim experiment: error: --set {kv!r}: {message}"), err
    assert not out.exists()  # nothing ran


def test_experiment_params_take_valid_edge_values():
    assert experiment_params("cost-table", ["hit=0", "premium=-0.5", "price_a=0", "chip_a=H100-SXM5-80GB"]) == {
        "hit": 0, "premium": -0.5, "price_a": 0, "chip_a": "H100-SXM5-80GB"}
    assert experiment_params("cost-ceiling", ["pairs=H100-SXM5-80GB/H20-96GB", "tpot_ms=0.5,100"]) == {
        "pairs": "H100-SXM5-80GB/H20-96GB", "tpot_ms": "0.5,100"}


def test_experiment_params_convert_by_the_parameter_type():
    assert experiment_params("cost-table", ["premium=0.3", "chip-b=MI300X", "price_a=none", "hit=1"]) == {
        "premium": 0.3, "chip_b": "MI300X", "price_a": None, "hit": 1.0}
    assert experiment_params("bathtub", ["inp=4096"]) == {"inp": 4096}
    assert experiment_params("cost-ceiling", ["tpot_ms=50,100", "kv_bytes=4096"]) == {
        "tpot_ms": "50,100", "kv_bytes": 4096}
    with pytest.raises(UsageError, match="premium takes a number"):
        experiment_params("cost-table", ["premium=abc"])
    with pytest.raises(UsageError, match="inp takes an integer"):
        experiment_params("bathtub", ["inp=1.5"])
    with pytest.raises(UsageError, match="experiment goodput takes no --set keys"):
        experiment_params("goodput", ["premium=0.3"])


@pytest.mark.parametrize("argv,names", [
    (["workload", "agentic", "--n", "0", "--out", "x.jsonl"], ["pdd workload agentic: error:", "--n", ">= 1"]),
    (["workload", "agentic", "--rate", "0"], ["--rate", "must be a finite number > 0, got 0"]),
    (["workload", "agentic", "--rate", "1e-9"], ["pdd workload agentic: error: argument --rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"]),
    (["sim", "agentic", "--rate", "1e-9"], ["pdd sim agentic: error: argument --rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"]),
    (["plan", "--rate", "1e-9"], ["pdd plan: error: argument --rate: must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"]),
    (["sim", "agentic", "--n", "-2"], ["pdd sim agentic: error:", "--n", ">= 1"]),
])
def test_workload_agentic_refuses_bad_counts(capsys, tmp_path, monkeypatch, argv, names):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, argv, *names)
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("out,message", [
    ("/nonexistent/dir/x.jsonl", "--out /nonexistent/dir/x.jsonl: no such directory: /nonexistent/dir"),
    ("DIR", "--out DIR: is a directory; give a file path"),
])
def test_workload_agentic_refuses_an_out_it_cannot_write(capsys, tmp_path, monkeypatch, out, message):
    """Found by a new user: the workload was generated, then open() failed with a traceback."""
    import pdd.workload.records

    monkeypatch.setattr(pdd.workload.records, "generate_agentic", lambda *a, **k: pytest.fail("generated first"))
    out = out.replace("DIR", str(tmp_path))
    message = message.replace("DIR", str(tmp_path))
    err = _refused(capsys, ["workload", "agentic", "--n", "5", "--out", out])
    assert err.endswith(f"pdd workload agentic: error: {message}\n"), err


@pytest.mark.parametrize("args", [["--md-min", "3", "--md-max", "1"], ["--md-step", "0"], ["--md-min", "0"]])
def test_plan_refuses_an_empty_md_range(capsys, args):
    """Found by a new user: an empty range said "no configuration meets the SLO" after a search."""
    _refused(capsys, ["plan"] + args, "pdd plan: error:", "--md-min", "empty")


@pytest.mark.parametrize("json_out,message", [
    # the search ran (minutes) and then writing the JSON into a directory was an IsADirectoryError traceback
    ("DIR", "pdd plan: error: --json DIR: is a directory; give a file path"),
    ("DIR/no/x.json", "pdd plan: error: --json DIR/no/x.json: no such directory: DIR/no"),
])
def test_plan_checks_its_json_before_the_search(capsys, tmp_path, monkeypatch, json_out, message):
    import pdd.sim.plan

    monkeypatch.setattr(pdd.sim.plan, "search", lambda *a, **k: pytest.fail("the search ran"))
    err = _refused(capsys, ["plan", "--json", json_out.replace("DIR", str(tmp_path))])
    assert err.splitlines()[-1] == message.replace("DIR", str(tmp_path))


@pytest.mark.parametrize("args,names", [
    (["--wan", "-1"], ["--wan", "GBPS:USD_PER_HOUR", "'-1'"]),
    (["--wan", "abc"], ["--wan", "'abc'"]),
    (["--wan", "1:x"], ["--wan", "'1:x'"]),
    (["--wan", "0:0"], ["--wan", "GBPS > 0"]),
    (["--wan", "10:5,-2:3"], ["--wan", "'-2:3'"]),
    (["--rld", "a"], ["--rld", ">= 1"]),
    (["--rld", "0"], ["--rld", ">= 1"]),
])
def test_plan_refuses_bad_wan_and_rld_lists(capsys, args, names):
    """Found by a new user: a malformed --wan was an IndexError / ValueError traceback, and
    --wan 0:0 a ZeroDivisionError from inside the simulator."""
    _refused(capsys, ["plan"] + args, "pdd plan: error:", *names)


@pytest.mark.parametrize("args,message", [
    (["--requests", "-3"], "argument --requests: must be >= 1, got -3"),
    (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["--input-len", "0"], "argument --input-len: must be >= 1, got 0"),
    (["--input-len", "-5"], "argument --input-len: must be >= 1, got -5"),
    (["--output-len", "-1"], "argument --output-len: must be >= 0, got -1"),
    (["--p-max", "0"], "argument --p-max: must be >= 1, got 0"),
    (["--hit", "2"], "argument --hit: must be a finite number in [0, 1], got 2"),
    (["--hit", "-0.5"], "argument --hit: must be a finite number in [0, 1], got -0.5"),
    (["--hit", "nan"], "argument --hit: must be a finite number in [0, 1], got nan"),
    (["--top", "0"], "argument --top: must be >= 1, got 0"),
    (["--top", "-1"], "argument --top: must be >= 1, got -1"),
    # past these the search, the workload or its instances took hours or all the memory (1e20: a hang)
    (["--requests", "1000001"], "argument --requests: must be at most 1,000,000 (requests of a generated workload), "
                                "got 1000001"),
    (["--workload", "fixed", "--input-len", "10000001"],
     "argument --input-len: must be at most 10,000,000 (prompt tokens), got 10000001"),  # 1e20: a MemoryError
    (["--p-max", "10001"], "argument --p-max: must be at most 10,000 (instances of one tier), got 10001"),
    (["--requests", "3", "--md-min", "10001", "--md-max", "10001"], "--md-max 10001: at most 10,000 (instances of "
                                                                    "one tier)"),
    (["--requests", "3", "--rld", "10001"], "--rld '10001': at most 10,000 (instances of one tier)"),
])
def test_plan_refuses_bad_numbers_naming_the_flag(capsys, args, message):
    """Found by a new user: --requests 0 searched for minutes, --hit 2 / --top 0 were tracebacks or
    silently empty tables."""
    err = _refused(capsys, ["plan"] + args, "pdd plan: error:")
    assert err.endswith(f"pdd plan: error: {message}\n"), err


def test_sim_run_profile_is_both_chips_unless_one_is_given():
    """`pdd sim run --profile X` was "ambiguous option: --profile could match --profile-a,
    --profile-b"; it now gives both chips X (as `pdd sim validate --profile`), and a per-chip flag
    still wins for its chip."""
    import argparse

    from pdd.sim import cli

    ap = argparse.ArgumentParser(prog="pdd")
    cli.add_sim_parser(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["sim", "run", "--profile", "m.json"])
    assert cli._profiles(a) == ("m.json", "m.json")
    a = ap.parse_args(["sim", "run", "--profile", "m.json", "--profile-b", "b.json"])
    assert cli._profiles(a) == ("m.json", "b.json")


def test_sim_run_max_input_caps_an_over_long_prompt(capsys, tmp_path):
    """`pdd sim run --profile data/profiles/this-machine.json` on the shared trace stopped at its
    87k-token request (the CPU profile's pool holds 32,768 tokens) with no way round it. The error
    now names --max-input, which clips prompts as `pdd bench --max-input` does (whole trailing
    512-token blocks dropped; no request dropped)."""
    from pdd.workload.records import REPO_ROOT

    profile = str(REPO_ROOT / "data" / "profiles" / "this-machine.json")
    t = tmp_path / "t.jsonl"
    recs = [{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
            {"timestamp": 100, "input_length": 40000, "output_length": 4, "hash_ids": list(range(10, 89))}]
    t.write_text("".join(json.dumps(r) + "\n" for r in recs))
    argv = ["sim", "run", "--profile", profile, "--trace", str(t)]
    _refused(capsys, argv, "pdd sim run: error: request 1: 40000 prompt + 4 output tokens do not fit the KV pool "
                           "of one P instance (32768 tokens); cap the prompts with --max-input 32764 or less")
    _refused(capsys, argv + ["--max-input", "40000"], "--max-input 32764 or less (--max-input 40000 is above that)")
    _refused(capsys, argv + ["--max-input", "0"], "--max-input", "must be >= 1")
    out = tmp_path / "s.json"
    assert pdd_main(argv + ["--max-input", "32764", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert (s["requests"], s["completed"]) == (2, 2)
    t.write_text(json.dumps({**recs[0], "output_length": 40000}) + "\n")
    _refused(capsys, argv, "600 prompt + 40000 output tokens do not fit the KV pool of one RLD instance (32768 "
                           "tokens); no prompt cap helps: the longest output alone does not fit")


def test_cap_input_drops_whole_trailing_blocks_as_bench_does():
    from pdd.workload.replay import Scale
    from pdd.workload.records import cap_input

    recs = [{"timestamp": 0, "input_length": 1300, "output_length": 4, "hash_ids": [1, 2, 3]},
            {"timestamp": 1, "input_length": 300, "output_length": 4, "hash_ids": [4]}]
    assert cap_input(recs, 1100) == [{**recs[0], "input_length": 1024, "hash_ids": [1, 2]}, recs[1]]
    assert cap_input(recs, 200) == [{**recs[0], "input_length": 200, "hash_ids": [1]},
                                    {**recs[1], "input_length": 200}]
    assert recs[0]["input_length"] == 1300  # the records given are not changed
    # the same lengths as pdd bench --max-input at 512 tokens a block (no scaling)
    for cap in (1100, 200, 1300):
        s = Scale(block_tokens=512, max_input_tokens=cap)
        assert [r["input_length"] for r in cap_input(recs, cap)] == [s.input_tokens(1300, 3), s.input_tokens(300, 1)]


def test_sim_run_refuses_an_empty_trace_and_a_directory(capsys, tmp_path):
    """An empty trace printed 'simulated 0 requests' with exit 0 (pdd bench and pdd plan refuse
    it); a directory was 'no such file'."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _refused(capsys, ["sim", "run", "--trace", str(empty)], "--trace", f"{empty} holds no trace records")
    _refused(capsys, ["sim", "run", "--trace", str(tmp_path)], "--trace", f"{tmp_path} is a directory, not a file")


@pytest.mark.parametrize("argv", [["sim", "validate", "--out", "OUT"], ["profile", "--out", "OUT/p.json"]])
def test_validate_and_profile_name_a_bad_config_field_without_a_traceback(capsys, tmp_path, argv):
    # as pdd serve does: a new user's `md_predicted_send: 3` got a pydantic traceback here
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  md_predicted_send: 3\n")
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    with pytest.raises(SystemExit) as ex:
        pdd_main(argv + ["--config", str(cfg)])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    prog = "pdd sim validate" if argv[0] == "sim" else "pdd profile"
    assert err.startswith(f"{prog}: error: --config {cfg}: invalid config: policy.md_predicted_send: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    # a role given twice (either spelling) kept the last; `md=4 md=2` was "unrecognized arguments: md=2"
    (["--autoscale", "md=4", "md=2"], "--autoscale: main_decode given twice ('md=4' and 'md=2'); give each role once"),
    (["--autoscale", "md=4,main_decode=2"],
     "--autoscale: main_decode given twice ('md=4' and 'main_decode=2'); give each role once"),
    (["--autoscale", "md=2", "--autoscale-min", "rld=1", "relay_decode=1"],
     "--autoscale-min: relay_decode given twice ('rld=1' and 'relay_decode=1'); give each role once"),
    (["--autoscale", ""], "--autoscale: expected ROLE=N with ROLE one of p, rld, md (or prefill, relay_decode, "
                          "main_decode) and N >= 1, e.g. md=3, got ''"),  # "" ran without the loop
    (["--autoscale-min", "md=1"],  # was ignored
     "--autoscale-min: only with --autoscale (the autoscaling loop's settings; without --autoscale no loop runs)"),
    # the loop's other settings were ignored too without --autoscale
    (["--autoscale-interval", "10", "--autoscale-cooldown", "5"],
     "--autoscale-interval, --autoscale-cooldown: only with --autoscale (the autoscaling loop's settings; without "
     "--autoscale no loop runs)"),
    (["--autoscale-start-s", "0"],
     "--autoscale-start-s: only with --autoscale (the autoscaling loop's settings; without --autoscale no loop runs)"),
    # the loop's settings name the flag that set them (they named AutoscaleConfig's fields)
    (["--autoscale", "md=3", "--autoscale-down-at", "0.5"],
     "--autoscale-down-at: 0.5 must be < --autoscale-up-at / 2 = 0.375 (hysteresis: no flapping)"),
    (["--autoscale", "md=3", "--autoscale-up-at", "1.5"], "--autoscale-up-at: Input should be less than or equal to 1"),
    # a vanishing sample period or interval ran on for minutes (a sample event every 1e-9 s)
    (["--autoscale", "md=3", "--autoscale-sample", "1e-9"],
     "--autoscale-sample: Input should be greater than or equal to 0.01"),
    (["--autoscale", "md=3", "--autoscale-interval", "1e-6"],
     "--autoscale-interval: Input should be greater than or equal to 0.1"),
    # a sample period past the interval decided on no sample (utilisation 0: a drain)
    (["--autoscale", "md=3", "--autoscale-sample", "100", "--autoscale-interval", "1"],
     "--autoscale-sample: 100 must be <= --autoscale-interval (1): a decision reads the load sampled within its "
     "interval"),
    (["--cross-traffic", ""], "--cross-traffic: no seconds:Gbit/s point in ''"),  # "" ran with none
    (["--rate-schedule", "0:1,inf:2"], "--rate-schedule: times must be finite seconds, got inf"),
])
def test_sim_run_refuses_duplicate_roles_and_empty_values(capsys, args, message):
    _refused(capsys, ["sim", "run", "--agentic", "5"] + args, f"pdd sim run: error: {message}\n")


def test_sim_run_autoscale_takes_both_role_spellings():
    """p/rld/md and the config's role names, comma- or space-separated."""
    import argparse

    from pdd.sim.cli import _autoscale_config, _autoscale_flags, add_sim_parser

    ap = argparse.ArgumentParser()
    add_sim_parser(ap.add_subparsers())
    for spec in (["md=3", "relay_decode=2"], ["main_decode=3,rld=2"]):
        a = ap.parse_args(["sim", "run", "--autoscale", *spec, "--autoscale-min", "prefill=1"])
        _autoscale_flags(a)
        acfg = _autoscale_config(a)
        assert acfg.max == {"main_decode": 3, "relay_decode": 2} and acfg.min == {"prefill": 1}


def test_calibrate_roles_without_the_run_s_model_is_a_usage_error(capsys, tmp_path, monkeypatch):
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # no models/small here; the run and the profile are fine
    _refused(capsys, ["sim", "calibrate-roles", "--run", str(root / "data" / "validation" / "cal-a"),
                      "--profile", str(root / PROFILE), "--out", str(tmp_path / "fit.json")],
             "error:", "no checkpoint at models/small", "pdd make-model")


def test_calibrate_roles_names_a_bad_run_or_profile_before_the_missing_model(capsys, tmp_path, monkeypatch):
    """A bad --run or --profile is named first, whether or not the model checkpoint exists (in a
    fresh clone the test of a hand-edited profile ran before any test had made the model, and got
    the checkpoint's error instead)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # no models/small here
    _refused(capsys, ["sim", "calibrate-roles", "--run", str(tmp_path), "--profile", str(root / PROFILE)],
             "error:", "--run", str(tmp_path))
    _refused(capsys, ["sim", "calibrate-roles", "--run", str(root / "data" / "validation" / "cal-a"),
                      "--profile", str(tmp_path / "p.json")], "error:", "--profile", "p.json")


@pytest.mark.parametrize("args,message", [
    # a count: "a finite number > 0" read as if 0.5 would do
    (["--requests", "0"], "--requests must be an integer >= 1, got 0"),  # was exit 1, no `error:`
    (["--block-tokens", "-2"], "--block-tokens must be an integer >= 1, got -2"),
    (["--rate", "nan"], "--rate must be a finite number > 0, got nan"),
    (["--rate", "1e-9"], "--rate must be >= 0.001 req/s (one request per 1000 s on average; a lower rate's run would take hours), got 1e-09"),  # passed "> 0": a live run spanning centuries
    # these were tracebacks from the workload's Scale: `ValueError: session_sample must be >= 1`, ...
    (["--session-sample", "0"], "--session-sample must be an integer >= 1, got 0"),
    (["--max-output-tokens", "0"], "--max-output-tokens must be an integer >= 1, got 0"),
    # the live topology's pipeline budget: NaN or negative reached its config unchecked
    (["--budget-ms", "nan"], "--budget-ms must be a finite number >= 0, got nan"),
    (["--budget-ms", "-1"], "--budget-ms must be a finite number >= 0, got -1.0"),
])
def test_validate_refuses_bad_workload_numbers_naming_the_flag(capsys, tmp_path, monkeypatch, args, message):
    import pdd.bench.live_validate as lv

    monkeypatch.setattr(lv, "run_validate", lambda *a, **k: pytest.fail("the validation ran"))
    err = _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), *args])
    assert err == f"pdd sim validate: error: {message}\n"
    assert not (tmp_path / "v").exists()


def test_validate_live_from_another_workload_is_a_usage_error(capsys, tmp_path, monkeypatch):
    import pdd.bench.live_validate as lv
    from pdd.sim.recorded import WorkloadMismatch

    def mismatch(*a, **k):
        raise WorkloadMismatch("live run has 40 requests, the workload 220: not the same workload")

    monkeypatch.setattr(lv, "run_validate", mismatch)
    _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(tmp_path)],
             "error:", f"--live-from {tmp_path}", "not the same workload")


def _record(**fields):
    """A completed request's record as the bench client writes it, with the gateway's ``pdd``
    block (its per-request events, ms from arrival)."""
    return {"ok": True, "send_s": 0.0, "token_times_s": [0.1],
            "pdd": {"events_ms": {"p_first_token": 80.0, "first_token": 90.0}}, **fields}


def _recorded_run(d, *, rate=0.8, n=2, budget=250.0):
    """A minimal `pdd sim validate --out` directory: validate.json's workload and budget, n request
    records, server stats."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "validate.json").write_text(json.dumps({
        "workload": {"requests": n, "rate_rps": rate, "block_tokens": 64, "session_sample": 50, "session_seed": 0,
                     "max_output_tokens": 320, "seed": 0},
        "config": {"pipeline_ttft_budget_ms": budget}}))
    (d / "requests.jsonl").write_text("".join(json.dumps(_record()) + "\n" for _ in range(n)))
    (d / "server_stats.json").write_text("{}")
    return d


def _fake_model_config(tmp_path):
    """A config whose model_path holds a config.json: the CLIs' checkpoint checks pass, and every
    case below is refused before the model is read."""
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"model_path: {m}\n")
    return str(cfg)


PROFILE = "data/profiles/this-machine.json"


@pytest.mark.parametrize("case,flag,message", [
    ("missing", "--run", "no such directory"),
    ("a_file", "--run", "not a directory"),
    ("empty", "--run", "no validate.json in it"),
    ("bad_validate", "--run", "validate.json: not JSON"),
    ("bad_line", "--run", "requests.jsonl line 2: not JSON"),
    ("no_stats", "--run", "no server_stats.json in it"),
    ("profile_missing", "--profile", "no such file"),
    ("profile_list", "--profile", "not a pdd-profile/1 profile (a JSON list, not an object)"),
    ("profile_dir", "--profile", "is a directory"),
    ("profile_bad_factor", "--profile", "decode_interference['RLD'] must be a finite number >= 1, got 0.5"),
    ("profile_bad_scale", "--profile", "role_step_scale must be an object of role -> number, got 1.5"),
    ("profile_bad_rtt", "--profile", "gateway_rtt_ms must be a finite number > 0, got 'fast'"),
    ("profile_bad_delay", "--profile", "client_delay_s must be a finite number >= 0, got -1"),
    ("profile_bad_fast_path", "--profile", "fast_path must be an object with gbps > 0 and latency_s >= 0, got 'x'"),
    ("out_dir_missing", "--out", "no such directory"),
    ("all_failed", "--run", "no completed request to fit (2 failed: ConnectionResetError)"),
    ("stats_not_object", "--run", "stats must be an object with an 'instances' object"),
    ("busy_not_number", "--run", "stats.instances.p0.engine_busy_s must be a number, got 'x'"),
    ("requests_text", "--run", "workload.requests must be a number, got '100'"),
    ("lost_instance", "--run", "the live run lost an instance (md0 unreachable at the run's end; 1 of 2 requests "
                               "degraded (an instance lost mid-run)): not a calibration run"),
    ("no_records", "--run", "no request to fit (its requests.jsonl has no records)"),
])
def test_calibrate_roles_bad_run_or_profile_is_one_line(capsys, tmp_path, case, flag, message):
    """A run directory or profile calibrate-roles cannot use: `error: FLAG: PATH: why` (exit 2),
    not a FileNotFoundError / JSONDecodeError / AttributeError traceback; nothing is fitted."""
    run = _recorded_run(tmp_path / "run")
    profile, out = PROFILE, str(tmp_path / "out.json")
    if case == "missing":
        run = tmp_path / "nosuch"
    elif case == "a_file":
        run = run / "validate.json"
    elif case == "empty":
        run = tmp_path / "empty"
        run.mkdir()
    elif case == "bad_validate":
        (run / "validate.json").write_text("{not json")
    elif case == "bad_line":
        (run / "requests.jsonl").write_text(json.dumps(_record()) + "\n{oops\n")
    elif case == "no_stats":
        (run / "server_stats.json").unlink()
    elif case == "profile_missing":
        profile = str(tmp_path / "nosuch.json")
    elif case == "profile_list":
        profile = str(tmp_path / "list.json")
        (tmp_path / "list.json").write_text("[1, 2]")
    elif case == "profile_dir":
        profile = str(run)
    elif case.startswith("profile_bad_"):  # a hand-edited fit
        prof = json.loads(Path(PROFILE).read_text())
        prof.update({"profile_bad_factor": {"decode_interference": {"RLD": 0.5}},
                     "profile_bad_scale": {"role_step_scale": 1.5},
                     "profile_bad_rtt": {"gateway_rtt_ms": "fast"},
                     "profile_bad_delay": {"client_delay_s": -1},
                     "profile_bad_fast_path": {"fast_path": "x"}}[case])
        profile = str(tmp_path / "bad.json")
        (tmp_path / "bad.json").write_text(json.dumps(prof))
    elif case == "out_dir_missing":
        out = str(tmp_path / "nosuch" / "out.json")
    elif case == "stats_not_object":
        (run / "server_stats.json").write_text('{"stats": 5}')
    elif case == "busy_not_number":
        (run / "server_stats.json").write_text(json.dumps({"stats": {"instances": {"p0": {"engine_busy_s": "x"}}}}))
    elif case == "requests_text":
        v = json.loads((run / "validate.json").read_text())
        v["workload"]["requests"] = "100"
        (run / "validate.json").write_text(json.dumps(v))
    elif case == "lost_instance":  # MD killed mid-run: the gateway finished on a fallback path
        (run / "requests.jsonl").write_text(json.dumps(_record(pdd={"degraded": True})) + "\n"
                                            + json.dumps(_record()) + "\n")
        (run / "server_stats.json").write_text(json.dumps({"flush": {"unreachable": ["md0"]}}))
    elif case == "all_failed":  # a killed topology: nothing to fit, and no profile written
        (run / "requests.jsonl").write_text("".join(json.dumps({"ok": False, "error": "ConnectionResetError"}) + "\n"
                                                    for _ in range(2)))
    elif case == "no_records":  # an empty requests.jsonl: not "0 failed"
        (run / "requests.jsonl").write_text("")
    _refused(capsys, ["sim", "calibrate-roles", "--run", str(run), "--profile", profile, "--out", out,
                      "--config", _fake_model_config(tmp_path)],
             "pdd sim calibrate-roles: error:", f"{flag}", message)
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("kv", [0, -5, 2.5, "x", True, None, float("inf")])
@pytest.mark.parametrize("argv", [
    ["sim", "validate", "--live-from", "data/validation/seed3", "--out", "{tmp}/v"],
    ["sim", "calibrate-roles", "--run", "data/validation/cal-a", "--out", "{tmp}/fit.json"],
    ["sim", "run", "--agentic", "20", "--rate", "1", "--seed", "1", "--max-input", "4000"],
])
def test_a_hand_edited_kv_capacity_is_one_line(capsys, tmp_path, kv, argv):
    """A profile's ``kv_capacity_tokens`` (the simulated KV pool) 0, negative, fractional, a string,
    a boolean, missing or infinite: `--profile FILE: kv_capacity_tokens must be ...` (exit 2), not
    a ValueError / OverflowError / KeyError traceback from the simulator's instances."""
    prof = json.loads(Path(PROFILE).read_text())
    if kv is None:
        del prof["kv_capacity_tokens"]
    else:
        prof["kv_capacity_tokens"] = kv
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(prof))  # inf is written as Infinity, which json.loads reads back
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--profile", str(bad)]
    _refused(capsys, argv, f"pdd {' '.join(argv[:2])}: error:", "--profile", str(bad),
             "kv_capacity_tokens must be a whole number of tokens >= 1")


@pytest.mark.parametrize("case,flag,message", [
    ("missing", "--live-from", "no such directory"),
    ("no_stats", "--live-from", "no server_stats.json in it"),
    ("profile_list", "--profile", "not a pdd-profile/1 profile"),
    ("profile_b_missing", "--profile-b", "no such file"),
])
def test_validate_live_from_bad_run_is_one_line(capsys, tmp_path, case, flag, message):
    """--live-from a directory that is not a recorded validate run (or a --profile that is not
    one): a usage error naming the flag, before the profile is measured or anything simulated."""
    run = _recorded_run(tmp_path / "run")
    profile = PROFILE
    if case == "missing":
        run = tmp_path / "nosuch"
    elif case == "no_stats":
        (run / "server_stats.json").unlink()
    elif case == "profile_list":
        profile = str(tmp_path / "list.json")
        (tmp_path / "list.json").write_text("[]")
    extra = ["--profile-b", str(tmp_path / "nosuch.json")] if case == "profile_b_missing" else []
    _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(run), "--profile", profile,
                      "--config", _fake_model_config(tmp_path), *extra],
             "pdd sim validate: error:", flag, message)
    assert not (tmp_path / "v" / "validate.json").exists()


def test_validate_live_from_a_run_at_another_rate_is_refused(capsys, tmp_path, monkeypatch):
    """A recorded run of as many requests but another rate (or session seed, output cap, budget)
    is another workload: re-simulating it at the flags' rate compared arrivals that never
    happened. Refused naming the flag and both values."""
    from types import SimpleNamespace

    import pdd.sim.validate as V

    run = _recorded_run(tmp_path / "run", rate=0.8, n=2)
    reqs = [SimpleNamespace(prompt_ids=[1, 2, 3], max_tokens=4) for _ in range(2)]
    monkeypatch.setattr(V, "build_workload", lambda cfg, **kw: (reqs, SimpleNamespace(max_output_tokens=320)))
    monkeypatch.setattr(V, "simulate", lambda *a, **k: pytest.fail("simulated another workload's live run"))
    err = _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(run), "--profile",
                            PROFILE, "--rate", "2", "--requests", "2", "--config", _fake_model_config(tmp_path)],
                   "pdd sim validate: error:", f"--live-from {run}", "not the same workload")
    assert "--rate 2.0 (the run's: 0.8)" in err, err


def test_check_same_run_names_each_differing_argument():
    from pdd.sim.recorded import WorkloadMismatch, check_same_run

    rec = {"workload": {"requests": 211, "rate_rps": 0.8, "session_seed": 1, "max_output_tokens": 32},
           "config": {"pipeline_ttft_budget_ms": 250.0}}
    check_same_run(rec, {"workload": {"requests": 211, "rate_rps": 0.8, "session_seed": 1, "max_output_tokens": 32,
                                      "block_tokens": 64}, "config": {"pipeline_ttft_budget_ms": 250}})
    with pytest.raises(WorkloadMismatch) as ex:
        check_same_run(rec, {"workload": {"requests": 211, "rate_rps": 0.8, "session_seed": 2,
                                          "max_output_tokens": 320}, "config": {"pipeline_ttft_budget_ms": 50.0}})
    assert str(ex.value) == ("not the same workload: --session-seed 2 (the run's: 1), --max-output-tokens 320 (the "
                             "run's: 32), --budget-ms 50.0 (the run's: 250.0); leave those flags out (a reused run's "
                             "own are the defaults) or give the run's own (its validate.json 'workload' and "
                             "'config.pipeline_ttft_budget_ms')")


def test_validate_live_from_a_run_with_no_completed_request_is_one_line(capsys, tmp_path, monkeypatch):
    """A recorded run whose every request failed (a killed topology) has nothing to compare: one
    usage line naming the run's errors, not a TypeError from the percentiles of nothing."""
    import json
    from types import SimpleNamespace

    import pdd.sim.validate as V

    run = _recorded_run(tmp_path / "run", rate=0.8, n=2)
    (run / "requests.jsonl").write_text("".join(json.dumps({"ok": False, "error": "ConnectionResetError"}) + "\n"
                                                for _ in range(2)))
    reqs = [SimpleNamespace(prompt_ids=[1, 2, 3], max_tokens=4) for _ in range(2)]
    monkeypatch.setattr(V, "build_workload", lambda cfg, **kw: (reqs, SimpleNamespace(max_output_tokens=320)))
    monkeypatch.setattr(V, "simulate", lambda *a, **k: pytest.fail("simulated a run with nothing to compare"))
    _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(run), "--profile", PROFILE,
                      "--rate", "0.8", "--requests", "2", "--config", _fake_model_config(tmp_path)],
             "pdd sim validate: error:", "--live-from", "no completed request to compare (2 failed: ConnectionResetError)")


def test_sim_run_applies_the_profiles_live_fit_unless_told_not_to(capsys, tmp_path):
    """A profile `pdd sim calibrate-roles` wrote carries a live-run fit (role step overheads and
    scale, client delay, ...). `pdd sim validate` applied it; `pdd sim run --profile` read only the
    step times and dropped the fit unsaid. It now applies it (and says so), as validate does;
    --no-live-fit runs the bare engine's step times."""
    from pdd.sim.sim_config import LIVE_FIT_FIELDS
    from pdd.workload.records import REPO_ROOT

    profile = REPO_ROOT / "data" / "profiles" / "this-machine.json"
    prof = json.loads(profile.read_text())
    t = tmp_path / "t.jsonl"
    t.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 8,
                                     "hash_ids": [i, i + 1]}) + "\n" for i in range(6)))
    argv = ["sim", "run", "--profile", str(profile), "--trace", str(t), "--n-p", "1", "--n-rld", "1", "--n-md", "1"]
    res = {}
    for name, extra in (("fit", []), ("bare", ["--no-live-fit"])):
        out = tmp_path / f"{name}.json"
        assert pdd_main(argv + extra + ["--json", str(out)]) == 0
        res[name] = json.loads(out.read_text())
        err = capsys.readouterr().err
        assert ("applying the live-run fit in" in err) == (name == "fit"), err
    # the client delay alone shifts every TTFT by it (one request at a time: no queueing)
    delay_ms = 1000 * prof["client_delay_s"]
    assert res["fit"]["median_ttft_ms"] > res["bare"]["median_ttft_ms"] + delay_ms
    # a bare profile (no fit) runs as before and says nothing
    bare = tmp_path / "bare-profile.json"
    bare.write_text(json.dumps({k: v for k, v in prof.items() if k not in LIVE_FIT_FIELDS}))
    out = tmp_path / "plain.json"
    assert pdd_main(argv[:3] + [str(bare)] + argv[4:] + ["--json", str(out)]) == 0
    assert "live-run fit" not in capsys.readouterr().err
    assert json.loads(out.read_text())["median_ttft_ms"] == res["bare"]["median_ttft_ms"]


def test_validate_live_from_reads_the_runs_workload_arguments(capsys, tmp_path, monkeypatch):
    """`pdd sim validate --live-from RUN` re-simulates RUN's workload: each workload flag not given
    is the run's own (its validate.json), not the fresh-run default that was then refused as
    another workload; a flag given still has to match."""
    import pdd.sim.validate as V

    run = _recorded_run(tmp_path / "run", rate=0.8, n=2, budget=40.0)
    got = {}

    def workload(cfg, **kw):
        got.update(kw)
        raise SystemExit(0)  # the workload's arguments are what this test reads

    monkeypatch.setattr(V, "build_workload", workload)
    real = V.validate_config
    monkeypatch.setattr(V, "validate_config", lambda config, budget_ms, recorded=None: (
        got.update(budget_ms=budget_ms), real(config, budget_ms, recorded))[1])
    with pytest.raises(SystemExit):
        pdd_main(["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(run), "--profile", PROFILE,
                  "--config", _fake_model_config(tmp_path)])
    assert got == {"n_requests": 2, "rate": 0.8, "block_tokens": 64, "session_sample": 50, "session_seed": 0,
                   "max_output_tokens": 320, "seed": 0, "budget_ms": 40.0}


def test_plan_names_the_prompt_cap_when_a_prompt_does_not_fit(capsys):
    """`pdd plan --profile data/profiles/this-machine.json` on its default agentic workload (57k-token
    prompts, a 32,768-token CPU pool) ended in a RequestTooLarge traceback and had no --max-input:
    now one line naming the cap, which plan takes as sim run does."""
    argv = ["plan", "--profile", PROFILE, "--requests", "20", "--rate", "1", "--seed", "1"]
    _refused(capsys, argv, "pdd plan: error:", "do not fit the KV pool", "cap the prompts with --max-input")


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["decode"][0].update(seconds_per_step="abc"), "decode[0].seconds_per_step must be a finite number > 0"),
    (lambda d: d["decode"][0].update(seconds_per_step=-1), "decode[0].seconds_per_step must be a finite number > 0"),
    (lambda d: d.update(decode=[]), "decode must be a non-empty list of measured rows"),
    (lambda d: d.pop("model"), "model must be an object with kv_bytes_per_token > 0"),
    (lambda d: d.update(format="other/9", **{k: None for k in ("role_step_overhead_s", "role_step_scale",
                                                                "decode_interference", "wan_send_buffer_bytes",
                                                                "client_delay_s", "gateway_rtt_ms", "fast_path")}),
     "unsupported profile format 'other/9'"),
])
def test_sim_run_refuses_a_profile_whose_measured_tables_are_malformed(capsys, tmp_path, edit, message):
    """A hand-edited profile's step tables: a string or negative step time, no decode rows, no
    model gave a TypeError / ZeroDivisionError / KeyError traceback or ran on nonsense; another
    format was read as a roofline calibration file. Each is one line naming file and field."""
    d = json.loads(Path(PROFILE).read_text())
    edit(d)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    _refused(capsys, ["sim", "run", "--profile", str(f), "--agentic", "5", "--max-input", "4000"],
             "pdd sim run: error: --profile", message)
    _refused(capsys, ["sim", "run", "--profile", str(tmp_path / "none.json")], "--profile")
    (tmp_path / "empty.json").write_text("{}")
    _refused(capsys, ["sim", "run", "--profile", str(tmp_path / "empty.json")], "prefill must be a list")


@pytest.mark.parametrize("case,flag", [("live_from", "--live-from"), ("profile", "--profile"),
                                       ("profile_b", "--profile-b")])
def test_validate_refuses_a_bad_input_before_making_the_model(capsys, tmp_path, case, flag):
    """A missing --live-from / --profile / --profile-b: refused in one line before `pdd sim
    validate` writes a model checkpoint (19 MB, into the working directory by default) for a run
    it will not make."""
    model = tmp_path / "no-model-yet"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"model_path: {model}\n")
    run = _recorded_run(tmp_path / "run") if case != "live_from" else tmp_path / "nosuch"
    profile = str(tmp_path / "nosuch.json") if case == "profile" else PROFILE
    extra = ["--profile-b", str(tmp_path / "nosuch-b.json")] if case == "profile_b" else []
    _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(run), "--profile", profile,
                      "--config", str(cfg), *extra], "pdd sim validate: error:", flag, "no such")
    assert not model.exists()


@pytest.mark.parametrize("times,message", [([-1.0, 0.2], "before the request's send_s"),
                                           ([0.3, 0.2], "non-decreasing")])
def test_a_recorded_token_before_its_send_or_out_of_order_is_one_line(capsys, tmp_path, times, message):
    """A hand-edited requests.jsonl whose first token comes before the request was sent (a
    negative live TTFT, read into the errors and their intervals as it stood) or whose tokens are
    out of order: refused naming the line and field."""
    run = _recorded_run(tmp_path / "run")
    lines = (run / "requests.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec["token_times_s"] = times
    lines[1] = json.dumps(rec)
    (run / "requests.jsonl").write_text("\n".join(lines) + "\n")
    _refused(capsys, ["sim", "validate", "--out", str(tmp_path / "v"), "--live-from", str(run),
                      "--profile", PROFILE, "--config", _fake_model_config(tmp_path)],
             "pdd sim validate: error:", "--live-from", "requests.jsonl line 2: token_times_s", message)


@pytest.mark.parametrize("pdd", ["absent", None])
@pytest.mark.parametrize("argv,flag", [
    (["sim", "calibrate-roles", "--run", "{run}", "--out", "{tmp}/fit.json"], "--run"),
    (["sim", "validate", "--live-from", "{run}", "--out", "{tmp}/v"], "--live-from"),
])
def test_a_completed_record_without_the_gateways_pdd_block_is_refused(capsys, tmp_path, argv, flag, pdd):
    """A completed record with no `pdd` block (the gateway's per-request events and decisions)
    was read as one: its P interval missing, the requests P prefilled beside it counted as
    isolated and the token gaps beside it as P quiet, so it moved the fit unsaid. Refused naming
    the file and line, as a record of the wrong shape is; a failed request has no block and is
    read as before."""
    run = _recorded_run(tmp_path / "run", n=3)
    bare = _record()
    if pdd == "absent":
        del bare["pdd"]
    else:
        bare["pdd"] = None  # what RequestRecord.to_dict writes when no usage chunk carried one
    recs = [{"ok": False, "error": "ConnectionResetError", "pdd": None}, bare, _record()]
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    argv = [a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv]
    _refused(capsys, argv + ["--profile", PROFILE, "--config", _fake_model_config(tmp_path)],
             f"pdd {' '.join(argv[:2])}: error: {flag}",
             f"{run / 'requests.jsonl'} line 2: pdd is missing on a completed request")
    assert not (tmp_path / "fit.json").exists() and not (tmp_path / "v" / "validate.json").exists()


@pytest.mark.parametrize("text,got", [("[1, 2]\n", "a list"), ("[]\n", "a list"), ('"fast"\n', "a string"),
                                      ("3\n", "a number"), ("false\n", "a boolean")])
@pytest.mark.parametrize("argv", [
    ["sim", "calibrate-roles", "--run", "{root}/data/validation/cal-a", "--profile", "{root}/" + PROFILE,
     "--out", "{tmp}/fit.json"],
    ["sim", "validate", "--out", "{tmp}/v", "--live-from", "{root}/data/validation/seed3"],
    ["sim", "run", "--agentic", "3"],
    ["plan", "--requests", "3"],
    ["profile", "--out", "{tmp}/p.json"],
])
def test_a_config_that_is_not_an_object_is_one_line(capsys, tmp_path, monkeypatch, argv, text, got):
    """--config FILE holding a JSON list (or a string, number, boolean): `pdd: invalid config:
    ...` with exit 1, or for an empty list or false no error at all (read as no settings: the
    embedded topology, unsaid). One usage line naming the file and what it must hold (exit 2),
    before anything is read or run, as for a config that is a directory."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # no models/small here: nothing is made or measured
    cfg = tmp_path / "c.json"
    cfg.write_text(text)
    argv = [a.replace("{root}", str(root)).replace("{tmp}", str(tmp_path)) for a in argv]
    err = _refused(capsys, argv + ["--config", str(cfg)])
    assert err.endswith(f"pdd {' '.join(argv[:2]) if argv[0] == 'sim' else argv[0]}: error: --config {cfg}: "
                        f"expected a JSON object (a YAML mapping) of config fields, got {got}\n"), err
    assert not any(tmp_path.glob("*/validate.json")) and not (tmp_path / "fit.json").exists()


@pytest.mark.parametrize("content,message", [
    (b'{"mode": [1,\n', "not valid YAML/JSON: while parsing a flow node: expected the node content, but found "
                        "'<stream end>' (line 2, column 1)"),
    (b"policy:\n\t- 1\n", "not valid YAML/JSON: while scanning for the next token: found character '\\t' that "
                           "cannot start any token (line 2, column 1)"),
    (b"mode: pdd\x00\n", "not valid YAML/JSON: unacceptable character #x0000 at position 9: special characters are "
                         "not allowed"),
    (b"\x87\xff mode: pdd\n", "not UTF-8 text (a YAML or JSON config)"),
    # Python's own message, naming no field and advising sys.set_int_max_str_digits()
    (b"engine:\n  num_pages: 1" + b"0" * 5000 + b"\n",
     "a number in it has more than 4300 digits; no setting takes one that large"),
])
@pytest.mark.parametrize("argv", [
    ["sim", "calibrate-roles", "--run", "{root}/data/validation/cal-a", "--profile", "{root}/" + PROFILE],
    ["profile", "--out", "{tmp}/p.json"],
])
def test_a_config_that_is_not_yaml_is_one_line(capsys, tmp_path, monkeypatch, argv, content, message):
    """A config that does not parse printed PyYAML's message over four lines (the file shown as
    "<unicode string>", a caret under the column: a traceback's look), one that is not UTF-8 a
    codec error not naming the file; both with exit 1. One usage line naming the file (exit 2)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(content)
    argv = [a.replace("{root}", str(root)).replace("{tmp}", str(tmp_path)) for a in argv]
    err = _refused(capsys, argv + ["--config", str(cfg)])
    prog = " ".join(argv[:2]) if argv[0] == "sim" else argv[0]
    assert err.endswith(f"pdd {prog}: error: --config {cfg}: {message}\n"), err


@pytest.mark.parametrize("argv,message", [
    (["sim", "calibrate-roles", "--run", "{run}", "--out", "{tmp}/fit.json"], "--run: the live run has no completed "
                                                                             "request to fit"),
    (["sim", "validate", "--live-from", "{run}", "--out", "{tmp}/v"], "--live-from: the live run has no completed "
                                                                     "request to compare"),
])
def test_the_run_and_the_profile_are_read_once(capsys, tmp_path, monkeypatch, argv, message):
    """calibrate-roles and validate --live-from read the run and the profile once, inside
    calibrate_roles / run_validate, before anything needs the model (the CLI read them first
    too, to name a bad one before the checkpoint, then the function read them again). Here a
    run with no completed request, refused after every file of it was read."""
    from types import SimpleNamespace

    import pdd.sim.validate as V

    run = _recorded_run(tmp_path / "run")
    reqs = [SimpleNamespace(prompt_ids=[1, 2, 3], max_tokens=4) for _ in range(2)]  # the fake model has no tokens
    monkeypatch.setattr(V, "build_workload", lambda cfg, **kw: (reqs, SimpleNamespace(max_output_tokens=320)))
    (run / "requests.jsonl").write_text("".join(json.dumps({"ok": False, "error": "ConnectionResetError"}) + "\n"
                                                for _ in range(2)))
    profile = tmp_path / "profile.json"
    profile.write_text(Path(PROFILE).read_text())
    cfg = _fake_model_config(tmp_path)
    reads = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (reads.append(Path(self).resolve()),
                                                                  real(self, *a, **k))[1])
    import pdd.files

    bounded = pdd.files.read_text  # how the run's files and the profile are read (regular files, bounded)
    monkeypatch.setattr(pdd.files, "read_text", lambda path, *a, **k: (reads.append(Path(path).resolve()),
                                                                       bounded(path, *a, **k))[1])
    argv = [a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv]
    _refused(capsys, argv + ["--profile", str(profile), "--config", cfg], message)
    for f in (run / "requests.jsonl", run / "server_stats.json", profile):
        assert reads.count(f.resolve()) == 1, (f, reads)


@pytest.mark.parametrize("argv", [
    ["sim", "run", "--agentic", "3"],
    ["sim", "calibrate-roles", "--run", "{root}/data/validation/cal-a", "--profile", "{root}/" + PROFILE,
     "--out", "{tmp}/fit.json"],
    ["sim", "validate", "--out", "{tmp}/v", "--live-from", "{root}/data/validation/seed3"],
    ["plan", "--requests", "3"],
    ["profile", "--out", "{tmp}/p.json"],
    ["serve"],
    ["launch", "--role", "prefill"],
])
@pytest.mark.parametrize("kind", ["missing", "list"])
def test_a_bad_config_file_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, kind):
    """Found by a new user: a --config file that does not exist was `pdd: config file not found:
    PATH` with exit 1, naming neither --config nor the command; one that is refused (here a JSON
    list) printed argparse's whole usage first (37 lines for `pdd sim run`), the line naming the
    file last. Both are one line, `PROG: error: --config PATH: ...`, exit 2, as every other bad
    flag of these commands (pdd.sim.cli.run_command)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # no models/small here: nothing is made or measured
    cfg = tmp_path / "c.json"
    if kind == "list":
        cfg.write_text("[1, 2]\n")
    argv = [a.replace("{root}", str(root)).replace("{tmp}", str(tmp_path)) for a in argv]
    err = usage_error(capsys, pdd_main, argv + ["--config", str(cfg)])
    prog = " ".join(argv[:2]) if argv[0] == "sim" else argv[0]
    what = "no such file" if kind == "missing" else "expected a JSON object (a YAML mapping) of config fields, got a list"
    assert err == f"pdd {prog}: error: --config {cfg}: {what}\n"


@pytest.mark.parametrize("engine", [None, "x", {"dtype": "float7"}])
@pytest.mark.parametrize("argv", [
    ["sim", "validate", "--live-from", "data/validation/seed3", "--out", "{tmp}/v"],
    ["sim", "calibrate-roles", "--run", "data/validation/cal-a", "--out", "{tmp}/fit.json"],
])
def test_a_hand_edited_engine_block_is_one_line(capsys, tmp_path, engine, argv):
    """A profile's ``engine`` block null, a string, or with a KV dtype the runtime lacks is one line
    naming the flag, the file and the field, exit 2 (it was an AttributeError / KeyError traceback
    from pdd.sim.validate.sim_config, exit 1)."""
    prof = json.loads(Path(PROFILE).read_text())
    if isinstance(engine, dict):
        prof["engine"] = {**prof["engine"], **engine}
    else:
        prof["engine"] = engine
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(prof))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--profile", str(bad)]
    _refused(capsys, argv, f"pdd {' '.join(argv[:2])}: error:", "--profile", str(bad), "engine")


@pytest.mark.parametrize("reps,message", [("0", "must be >= 1, got 0"), ("-2", "must be >= 1, got -2"),
                                          ("x", "not an integer: 'x'")])
def test_profile_refuses_reps_below_one_naming_the_flag(capsys, tmp_path, reps, message):
    # `pdd profile --reps 0` loaded the model, then died in statistics.median([]) with a traceback
    _refused(capsys, ["profile", "--reps", reps, "--out", str(tmp_path / "p.json")], "--reps", message)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("argv,names", [
    (["sim", "run", "--agentic", "5", "--seed", "-1"], ["pdd sim run: error:", "--seed", "must be >= 0, got -1"]),
    (["plan", "--seed", "-1"], ["pdd plan: error:", "--seed", "must be >= 0, got -1"]),
    (["sim", "agentic", "--n", "5", "--seed", "-1"], ["pdd sim agentic: error:", "--seed", "must be >= 0, got -1"]),
    (["workload", "agentic", "--n", "5", "--seed", "-1", "--out", "x.jsonl"],
     ["pdd workload agentic: error:", "--seed", "must be >= 0, got -1"]),
])
def test_a_negative_workload_seed_is_a_usage_error(capsys, tmp_path, monkeypatch, argv, names):
    # numpy's default_rng takes no negative seed: `pdd sim agentic --seed -1` was a ValueError traceback
    monkeypatch.chdir(tmp_path)
    _refused(capsys, argv, *names)
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("out,message", [
    ("FILE", "--out FILE: cannot create the output directory: a file of that name exists"),
    ("FILE/sub", "--out FILE/sub: cannot create the output directory: FILE is a file, not a directory"),
    ("", "--out '': empty; give the output directory")])  # '' wrote into the current directory
def test_sim_experiment_refuses_an_out_that_cannot_be_a_directory(capsys, tmp_path, monkeypatch, out, message):
    # `pdd sim experiment ttft --out FILE` was a FileExistsError traceback from the experiment's mkdir;
    # the wording is pdd bench's and pdd make-model's (pdd.cli_args.out_dir_problem)
    import pdd.sim.experiments

    monkeypatch.chdir(tmp_path)

    monkeypatch.setattr(pdd.sim.experiments, "run_experiment", lambda *a, **k: pytest.fail("ran"))
    f = tmp_path / "f.json"
    f.write_text("{}")
    out, message = out.replace("FILE", str(f)), message.replace("FILE", str(f))
    err = _refused(capsys, ["sim", "experiment", "ttft", "--quick", "--out", out])
    assert err.strip().splitlines() == [f"pdd sim experiment: error: {message}"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


@pytest.mark.parametrize("argv", [
    ["sim", "validate-report", "--calibration", "data/validation/cal-a", "--held-out", "data/validation/seed3",
     "--json", ""],
    ["sim", "run", "--json", ""], ["plan", "--json", ""], ["sim", "compare-profiles", "--json", ""],
    ["workload", "agentic", "--out", ""]])
def test_an_empty_output_file_is_refused_not_ignored(capsys, monkeypatch, argv):
    """`--json ''` read as no --json: the report was printed and its file silently not written
    (as bench --out '' wrote into the current directory). Refused, naming the flag, exit 2."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    err = usage_error(capsys, pdd_main, argv)
    assert f"error: {argv[-2]} '': empty; give a file path" in err and len(err.strip().splitlines()) == 1


def test_sim_run_checks_a_json_no_file_can_be_made_in_before_the_simulation(capsys, monkeypatch):
    """Found by a new user (as root): `pdd sim run --json /proc/x.json` simulated, printed its
    summary, then ended in a FileNotFoundError traceback (os.access says yes to root there)."""
    import pdd.sim.cluster

    monkeypatch.setattr(pdd.sim.cluster.ClusterSim, "run", lambda *a, **k: pytest.fail("simulated first"))
    err = _refused(capsys, ["sim", "run", "--limit", "5", "--json", "/proc/pdd-no-such.json"])
    assert err.splitlines()[-1] in ("pdd sim run: error: --json /proc/pdd-no-such.json: cannot write it: "
                                    "No such file or directory",
                                    "pdd sim run: error: --json /proc/pdd-no-such.json: not writable"), err


def test_check_out_file_leaves_no_file_behind(tmp_path):
    from pdd.sim.cli import check_out_file

    check_out_file(str(tmp_path / "s.json"), "--json")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old.json").write_text("kept")
    check_out_file(str(tmp_path / "old.json"), "--json")
    assert (tmp_path / "old.json").read_text() == "kept"


def test_sim_run_warns_of_requests_a_stalled_run_left_unfinished(capsys, tmp_path):
    """Seven small P->MD requests hold P's pool until MD admits them; MD's pool holds the big
    relayed request's reservation, whose prefill waits for P's: the run ended with every request
    unfinished and printed a summary of nothing, unsaid. It says so on stderr and in --json.
    (With the gateway's WAN backlog in its plan, as the runtime's, the small requests queued at
    MD are relayed and finish on RLD; the big one's prefill still waits for P's pool.)"""
    t = tmp_path / "t.jsonl"
    recs = [{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [10 + i]} for i in range(7)]
    recs.append({"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [99]})
    t.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("link:\n  wan_gbps: 0.5\nengine:\n  page_size: 16\n  num_pages: 19\n")  # 304-token pools
    out = tmp_path / "s.json"
    # --budget-ms 250: the seven small requests go P->MD (the runtime's 50 ms would relay them)
    assert pdd_main(["sim", "run", "--trace", str(t), "--config", str(cfg), "--n-p", "1", "--n-rld", "1", "--n-md",
                     "1", "--budget-ms", "250", "--json", str(out)]) == 0
    stall = ("the simulation stalled at 0.0203036 s with 1 of 8 requests unfinished, their KV admissions waiting on each "
             "other: P0 (112 of 304 tokens held, 1 queued), MD0 (301 of 304 tokens held, 7 queued); the live engine "
             "would refuse them (OutOfPages): give the tiers larger KV pools or a lower load")
    assert capsys.readouterr().err.endswith(f"pdd sim run: warning: {stall}\n")
    s = json.loads(out.read_text())
    assert (s["requests"], s["completed"], s["stalled"]) == (8, 7, stall)


@pytest.mark.parametrize("argv", [["sim", "agentic", "--n", "1000001"], ["workload", "agentic", "--n", "1000001"]])
def test_a_generated_workload_past_a_million_requests_is_one_line(capsys, argv):
    """A million agentic requests take about 1 GB of records; 1e20 filled the memory (a hang)."""
    _refused(capsys, argv, "error: argument --n", "must be at most 1,000,000 (requests of a generated workload), got "
                           "1000001")


def _pipeline_decision(**inputs) -> dict:
    from dataclasses import asdict

    from pdd.policy.pipeline import PipelineInputs

    return {"policy": "pipeline", "inputs": {**asdict(PipelineInputs(mode="pdd", prompt_tokens=100)), **inputs},
            "result": "p_rld_md"}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _pdd_block(**fields) -> dict:
    return {**_record()["pdd"], **fields}


@pytest.mark.parametrize("file,value,message", [
    ("requests", {"pdd": _pdd_block(decisions=True)}, "pdd.decisions must be a list of decisions"),
    ("requests", {"pdd": _pdd_block(decisions=[True])},
     "pdd.decisions[0] must be an object whose policy is pipeline or handoff"),
    ("requests", {"pdd": _pdd_block(decisions=[{**_pipeline_decision(), "policy": {}}])},
     "pdd.decisions[0] must be an object whose policy is pipeline or handoff"),
    ("requests", {"pdd": _pdd_block(decisions=[{**_pipeline_decision(), "inputs": True}])},
     "pdd.decisions[0].inputs must be an object"),
    ("requests", {"pdd": _pdd_block(decisions=[{**_pipeline_decision(), "inputs": _without(
        _pipeline_decision()["inputs"], "prompt_tokens")}])}, "pdd.decisions[0].inputs.prompt_tokens is missing"),
    ("requests", {"pdd": _pdd_block(decisions=[_pipeline_decision(wan_rtt_ms=[1])])},
     "pdd.decisions[0].inputs.wan_rtt_ms must be a number, got [1]"),
    ("requests", {"pdd": _pdd_block(decisions=[_pipeline_decision(bogus=1)])},
     "pdd.decisions[0].inputs has bogus, not an input of the pipeline policy"),
    ("requests", {"pdd": _pdd_block(decisions=[{"policy": "handoff", "inputs": {"tokens_pending": 3},
                                                "result": {"final": True}}])},
     "pdd.decisions[0].result must be an object with a mode and final (true or false), got {'final': True}"),
    ("requests", {"pdd": _pdd_block(p_cached_tokens="x")},
     "pdd.p_cached_tokens must be a whole number of tokens >= 0, got 'x'"),
    ("requests", {"tiers": [{}]}, "tiers must be a list of tier names (one a token)"),
    ("requests", {"prompt_tokens": 1e20}, "prompt_tokens must be a whole number of tokens >= 0, got 1e+20"),
    ("stats", {"stats": {"totals": True}}, "stats.totals must be an object"),
    ("stats", {"stats": {"instances": {"rld0": {"role": {}}}}}, "stats.instances.rld0.role must be a role's name, got {}"),
    ("stats", {"stats_before": {"totals": {"wan_bytes_cancelled": None}}},
     "stats_before.totals.wan_bytes_cancelled must be a number, got None"),
    ("validate", {"max_output_tokens": [1]}, "workload.max_output_tokens must be a number, got [1]"),
])
@pytest.mark.parametrize("argv,flag", [
    (["sim", "calibrate-roles", "--run", "{run}", "--out", "{tmp}/fit.json"], "--run"),
    (["sim", "validate", "--live-from", "{run}", "--out", "{tmp}/v"], "--live-from"),
])
def test_a_recorded_run_with_a_field_of_the_wrong_type_is_one_line(capsys, tmp_path, argv, flag, file, value,
                                                                    message):
    """Found by mutating a recorded run's files at random: a decision's inputs of the wrong type
    or shape, a cached-token count, tier names, the gateway's totals or a workload argument that is
    not a number were TypeError / KeyError / AttributeError tracebacks, and a prompt of 1e20 tokens
    chunked P's prefill without end. Each is refused naming the file and field."""
    run = _recorded_run(tmp_path / "run")
    if file == "requests":
        (run / "requests.jsonl").write_text(json.dumps(_record()) + "\n" + json.dumps({**_record(), **value}) + "\n")
    elif file == "stats":
        (run / "server_stats.json").write_text(json.dumps(value))
    else:
        v = json.loads((run / "validate.json").read_text())
        v["workload"].update(value)
        (run / "validate.json").write_text(json.dumps(v))
    argv = [a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv]
    _refused(capsys, argv + ["--profile", PROFILE, "--config", _fake_model_config(tmp_path)],
             f"pdd {' '.join(argv[:2])}: error:", flag, message)


def test_a_recorded_request_of_another_prompt_length_is_not_the_workload():
    """A record whose prompt is not its request's (1e20 tokens here) is another workload, named by
    request; before, the prefill-compute share chunked 1e20 tokens without end."""
    from pdd.sim.recorded import WorkloadMismatch, check_same_requests

    check_same_requests([{"prompt_tokens": 3}, {}], [3, 5])  # a record without it is not compared
    with pytest.raises(WorkloadMismatch) as ex:
        check_same_requests([{"prompt_tokens": 3}, {"prompt_tokens": 10**20}], [3, 5])
    assert str(ex.value) == ("live run's request 1 has 100000000000000000000 prompt tokens, the workload's 5: not the "
                             "same workload (give the run's own workload arguments: its validate.json 'workload')")
    with pytest.raises(WorkloadMismatch, match="live run has 1 requests, the workload 2: not the same workload"):
        check_same_requests([{}], [3, 5])


@pytest.mark.parametrize("argv,flag", [
    (["sim", "calibrate-roles", "--run", "{run}", "--out", "{tmp}/fit.json"], "--run"),
    (["sim", "validate", "--live-from", "{run}", "--out", "{tmp}/v"], "--live-from"),
])
def test_a_recorded_run_of_other_prompts_is_refused_before_it_is_used(capsys, tmp_path, monkeypatch, argv, flag):
    """`--live-from` / `--run` whose second record holds a 1e20-token prompt: P's prefill was
    chunked through it without end (a hang). Refused as another workload, before anything is
    simulated or fitted."""
    from types import SimpleNamespace

    import pdd.sim.calibrate as C
    import pdd.sim.validate as V

    run = _recorded_run(tmp_path / "run", n=2)
    (run / "requests.jsonl").write_text(json.dumps(_record(prompt_tokens=3)) + "\n"
                                        + json.dumps(_record(prompt_tokens=10**20)) + "\n")
    reqs = [SimpleNamespace(prompt_ids=[1, 2, 3], max_tokens=4) for _ in range(2)]
    for mod in (V, C):
        monkeypatch.setattr(mod, "build_workload", lambda cfg, **kw: (reqs, SimpleNamespace(max_output_tokens=320)))
        monkeypatch.setattr(mod, "as_sent", lambda *a: pytest.fail("used a run of other prompts"))
    argv = [a.replace("{run}", str(run)).replace("{tmp}", str(tmp_path)) for a in argv]
    workload = ["--rate", "0.8", "--requests", "2"] if flag == "--live-from" else []  # the run's (validate's flags)
    _refused(capsys, argv + ["--profile", PROFILE, "--config", _fake_model_config(tmp_path)] + workload,
             f"pdd {' '.join(argv[:2])}: error:", flag, "live run's request 1 has 100000000000000000000 prompt "
             "tokens, the workload's 3: not the same workload")


def test_a_completed_record_without_its_prompt_length_counts_its_requests():
    """A completed record without ``prompt_tokens`` (the other checks pass it: the field is
    optional) was a KeyError in `pdd sim validate --live-from`'s prefill-compute share; its
    request's own prompt stands for it, as when it is 0."""
    from pdd.sim.cluster import ClusterSim, SimConfig
    from pdd.sim.validate import compute_share

    sim = ClusterSim(SimConfig(mode="pdd", warmup_frac=0.0)).run(
        [{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}])
    rec = {"ok": True, "send_s": 0.0, "token_times_s": [0.5], "pdd": {"p_cached_tokens": 0}}
    share = compute_share(sim, [{**rec, "prompt_tokens": 600}])
    assert share > 0 and compute_share(sim, [rec]) == share == compute_share(sim, [{**rec, "prompt_tokens": 0}])


def test_sim_run_reads_the_cut_off_policy_of_its_config_and_flags(tmp_path):
    """``--config``'s ``policy.cutoff`` / ``cutoff_min_remaining_s`` / ``cutoff_max_sent_fraction``
    are simulated (they were read nowhere: ``cutoff: false`` in a config still cut transfers
    off), as ``--no-cutoff`` / ``--cutoff-*`` are without a config; a bad flag value is one line."""
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps({"timestamp": 0, "input_length": 8192, "output_length": 2,
                             "hash_ids": list(range(16))}) + "\n")
    base = ["sim", "run", "--trace", str(t), "--mode", "pdd", "--n-p", "1", "--n-rld", "1", "--n-md", "1",
            "--budget-ms", "0", "--wan-gbps", "1"]

    def cut_offs(*extra: str, config: str | None = None) -> int:
        out = tmp_path / "s.json"
        argv = base + list(extra) + ["--json", str(out)]
        if config is not None:
            c = tmp_path / "c.yaml"
            c.write_text("link:\n  wan_gbps: 1.0\npolicy:\n" + config)
            argv += ["--config", str(c)]
        assert pdd_main(argv) == 0
        return json.loads(out.read_text())["cutoffs"]

    assert cut_offs() == 1  # RLD finishes 2 tokens long before 1 GiB crosses 1 Gbit/s
    assert cut_offs("--no-cutoff") == 0
    assert cut_offs(config="  cutoff: false\n") == 0
    assert cut_offs(config="  cutoff_min_remaining_s: 1000\n") == 0
    assert cut_offs("--cutoff-min-remaining-s", "1000") == 0
    assert cut_offs(config="  cutoff: true\n") == 1
    with pytest.raises(SystemExit) as e:
        pdd_main(base + ["--cutoff-max-sent-fraction", "2"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,flag", [
    (["profile", "--config", "{cfg}", "--out", "OUT"], "--out"),
    (["plan", "--json", "OUT"], "--json"),
    (["workload", "agentic", "--n", "5", "--out", "OUT"], "--out"),
])
@pytest.mark.parametrize("below", ["x.json", "a/x.json"])
def test_an_out_path_under_a_file_says_the_file_is_not_a_directory(capsys, tmp_path, argv, flag, below):
    """``pdd profile --out /etc/passwd/x.json`` said "no such directory: /etc/passwd", though
    /etc/passwd is there: a file, not a directory (found by a new user)."""
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0\n")
    out = f"{f}/{below}"
    cfg = _fake_model_config(tmp_path)
    argv = [a.replace("OUT", out).replace("{cfg}", cfg) for a in argv]
    err = _refused(capsys, argv)
    assert err.splitlines()[-1].endswith(f"error: {flag} {out}: {f} is a file, not a directory"), err
    assert f.read_text() == "root:x:0:0\n"
