"""Scheduler speed, measured (pytest-benchmark), never asserted: one plan over 10,000 running
sequences (5,000 decodes and 5,000 waiting prefills, 8,192-token budget) beside the same plan over
1,000, so the report shows how planning time grows with the running set (linear: about x10)."""

import pytest

from pdd.engine.scheduler import SchedulerConfig, SeqState, schedule


def _states(n: int) -> list[SeqState]:
    return [SeqState(i, 1000, 999 if i % 2 else 0, i) for i in range(n)]


@pytest.mark.parametrize("n", [1000, 10000])
def test_schedule_speed(benchmark, n):
    cfg = SchedulerConfig(max_batch_tokens=8192, max_running_seqs=n)
    states = _states(n)
    plan = benchmark.pedantic(schedule, args=(states, cfg), rounds=3, iterations=1)
    assert plan.num_decodes == n // 2 and plan.num_tokens == 8192
