"""pdd bench's WAN line flags: --cross-traffic-gbps / --cross-traffic (schedule) and --wan-loss-rate
reach the topology's link config; bad values are refused naming the flag before anything runs."""

import pytest

from pdd.bench import bench as bench_mod
from pdd.bench.bench import apply_overrides, main
from pdd.config import ClusterConfig
from pdd.launch import link_config
from pdd.topology import layout
from tests.cli_usage import usage_error


@pytest.fixture
def captured(monkeypatch):
    """run_bench replaced: records the config it was given, runs nothing."""
    got = {}

    def run_bench(out, modes, requests, scale, config, *a, **k):
        got["config"] = config
        return {"bench": {"run_order": []}, "modes": {}}

    monkeypatch.setattr(bench_mod, "run_bench", run_bench)
    return got


def _refused(capsys, argv, *names):
    err = usage_error(capsys, main, argv)
    assert "pdd bench: error:" in err, err
    for n in names:
        assert n in err, (n, err)


def test_cross_traffic_flags_reach_the_link_config(captured, tmp_path):
    assert main(["--cross-traffic-gbps", "0.025", "--wan-loss-rate", "0.001", "--out", str(tmp_path)]) == 0
    link = captured["config"].link
    assert link.wan_cross_traffic == [(0.0, 0.025)] and link.wan_loss_rate == 0.001
    assert main(["--cross-traffic", "0:0.01,30:0.03", "--out", str(tmp_path)]) == 0
    cfg = captured["config"]
    assert cfg.link.wan_cross_traffic == [(0.0, 0.01), (30.0, 0.03)] and cfg.link.wan_loss_rate == 0.0
    # ... and the emulator process gets them
    lc = link_config(cfg, layout(cfg))
    assert lc["cross_traffic"] == [[0.0, 0.01], [30.0, 0.03]] and lc["loss_rate"] == 0.0 and lc["mss_bytes"] == 1460


def test_apply_overrides_sets_the_link_fields():
    cfg = apply_overrides(ClusterConfig(), wan_loss_rate=0.01, wan_cross_traffic=[(0.0, 0.02)])
    assert cfg.link.wan_loss_rate == 0.01 and cfg.link.wan_cross_traffic == [(0.0, 0.02)]
    assert ClusterConfig().link.wan_cross_traffic == [] and ClusterConfig().link.wan_loss_rate == 0.0


@pytest.mark.parametrize("args,names", [
    (["--cross-traffic-gbps", "-1"], ["argument --cross-traffic-gbps: Gbit/s must be >= 0, got -1.0"]),
    (["--cross-traffic-gbps", "x"], ["argument --cross-traffic-gbps: expected Gbit/s, got 'x'"]),
    (["--cross-traffic-gbps", "0.05"], ["--cross-traffic:", "must be below the line's 0.05 Gbit/s"]),
    # a validator's message is printed as it is: no pydantic "Value error, " nor a trailing ", got [(0.0, 5.0)]"
    (["--cross-traffic", "0:5"], ["pdd bench: error: --cross-traffic: 5 Gbit/s at 0 s must be below the line's "
                                  "0.05 Gbit/s\n"]),
    # inf is >= 0: the message says what is wrong with it
    (["--cross-traffic-gbps", "inf"], ["argument --cross-traffic-gbps: Gbit/s must be a finite number, got inf\n"]),
    (["--cross-traffic", "5:inf"], ["argument --cross-traffic: schedule: Gbit/s must be a finite number, got inf at 5 s"]),
    (["--cross-traffic-gbps", "0.1", "--wan-gbps", "0.2"], []),  # accepted: below the line given
    (["--cross-traffic", "0:0.01,5"], ["argument --cross-traffic: schedule: expected seconds:Gbit/s, got '5'"]),
    (["--cross-traffic", "9:0.01,5:0.02"], ["argument --cross-traffic: schedule: times must increase"]),
    # an empty item was skipped: '0:0.01,,5:0.02' ran as '0:0.01,5:0.02', a trailing comma as if absent
    (["--cross-traffic", "0:0.01,,5:0.02"], ["pdd bench: error: argument --cross-traffic: schedule: item 2 of "
                                             "'0:0.01,,5:0.02' is empty; give seconds:Gbit/s points separated by "
                                             "single commas\n"]),
    (["--cross-traffic", "0:0.01,"], ["pdd bench: error: argument --cross-traffic: schedule: item 2 of '0:0.01,' is "
                                      "empty; give seconds:Gbit/s points separated by single commas\n"]),
    (["--cross-traffic", ", 0:0.01"], ["argument --cross-traffic: schedule: item 1 of ', 0:0.01' is empty"]),
    (["--cross-traffic", "0:-0.01"], ["argument --cross-traffic: schedule: Gbit/s must be >= 0"]),
    (["--cross-traffic", "0:0.01", "--cross-traffic-gbps", "0.01"], ["not allowed with argument"]),
    (["--wan-loss-rate", "1"], ["--wan-loss-rate:", "less than 1"]),
    (["--wan-loss-rate", "-0.1"], ["--wan-loss-rate:", "greater than or equal to 0"]),
])
def test_bad_line_flags_are_refused_naming_the_flag(capsys, captured, tmp_path, args, names):
    if not names:
        assert main(args + ["--out", str(tmp_path)]) == 0
        return
    _refused(capsys, args + ["--out", str(tmp_path / "b")], *names)
    assert "config" not in captured and not (tmp_path / "b").exists()


def test_url_refuses_cross_traffic(capsys, captured, tmp_path):
    _refused(capsys, ["--url", "http://127.0.0.1:1", "--cross-traffic-gbps", "0.01", "--out", str(tmp_path / "b")],
             "--cross-traffic", "with --url the server runs its own config")
