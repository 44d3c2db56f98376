"""pdd bench --fault: spec parsing, the CLI, which modes a fault applies to, outcome counting."""

import pytest

from pdd.bench.bench import build_parser, parse_fault_args
from pdd.bench.faults import applicable, fault_report, parse_bench_fault, request_outcomes
from pdd.config import ClusterConfig
from pdd.faults import FaultError
from pdd.topology import layout


def test_parse_bench_fault():
    f = parse_bench_fault("kill:rld@rld_decode")
    assert (f.spec.kind, f.spec.arg, f.spec.phase, f.nth, f.role) == ("kill", "relay_decode", "rld_decode", 1,
                                                                      "relay_decode")
    f = parse_bench_fault("kill:md0@handoff#3")
    assert (f.spec.arg, f.nth, f.role) == ("md0", 3, None)
    f = parse_bench_fault("wan_outage:2.5@transfer#2")
    assert (f.spec.kind, f.spec.arg, f.nth) == ("wan_outage", "2.5", 2)
    f = parse_bench_fault("cross_traffic:0.025@transfer#40")  # other traffic takes 0.025 Gbit/s from then on
    assert (f.spec.kind, f.spec.arg, f.spec.phase, f.nth) == ("cross_traffic", "0.025", "transfer", 40)
    for bad in ("kill:md0@decode", "kill@transfer", "wan_slowdown:0.5@transfer", "kill:p@prefill#0",
                "kill:p@prefill#x", "client_disconnect@md_decode", "nothing", "cross_traffic:x@transfer",
                "cross_traffic:-1@transfer"):
        with pytest.raises(FaultError):
            parse_bench_fault(bad)


@pytest.mark.parametrize("spec", ["wan_slowdown:nan@transfer", "wan_slowdown:inf@transfer", "wan_outage:nan@transfer",
                                  "wan_outage:inf@transfer", "cross_traffic:nan@transfer", "cross_traffic:inf@transfer",
                                  "cross_traffic:1e400@transfer"])
def test_a_fault_argument_that_is_not_a_finite_number_is_refused(spec):
    """NaN and inf passed the range checks (NaN compares false, inf is >= 1): a slowdown set the
    line's rate to NaN or 0 in the middle of the run."""
    with pytest.raises(FaultError, match="needs a finite number"):
        parse_bench_fault(spec)


@pytest.mark.parametrize("rec", ["nan", "inf"])
def test_fault_recover_after_must_be_finite(rec):
    with pytest.raises(ValueError, match="--fault-recover-after: seconds or 'end'"):
        parse_fault_args(["kill:p@prefill"], rec, None)


def test_cli_fault_flags():
    a = build_parser().parse_args(["--fault", "kill:rld@rld_decode", "--fault", "wan_slowdown:10@transfer#2",
                                   "--fault-recover-after", "end"])
    assert a.fault == ["kill:rld@rld_decode", "wan_slowdown:10@transfer#2"]
    assert parse_fault_args(a.fault, a.fault_recover_after, None) == (a.fault, None)
    assert parse_fault_args([], "2.5", None) == ([], 2.5)
    assert build_parser().parse_args([]).fault == []
    for specs, rec, url in ((["kill:x@nowhere"], "5", None), (["kill:p@prefill"], "soon", None),
                            (["kill:p@prefill"], "-1", None), (["kill:p@prefill"], "5", "http://127.0.0.1:1")):
        with pytest.raises(ValueError):
            parse_fault_args(specs, rec, url)


def test_applicable_by_mode():
    lay = {m: layout(ClusterConfig(mode=m)) for m in ("colocated", "same_dc_pd", "cross_dc_pd", "pdd")}
    kill_rld = parse_bench_fault("kill:rld@rld_decode")
    assert applicable(kill_rld, lay["pdd"]) is None
    assert all(applicable(kill_rld, lay[m]) for m in ("colocated", "same_dc_pd", "cross_dc_pd"))
    outage = parse_bench_fault("wan_outage:3@transfer")
    assert applicable(outage, lay["cross_dc_pd"]) is None and applicable(outage, lay["pdd"]) is None
    assert applicable(outage, lay["same_dc_pd"]) and applicable(outage, lay["colocated"])
    kill_md0 = parse_bench_fault("kill:md0@md_decode")
    assert applicable(kill_md0, lay["cross_dc_pd"]) is None and applicable(kill_md0, lay["same_dc_pd"])
    assert applicable(parse_bench_fault("kill:md@md_decode"), lay["same_dc_pd"]) is None  # d0 is its main_decode


def test_outcomes_and_report():
    recs = [{"ok": True, "token_times_s": [0, 1], "max_tokens": 2,
             "pdd": {"rid": "a", "recoveries": 1, "degraded": False, "pipeline": "p_rld_md"}},
            {"ok": True, "token_times_s": [0], "max_tokens": 1, "pdd": {"rid": "b", "recoveries": 0, "degraded": True}},
            {"ok": False, "error": "boom", "pdd": None}]
    assert request_outcomes(recs) == {"requests": 3, "completed": 2, "failed": 1, "recovered": 1, "degraded": 1,
                                      "errors": ["boom"]}

    class R:
        injections = [{"spec": "kill:rld@rld_decode", "rid": "a"}, {"spec": "kill:md@md_decode", "rid": "zz"}]
        not_injected = {"wan_outage:1@handoff": "never"}

    rep = fault_report(R(), recs, {"x": "no wan"}, 5.0)
    assert rep["injections"][0]["outcome"]["ok"] and rep["injections"][0]["outcome"]["recoveries"] == 1
    assert rep["injections"][1]["outcome"]["ok"] is False
    assert rep["not_injected"] == {"wan_outage:1@handoff": "never"} and rep["not_applicable"] == {"x": "no wan"}


@pytest.mark.parametrize("spec, want", [("wan_slowdown:0.5@transfer", "wan_slowdown needs a factor >= 1"),
                                        ("wan_slowdown:0@transfer", "wan_slowdown needs a factor >= 1"),
                                        ("wan_outage:-2@transfer", "wan_outage needs seconds > 0")])
def test_an_argument_out_of_range_names_the_range(spec, want):
    """A new user's `--fault wan_slowdown:0.5@transfer` read "argument out of range", naming neither
    the range nor what FACTOR does."""
    with pytest.raises(FaultError, match=want):
        parse_bench_fault(spec)


def test_the_fault_line_reads_cleanly():
    """``pdd bench`` printed "faults pdd: 2 injected ; not injected -; requests {...}": the
    injections, in square brackets, were eaten as console markup, and the outcomes were a dict."""
    from pdd.bench.faults import fault_line

    fr = {"injections": [{"spec": "kill:rld@rld_decode", "target": "rld0", "phase": "rld_decode"},
                         {"spec": "wan_outage:3@transfer", "target": None, "phase": "transfer",
                          "error": "FaultError: no link"}],
          "not_injected": {}, "requests": {"requests": 3, "completed": 2, "failed": 1, "recovered": 1, "degraded": 0}}
    assert fault_line("pdd", fr) == (
        "faults pdd: 2 injected (kill:rld@rld_decode -> rld0 in rld_decode; wan_outage:3@transfer in transfer: "
        "FaultError: no link); requests: 3, 2 completed, 1 failed, 1 recovered, 0 degraded")
    fr = {"injections": [], "not_injected": {"wan_outage:1@handoff": "no eligible request reached handoff"},
          "requests": {"requests": 2, "completed": 2, "failed": 0, "recovered": 0, "degraded": 0}}
    assert fault_line("cross_dc_pd", fr) == (
        "faults cross_dc_pd: 0 injected; not injected: wan_outage:1@handoff (no eligible request reached "
        "handoff); requests: 2, 2 completed, 0 failed, 0 recovered, 0 degraded")
