"""The paired bootstrap interval of a percentile error (pdd.sim.uncertainty): exact on cases whose
resampled errors are known, and a clear error for inputs it cannot use."""

import numpy as np
import pytest

import pdd.sim.uncertainty as U
from pdd.sim.uncertainty import error_intervals, paired_percentile_error_ci


def test_an_exact_copy_has_a_zero_width_interval_at_zero():
    x = np.linspace(0.01, 1.0, 57)
    assert paired_percentile_error_ci(x, x.copy(), 50) == (0.0, 0.0)


def test_a_uniformly_scaled_run_has_its_scale_on_both_ends():
    x = np.random.default_rng(3).lognormal(-2.0, 1.0, 80)
    lo, hi = paired_percentile_error_ci(x, 1.1 * x, 90)
    assert lo == pytest.approx(0.1, abs=1e-12) and hi == pytest.approx(0.1, abs=1e-12)


def test_two_requests_give_the_known_resampled_errors():
    # resamples of requests {a, b} with live (1, 2) and sim (1, 4): aa -> 0 (1 in 4), bb -> +1
    # (1 in 4), ab -> 2.5 / 1.5 - 1 = 2/3 (2 in 4): the central 95% runs from 0 to +1
    assert paired_percentile_error_ci([1.0, 2.0], [1.0, 4.0], 50) == (0.0, 1.0)


def test_pairing_is_kept_a_shuffled_sim_is_not_the_same_run():
    x = np.arange(1.0, 101.0)
    lo, hi = paired_percentile_error_ci(x, x, 50)
    assert (lo, hi) == (0.0, 0.0)
    lo, hi = paired_percentile_error_ci(x, x[::-1].copy(), 50)  # same values, other requests
    assert lo < 0 < hi


def test_the_interval_is_seeded_and_holds_the_level():
    rng = np.random.default_rng(1)
    x = rng.lognormal(-2.0, 1.0, 120)
    y = x * rng.lognormal(0.0, 0.2, 120)
    a = paired_percentile_error_ci(x, y, 50)
    assert a == paired_percentile_error_ci(x, y, 50)
    lo90, hi90 = paired_percentile_error_ci(x, y, 50, level=0.9)
    assert a[0] <= lo90 <= hi90 <= a[1]


def test_large_runs_are_resampled_in_blocks(monkeypatch):
    monkeypatch.setattr(U, "_CELLS", 100)  # 1 resample of 300 requests at a time
    x = np.linspace(0.1, 3.0, 300)
    assert paired_percentile_error_ci(x, 1.5 * x, 50, resamples=7) == (pytest.approx(0.5), pytest.approx(0.5))


def test_too_few_requests_give_none():
    assert paired_percentile_error_ci([], [], 50) is None
    assert paired_percentile_error_ci([0.1], [0.2], 50) is None
    assert paired_percentile_error_ci([0.0, 0.0], [0.1, 0.2], 50) is None  # no positive live percentile


@pytest.mark.parametrize("kw,message", [
    ({"live": [1.0, 2.0], "sim": [1.0]}, "two flat sequences of one length"),
    ({"sim": [1.0, float("nan")]}, "finite numbers only"),
    ({"q": 101}, "q must be a percentile in \\[0, 100\\], got 101"),
    ({"level": 1.0}, "level must be in \\(0, 1\\), got 1.0"),
    ({"resamples": 0}, "resamples must be a whole number >= 1, got 0"),
    ({"resamples": 2.5}, "resamples must be a whole number >= 1, got 2.5"),
    ({"resamples": True}, "resamples must be a whole number >= 1, got True"),
])
def test_bad_arguments_are_a_clear_error(kw, message):
    args = {"live": [1.0, 2.0], "sim": [1.0, 2.0], "q": 50, **kw}
    with pytest.raises(ValueError, match=message):
        paired_percentile_error_ci(**args)


def test_error_intervals_of_the_judged_metrics():
    ttft = [(0.1 * k, 0.12 * k) for k in range(1, 40)]
    tpot = [(0.005, 0.005)]  # one request: no interval
    got = error_intervals(ttft, tpot)
    assert got["level"] == 0.95 and got["resamples"] == 2000
    for k in ("p50_ttft_ms", "p90_ttft_ms"):
        assert got[k] == [pytest.approx(0.2), pytest.approx(0.2)]
    assert got["p50_tpot_ms"] is None and "p99_ttft_ms" not in got  # P99: no interval


def test_validate_prints_each_errors_interval():
    import json
    from pathlib import Path

    from pdd.sim.validate import error_distribution, format_validate

    v = json.loads((Path(__file__).resolve().parents[2] / "data" / "profiles" / "calibration-run"
                    / "validate.json").read_text())
    v["ttft_error_per_request"] = error_distribution([0.1, -0.2])
    assert "95% interval" in format_validate(v) and "paired bootstrap" not in format_validate(v)  # none recorded
    v["err_ci"] = {"p50_ttft_ms": [-0.123, 0.402], "p90_ttft_ms": [0.0, 0.05], "p99_ttft_ms": None,
                   "p50_tpot_ms": None, "level": 0.95, "resamples": 2000}
    text = format_validate(v)
    assert "-0.123 .. +0.402" in text and "+0 .. +0.05" in text  # rel_err's units
    assert "95% interval: rel_err's paired bootstrap over the compared requests" in text


def test_an_overflowing_error_is_left_out_not_a_nan_interval():
    """A live percentile so small (subnormal) that sim / live overflows: those resamples are left
    out like a non-positive live percentile, never a (nan, nan) interval with RuntimeWarnings."""
    import warnings

    from pdd.sim.uncertainty import paired_percentile_error_ci

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paired_percentile_error_ci([1e-320] * 3, [1.0] * 3, 50) is None
        lo, hi = paired_percentile_error_ci([1e-320, 1.0, 1.0, 1.0], [1.0, 1.1, 1.1, 1.1], 50)
    assert lo == lo and hi == hi and lo <= hi


def test_share_interval_is_wilsons():
    """Wilson's score interval at 95% (z = 1.959964): 92 of 100 -> [0.8500, 0.9589] (as the
    published tables give), exactly 0 / 1 at the ends, None for no requests."""
    from pdd.sim.uncertainty import share_interval

    assert share_interval(92, 100) == pytest.approx((0.8500189, 0.9589065), abs=1e-6)
    assert share_interval(0, 10) == pytest.approx((0.0, 0.2775328), abs=1e-6) and share_interval(0, 10)[0] == 0.0
    assert share_interval(100, 100)[1] == 1.0 and share_interval(100, 100)[0] == pytest.approx(0.9630065, abs=1e-6)
    assert share_interval(0, 0) is None
    for hits, n, msg in ((3, 2, "hits must be in"), (-1, 5, "hits must be in"), (1.5, 5, "whole number"),
                         (True, 5, "whole number")):
        with pytest.raises(ValueError, match=msg):
            share_interval(hits, n)
    with pytest.raises(ValueError, match="level"):
        share_interval(1, 2, level=1.0)
