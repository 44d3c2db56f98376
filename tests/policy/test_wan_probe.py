"""When an idle WAN peer is probed, and what a probe measures (``policy.wan_estimate.probe_due``,
``probe_goodput_gbps``). Exact values."""

from __future__ import annotations

import pytest

from pdd.policy.wan_estimate import probe_due, probe_goodput_gbps


def test_a_peer_is_due_once_per_interval_without_samples():
    assert probe_due(100.0, None, None, 5.0)  # never sampled nor probed
    assert not probe_due(100.0, 96.0, None, 5.0)  # a KV receive sample 4 s ago
    assert probe_due(101.0, 96.0, None, 5.0)  # 5 s ago: stale
    assert not probe_due(101.0, 90.0, 99.0, 5.0)  # probed 2 s ago
    assert probe_due(104.0, 90.0, 99.0, 5.0)
    assert not probe_due(1e9, None, None, 0.0)  # 0: probes off
    assert not probe_due(1e9, None, None, -1.0)


def test_probe_goodput_is_the_payloads_extra_time():
    # 131,072 bytes took 21 ms longer than the empty round trip: 0.0499322 Gbit/s
    assert probe_goodput_gbps(131072, 0.051, 0.030) == pytest.approx(131072 * 8 / 0.021 / 1e9, rel=1e-12)
    assert probe_goodput_gbps(125_000, 0.040, 0.020) == pytest.approx(0.05, rel=1e-12)
    assert probe_goodput_gbps(131072, 0.030, 0.030) is None  # no longer than the empty one
    assert probe_goodput_gbps(131072, 0.020, 0.030) is None
    assert probe_goodput_gbps(0, 0.050, 0.030) is None
