import json

import pytest

from pdd.sim.cli import main
from pdd.sim.experiments import _cost_cfg, cost_ceiling


def _cfg(a, b, price_a=None, premium=0.25, tpot=0.05):
    return _cost_cfg("qwen3-30b-a3b-fp8kv", a, b, price_a, premium, 100.0, 15.0, 3.0, tpot)


def test_premium_not_profile_prices_gpu_b():
    c = _cfg("A100-SXM4-80GB", "H20-96GB")
    assert c.chip("a").usd_per_hour == pytest.approx(1.50)  # chip A's profile price
    assert c.chip("b").usd_per_hour == pytest.approx(1.875)  # 25% over A, not H20's profile 1.20
    c = _cfg("H100-SXM5-80GB", "H200-SXM-141GB", price_a=2.0, premium=0.3)
    assert (c.price_a, c.chip("b").usd_per_hour) == (2.0, pytest.approx(2.6))


def test_ceiling_h100_h200_is_the_documented_one():
    r = cost_ceiling(_cfg("H100-SXM5-80GB", "H200-SXM-141GB"), 63 * 1024, 1024, 0.9, 48)
    assert r["baseline"] == "same_dc_pd[20P+68D]" and r["baseline_binding"] == "D"
    assert r["pdd_binding"] == "MD" and r["pdd"].endswith("+32MD]")
    assert r["baseline_cost_per_hour"] == pytest.approx(220.0) and r["pdd_cost_per_hour"] == pytest.approx(222.5)
    assert r["bcr_ceiling"] == pytest.approx(1.06, abs=0.01)


def test_cost_ceiling_cli(tmp_path):
    out = tmp_path / "c"
    assert main(["sim", "experiment", "cost-ceiling", "--out", str(out), "--set", "pairs=A100-SXM4-80GB/H20-96GB",
                 "--set", "tpot_ms=50", "--set", "kv_bytes=49152"]) == 0
    res = json.loads((out / "result.json").read_text())
    (row,) = res["rows"]
    assert (row["chip_a"], row["chip_b"], row["tpot_ms"]) == ("A100-SXM4-80GB", "H20-96GB", 50.0)
    assert row["price_a"] == pytest.approx(1.5) and row["price_b"] == pytest.approx(1.875)
    assert (out / "cost-ceiling.png").exists()
