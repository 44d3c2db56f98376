"""The WAN backlog in the estimated transfer time (``policy.wan_estimate.transfer_seconds``,
``queued_bytes``, ``pipeline.expected_wan_seconds``): the bytes already queued to an MD cross
the line before a new request's missing KV. Exact values on the default line (0.05 Gbit/s =
6.25 MB/s, 20 ms)."""

from __future__ import annotations

import math

import pytest

from pdd.policy.pipeline import PipelineInputs, choose_pipeline, expected_wan_seconds
from pdd.policy.wan_estimate import PeerWanEstimates, queued_bytes, transfer_seconds
from pdd.types import Pipeline


def test_transfer_time_counts_the_backlog_ahead():
    # 625,000 bytes alone: 20 ms + 100 ms; behind 1,250,000 queued bytes: 20 + 300 ms
    assert transfer_seconds(625_000, 0.05, 20.0) == pytest.approx(0.12, abs=1e-12)
    assert transfer_seconds(625_000, 0.05, 20.0, backlog_bytes=1_250_000) == pytest.approx(0.32, abs=1e-12)
    assert transfer_seconds(0, 0.05, 20.0, backlog_bytes=625_000) == pytest.approx(0.12, abs=1e-12)
    assert transfer_seconds(0, 0.05, 20.0) == 0.02
    assert transfer_seconds(1, 0.0, 20.0) == math.inf
    peers = PeerWanEstimates(line_gbps=0.05, rtt_ms=20.0)
    assert peers.transfer_s("md0", 625_000, 625_000) == pytest.approx(0.22, abs=1e-12)


def test_queued_bytes_less_what_the_line_carried_since_the_oldest_started():
    # 1 MB + 0.5 MB planned, the oldest started 80 ms ago: 0.05 Gbit/s carried at most 500,000 bytes
    assert queued_bytes([1_000_000, 500_000], 0.08, 0.05) == pytest.approx(1_000_000, abs=1e-6)
    assert queued_bytes([1_000_000], 0.2, 0.05) == 0.0  # all of it could have crossed
    assert queued_bytes([], 1.0, 0.05) == 0.0
    assert queued_bytes([300_000], 0.0, 0.05) == 300_000  # not started yet
    assert queued_bytes([300_000], 1.0, 0.0) == 300_000


def test_a_request_that_fits_the_budget_alone_relays_behind_a_backlog():
    # 300 missing tokens x 2,048 bytes = 614,400 bytes: 20 + 98.304 ms at 0.05 Gbit/s, fits 150 ms
    inp = PipelineInputs(mode="pdd", prompt_tokens=300, kv_bytes_per_token=2048, wan_gbps_estimate=0.05,
                         wan_rtt_ms=20.0, ttft_budget_ms=150.0)
    assert expected_wan_seconds(inp) == pytest.approx(0.118304, abs=1e-12)
    assert choose_pipeline(inp) == Pipeline.P_MD
    # 250,000 bytes queued ahead: + 40 ms, 158.304 ms > 150: relayed
    behind = PipelineInputs(**{**inp.__dict__, "wan_backlog_bytes": 250_000})
    assert expected_wan_seconds(behind) == pytest.approx(0.158304, abs=1e-12)
    assert choose_pipeline(behind) == Pipeline.P_RLD_MD
