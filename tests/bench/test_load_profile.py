"""Rate schedules and their seeded arrivals (pdd.load_profile), the ramp flags of pdd bench, and
the autoscale mode suffix."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from pdd.bench.args import load_schedule
from pdd.bench.modes import mode_config, parse_mode_label
from pdd.config import ClusterConfig
from pdd.load_profile import (expected_arrivals, invert, parse_rate_schedule, ramp_schedule, rate_at,
                              schedule_arrivals)


def test_ramp_schedule_points_and_total():
    s = ramp_schedule(1, 4, (2, 4, 2, 4))
    assert s == ((0.0, 1.0), (2.0, 1.0), (6.0, 4.0), (8.0, 4.0), (12.0, 1.0), (14.0, 1.0))
    assert expected_arrivals(s) == 2 * 1 + 4 * 2.5 + 2 * 4 + 4 * 2.5 + 2 * 1  # 32 requests expected
    assert rate_at(s, 4.0) == 2.5 and rate_at(s, 7.0) == 4.0 and rate_at(s, 15.0) == 0.0
    assert ramp_schedule(0.5, 2, (0, 10, 0, 10)) == ((0.0, 0.5), (10.0, 2.0), (20.0, 0.5))


def test_arrivals_exact_for_a_seed_linear_rate():
    """Rate 1 + 0.2 t over [0, 10]: Lambda(t) = t + 0.1 t^2, so arrival k is at
    (-1 + sqrt(1 + 0.4 y_k)) / 0.2 with y_k the cumulative unit exponentials of default_rng(seed)."""
    s = parse_rate_schedule("0:1,10:3")
    got = schedule_arrivals(s, 100, seed=3)
    y = np.cumsum(np.random.default_rng(3).standard_exponential(100))
    want = [(-1 + math.sqrt(1 + 0.4 * v)) / 0.2 for v in y if v <= 20.0]  # Lambda(10) = 20
    assert len(got) == len(want)
    assert got == pytest.approx(want, abs=1e-9)
    assert schedule_arrivals(s, 100, seed=3) == got  # deterministic
    assert schedule_arrivals(s, 5, seed=3) == got[:5]  # n_max cuts, the times stay


def test_arrivals_exact_for_a_seed_ramp():
    got = schedule_arrivals(ramp_schedule(1, 4, (2, 4, 2, 4)), 100, seed=7)
    assert len(got) == 36
    assert [round(t, 9) for t in got[:4]] == [0.707529256, 1.732732604, 2.273276288, 2.895602312]
    # the first two fall in the low phase (rate 1): t = y; the third in the rise: 1 s + 0.375 s^2 = y - 2
    y = np.cumsum(np.random.default_rng(7).standard_exponential(3))
    assert got[0] == pytest.approx(y[0]) and got[1] == pytest.approx(y[1])
    s3 = got[2] - 2
    assert s3 + 0.375 * s3 * s3 == pytest.approx(y[2] - 2)
    assert all(b > a for a, b in zip(got, got[1:])) and got[-1] <= 14.0


def test_invert_flat_falling_and_beyond():
    s = parse_rate_schedule("0:2,5:2,10:0")
    assert invert(s, 4.0) == pytest.approx(2.0)
    assert invert(s, 10.0 + 4.0) == pytest.approx(5 + 5 - math.sqrt(5))  # falling: 2 s - 0.2 s^2 = 4
    assert invert(s, 15.0) == pytest.approx(10.0)
    assert invert(s, 15.1) is None


@pytest.mark.parametrize("text,msg", [
    ("0:1", "at least two"), ("1:1,2:2", "first point must be at t=0"), ("0:1,0:2", "increase strictly"),
    ("0:1,5:-1", ">= 0"), ("0:0,5:0", "every rate is 0"), ("0:1,x", "bad item 'x'"),
    # inf and NaN are named as such (were "increase strictly", "first point", "rates ... got 2 at t=inf")
    ("0:1,inf:2", "times must be finite seconds, got inf"), ("0:1,nan:2", "times must be finite seconds, got nan"),
    ("nan:1,5:2", "times must be finite seconds, got nan"), ("0:1,5:inf", "rates must be finite req/s, got inf at t=5"),
    ("0:nan,5:1", "rates must be finite req/s, got nan at t=0"), ("", "--rate-schedule: empty"), (" ", "empty"),
])
def test_bad_schedules_named(text, msg):
    with pytest.raises(ValueError, match="--rate-schedule") as e:
        parse_rate_schedule(text)
    assert msg in str(e.value)


def _args(**kw):
    base = dict(load_profile=None, rate_schedule=None, peak_rate=None, low_rate=None, phase_seconds=None,
                ramp=None, rate=2.0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_bench_flags_to_schedule():
    assert load_schedule(_args()) is None
    with pytest.raises(ValueError, match="--rate-schedule: empty"):  # "" was taken as no schedule
        load_schedule(_args(rate_schedule=""))
    assert load_schedule(_args(load_profile="ramp")) == ramp_schedule(0.5, 2.0, (10, 20, 10, 20))
    assert load_schedule(_args(load_profile="ramp", peak_rate=3, low_rate=1, phase_seconds="1:2:3:4")) == \
        ramp_schedule(1, 3, (1, 2, 3, 4))
    assert load_schedule(_args(rate_schedule="0:1,4:2")) == ((0.0, 1.0), (4.0, 2.0))
    for bad, msg in ((dict(load_profile="ramp", rate_schedule="0:1,4:2"), "give one"),
                     (dict(peak_rate=3), "--peak-rate: only with --load-profile ramp"),
                     (dict(load_profile="ramp", ramp="1:2"), "--ramp"),
                     (dict(load_profile="ramp", phase_seconds="1:2"), "--phase-seconds"),
                     (dict(load_profile="ramp", low_rate=5), "--low-rate")):
        with pytest.raises(ValueError, match=msg):
            load_schedule(_args(**bad))


def test_autoscale_mode_suffix():
    assert parse_mode_label("pdd+autoscale") == ("pdd", {"autoscale": True})
    assert parse_mode_label("pdd+autoscale=false+allow_p_rld") == ("pdd", {"autoscale": False, "allow_p_rld": True})
    with pytest.raises(ValueError, match="true or false"):
        parse_mode_label("pdd+autoscale=maybe")
    base = ClusterConfig.model_validate({"mode": "pdd", "instances": {"main_decode": 2}, "standby": ["md1"],
                                         "autoscale": {"max": {"main_decode": 2}}})
    assert mode_config(base, "pdd").autoscale.enabled is False
    on = mode_config(base, "pdd+autoscale")
    assert on.autoscale.enabled is True and on.standby == ["md1"] and on.autoscale.max == {"main_decode": 2}
    full = mode_config(base, "pdd+standby=none")
    assert full.standby == [] and full.autoscale.enabled is False
    assert parse_mode_label("pdd+standby=none") == ("pdd", {"standby": []})
    with pytest.raises(ValueError, match="takes none"):
        parse_mode_label("pdd+standby=md1")
    with pytest.raises(ValueError, match="max"):  # nothing to scale: refused before anything starts
        mode_config(ClusterConfig(), "pdd+autoscale")


def test_autoscale_lines():
    from pdd.bench.table import autoscale_lines

    a = {"instance_seconds": 118.514, "window_s": 36.081, "scale_ups": 1, "scale_downs": 1, "enabled": True}
    modes = {"pdd": {"request_goodput": 1.723, "p90_ttft_ms": 327.8, "failed": 0,
                     "autoscale": dict(a, enabled=False, instance_seconds=106.9)},
             "pdd+autoscale": {"request_goodput": 1.704, "p90_ttft_ms": 264.4, "failed": 2, "autoscale": a},
             "vllm_colocated": {"autoscale": None}}
    assert autoscale_lines(modes) == [
        "cost pdd: goodput 1.72 req/s, TTFT P90 327.8 ms, 0 failed, 106.9 instance-s over 36.1 s, autoscale off",
        "cost pdd+autoscale: goodput 1.70 req/s, TTFT P90 264.4 ms, 2 FAILED, 118.5 instance-s over 36.1 s, "
        "autoscale 1 up / 1 down"]


def test_the_rate_floor_is_inclusive_and_leaves_other_values_to_their_checks():
    """MIN_RATE_RPS (0.001 req/s) is accepted, anything > 0 below it refused with the floor named;
    0, negatives, NaN and inf keep their callers' own messages (None here)."""
    from pdd.load_profile import MIN_RATE_RPS, slow_rate_problem

    assert MIN_RATE_RPS == 1e-3
    for ok in (1e-3, 0.5, 1e6, 0.0, -1.0, math.nan, math.inf):
        assert slow_rate_problem(ok) is None and slow_rate_problem(ok, factor=True) is None
    assert slow_rate_problem(9.99e-4) == ("must be >= 0.001 req/s (one request per 1000 s on average; a lower "
                                          "rate's run would take hours), got 0.000999")
    assert slow_rate_problem(5e-324, factor=True) == (
        "must be >= 0.001 (a replay at most 1000 times slower than the trace; a slower one's run would not end), "
        "got 4.94066e-324")


def test_a_schedule_s_shape_names_its_rates_in_turn_and_its_span():
    """What a run's progress bar and summary line say of a rate schedule (the mean alone hid it)."""
    from pdd.load_profile import shape

    assert shape(ramp_schedule(1, 4, (2, 4, 2, 4))) == "1 -> 4 -> 1 req/s over 14 s"
    assert shape(parse_rate_schedule("0:0.5,20:4,40:0.5")) == "0.5 -> 4 -> 0.5 req/s over 40 s"
    assert shape(parse_rate_schedule("0:2,10:2")) == "2 req/s over 10 s"
    assert shape(parse_rate_schedule("0:0,5:3,7.5:3")) == "0 -> 3 req/s over 7.5 s"
