"""The link emulator's loss-limited connections and cross traffic, through real sockets.

Times are asserted on the emulator's own computed schedule (each connection's ``sched_s``: the
seconds of line its bytes were scheduled over, idle gaps excluded), never on the wall clock."""

import asyncio
import os

import pytest

from pdd.policy import tcp_model as tm
from pdd.transfer.link import Link, normalize_config, query_stats, set_link
from pdd.transfer.peer import RemoteError

from .test_transfer_link import SinkServer, cfg, wait_for


async def push(link, sink, n):
    """Send ``n`` random bytes through the link (no EOF, so the connection's flow stays
    inspectable); wait until the sink has them all; return (the a->b flow, writer)."""
    data = os.urandom(n)
    r, w = await asyncio.open_connection("127.0.0.1", link.ports[0])
    w.write(data)
    await w.drain()
    await wait_for(lambda: sink.conns and sink.conns[0]["bytes"] == n, 30)
    assert bytes(sink.conns[0]["data"]) == data
    (flow,) = link.a_to_b.flows
    return flow, w


@pytest.mark.parametrize("loss", [1e-3, 1e-2])
async def test_loss_limits_one_connection_to_the_mathis_rate(loss):
    sink = await SinkServer().start()
    n, gbps, rtt = 400_000, 0.05, 20.0
    async with Link(cfg(sink.port, gbps=gbps, rtt_ms=rtt, loss_rate=loss, mss_bytes=1460)) as link:
        m = tm.mathis_gbps(1460, rtt, loss)
        assert m < gbps
        flow, w = await push(link, sink, n)
        assert flow.bytes_admitted == n
        # the emulator's schedule: n bytes over min(line, mathis), up to float sums
        assert flow.sched_s == pytest.approx(n * 8 / (min(gbps, m) * 1e9), rel=1e-9)
        # the line itself was busy only n / line: the rest was free for other connections
        assert link.stats()["busy_s_a_to_b"] == pytest.approx(n * 8 / (gbps * 1e9), rel=1e-9)
        st = link.stats()
        assert st["conn_gbps"] == pytest.approx(m, rel=1e-12)
        assert st["loss_rate"] == loss and st["mss_bytes"] == 1460
        w.close()
    await sink.close()


async def test_cross_traffic_takes_its_share_of_the_line():
    sink = await SinkServer().start()
    n, gbps = 400_000, 0.1
    async with Link(cfg(sink.port, gbps=gbps, rtt_ms=0, cross_traffic=[[0, 0.06]])) as link:
        assert link.stats()["cross_gbps"] == 0.06
        flow, w = await push(link, sink, n)
        assert flow.sched_s == pytest.approx(n * 8 / ((gbps - 0.06) * 1e9), rel=1e-9)
        assert link.stats()["busy_s_a_to_b"] == pytest.approx(flow.sched_s, rel=1e-9)
        w.close()
    await sink.close()


async def test_defaults_keep_the_plain_line():
    sink = await SinkServer().start()
    async with Link(cfg(sink.port, gbps=0.1, rtt_ms=10)) as link:
        st = link.stats()
        assert link._plain and st["conn_gbps"] is None and st["cross_gbps"] == 0.0 and st["loss_rate"] == 0.0
        flow, w = await push(link, sink, 200_000)
        assert flow.sched_s == pytest.approx(200_000 * 8 / (0.1 * 1e9), rel=1e-9)
        w.close()
    await sink.close()


async def test_control_port_sets_loss_and_cross_traffic():
    sink = await SinkServer().start()
    async with Link(cfg(sink.port, gbps=0.1, rtt_ms=20)) as link:
        host, port = "127.0.0.1", link.control_port
        st = await set_link(host, port, loss_rate=1e-3, cross_gbps=0.03)
        assert st["loss_rate"] == 1e-3 and st["cross_gbps"] == 0.03
        assert st["conn_gbps"] == pytest.approx(tm.mathis_gbps(1460, 20, 1e-3), rel=1e-12)
        assert len(st["cross_traffic"]) == 1 and st["cross_traffic"][0][1] == 0.03
        st = await set_link(host, port, cross_gbps=0.0, loss_rate=0.0)
        assert st["cross_gbps"] == 0.0 and st["conn_gbps"] is None and link._plain is False  # a schedule is set
        with pytest.raises(RemoteError, match=r"loss_rate must be in \[0, 1\)"):
            await set_link(host, port, loss_rate=1.0)
        assert (await query_stats(host, port))["loss_rate"] == 0.0
    await sink.close()


@pytest.mark.parametrize("kw,msg", [
    ({"loss_rate": 1.0}, r"loss_rate must be in \[0, 1\)"),
    ({"loss_rate": -0.5}, r"loss_rate must be in \[0, 1\)"),
    ({"cross_traffic": [[0, -1.0]]}, r"cross_traffic: Gbit/s must be >= 0"),
    ({"cross_traffic": [[5, 0.1], [1, 0.1]]}, r"cross_traffic: times must increase"),
    ({"mss_bytes": 0}, r"mss_bytes must be >= 1"),
])
def test_bad_link_config_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        normalize_config(cfg(1, **kw))


@pytest.mark.parametrize("kw,msg", [
    ({"gbps": float("nan")}, r"gbps must be a finite number > 0, got nan"),
    ({"gbps": float("inf")}, r"gbps must be a finite number > 0, got inf"),
    ({"gbps": 0.0}, r"gbps must be a finite number > 0, got 0.0"),
    # subnormal: passed > 0, then 8 / (gbps * 1e9) s per byte made a chunk's time inf
    ({"gbps": 1e-312}, r"gbps must be >= 1e-06 Gbit/s \(1 kbit/s: a 64 KiB chunk then takes 524 s; below it a "
                       r"chunk's time overflows\), got 1e-312"),
    ({"gbps": 9e-7}, r"gbps must be >= 1e-06 Gbit/s .*, got 9e-07"),
    ({"rtt_ms": float("inf")}, r"rtt_ms must be a finite number >= 0, got inf"),
    ({"jitter_ms": float("nan")}, r"jitter_ms must be a finite number >= 0, got nan"),
    ({"jitter_ms": -1.0}, r"jitter_ms must be a finite number >= 0, got -1.0"),
    # a minute at most: 1e12 ms passed >= 0 and held every byte past every timeout
    ({"rtt_ms": 1e12}, r"rtt_ms must be <= 60000 ms, got 1000000000000.0"),
    ({"jitter_ms": 60000.5}, r"jitter_ms must be <= 60000 ms, got 60000.5"),
    ({"loss_rate": 1e-3, "gbps": 0.0}, r"gbps must be a finite number > 0"),  # refused whole: loss unchanged
    ({"cross_gbps": 0.01, "rtt_ms": -1.0}, r"rtt_ms must be a finite number >= 0"),
])
async def test_control_port_refuses_a_bad_line_setting_and_changes_nothing(kw, msg):
    """The control port's set took gbps NaN (every later transfer's time NaN) and jitter or RTT
    inf, and a set refused for one field had already applied the loss rate or cross traffic given
    with it."""
    sink = await SinkServer().start()
    async with Link(cfg(sink.port, gbps=0.1, rtt_ms=20, jitter_ms=1)) as link:
        host, port = "127.0.0.1", link.control_port
        before = await query_stats(host, port)
        with pytest.raises(RemoteError, match=msg):
            await set_link(host, port, **kw)
        after = await query_stats(host, port)
        keys = ("gbps", "rtt_ms", "jitter_ms", "loss_rate", "cross_gbps", "cross_traffic", "conn_gbps")
        assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
    await sink.close()


@pytest.mark.parametrize("kw,msg", [
    ({"gbps": float("nan")}, r"gbps must be a finite number > 0, got nan"),
    ({"gbps": 1e-312}, r"gbps must be >= 1e-06 Gbit/s .*, got 1e-312"),
    ({"rtt_ms": float("inf")}, r"rtt_ms must be a finite number >= 0, got inf"),
    ({"rtt_ms": 1e12}, r"rtt_ms must be <= 60000 ms, got 1000000000000.0"),
])
def test_bad_link_line_config_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        normalize_config(cfg(1, **kw))
