"""Every float flag of `pdd sim run`, `pdd plan` and `pdd sim agentic` refuses a value that is not
finite or out of its range with one message naming the flag, whatever the value: `nan` said
"must be >= 0", `inf` "must be a finite number >= 0", and `-inf` (read by argparse as an option)
"expected one argument"; `--wan-loss-rate`, a bare float, was refused only after the workload was
read, in other words, and not at all with --config."""

import pytest

from pdd.cli import main as pdd_main
from pdd.cli_args import ShortUsageParser
from pdd.sim import cli
from tests.cli_usage import usage_error

# the range each float type says it takes, after "must be a finite number "
RANGE = {cli.POS_FLOAT: "> 0", cli.NONNEG_FLOAT: ">= 0", cli.FRACTION: "in [0, 1]", cli.RATE: "> 0",
         cli.SCALE_RATE: "> 0", cli.LOSS_RATE: "in [0, 1)"}
ABOVE = {cli.FRACTION: "2", cli.LOSS_RATE: "1"}  # a finite value above the range


def _float_flags(argv: list[str]) -> list[tuple[str, object]]:
    """(flag, its type) of every float flag of the sub-command ``argv`` names."""
    ap = ShortUsageParser(prog="pdd")
    sub = ap.add_subparsers(dest="cmd")
    cli.add_sim_parser(sub)
    cli.add_plan_parser(sub)
    p = ap
    for word in argv:
        p = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction").choices[word]
    out = []
    for act in p._actions:
        assert act.type is not float, f"{act.option_strings}: a bare float takes nan and inf"
        if act.type in RANGE:
            out.append((act.option_strings[-1], act.type))
    return out


CASES = [(argv, flag, typ, value)
         for argv in (["sim", "run"], ["plan"], ["sim", "agentic"])
         for flag, typ in _float_flags(argv)
         for value in ("nan", "inf", "-inf", "-1", "-0.5e3", *([ABOVE[typ]] if typ in ABOVE else []))]


def test_the_float_flags_are_the_expected_ones():
    assert [f for f, _ in _float_flags(["sim", "run"])] == [
        "--price-a", "--price-b", "--wan-gbps", "--wan-rtt-ms", "--wan-express-lane-bdp", "--wan-usd-per-hour",
        "--wan-loss-rate", "--budget-ms", "--cutoff-min-remaining-s", "--cutoff-max-sent-fraction", "--slo-ttft",
        "--slo-tpot", "--scale-rate", "--rate", "--peak-rate", "--low-rate", "--autoscale-interval",
        "--autoscale-sample", "--autoscale-cooldown", "--autoscale-up-at", "--autoscale-down-at",
        "--autoscale-start-s"]
    assert "--hit" in [f for f, _ in _float_flags(["plan"])]
    assert [f for f, _ in _float_flags(["sim", "agentic"])] == ["--rate"]


@pytest.mark.parametrize("argv,flag,typ,value", CASES, ids=[f"{' '.join(c[0])} {c[1]} {c[3]}" for c in CASES])
def test_a_float_flag_refuses_a_non_finite_or_out_of_range_value(capsys, argv, flag, typ, value):
    err = usage_error(capsys, pdd_main, argv + [flag, value])
    assert err.splitlines()[-1] == f"pdd {' '.join(argv)}: error: argument {flag}: must be a finite number " \
                                   f"{RANGE[typ]}, got {value}", err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_the_express_lane_flag_names_itself_alike_for_every_bad_value(capsys, value):
    """The brief's case: one wording for nan, inf, -inf and a negative value, `=` or not."""
    for argv in (["--wan-express-lane-bdp", value], [f"--wan-express-lane-bdp={value}"]):
        err = usage_error(capsys, pdd_main, ["sim", "run", *argv])
        assert err.splitlines()[-1] == (f"pdd sim run: error: argument --wan-express-lane-bdp: must be a finite "
                                        f"number >= 0, got {value}")


def test_a_bad_loss_rate_is_refused_with_a_config_too(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("link:\n  wan_gbps: 40\n")
    err = usage_error(capsys, pdd_main, ["sim", "run", "--config", str(cfg), "--wan-loss-rate", "nan"])
    assert err.splitlines()[-1] == "pdd sim run: error: argument --wan-loss-rate: must be a finite number in [0, 1), " \
                                   "got nan"

