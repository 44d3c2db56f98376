"""The gateway's autoscaling loop in the simulator (pdd.sim.autoscale) on a load ramp: the decision
sequence is exact (one scale-up on the way up, one scale-down on the way down), every decision is
what the runtime's rule decides on the same inputs, and instance-seconds follow the membership log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdd.config import AutoscaleConfig
from pdd.gateway.autoscale import Autoscaler
from pdd.load_profile import ramp_schedule, schedule_arrivals
from pdd.policy.autoscale import AutoscaleInputs, RoleLoad, decide_mix
from pdd.sim.autoscale import autoscaled_sim, fixed_summary, parse_role_counts, retime
from pdd.sim.cluster import ClusterSim
from pdd.sim.report import summarize
from pdd.sim.sim_config import SimConfig

ACFG = AutoscaleConfig(enabled=True, interval_s=5, sample_s=0.5, cooldown_s=10, max={"main_decode": 3},
                       up_at=0.75, down_at=0.25)
# a 250 ms pipeline budget (not the runtime's 50 ms): the ramp's 1024-token prompts go P->MD, so
# the MD added at the peak still decodes when it is drained (75 -> 75.5 s) and the drain is seen
# waiting for it; at 50 ms they are relayed and the idle MD0 goes at once
CFG = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, max_running_md=4, wan_gbps=25, wan_rtt_ms=30, ttft_budget_ms=250.0)


def _records():
    """A ramp 0.5 -> 4 -> 0.5 req/s (20 s phases), 1024-token prompts without shared prefixes,
    200 output tokens: MD (4 decode slots) fills at the peak."""
    arr = schedule_arrivals(ramp_schedule(0.5, 4.0, (20, 20, 20, 20)), 1000, seed=0)
    return [{"timestamp": 0.0, "input_length": 1024, "output_length": 200, "hash_ids": [10 * i + 1, 10 * i + 2]}
            for i in range(len(arr))], arr


def _inputs(d: dict) -> AutoscaleInputs:
    x = dict(d)
    return AutoscaleInputs(roles=tuple(RoleLoad(**r) for r in x.pop("roles")), **x)


def test_ramp_scales_md_up_then_down():
    recs, arr = _records()
    assert len(arr) == 167
    sim = autoscaled_sim(CFG, ACFG).run(retime(recs, arr))
    assert all(r.finished for r in sim.reqs)
    a = sim.autoscaler
    # what pick_drain is given, as the gateway gives it: each tier's datacenter, MD's slots in B
    assert (a.dc, a.slots) == ({"P": "A", "RLD": "A", "MD": "B"}, [("main_decode", "B")])
    changes = [(d["time"], o["op"], o["instance"]) for d in a.decisions for o in d["applied"]]
    assert changes == [(35.0, "add", "MD1"), (75.0, "drain", "MD1")]
    assert [(e["time"], e["op"], e["instance"], e["to"]) for e in a.events] == [
        (35.0, "add", "MD1", "active"), (75.0, "drain", "MD1", "draining"), (75.5, "remove", "MD1", "removed")]
    up = next(d for d in a.decisions if d["applied"] and d["applied"][0]["op"] == "add")
    down = next(d for d in a.decisions if d["applied"] and d["applied"][0]["op"] == "drain")
    assert up["inputs"]["roles"] == [{"role": "main_decode", "active": 1, "utilisation": 0.7955}]
    assert down["inputs"]["roles"] == [{"role": "main_decode", "active": 2, "utilisation": 0.1364}]
    assert up["inputs"]["prompt_tokens_mean"] == 1024 and up["inputs"]["output_tokens_mean"] == 200
    # the decision right after each change holds for the cool-down
    after_up = a.decisions[a.decisions.index(up) + 1]["decision"]
    assert after_up["reason"].startswith("cool-down") and {r["action"] for r in after_up["roles"]} == {"hold"}

    # the same inputs through the runtime's loop's rule (built from the same config): the same decisions
    gw = Autoscaler(SimpleNamespace(), ACFG)
    assert gw.rule == a.rule
    for d in a.decisions:
        assert decide_mix(_inputs(d["inputs"]), gw.rule).as_dict() == d["decision"]

    s = summarize(sim)
    t1 = s["duration_s"]
    auto = a.summary(t1)
    assert (auto["scale_ups"], auto["scale_downs"], auto["errors"]) == (1, 1, 0)
    assert auto["instance_seconds_by_role"]["main_decode"] == pytest.approx(t1 + 40.5, abs=1e-5)
    assert auto["instance_seconds"] == pytest.approx(3 * t1 + 40.5, abs=1e-5)  # P, RLD, MD0 all along + MD1
    assert auto["timeline"]["main_decode"] == [[0.0, 1], [35.0, 2], [75.0, 2], [75.5, 1]]


def test_fixed_topology_costs_its_instances_all_along():
    recs, arr = _records()
    sim = ClusterSim(CFG).run(retime(recs, arr))
    t1 = summarize(sim)["duration_s"]
    f = fixed_summary(sim, t1)
    assert f["instance_seconds"] == pytest.approx(3 * t1) and f["scale_ups"] == 0


def test_role_counts_and_refusals():
    assert parse_role_counts("md=3,rld=2") == {"main_decode": 3, "relay_decode": 2}
    for bad in ("md", "md=0", "d=2", "md=x"):
        with pytest.raises(ValueError, match="--autoscale"):
            parse_role_counts(bad)
    with pytest.raises(ValueError, match="no main_decode tier"):
        autoscaled_sim(SimConfig(mode="same_dc_pd"), ACFG)
    with pytest.raises(ValueError, match="below its 4"):
        autoscaled_sim(CFG.replace(n_md=4), ACFG)


def test_pdd_sim_run_autoscale_cli(capsys, tmp_path):
    """The CLI path: a ramp retimes the workload, the loop's decisions and instance-seconds are
    printed and written; bad autoscale flags are refused naming them."""
    import json

    from pdd.cli import main as pdd_main

    out = tmp_path / "s.json"
    rc = pdd_main(["sim", "run", "--mode", "pdd", "--agentic", "3000", "--n-p", "4", "--n-rld", "2", "--n-md", "2",
                   "--max-running-seqs", "8", "--load-profile", "ramp", "--peak-rate", "4", "--low-rate", "1",
                   "--phase-seconds", "120:240:120:240", "--autoscale", "md=6", "--autoscale-interval", "10",
                   "--autoscale-cooldown", "30", "--autoscale-start-s", "60", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    s = json.loads(out.read_text())
    a = s["autoscale"]
    assert s["rate_schedule"] == [[0, 1], [120, 1], [360, 4], [480, 4], [720, 1], [840, 1]]
    assert a["scale_ups"] >= 1 and a["scale_downs"] >= 1 and a["errors"] == 0
    ups = [d for d in a["decisions"] if any(o["op"] == "add" for o in d["applied"])]
    assert "autoscale t=" in text and "-> add MD" in text and "-> drain MD" in text
    assert f"instance-seconds {a['instance_seconds']:.1f}" in text
    # an add serves 60 s after its decision (--autoscale-start-s): the membership event follows
    adds = [e for e in a["events"] if e["op"] == "add"]
    assert [e["time"] for e in adds] == [round(d["time"] + 60, 6) for d in ups][:len(adds)]
    for argv, msg in ((["--autoscale", "md=0"], "--autoscale: expected ROLE=N"),
                      (["--autoscale", "md=2", "--autoscale-down-at", "0.5"], "--autoscale-down-at: 0.5"),
                      (["--autoscale", "md=1", "--n-md", "2"], "below its 2"),
                      (["--peak-rate", "3"], "--peak-rate: only with --load-profile ramp")):
        with pytest.raises(SystemExit) as ex:
            pdd_main(["sim", "run", "--agentic", "20"] + argv)
        assert ex.value.code == 2
        assert msg in capsys.readouterr().err


def test_pdd_sim_run_names_its_rate_schedule_in_its_summary_line(capsys):
    """With ``--rate-schedule`` / ``--load-profile ramp`` the output said only the rates measured;
    the summary line names the schedule that was run."""
    from pdd.cli import main as pdd_main

    assert pdd_main(["sim", "run", "--agentic", "20", "--rate-schedule", "0:1,4:3,8:1"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("simulated ")]
    assert len(line) == 1 and line[0].startswith("simulated 10 requests (") and (
        " s of traffic at rate schedule 0s:1, 4s:3, 8s:1 req/s) in " in line[0])
    assert pdd_main(["sim", "run", "--agentic", "20", "--load-profile", "ramp", "--peak-rate", "2",
                     "--phase-seconds", "1:2:1:2"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("simulated ")]
    assert " s of traffic at rate schedule 0s:0.5, 1s:0.5, 3s:2, 4s:2, 6s:0.5, 7s:0.5 req/s) in " in line[0]
