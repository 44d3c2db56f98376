"""The lossy, shared line's pure math (pdd.policy.tcp_model): Mathis rate, cross traffic's share,
and the emulator's per-chunk schedule driven by a simulated reader (no sockets, no clock)."""

import math

import pytest

from pdd.policy import tcp_model as tm

CHUNK = 64 << 10
LEAD_S = 0.004  # pdd.transfer.link.RESUME_LEAD_S: a connection reads its next chunk this early


def test_mathis_rate_exact_values():
    # 1460 B * 8 / 20 ms = 584,000 bit/s per (window/segment); x sqrt(3/2) / sqrt(p)
    assert tm.mathis_gbps(1460, 20.0, 1e-4) == pytest.approx(0.0715251004892688, rel=1e-12)
    assert tm.mathis_gbps(1460, 20.0, 1e-3) == pytest.approx(0.02261822274185131, rel=1e-12)
    assert tm.mathis_gbps(1460, 40.0, 0.01) == pytest.approx(0.0035762550244634395, rel=1e-12)
    assert tm.MATHIS_C == pytest.approx(1.2247448713915890, rel=1e-15)
    # 4x the loss halves the rate; twice the RTT halves it
    assert tm.mathis_gbps(1460, 20.0, 4e-4) == pytest.approx(tm.mathis_gbps(1460, 20.0, 1e-4) / 2, rel=1e-12)
    assert tm.mathis_gbps(1460, 40.0, 1e-4) == pytest.approx(tm.mathis_gbps(1460, 20.0, 1e-4) / 2, rel=1e-12)
    assert tm.mathis_gbps(1460, 20.0, 0.0) == math.inf
    assert tm.mathis_gbps(1460, 0.0, 0.01) == math.inf


@pytest.mark.parametrize("bad", [1.0, -0.01, 1.5, float("nan")])
def test_loss_rate_outside_unit_interval_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"loss_rate must be in \[0, 1\)"):
        tm.mathis_gbps(1460, 20.0, bad)
    with pytest.raises(ValueError, match=r"^wan_loss_rate must be in"):
        tm.check_loss_rate(bad, "wan_loss_rate")


def test_mathis_bad_mss_and_rtt():
    with pytest.raises(ValueError, match="mss_bytes must be > 0"):
        tm.mathis_gbps(0, 20.0, 0.01)
    with pytest.raises(ValueError, match="rtt_ms must be >= 0"):
        tm.mathis_gbps(1460, -1.0, 0.01)


def test_cross_traffic_takes_exactly_its_share():
    assert tm.available_gbps(0.05, 0.025) == pytest.approx(0.025, rel=1e-12)
    assert tm.available_gbps(0.05, 0.0) == 0.05
    assert tm.available_gbps(0.05, 0.0499999) == pytest.approx(0.0005, rel=1e-12)  # floor: 1% of the line
    # 1 MB at 0.05 Gbit/s: 0.16 s alone, 0.32 s beside 0.025 Gbit/s of cross traffic
    assert tm.transfer_seconds(1_000_000, 0.05) == pytest.approx(0.16, rel=1e-12)
    assert tm.transfer_seconds(1_000_000, 0.05, cross_gbps=0.025) == pytest.approx(0.32, rel=1e-12)
    assert tm.serialize_end(2.0, 1_000_000, 0.05, ((0.0, 0.025),)) == pytest.approx(2.32, rel=1e-12)
    # loss below the line: the connection's rate decides; two connections double it
    m = tm.mathis_gbps(1460, 20.0, 1e-3)
    assert tm.transfer_seconds(1_000_000, 0.05, conn_gbps=m) == pytest.approx(8e6 / (m * 1e9), rel=1e-12)
    assert tm.transfer_seconds(1_000_000, 0.05, conn_gbps=m, connections=2) == pytest.approx(
        8e6 / (2 * m * 1e9), rel=1e-12)
    assert tm.transfer_seconds(1_000_000, 0.05, conn_gbps=m, connections=3) == pytest.approx(0.16, rel=1e-12)


def test_serialize_end_integrates_across_schedule_changes():
    sched = ((0.0, 0.0), (1.0, 0.04))  # line 0.05: 6.25 MB/s until 1 s, then 1.25 MB/s
    # 1.25 MB from 0.9 s: 0.625 MB by 1.0 s, the other 0.625 MB at 1.25 MB/s -> 1.5 s
    assert tm.serialize_end(0.9, 1_250_000, 0.05, sched) == pytest.approx(1.5, rel=1e-12)
    assert tm.serialize_end(1.2, 125_000, 0.05, sched) == pytest.approx(1.3, rel=1e-12)
    assert tm.serialize_end(0.0, 625_000, 0.05, sched) == pytest.approx(0.1, rel=1e-12)
    assert tm.cross_gbps_at(sched, 0.99) == 0.0 and tm.cross_gbps_at(sched, 1.0) == 0.04
    assert tm.cross_gbps_at(((5.0, 0.01),), 4.0) == 0.0


def test_parse_cross_traffic_and_bad_schedules():
    assert tm.parse_cross_traffic("0:0.5,10:2.0") == ((0.0, 0.5), (10.0, 2.0))
    assert tm.parse_cross_traffic(" 3:0.01 ") == ((3.0, 0.01),)
    with pytest.raises(ValueError, match=r"--cross-traffic: Gbit/s must be >= 0, got -1.0 at 0 s"):
        tm.parse_cross_traffic("0:-1")
    with pytest.raises(ValueError, match=r"--cross-traffic: times must increase"):
        tm.parse_cross_traffic("5:0.1,2:0.2")
    with pytest.raises(ValueError, match=r"--cross-traffic: expected seconds:Gbit/s, got '0.5'"):
        tm.parse_cross_traffic("0.5")
    with pytest.raises(ValueError, match=r"--cross-traffic: expected seconds:Gbit/s numbers"):
        tm.parse_cross_traffic("a:b")
    with pytest.raises(ValueError, match="no seconds:Gbit/s point"):
        tm.parse_cross_traffic(",")
    with pytest.raises(ValueError) as ex:  # was skipped: the schedule ran without the item
        tm.parse_cross_traffic("0:0.5,,10:2.0,")
    assert str(ex.value) == ("--cross-traffic: item 2 of '0:0.5,,10:2.0,' is empty; give seconds:Gbit/s points "
                             "separated by single commas")
    with pytest.raises(ValueError) as ex:
        tm.parse_cross_traffic("0:0.5,10:2.0, ")
    assert str(ex.value) == ("--cross-traffic: item 3 of '0:0.5,10:2.0, ' is empty; give seconds:Gbit/s points "
                             "separated by single commas")


def test_a_non_finite_schedule_point_is_named_as_such():
    """inf passes ">= 0": the message must say finite, not ">= 0, got inf"."""
    with pytest.raises(ValueError) as ex:
        tm.check_schedule([(5.0, math.inf)], "cross_traffic")
    assert str(ex.value) == "cross_traffic: Gbit/s must be a finite number, got inf at 5 s"
    with pytest.raises(ValueError) as ex:
        tm.check_schedule([(math.inf, 0.01)], "cross_traffic")
    assert str(ex.value) == "cross_traffic: time must be a finite number of seconds, got inf"
    with pytest.raises(ValueError) as ex:
        tm.check_schedule([(-1.0, 0.01)], "cross_traffic")
    assert str(ex.value) == "cross_traffic: time must be >= 0 s, got -1.0"
    with pytest.raises(ValueError, match=r"x: 0.05 Gbit/s at 0 s must be below the line's 0.05 Gbit/s"):
        tm.check_schedule([(0, 0.05)], "x", line_gbps=0.05)


def simulate(flows: dict, line_gbps: float, schedule=(), conn_gbps=math.inf):
    """The emulator's loop without sockets: every connection reads its next chunk as soon as its
    hold ends (``end - LEAD_S``) and hands it to :func:`tm.chunk_times`; returns, per flow, the
    end of its last chunk and its first read."""
    left = dict(flows)
    t_read = {k: 0.0 for k in flows}
    free = {k: 0.0 for k in flows}
    first = {}
    line_free = 0.0
    while left:
        k = min(left, key=lambda x: (t_read[x], x))
        now = t_read[k]
        n = min(CHUNK, left[k])
        first.setdefault(k, now)
        _, line_free, end = tm.chunk_times(now, n, line_free, free[k], line_gbps, schedule, conn_gbps)
        free[k] = end
        left[k] -= n
        if not left[k]:
            del left[k]
        t_read[k] = max(now, end - LEAD_S)
    return {k: free[k] - first[k] for k in flows}


@pytest.mark.parametrize("loss", [0.0, 1e-4, 1e-3, 1e-2])
def test_one_connection_moves_n_bytes_in_bytes_over_min_line_mathis(loss):
    n, line = 3_000_000 + 123, 0.05
    m = tm.mathis_gbps(1460, 20.0, loss)
    got = simulate({"a": n}, line, conn_gbps=m)["a"]
    expect = n * 8 / (min(line, m) * 1e9)
    # exact up to float sums: every chunk starts where the connection's previous one ended
    assert got == pytest.approx(expect, rel=1e-9)


def test_cross_traffic_slows_one_connection_by_exactly_its_share():
    n = 2_000_000
    got = simulate({"a": n}, 0.05, schedule=((0.0, 0.025),))["a"]
    assert got == pytest.approx(n * 8 / (0.025 * 1e9), rel=1e-9)
    # cross traffic and loss: the smaller of the two limits
    m = tm.mathis_gbps(1460, 20.0, 1e-3)  # 0.0226 < 0.05 - 0.02
    got = simulate({"a": n}, 0.05, schedule=((0.0, 0.02),), conn_gbps=m)["a"]
    assert got == pytest.approx(n * 8 / (m * 1e9), rel=1e-9)
    got = simulate({"a": n}, 0.05, schedule=((0.0, 0.04),), conn_gbps=m)["a"]
    assert got == pytest.approx(n * 8 / (0.01 * 1e9), rel=1e-9)


def test_loss_limited_connections_leave_the_line_to_others():
    """Two connections capped at 0.0226 Gbit/s each fit a 0.05 line together: each takes its own
    rate, within one chunk's time on the line (the emulator's quantum); a third uncapped share
    is what a line at 0.05 would give them all together."""
    n, line = 2_000_000, 0.05
    m = tm.mathis_gbps(1460, 20.0, 1e-3)
    quantum = CHUNK * 8 / (line * 1e9)
    got = simulate({"a": n, "b": n}, line, conn_gbps=m)
    for k in "ab":
        assert abs(got[k] - n * 8 / (m * 1e9)) <= quantum, got
    # without loss, the two share the line: both end together at 2n / line
    got = simulate({"a": n, "b": n}, line)
    for k in "ab":
        assert abs(got[k] - 2 * n * 8 / (line * 1e9)) <= quantum, got
