"""P's prefill interference on a shared host (``SimConfig.prefill_interference``: P's step runs
slower while a decoding instance is in a step, as on the one-machine CPU testbed, where each
decoded token also keeps the gateway and the client busy), its fit from a live run's isolated
prefills' steps and P's mean live step (``calibrate.calibrate_p_interference``), and the
validation's replay of the requests as the live client sent them (``validate.as_sent``)."""

import dataclasses

import numpy as np
import pytest

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.recorded import RecordedRunError, check_role_fits
from pdd.sim.sim_config import with_live_fit
from pdd.sim.validate import as_sent, sim_records
from pdd.workload.replay import ReplayRequest
# A: a short prompt decoding on D; B: a long prompt arriving at 2 s while A decodes; run(): the
# simulation, with every page and counter back to 0 at its end
from tests.sim.test_decode_interference import A, B, HOST, run


def test_a_prefill_beside_decoding_takes_the_factor_longer():
    base = run(HOST, [A, B])
    slow = run(HOST.replace(prefill_interference=2.0), [A, B])
    a0, a1 = base.reqs[0], slow.reqs[0]
    b0, b1 = base.reqs[1], slow.reqs[1]
    assert a1.t_prefill_done == a0.t_prefill_done  # A's prefill: nothing decodes beside it
    w = b0.t_prefill_done - B["timestamp"] / 1000.0  # B's prefill alone, P idle when it comes
    assert a0.t_done > b1.t_prefill_done  # A decodes all along B's prefill
    assert b1.t_prefill_done - B["timestamp"] / 1000.0 == pytest.approx(2 * w, rel=1e-9)
    p0, p1 = base.tiers["P"][0], slow.tiers["P"][0]
    assert p1.steps == p0.steps
    assert p1.busy_s - p0.busy_s == pytest.approx(w, rel=1e-9)  # P's busy time holds the slow-down


def test_the_step_in_flight_is_re_timed_when_the_decoders_stop():
    a = {**A, "output_length": 330}  # A's last token comes during B's prefill
    base = run(HOST, [a, B])
    slow = run(HOST.replace(prefill_interference=2.0), [a, B])
    t0, w = B["timestamp"] / 1000.0, base.reqs[1].t_prefill_done - B["timestamp"] / 1000.0
    end = slow.reqs[0].t_done
    assert t0 < end < t0 + w  # A ends inside B's prefill (a single step)
    # half pace until A's decoding ends, full pace for the rest of the work
    assert slow.reqs[1].t_prefill_done == pytest.approx(end + (w - (end - t0) / 2.0), rel=1e-12)


def test_without_a_shared_host_or_decoding_beside_nothing_changes():
    off = HOST.replace(host_cores=0.0)  # one accelerator per instance: the factor does not apply
    assert [r.t_done for r in run(off, [A, B]).reqs] == \
        [r.t_done for r in run(off.replace(prefill_interference=2.0), [A, B]).reqs]
    late = {**B, "timestamp": 60_000}  # B comes after A finished: nothing decodes beside it
    a, b = run(HOST, [A, late]), run(HOST.replace(prefill_interference=2.0), [A, late])
    assert a.reqs[0].t_done < 60.0
    assert [r.t_done for r in a.reqs] == [r.t_done for r in b.reqs]
    # a factor of 1 is none: the same run to the last event
    one = run(HOST.replace(prefill_interference=1.0), [A, B])
    assert [r.t_done for r in run(HOST, [A, B]).reqs] == [r.t_done for r in one.reqs]


@pytest.mark.parametrize("bad", [0.5, float("inf"), float("nan"), True, "2", None])
def test_the_factor_is_checked(bad):
    with pytest.raises(ValueError, match=r"prefill_interference must be a finite factor >= 1"):
        HOST.replace(prefill_interference=bad)


def test_a_profile_s_factor_is_checked_and_applied(tmp_path):
    with pytest.raises(RecordedRunError, match=r"prefill_interference must be a finite number >= 1"):
        check_role_fits({"prefill_interference": 0.9}, tmp_path / "p.json")
    check_role_fits({"prefill_interference": 1.3}, tmp_path / "p.json")
    assert with_live_fit(HOST, {"prefill_interference": 1.3}).prefill_interference == 1.3
    assert with_live_fit(HOST, {}).prefill_interference == 1.0


def test_the_factor_is_found_again_from_p_s_mean_step(tmp_path):
    """calibrate_p_interference: given P's mean step of a run simulated with a factor of 1.3 on a
    shared host (each prefill has the previous request decoding beside it), the factor is
    found again; a live mean step below the factor-free one, or above the largest factor's, gives
    None (the level's job), as does a run where nothing decodes beside P."""
    from types import SimpleNamespace

    from pdd.sim.calibrate import calibrate_p_interference
    from pdd.sim.validate import sim_role_steps, simulate
    from tests.sim.test_profile_validate import _overhead_fixture

    prof, p, cfg, _ = _overhead_fixture(tmp_path)
    reqs = [SimpleNamespace(arrival_s=0.5 * i, prompt_ids=[0] * (200 + 64 * (i % 9)), max_tokens=200,
                            hash_ids=list(range(100 * i, 100 * i + 13 + 4 * (i % 9)))) for i in range(40)]
    prof = {**prof, "role_step_scale": {"P": 1.5}}
    ovh = {"P": 0.004, "RLD": 0.004, "MD": 0.008}

    def mean_step(f):
        return sim_role_steps(simulate(cfg, p, {**prof, "prefill_interference": f}, 16, reqs, ovh))["P"]["mean_step_s"]

    target = mean_step(1.3)
    assert target > mean_step(1.0) * 1.02  # the fixture's prefills do run beside decoding
    got = calibrate_p_interference(cfg, p, prof, 16, reqs, target, ovh)
    assert got == pytest.approx(1.3, abs=2e-3)
    assert mean_step(got) == pytest.approx(target, rel=1e-3)
    assert calibrate_p_interference(cfg, p, prof, 16, reqs, 0.9 * mean_step(1.0), ovh) is None
    assert calibrate_p_interference(cfg, p, prof, 16, reqs, 10 * target, ovh, f_max=2.0) is None
    # one request: nothing decodes beside its prefill, no factor moves P's step
    alone = reqs[:1]
    m = sim_role_steps(simulate(cfg, p, prof, 16, alone, ovh))["P"]["mean_step_s"]
    assert calibrate_p_interference(cfg, p, prof, 16, alone, 1.2 * m, ovh) is None


def req(idx, t):
    return ReplayRequest(idx=idx, arrival_s=t, prompt_ids=[1] * 9000, max_tokens=2, trace_record={},
                         hash_ids=tuple(range(idx * 100, idx * 100 + 18)), block_tokens=512)


def test_requests_are_replayed_as_the_live_client_sent_them():
    reqs = [req(0, 1.0), req(1, 1.0), req(2, 3.0)]
    live = [{"send_s": 1.0021}, {"send_s": 1.0008}, {"ok": False}]  # a tie sent in the other order
    sent = as_sent(reqs, live)
    assert [r.arrival_s for r in sent] == [1.0021, 1.0008, 3.0]  # no send_s: the schedule's
    assert [dataclasses.replace(r, arrival_s=0) for r in sent] == [dataclasses.replace(r, arrival_s=0) for r in reqs]
    # on one P, the request sent first is prefilled first, whatever its index
    cfg = SimConfig(mode="same_dc_pd", n_p=1, n_d=1, warmup_frac=0.0)
    on_schedule = ClusterSim(cfg).run(sim_records(reqs[:2]))
    as_live = ClusterSim(cfg).run(sim_records(sent[:2]))
    assert on_schedule.reqs[0].t_prefill_done < on_schedule.reqs[1].t_prefill_done
    assert as_live.reqs[1].t_prefill_done < as_live.reqs[0].t_prefill_done


def test_a_late_clock_does_not_stall_a_re_timed_step():
    """At a late simulated time a step's last sliver of work is below the clock's resolution: a
    timeout of it would not move the clock, and the re-timing loop spun for ever (found with a
    hand-edited dispatch delay of 1e5 s). Two days into a run, the step ends."""
    late = [{**A, "timestamp": 200_000_000}, {**B, "timestamp": 200_002_000}]
    sim = run(HOST.replace(prefill_interference=1.3), late)
    assert 200_002.0 < sim.reqs[1].t_prefill_done < 200_003.0


@pytest.mark.parametrize("bad", [-0.001, 60.5, 1e308, float("inf"), float("nan"), True, "5"])
def test_the_dispatch_delay_is_checked(bad, tmp_path):
    with pytest.raises(ValueError, match=r"p_dispatch_s must be a number of seconds in \[0, 60\]"):
        HOST.replace(p_dispatch_s=bad)
    if isinstance(bad, float) and bad > 60 and bad != float("inf"):
        with pytest.raises(RecordedRunError, match=r"p_dispatch_s must be a finite number >= 0 and <= 60,"):
            check_role_fits({"p_dispatch_s": bad}, tmp_path / "p.json")
