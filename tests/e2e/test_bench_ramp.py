"""``pdd bench --url --load-profile ramp`` against ``pdd serve --autoscale`` (a live pdd topology with
a standby MD): the ramp's peak fills the only MD, the gateway's loop adds md1, and once the load
has fallen it drains one MD and removes it. Every request of the ramp completes, the report carries
the mode's instance-seconds and decision counts, and the decision log holds a scale-up and a
scale-down. Waits on the decision log, never on a sleep."""

from __future__ import annotations

import json

import httpx
import pytest

from pdd.bench.bench import main
from tests.e2e.conftest import make_cfg
from tests.e2e.test_elastic import _wait

pytestmark = pytest.mark.slow


def _applied(url: str, op: str) -> list[dict]:
    log = httpx.get(url + "/pdd/autoscale", timeout=30).json()
    return [a for d in log["decisions"] for a in d["applied"] if a.get("op") == op and "error" not in a]


def test_bench_ramp_against_autoscaled_topology(small_model, topology_factory, tmp_path):
    cfg = make_cfg(small_model, "pdd", instances={"prefill": 1, "relay_decode": 1, "main_decode": 2},
                   standby=["md1"], engine={"device": "cpu", "min_step_ms": 30, "max_running": 4},
                   limits={"max_inflight_requests": 0, "tier_max_waiting": 64},  # queue at the peak, no 429
                   autoscale={"enabled": True, "interval_s": 1.0, "sample_s": 0.1, "cooldown_s": 2.0,
                              "max": {"main_decode": 2}, "up_at": 0.5, "down_at": 0.2})
    topo = topology_factory(cfg)
    url = topo.url
    cfg_file = tmp_path / "cfg.json"  # the model's token space and served name for the client
    cfg_file.write_text(cfg.model_dump_json())
    out = tmp_path / "bench"
    rc = main(["--url", url, "--config", str(cfg_file), "--out", str(out), "--requests", "24", "--session-sample", "1",
               "--load-profile", "ramp", "--peak-rate", "8", "--low-rate", "1", "--phase-seconds", "1:2:2:2",
               "--min-output", "40", "--max-output", "40", "--max-input", "200", "--slo", "ttft:100000",
               "tpot:100000", "--sweep-rate", "none", "--no-warmup", "--no-progress"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["workload"]["rate_schedule"] == [[0, 1], [1, 1], [3, 8], [5, 8], [7, 1], [8, 1]]
    m = rep["modes"]["pdd"]
    assert m["completed"] == 24 and m["failed"] == 0, m.get("errors")
    a = m["autoscale"]
    assert a["enabled"] is True and a["scale_ups"] >= 1, a
    # P, RLD and md0 are members the whole window; md1 only once added
    assert a["instance_seconds"] >= 3 * a["window_s"] - 1e-6
    assert a["instance_seconds_by_role"]["main_decode"] >= a["window_s"] - 1e-6
    assert (out / "autoscale.png").stat().st_size > 0
    _wait(lambda: _applied(url, "add"), "a scale-up in the decision log", timeout_s=120)
    down = _wait(lambda: _applied(url, "drain"), "a scale-down in the decision log", timeout_s=120)
    assert down[0]["remove_when_idle"] is True
    print(f"BENCH_RAMP instance_seconds={a['instance_seconds']} window_s={a['window_s']} ups={a['scale_ups']} "
          f"downs_in_window={a['scale_downs']} p90_ttft_ms={m['p90_ttft_ms']:.0f}")
