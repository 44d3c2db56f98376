"""What keeps a topology from being settled (``pdd.launch.busy_reasons``), read from the
gateway's /pdd/stats: the waits of tests and benchmarks (``Topology.wait_idle``,
``bench.live.HttpServer.wait_idle``) send a next request only once it is empty."""

from pdd.launch import busy_reasons


def test_settled_stats_have_no_reason():
    st = {"instances": {"p0": {"running": 0}, "md0": {"running": 0}}, "link": {"in_flight_a_to_b": 0},
          "transfers_pending": 0, "requests_live": 0, "kv_awaited": 0}
    assert busy_reasons(st) == []
    assert busy_reasons({}) == []  # a server without pdd's stats (vLLM) is settled


def test_each_kind_of_pending_work_is_named():
    st = {"instances": {"p0": {"running": 0}, "md0": {"running": 2}, "rld0": {"error": "closed"}},
          "link": {"in_flight_a_to_b": 0, "in_flight_b_to_a": 512}, "transfers_pending": 1,
          "requests_live": 3, "kv_awaited": 1}
    assert busy_reasons(st) == ["md0 running 2", "link in_flight_b_to_a 512", "transfers_pending 1", "kv_awaited 1"]


def test_a_relayed_request_whose_kv_still_crosses_to_md_is_pending_work():
    # every instance idle and the line empty, but the gateway still awaits MD's kv_ready of a
    # request RLD finished: MD caches that prompt's pages only when its KV lands
    st = {"instances": {"md0": {"running": 0}}, "link": {}, "transfers_pending": 0, "kv_awaited": 1}
    assert busy_reasons(st) == ["kv_awaited 1"]
