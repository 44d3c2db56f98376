"""The gateway's WAN probes end to end (``policy.wan_probe_interval_s``): with no request at all,
an idle MD across the emulated line is probed (MD answers ``wan_probe``), and its RTT and goodput
samples and the probe counters show on /pdd/stats and /metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow


def test_an_idle_md_is_probed_and_its_estimate_sampled(small_model, topology_factory):
    cfg = make_cfg(small_model, "cross_dc_pd", engine={"device": "cpu"},
                   policy={"wan_probe_interval_s": 0.5, "wan_probe_bytes": 131072})
    topo = topology_factory(cfg)
    deadline = time.monotonic() + 60
    st = topo.stats()
    while st["wan_probes"]["goodput_samples"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)  # probes come on the gateway's own clock: poll its counters
        st = topo.stats()
    assert st["wan_probes"]["goodput_samples"] >= 2, st["wan_probes"]
    assert st["wan_probes"]["failures"] == 0
    assert st["wan_probes"]["bytes"] == 131072 * st["wan_probes"]["probes"]
    md = st["wan_peers"]["md0"]
    assert md["rtt_samples"] >= 2 and md["goodput_samples"] >= 2
    # the emulated line's round trip (20 ms) is the floor of every sample
    assert md["rtt_ms_measured"] >= cfg.link.wan_rtt_ms - cfg.link.wan_jitter_ms
    assert st["totals"]["requests"] == 0  # no request was needed
    text = httpx.get(topo.url + "/metrics").text
    assert 'pdd_gateway_wan_probes_total{outcome="ok"}' in text
