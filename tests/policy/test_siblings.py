"""pdd.policy.siblings: a choice waits for its sibling's KV on MD when the copy costs the line
more than a round trip."""
from pdd.policy.siblings import sibling_waits_for_kv


def test_waits_when_copies_take_longer_than_a_round_trip():
    # 100 tokens x 2 KiB = 204,800 B; one copy on 0.05 Gbit/s is 32.8 ms of line, RTT 20 ms
    assert sibling_waits_for_kv(204_800, 1, 0.05, 20.0)
    # 4 tokens' KV (8 KiB): one copy 1.3 ms; three copies 3.9 ms: cheaper to send than to wait
    assert not sibling_waits_for_kv(8192, 1, 0.05, 20.0)
    assert not sibling_waits_for_kv(8192, 3, 0.05, 20.0)
    # the boundary: copies' line time equal to the RTT does not wait; above it waits
    rtt_bytes = int(0.020 * 0.05e9 / 8)  # 125,000 B
    assert not sibling_waits_for_kv(rtt_bytes, 1, 0.05, 20.0)
    assert sibling_waits_for_kv(rtt_bytes // 2 + 1, 2, 0.05, 20.0)


def test_nothing_to_share_or_no_siblings():
    assert not sibling_waits_for_kv(0, 7, 0.05, 20.0)
    assert not sibling_waits_for_kv(10**9, 0, 0.05, 20.0)


def test_zero_rtt_or_dead_line():
    assert sibling_waits_for_kv(1, 1, 100.0, 0.0)  # any line time beats a zero round trip
    assert sibling_waits_for_kv(1, 1, 0.0, 20.0)  # a line that never finishes a copy


def test_a_claim_is_waited_for_when_its_copy_would_cost_the_line_more_than_a_round_trip():
    """claim_waits_for_kv: one copy of the claimed pages' KV against the round trip (the sibling
    rule with one sibling). 15 Gbit/s, 30 ms: 30 ms of line is 56,250,000 bytes."""
    from pdd.policy.siblings import claim_waits_for_kv

    rtt_bytes = 15e9 / 8 * 0.030
    assert rtt_bytes == 56_250_000
    assert not claim_waits_for_kv(56_250_000, 15.0, 30.0)  # exactly a round trip: sent again
    assert claim_waits_for_kv(56_250_001, 15.0, 30.0)
    assert claim_waits_for_kv(4096 * 131072, 15.0, 30.0)  # a 4,096-token Llama-3.1-8B prefix: 286 ms of line
    assert claim_waits_for_kv(512 * 131072, 15.0, 30.0)  # one 512-token block: 35.8 ms of line
    assert not claim_waits_for_kv(256 * 131072, 15.0, 30.0)  # 256 tokens: 17.9 ms, a copy is cheaper
    assert claim_waits_for_kv(1, 0.0, 30.0) and not claim_waits_for_kv(0, 15.0, 30.0)
