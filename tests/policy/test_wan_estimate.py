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


def test_loss_caps_the_estimate_at_one_connections_mathis_rate():
    from pdd.policy.tcp_model import mathis_gbps

    m = mathis_gbps(1460, 20.0, 1e-3)  # 0.0226 Gbit/s
    est = WanEstimate.for_line(0.05, 20.0, loss_rate=1e-3)
    assert est.cap_gbps == pytest.approx(m, rel=1e-12)
    assert est.gbps == pytest.approx(m, rel=1e-12)  # before a sample: min(line, cap)
    assert est.add(0.04) == pytest.approx(m, rel=1e-12)  # a burst above the cap reads as the cap
    assert est.add(0.01) == pytest.approx(m, rel=1e-12)  # median of 0.04, 0.01: 0.025, above the cap
    assert est.add(0.01) == 0.01  # median below the cap
    # light loss: the cap is above the line; the first estimate is the line's rate
    assert WanEstimate.for_line(0.05, 20.0, loss_rate=1e-5).gbps == 0.05
    # no loss: exactly the plain estimate (None before a sample, no cap)
    plain = WanEstimate.for_line(0.05, 20.0)
    assert plain.gbps is None and plain.cap_gbps is None and plain.add(1.86) == 1.86
    # a sender reporting the loss it saw sets the cap from then on
    est = WanEstimate.for_line(0.05, 20.0)
    est.add(0.05)
    assert est.add(0.05, loss_rate=1e-2) == pytest.approx(mathis_gbps(1460, 20.0, 1e-2), rel=1e-12)


@pytest.mark.parametrize("bad", [1.0, -0.1])
def test_bad_loss_rate_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"loss_rate must be in \[0, 1\)"):
        WanEstimate.for_line(0.05, 20.0, loss_rate=bad)
    with pytest.raises(ValueError, match=r"loss_rate must be in \[0, 1\)"):
        WanEstimate().add(0.05, loss_rate=bad)


def test_a_striped_transfer_is_capped_at_its_connections_mathis_rate():
    from pdd.policy.tcp_model import mathis_gbps

    m = mathis_gbps(1460, 20.0, 1e-3)  # 0.0226 Gbit/s per connection
    two = WanEstimate.for_line(0.05, 20.0, loss_rate=1e-3, connections=2)
    assert two.cap_gbps == pytest.approx(2 * m, rel=1e-12)
    assert two.gbps == pytest.approx(2 * m, rel=1e-12)  # 0.0452 < the line
    assert WanEstimate.for_line(0.05, 20.0, loss_rate=1e-3, connections=4).gbps == 0.05  # the line binds
    with pytest.raises(ValueError, match="connections must be >= 1"):
        WanEstimate(connections=0)
