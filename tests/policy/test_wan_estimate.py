import pytest

from pdd.policy.wan_estimate import WanEstimate


def test_median_ignores_one_burst_sample():
    est = WanEstimate(window=5)
    assert est.gbps is None
    for g in (0.05, 0.049, 0.051):
        est.add(g)
    assert est.gbps == 0.05
    assert est.add(1.86) == pytest.approx(0.0505)  # 4 samples: mean of the middle two
    assert est.add(0.05) == 0.05  # the burst does not move the median


def test_window_drops_oldest_and_ignores_meaningless_samples():
    est = WanEstimate(window=3)
    for g in (1.0, 2.0, 3.0, 4.0):
        est.add(g)
    assert list(est.samples) == [2.0, 3.0, 4.0] and est.gbps == 3.0
    assert est.add(0.0) == 3.0 and est.add(-1.0) == 3.0 and est.add(float("inf")) == 3.0
    assert est.add(float("nan")) == 3.0
    assert len(est.samples) == 3


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window"):
        WanEstimate(window=0)
