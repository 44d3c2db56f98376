import pytest

from pdd.policy.cutoff import predict_rld_finishes_first, should_cut_off
from pdd.policy.routing import InstanceLoad, choose_instance
from pdd.policy.wan_order import TransferView, pick_next


def test_should_cut_off_truth_table():
    assert should_cut_off(True, False) is True
    assert should_cut_off(True, True) is False
    assert should_cut_off(False, False) is False
    assert should_cut_off(False, True) is False


def test_predict():
    assert predict_rld_finishes_first(10, 0.02, 1.0) is True  # 0.2 s < 1 s
    assert predict_rld_finishes_first(100, 0.02, 1.0) is False  # 2 s


T = [TransferView("a", 500, 3), TransferView("b", 100, 7), TransferView("c", 100, 5), TransferView("d", 900, 1)]


def test_fifo_and_srf():
    assert pick_next(T, "fifo") == 3
    assert pick_next(T, "srf") == 2  # tie on 100 bytes broken by enqueued_seq
    with pytest.raises(ValueError):
        pick_next([], "fifo")
    with pytest.raises(ValueError):
        pick_next(T, "lifo")


def L(name, running=0, queued=0, used=0, total=100, hit=0):
    return InstanceLoad(name, running, queued, used, total, hit)


def test_round_robin_and_load():
    c = [L("a", 3), L("b", 1, 1), L("c", 1, 1, used=10)]
    assert choose_instance(c, "round_robin", rr_counter=7) == 1
    assert choose_instance(c, "load") == 1  # load 2, util 0 beats c's util 0.1


def test_cache_aware_prefers_longest_prefix_within_slack():
    c = [L("a", running=2, hit=0), L("b", running=6, hit=4096), L("c", running=5, hit=4096)]
    assert choose_instance(c, "cache_aware", load_slack=8) == 2  # tie on hit, lower load
    assert choose_instance(c, "cache_aware", load_slack=3) == 2  # b (6 > 2+3) ineligible
    assert choose_instance(c, "cache_aware", load_slack=2) == 0  # only a eligible


def test_cache_aware_skips_full_pools():
    c = [L("a", used=100, hit=9999), L("b", used=50, hit=10)]
    assert choose_instance(c, "cache_aware") == 1
    assert choose_instance([L("a", used=100), L("b", used=100, hit=5)], "cache_aware") == 1


def test_a_full_queue_is_chosen_only_when_every_candidate_is_full():
    """A candidate whose bounded queue is full (the router's own count) is skipped by every policy
    while another has room, whatever its prefix hit or load; all full: the policy as usual."""
    import dataclasses

    c = [L("a", running=3, hit=4096), L("b", running=9, hit=0), L("c", running=1, hit=0)]
    full = [dataclasses.replace(c[0], full=True), c[1], dataclasses.replace(c[2], full=True)]
    assert choose_instance(c, "cache_aware", load_slack=4) == 0  # the hit within the slack
    assert choose_instance(full, "cache_aware", load_slack=4) == 1  # the only one with room
    assert choose_instance(full, "load") == 1
    assert [choose_instance(full, "round_robin", rr_counter=k) for k in range(3)] == [1, 1, 1]
    timed = [dataclasses.replace(x, transfer_s=0.01 * i) for i, x in enumerate(full)]
    assert choose_instance(timed, "cache_aware") == 1  # with WAN estimates too
    every = [dataclasses.replace(x, full=True) for x in c]
    for pol in ("cache_aware", "load", "round_robin"):
        assert choose_instance(every, pol, rr_counter=2, load_slack=4) == choose_instance(c, pol, rr_counter=2,
                                                                                          load_slack=4)


def test_load_cap_skips_an_instance_at_its_tpot_batch_while_another_is_below():
    """The MD holding the prompt's prefix within the slack wins until its load reaches the cap;
    then the longest hit among those below it; every one at the cap: the policy as without one."""
    c = [L("a", running=56, queued=1, hit=60000), L("b", running=30, hit=4096), L("c", running=10, hit=0)]
    assert choose_instance(c, "cache_aware", load_slack=64) == 0  # 57 <= 10 + 64: the hit wins
    assert choose_instance(c, "cache_aware", load_slack=64, load_cap=58) == 0  # 57 < 58
    assert choose_instance(c, "cache_aware", load_slack=64, load_cap=57) == 1  # a at 57: b's hit
    assert choose_instance(c, "cache_aware", load_slack=64, load_cap=30) == 2  # only c below (b at 30)
    assert choose_instance(c, "cache_aware", load_slack=64, load_cap=10) == 0  # none below: no cap
    assert choose_instance(c, "load", load_cap=11) == 2
    assert choose_instance(c, "round_robin", rr_counter=3, load_cap=30) == 2
    import dataclasses
    timed = [dataclasses.replace(x, transfer_s=t) for x, t in zip(c, (0.02, 0.3, 0.6))]
    assert choose_instance(timed, "cache_aware", load_slack=64, load_cost_s=0.001) == 0
    assert choose_instance(timed, "cache_aware", load_slack=64, load_cost_s=0.001, load_cap=57) == 1


def test_empty_and_bad():
    with pytest.raises(ValueError):
        choose_instance([], "load")
    with pytest.raises(ValueError):
        choose_instance([L("a")], "random")


def test_cache_aware_min_hit_fraction_falls_back_to_load():
    c = [L("a", running=5, hit=512), L("b", running=1, hit=0), L("c", running=0, used=5, hit=0)]
    assert choose_instance(c, "cache_aware") == 0  # any hit wins within the slack
    assert choose_instance(c, "cache_aware", prompt_tokens=12000, min_hit_frac=0.5) == 2  # 4% hit: least loaded
    assert choose_instance(c, "cache_aware", prompt_tokens=800, min_hit_frac=0.5) == 0  # 64% hit: affinity


def test_should_cut_off_lets_short_remainders_finish():
    # the anomaly filter only cancels what would still take long; short remainders keep MD's cache aligned
    assert should_cut_off(True, False, remaining_wan_s=0.2, min_remaining_s=0.5) is False
    assert should_cut_off(True, False, remaining_wan_s=0.5, min_remaining_s=0.5) is True
    assert should_cut_off(True, False, remaining_wan_s=3.0, min_remaining_s=0.5) is True
    assert should_cut_off(True, False, remaining_wan_s=None, min_remaining_s=0.5) is True
    assert should_cut_off(True, True, remaining_wan_s=9.0, min_remaining_s=0.0) is False
    assert should_cut_off(False, False, remaining_wan_s=9.0, min_remaining_s=0.0) is False


def test_a_transfer_mostly_received_is_let_through():
    """``sent_fraction`` at ``max_sent_fraction`` or more lets a transfer finish however long its
    rest: a cut-off would throw away what crossed and the next turn would send it all again."""
    from pdd.policy.cutoff import sent_fraction

    assert sent_fraction(1_000_000, 4_000_000) == 0.25
    assert sent_fraction(5_000_000, 4_000_000) == 1.0 and sent_fraction(-1, 4_000_000) == 0.0
    assert sent_fraction(10, 0) == 0.0
    assert should_cut_off(True, False, 60.0, 0.5, sent_fraction=0.25, max_sent_fraction=0.25) is False
    assert should_cut_off(True, False, 60.0, 0.5, sent_fraction=0.24, max_sent_fraction=0.25) is True
    assert should_cut_off(True, False, None, 0.5, sent_fraction=0.9, max_sent_fraction=0.25) is False
    assert should_cut_off(True, False, 60.0, 0.5, sent_fraction=0.9) is True  # 1 by default: time alone
    assert should_cut_off(True, False, 0.2, 0.5, sent_fraction=0.0, max_sent_fraction=0.25) is False


def test_the_cut_off_reads_an_in_flight_transfer_s_own_rate():
    """The remaining time from MD's last progress report (``inflight_remaining_s``): a 4 MB
    transfer whose finished-transfer estimate (0.05 Gbit/s) said 0.24 s left, 0.4 s in, has 1 MB
    in and crawls at 0.4 Mbit/s: 60 s left, less the report's age (at most one report interval);
    the cut-off then cancels it."""
    from pdd.policy.handoff import early_handoff_delay_s
    from pdd.policy.wan_estimate import inflight_remaining_s

    stale = early_handoff_delay_s(4_000_000, 0.05, 0.4)
    assert stale == pytest.approx(0.24, abs=1e-12) and not should_cut_off(True, False, stale, 0.5)
    assert inflight_remaining_s(4_000_000, 1_000_000, 0.0004, 0.0) == 60.0
    assert inflight_remaining_s(4_000_000, 1_000_000, 0.0004, 0.25) == 59.75
    assert inflight_remaining_s(4_000_000, 1_000_000, 0.0004, 1.5) == 59.5  # one report interval credited at most
    assert should_cut_off(True, False, inflight_remaining_s(4_000_000, 1_000_000, 0.0004, 1.5), 0.5) is True
    # at the line's rate the rest is 0.48 s: let through, MD's cache keeps the prompt
    assert inflight_remaining_s(4_000_000, 1_000_000, 0.05, 0.0) == 0.48
    assert should_cut_off(True, False, inflight_remaining_s(4_000_000, 1_000_000, 0.05, 0.0), 0.5) is False
    assert inflight_remaining_s(4_000_000, 1_000_000, 0.05, 1.0) == 0.0  # the report is older than the rest
    assert inflight_remaining_s(4_000_000, 4_000_000, 0.0, 0.0) == 0.0  # all in: nothing left, any rate
    assert inflight_remaining_s(4_000_000, 5_000_000, 0.05, 0.0) == 0.0
    assert inflight_remaining_s(4_000_000, 0, 0.0, 0.0) == float("inf")  # nothing moves: cut off


def test_wan_send_buffer_is_one_bdp_with_a_floor():
    from pdd.policy.wan_order import MIN_SEND_BUFFER_BYTES, send_buffer_bytes

    # 0.05 Gbit/s x 20 ms = 125,000 bytes; 100 Gbit/s x 20 ms = 250 MB
    assert send_buffer_bytes(0.05, 20.0, 1.0) == 125_000
    assert send_buffer_bytes(100.0, 20.0, 1.0) == 250_000_000
    assert send_buffer_bytes(0.05, 20.0, 2.0) == 250_000
    assert send_buffer_bytes(0.05, 2.0, 1.0) == MIN_SEND_BUFFER_BYTES == 65536  # 12.5 kB: the floor
    assert send_buffer_bytes(0.05, 20.0, 0.0) is None  # the OS default
    with pytest.raises(ValueError):
        send_buffer_bytes(0.05, 20.0, -1.0)


def test_wan_lane_sends_small_transfers_on_the_express_lane():
    from pdd.policy.wan_order import express_max_bytes, wan_lane

    # 2 BDPs of 0.05 Gbit/s x 20 ms = 250,000 bytes; 0 = one lane
    limit = express_max_bytes(0.05, 20.0, 2.0)
    assert limit == 250_000
    assert express_max_bytes(0.05, 20.0, 0.0) == 0
    assert wan_lane(32_768, limit) == "express"  # a high-hit increment: one page
    assert wan_lane(250_000, limit) == "express"  # the bound is inclusive
    assert wan_lane(250_001, limit) == "bulk"
    assert wan_lane(0, limit) == "express"  # kv_done only (every page cached)
    assert wan_lane(32_768, 0) == "bulk"  # the lane disabled
    with pytest.raises(ValueError):
        express_max_bytes(0.05, 20.0, -1.0)


def test_a_stalled_transfer_s_remaining_time_does_not_run_down_to_zero():
    """MD reports on a frame's arrival at most every ``KV_PROGRESS_INTERVAL_S`` (0.5 s): a report
    older than that says no frame came since, so the age credits at most one interval of
    progress. 40 MB planned, 1 MB in at 0.05 Gbit/s: 6.24 s left; 10 s later with no newer report
    (an outage) still 5.74 s, so RLD's finish cuts it off. The age subtracted whole read 0 s and
    let the stalled transfer through."""
    from pdd.policy.wan_estimate import KV_PROGRESS_INTERVAL_S, inflight_remaining_s

    assert KV_PROGRESS_INTERVAL_S == 0.5
    assert inflight_remaining_s(40_000_000, 1_000_000, 0.05, 0.0) == pytest.approx(6.24, abs=1e-9)
    assert inflight_remaining_s(40_000_000, 1_000_000, 0.05, 0.3) == pytest.approx(5.94, abs=1e-9)
    assert inflight_remaining_s(40_000_000, 1_000_000, 0.05, 10.0) == pytest.approx(5.74, abs=1e-9)
    assert should_cut_off(True, False, inflight_remaining_s(40_000_000, 1_000_000, 0.05, 10.0), 0.5) is True
    assert inflight_remaining_s(40_000_000, 1_000_000, 0.05, 10.0, report_interval_s=2.0) == pytest.approx(4.24, abs=1e-9)


def test_progress_report_is_due_once_an_interval_passed_with_bytes_since():
    """MD's ``kv_progress`` (runtime and simulator alike): the bytes in and the rate since the
    previous report, once ``interval_s`` passed since it and bytes came since; else None."""
    from pdd.policy.wan_estimate import progress_report

    assert progress_report(10.0, 1_000_000, 10.5, 1_250_000) == (1_250_000, 0.004)  # 250 kB in 0.5 s
    assert progress_report(10.0, 1_000_000, 12.0, 1_250_000) == (1_250_000, 0.001)  # a stall: the rate since the mark
    assert progress_report(10.0, 1_000_000, 10.4, 1_250_000) is None  # under one interval
    assert progress_report(10.0, 1_000_000, 11.0, 1_000_000) is None  # nothing came since
    assert progress_report(10.0, 0, 10.0, 5, interval_s=0.0) is None  # no time passed
    assert progress_report(0.0, 0, 0.1, 125_000, interval_s=0.1) == (125_000, 0.01)
