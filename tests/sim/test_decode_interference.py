"""The simulator's decode interference on a shared host (``SimConfig.decode_interference``: a
decode step slows while another instance runs a prefill step, as on the one-machine CPU testbed)
and its fit from a live run's token gaps (``live_measures.live_decode_interference``)."""

import pytest

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.live_measures import live_decode_gaps, live_decode_interference

# A: a short prompt with a long output, decoding on D; B: a long prompt arriving while A decodes
A = {"timestamp": 0, "input_length": 512, "output_length": 3000, "hash_ids": [0]}
B = {"timestamp": 2000, "input_length": 8192, "output_length": 1, "hash_ids": list(range(100, 116))}
HOST = SimConfig(mode="same_dc_pd", n_p=1, n_d=1, host_cores=2.0, warmup_frac=0.0)
SLOW = {"D": 2.0}


def run(cfg, recs):
    sim = ClusterSim(cfg).run(recs)
    for insts in sim.tiers.values():
        for inst in insts:
            assert inst.private == 0 and inst.slots == 0 and not inst.seqs, inst.name
    assert sim.host_prefilling == 0 and sim.host_busy == 0 and sim.host_decoding == 0
    return sim


def test_a_decode_slows_by_the_factor_while_a_prefill_runs_beside_it():
    base = run(HOST, [A, B])
    slow = run(HOST.replace(decode_interference=SLOW), [A, B])
    a0, a1 = base.reqs[0], slow.reqs[0]
    b0, b1 = base.reqs[1], slow.reqs[1]
    p0, p1 = base.tiers["P"][0], slow.tiers["P"][0]
    assert p0.busy_s == p1.busy_s and p0.steps == p1.steps  # P's prefill steps are not slowed
    assert b1.t_prefill_done == b0.t_prefill_done  # B's prefill ends at the same time
    window = b0.t_prefill_done - B["timestamp"] / 1000.0  # P's steps for B (A decodes throughout)
    d = base.tiers["D"][0]
    step = d.busy_s / d.steps  # A decodes alone: every D step the same length
    assert a0.t_done > b0.t_prefill_done  # A still decodes when B's prefill ends
    # over the window, A runs at half pace: it ends window/2 later, give or take the step in
    # flight at each edge (finished at the pace it started with)
    assert a1.t_done - a0.t_done == pytest.approx(window / 2, abs=2 * step)
    assert a1.n_emitted == a0.n_emitted == 3000


def test_without_a_shared_host_or_an_overlapping_prefill_nothing_changes():
    # one accelerator per instance (host_cores 0): the factor does not apply
    off = HOST.replace(host_cores=0.0)
    a = run(off, [A, B])
    b = run(off.replace(decode_interference=SLOW), [A, B])
    assert [r.t_done for r in a.reqs] == [r.t_done for r in b.reqs]
    # B arrives after A finished: no decode beside its prefill
    late = {**B, "timestamp": 60_000}
    a = run(HOST, [A, late])
    b = run(HOST.replace(decode_interference=SLOW), [A, late])
    assert a.reqs[0].t_done < 60.0
    assert [r.t_done for r in a.reqs] == [r.t_done for r in b.reqs]
    # a factor for another role: D's steps unchanged
    a = run(HOST, [A, B])
    b = run(HOST.replace(decode_interference={"MD": 2.0}), [A, B])
    assert [r.t_done for r in a.reqs] == [r.t_done for r in b.reqs]


@pytest.mark.parametrize("bad", [0.5, float("inf"), float("nan"), True, "2"])
def test_the_factor_is_checked(bad):
    with pytest.raises(ValueError, match=r"decode_interference\['RLD'\]"):
        HOST.replace(decode_interference={"RLD": bad})


@pytest.mark.parametrize("role", ["P", "rld"])
def test_a_role_without_decode_steps_is_refused(role):
    with pytest.raises(ValueError, match=rf"decode_interference has role '{role}'; it applies to the decoding roles"):
        HOST.replace(decode_interference={role: 1.2})


def rec(send, p_first_ms, tokens, tiers=None, **ev):
    r = {"ok": True, "send_s": send, "token_times_s": tokens,
         "pdd": {"events_ms": {"p_first_token": p_first_ms, **ev}}}
    if tiers is not None:
        r["tiers"] = tiers
    return r


def test_token_gaps_split_by_what_p_did():
    # request 1's P interval: [10.0, 10.5) s
    p = rec(10.0, 500.0, [10.6, 10.7])
    # request 2 decodes 9.0 .. 10.8: gaps before and after P's interval (quiet), two with their
    # midpoint inside it (busy), two overlapping it with their midpoint outside (left out)
    d = rec(8.0, 100.0, [8.9, 9.0, 9.1, 9.2, 10.1, 10.3, 10.45, 10.6, 10.7, 10.8])
    g = live_decode_gaps([p, d])
    assert list(g) == ["all"]  # no per-token tiers in the records
    assert g["all"]["quiet"] == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 9.0-9.1, 9.1-9.2, 10.6-10.7, 10.7-10.8
    assert g["all"]["busy"] == pytest.approx([0.2, 0.15])  # 10.1-10.3, 10.3-10.45
    # 9.2-10.1 and 10.45-10.6 overlap P's interval in part, midpoint outside: left out;
    # the first token (8.9) starts no gap


def test_gaps_around_a_handoff_or_between_tiers_are_not_decode_gaps():
    d = rec(0.0, 100.0, [0.2, 0.3, 0.4, 0.9, 1.0, 1.1], handoff_call=450.0, switch=850.0)
    g = live_decode_gaps([d])
    # 0.4-0.9 overlaps the handoff (0.45 .. 0.85 s, +-20 ms): left out
    assert g["all"]["quiet"] == pytest.approx([0.1, 0.1, 0.1]) and g["all"]["busy"] == []
    # by tier: RLD's 0.3-0.4, MD's 1.0-1.1; 0.9-1.0 is RLD's token then MD's: left out
    d = rec(0.0, 100.0, [0.2, 0.3, 0.4, 0.9, 1.0, 1.1], ["rld", "rld", "rld", "rld", "md", "md"],
            handoff_call=450.0, switch=850.0)
    g = live_decode_gaps([d])
    assert g["rld"]["quiet"] == pytest.approx([0.1]) and g["md"]["quiet"] == pytest.approx([0.1])


def test_interference_is_the_ratio_of_medians_per_tier_and_needs_samples():
    p = rec(100.0, 50_000.0, [150.1, 150.2])  # P busy 100 .. 150 s
    # RLD: 60 gaps of 10 ms before P's interval, 61 of 15 ms inside it
    quiet = [50.0 + 0.01 * i for i in range(62)]
    busy = [110.0 + 0.015 * i for i in range(62)]
    rld = rec(49.0, 10.0, quiet + busy, ["rld"] * 124)
    # MD: 100 quiet gaps of 4 ms, never beside P: no factor of its own
    md = rec(160.0, 10.0, [161.0 + 0.004 * i for i in range(102)], ["md"] * 102)
    f = live_decode_interference([p, rld, md])
    assert f["factors"] == {"RLD": pytest.approx(1.5)}
    t = f["tiers"]["rld"]
    assert (t["busy_samples"], t["quiet_samples"]) == (61, 60)  # the gap 50.61 .. 110.0 overlaps in part
    assert live_decode_interference([p, rld, md], min_samples=62) is None
    # MD beside P too, 20 ms gaps inside P's interval against 4 ms quiet: its own factor
    md2 = rec(49.0, 10.0, [120.0 + 0.02 * i for i in range(62)], ["md"] * 62)
    f = live_decode_interference([p, rld, md, md2])
    assert f["factors"] == {"RLD": pytest.approx(1.5), "MD": pytest.approx(5.0)}
    # faster while P is busy: floored at 1; records without per-token tiers count for none
    d2 = rec(49.0, 10.0, [50.0 + 0.02 * i for i in range(62)] + busy, ["rld"] * 124)
    assert live_decode_interference([p, d2])["factors"] == {"RLD": 1.0}
    assert live_decode_interference([p, rec(49.0, 10.0, quiet + busy)]) is None


def test_md_profile_for_the_simulator_alone():
    """`pdd sim validate --profile-b`: MD's chip in the simulator, the live config untouched."""
    import json
    from pathlib import Path

    from pdd.sim import validate as V

    path = "data/profiles/this-machine.json"
    prof = json.loads(Path(path).read_text())
    cfg = V.validate_config(None, 40.0)
    a = V.sim_config(cfg, path, prof, 64)
    b = V.sim_config(cfg, path, prof, 64, profile_b="md-bf16.json")
    assert (a.profile_a, a.profile_b) == (path, path)
    assert (b.profile_a, b.profile_b) == (path, "md-bf16.json")
    assert cfg.engine_for("main_decode").profile is None


def test_a_factor_of_one_simulates_as_none():
    # calibrate-roles floors a ratio at 1: such a role must not re-time (poke) the decoders
    a = run(HOST, [A, B])
    b = run(HOST.replace(decode_interference={"D": 1.0}), [A, B])
    assert [r.t_done for r in a.reqs] == [r.t_done for r in b.reqs]
    assert a.tiers["D"][0].busy_s == b.tiers["D"][0].busy_s


@pytest.mark.parametrize("tiers", [["rld"], "rld", [None] * 3, [1, 1, 1]])
def test_malformed_per_token_tiers_count_for_no_tier(tiers):
    # a hand-edited or truncated requests.jsonl: no IndexError, no role named "NONE" or "1"
    g = live_decode_gaps([rec(0.0, 100.0, [0.2, 0.3, 0.4], tiers)])
    assert list(g) == ["all"]


def test_a_role_the_simulator_does_not_have_is_refused(tmp_path):
    import json
    from pathlib import Path

    from pdd.sim.recorded import RecordedRunError, load_profile_checked

    prof = json.loads(Path("data/profiles/this-machine.json").read_text())
    p = tmp_path / "p.json"
    p.write_text(json.dumps({**prof, "decode_interference": {"rld": 1.5}}))
    with pytest.raises(RecordedRunError, match=r"decode_interference has role 'rld'"):
        load_profile_checked(p)
    # P's steps are the prefills themselves: a factor for it would be silently unused
    p.write_text(json.dumps({**prof, "decode_interference": {"P": 1.2}}))
    with pytest.raises(RecordedRunError, match=r"decode_interference has role 'P'; roles are RLD, MD, D, C"):
        load_profile_checked(p)


@pytest.mark.parametrize("field,value,message", [
    ("send_s", None, "send_s is missing"),
    ("send_s", "0.5", "send_s must be a number"),
    ("token_times_s", [0.1, "x"], "token_times_s must be a list of numbers"),
    ("pdd", {"events_ms": {"p_first_token": "7"}}, "pdd.events_ms must be an object of numbers"),
    ("pdd", None, "pdd is missing on a completed request"),
])
def test_a_malformed_record_is_named_not_a_traceback(tmp_path, field, value, message):
    """calibrate-roles and validate --live-from read a recorded run's records: a record whose
    fields the fits read are of the wrong type is refused naming the file, line and field."""
    import json

    from pdd.sim.recorded import RecordedRunError, read_run

    good = rec(1.0, 50.0, [1.1, 1.2, 1.3], ["rld"] * 3)
    bad = dict(good)
    if value is None:
        del bad[field]
    else:
        bad[field] = value
    (tmp_path / "validate.json").write_text(json.dumps({"workload": {}}))
    (tmp_path / "server_stats.json").write_text("{}")
    (tmp_path / "requests.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordedRunError, match=f"requests.jsonl line 2: {message}"):
        read_run(tmp_path)
    (tmp_path / "requests.jsonl").write_text(json.dumps(good) + "\n")
    assert read_run(tmp_path)[1] == [good]


def test_validate_names_what_the_simulator_was_given():
    """`pdd sim validate` prints which MD profile and decode factors the re-simulation used, so a
    reader of the table knows whether --profile-b and the interference fit applied."""
    import json
    from pathlib import Path

    from pdd.sim.validate import error_distribution, format_validate

    v = json.loads((Path(__file__).resolve().parents[2] / "data" / "profiles" / "calibration-run"
                    / "validate.json").read_text())
    v["ttft_error_per_request"] = error_distribution([0.1, -0.2])  # the recorded file predates its P99
    v["profile"].update(path="fit.json", profile_b="md-bf16.json", decode_interference={"RLD": 1.39}, host_cores=2)
    assert ("simulated with: profile fit.json; MD's step from --profile-b md-bf16.json; decode step while P "
            "prefills: RLD x1.39 (2 shared cores)") in format_validate(v)
    v["profile"].update(profile_b=None, decode_interference={}, host_cores=2)
    assert "MD's step from the same profile (or MD's tier's own); decode step while P prefills: no factor" \
        in format_validate(v)
    v["live_failed"], v["live_errors"] = 2, ["ConnectionResetError"]
    assert "2 live failures (ConnectionResetError)" in format_validate(v)
    assert "WARNING" not in format_validate(v)
    v["live_faults"] = {"degraded": 10, "unreachable": ["md0"]}
    assert ("WARNING: the live run lost an instance (md0 unreachable at the run's end; 10 of "
            f"{v['requests_compared']} requests degraded (an instance lost mid-run))") in format_validate(v)


def test_alone_gaps_leave_out_any_gap_another_request_overlaps():
    from pdd.sim.live_measures import live_decode_alone_gaps

    p = rec(10.0, 500.0, [10.6, 10.7])  # in the system 10.0 .. 10.7 s: at P to 10.5, streaming from 10.6
    d = rec(8.0, 100.0, [8.9, 9.0, 9.1, 9.2, 10.1, 10.3, 10.45, 10.6, 10.65, 10.8, 10.9], ["rld"] * 11)
    d["prompt_tokens"] = 100
    g = live_decode_alone_gaps([p, d])
    # 9.2 .. 10.8 overlap the other request (10.65-10.8 in part: not alone either); the gap
    # between tokens i and i + 1 is a step over prompt + i tokens
    assert [(round(x, 6), c) for x, c in g["rld"]] == [(0.1, 101), (0.1, 102), (0.1, 109)]
    # a request between P's reply (12.1) and its first token (12.3): its KV on the way to RLD
    q = rec(12.0, 100.0, [12.3, 12.4])
    e = rec(11.0, 10.0, [11.5, 11.6, 11.7, 12.15, 12.25, 12.5], ["rld"] * 6)
    e["prompt_tokens"] = 10
    assert [(round(x, 6), c) for x, c in live_decode_alone_gaps([q, e])["rld"]] == [(0.1, 11)]
    assert live_decode_alone_gaps([rec(8.0, 100.0, [8.9, 9.0, 9.1])]) == {}  # no per-token tiers


def test_decode_scale_is_the_median_gap_over_the_bare_step():
    from pdd.sim.live_measures import live_decode_scale

    class Bare:  # 1 ms + 1 us a token of context
        def decode_time(self, batch, ctx):
            return 0.001 + 1e-6 * ctx

    t, tokens = 5.0, [5.0]
    for i in range(70):  # the gap before token i + 1: twice the bare step over 1,000 + i tokens
        t += 2 * (0.001 + 1e-6 * (1000 + i))
        tokens.append(t)
    r = rec(4.0, 100.0, tokens, ["rld"] * len(tokens))
    r["prompt_tokens"] = 1000
    md = rec(20.0, 100.0, [20.1 + 0.004 * i for i in range(10)], ["md"] * 10)  # 8 gaps: too few
    md["prompt_tokens"] = 10
    got = live_decode_scale([r, md], {"RLD": Bare(), "MD": Bare()})
    assert got["factors"] == {"RLD": pytest.approx(2.0, rel=1e-9)}
    assert got["tiers"]["rld"]["samples"] == 69  # the first token starts no gap
    assert live_decode_scale([r], {"RLD": Bare()}, min_samples=70) is None
    assert live_decode_scale([r], {"MD": Bare()}) is None  # no model for RLD's tier
