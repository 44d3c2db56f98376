"""scripts/sim_goodput_limits.py, what limits pdd in the goodput experiment, on a small run: its
figures add up (every measured request has one outcome, every arrival one window) and its
command line refuses bad rates."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "sim_goodput_limits.py"
spec = importlib.util.spec_from_file_location("sim_goodput_limits", SCRIPT)
limits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(limits)


def test_figures_add_up():
    x = limits.analyse(6.0, 200)
    assert x["rate"] == 6.0 and x["requests"] == 200
    assert sum(x["outcome"].values()) == 180  # the 200 less the warm-up tenth (SimConfig.warmup_frac)
    missed = sum(c for k, c in x["outcome"].items() if k.startswith("p_rld_md ") and "ok" not in k)
    assert x["relayed_ttft_missed"] == missed - x["outcome"].get("p_rld_md tpot", 0)
    w = x["windows"]
    assert [r["t_s"] for r in w] == [limits.WINDOW_S * i for i in range(len(w))]
    assert round(sum(r["arrivals_per_s"] for r in w) * limits.WINDOW_S) <= 200
    assert all(0.0 <= r["rld_pool_occ"] <= 1.0 and r["wan_util"] <= 1.0 + 1e-9 for r in w)
    assert set(x["util"]) == {"P", "RLD", "MD"}


def test_command_line(capsys):
    assert limits.main(["--rates", "6", "--requests", "200", "--no-variants"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## 6 req/s: attainment ") and "| t_s " in out and "variants" not in out
    for bad in (["--rates", "x"], ["--rates", "0"], ["--requests", "5"]):
        with pytest.raises(SystemExit) as e:
            limits.main(bad)
        assert e.value.code == 2
