"""Instance-seconds from a membership log (pdd.policy.autoscale.instance_seconds) and the bench's
window over two /pdd/autoscale snapshots (pdd.bench.autoscaling)."""

from __future__ import annotations

import pytest

from pdd.bench.autoscaling import decision_counts, mode_autoscale
from pdd.policy.autoscale import instance_seconds, pick_drain, role_home_dc

INITIAL = {"p0": ("prefill", "active"), "rld0": ("relay_decode", "active"), "md0": ("main_decode", "active"),
           "md1": ("main_decode", "standby")}
EVENTS = [
    {"time": 95.0, "op": "drain", "instance": "md0", "role": "main_decode", "to": "draining"},  # before t0: ignored
    {"time": 110.0, "op": "add", "instance": "md1", "role": "main_decode", "to": "active"},
    {"time": 130.0, "op": "drain", "instance": "md1", "role": "main_decode", "to": "draining"},
    {"time": 134.5, "op": "remove", "instance": "md1", "role": "main_decode", "to": "removed"},
    {"time": 140.0, "op": "add", "instance": "md1", "role": "main_decode", "to": "active"},
    {"time": 170.0, "op": "remove", "instance": "md1", "role": "main_decode", "to": "removed"},  # after t1
]


def test_instance_seconds_exact():
    u = instance_seconds(INITIAL, EVENTS, 100.0, 150.0)
    # p0, rld0, md0: the whole 50 s; md1: 110..134.5 (active then draining) + 140..150
    assert u["by_instance"] == {"p0": 50.0, "rld0": 50.0, "md0": 50.0, "md1": 24.5 + 10.0}
    assert u["by_role"] == {"prefill": 50.0, "relay_decode": 50.0, "main_decode": 84.5}
    assert u["total"] == 184.5
    assert u["timeline"]["main_decode"] == [[0.0, 1], [10.0, 2], [30.0, 2], [34.5, 1], [40.0, 2]]
    assert u["timeline"]["prefill"] == [[0.0, 1]]


def test_instance_seconds_fixed_and_unknown_instance():
    assert instance_seconds(INITIAL, [], 0.0, 10.0)["total"] == 30.0  # md1 standby costs nothing
    ev = [{"time": 4.0, "op": "add", "instance": "md2", "role": "main_decode", "to": "active"}]
    assert instance_seconds({}, ev, 0.0, 10.0)["by_instance"] == {"md2": 6.0}
    with pytest.raises(ValueError):
        instance_seconds(INITIAL, [], 10.0, 0.0)


def test_pick_drain():
    assert pick_drain([("md0", 3, True)]) is None
    assert pick_drain([("md0", 0, True), ("md1", 0, False)]) == "md1"  # the added one first
    assert pick_drain([("md0", 0, True), ("md1", 2, False)]) == "md0"  # fewest in flight first
    assert pick_drain([("md0", 1, False), ("md1", 1, False)]) == "md1"  # then the latest listed


def test_pick_drain_keeps_the_last_main_decoder_in_b():
    """A relay decoder re-roled to main-decode duty in A (rld0) is drained before any MD in B,
    busier or not; the last MD in B never goes while it serves (../shared/PDD.md: MD in B)."""
    assert pick_drain([("md0", 0, True, "B"), ("rld0", 5, True, "A")], "B") == "rld0"
    assert pick_drain([("md0", 0, True, "B"), ("md1", 0, False, "B"), ("rld0", 2, True, "A")], "B") == "rld0"
    # several in A: the rule among them; none in A: the rule as without datacenters
    assert pick_drain([("md0", 0, True, "B"), ("rld0", 2, True, "A"), ("rld1", 1, True, "A")], "B") == "rld1"
    assert pick_drain([("md0", 0, True, "B"), ("md1", 2, False, "B")], "B") == "md0"
    assert pick_drain([("md0", 0, True, "B"), ("rld0", 5, True, "A")]) == "md0"  # no home given: in flight alone
    assert pick_drain([("rld0", 5, True, "A")], "B") is None
    assert role_home_dc([("prefill", "A"), ("relay_decode", "A"), ("main_decode", "B"), ("main_decode", "B")],
                        "main_decode") == "B"
    assert role_home_dc([("prefill", "A"), ("main_decode", "A")], "main_decode") == "A"  # same_dc_pd's d0
    assert role_home_dc([("prefill", "A")], "main_decode") is None


def _snap(t, states, events=(), decisions=(), enabled=True):
    return {"enabled": enabled, "time": t, "decisions": list(decisions),
            "membership": {"instances": {n: {"role": r, "state": s, "since": 0.0} for n, (r, s) in states.items()},
                           "events": list(events)}}


def test_bench_window_from_two_snapshots():
    decisions = [
        {"time": 90.0, "applied": [{"op": "add", "instance": "md1"}]},  # before the window
        {"time": 109.0, "applied": [{"op": "add", "instance": "md1"}]},
        {"time": 129.0, "applied": [{"op": "drain", "instance": "md1", "remove_when_idle": True}]},
        {"time": 139.0, "applied": [{"op": "add", "error": "no free slot"}]},
        {"time": 140.0, "applied": []},
        {"time": 145.0, "applied": [], "under_way": [{"op": "add", "role": "main_decode"}]},  # starting
    ]
    assert decision_counts(decisions, 100.0, 150.0) == {"scale_ups": 2, "scale_downs": 1, "errors": 1}
    before = _snap(100.0, INITIAL, EVENTS[:1])
    after = _snap(150.0, INITIAL, EVENTS[:5], decisions)
    a = mode_autoscale(before, after)
    assert a["instance_seconds"] == 184.5 and a["window_s"] == 50.0 and a["mean_instances"] == 3.69
    assert a["instance_seconds_by_role"]["main_decode"] == 84.5
    assert (a["scale_ups"], a["scale_downs"], a["errors"], a["enabled"]) == (2, 1, 1, True)
    assert [e["op"] for e in a["events"]] == ["add", "drain", "remove", "add"]
    assert mode_autoscale(before, None) is None
    fixed = mode_autoscale(_snap(0.0, INITIAL, enabled=False), _snap(20.0, INITIAL, enabled=False))
    assert (fixed["instance_seconds"], fixed["scale_ups"], fixed["enabled"]) == (60.0, 0, False)
