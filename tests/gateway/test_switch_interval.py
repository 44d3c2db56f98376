"""``gateway_switch_interval_ms``: the gateway process's thread switch interval (how long the event
loop may wait for the interpreter lock while the compiler thread runs Python)."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from pdd.config import ClusterConfig
from pdd.gateway.api import set_switch_interval


def test_the_gateway_sets_the_configured_interval_in_seconds():
    old = sys.getswitchinterval()
    try:
        assert set_switch_interval(ClusterConfig()) == 0.001  # the default, 1 ms
        assert sys.getswitchinterval() == pytest.approx(0.001)
        assert set_switch_interval(ClusterConfig(gateway_switch_interval_ms=5)) == 0.005
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("bad", [0, -1, 101])
def test_an_interval_out_of_range_is_refused(bad):
    with pytest.raises(ValidationError, match="gateway_switch_interval_ms"):
        ClusterConfig(gateway_switch_interval_ms=bad)
