"""The grammar compiler's queue (``pdd.compile_queue.CompileQueue``): the highest response ratio
``(waited + cost) / cost`` runs next (``next_job``), a job cancelled while queued never runs. A
clock the test sets makes every order exact; a first job held on an Event keeps the one thread
busy while the others queue."""

from __future__ import annotations

import threading

import pytest

from pdd.compile_queue import MIN_COST_S, CompileQueue, next_job


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def held():
    """A one-thread queue on a frozen clock whose thread is held by a first job until ``go``."""
    clock = Clock()
    q = CompileQueue(threads=1, clock=clock, name="test-compile")
    go = threading.Event()
    busy = _hold(q, go)
    yield q, clock, go
    go.set()
    busy.result(60)
    q.shutdown()


def test_the_smallest_job_queued_runs_first(held):
    q, clock, go = held
    ran: list[str] = []
    futs = [q.submit_costed(cost, ran.append, name) for name, cost in
            (("large", 5.0), ("small", 1.0), ("medium", 3.0), ("free", 0.0))]
    clock.now = 1.0  # each has waited 1 s: ratios 1.2, 2, 1.33, 1001
    go.set()
    for f in futs:
        f.result(60)
    assert ran == ["free", "small", "medium", "large"]


def test_a_job_that_has_waited_is_not_overtaken_by_one_just_arrived(held):
    """Ratios: the large job submitted at 0 (cost 10) 3 at 20; the small one submitted at 4
    (cost 1) 17; the free one submitted at 20 1: a new arrival starts at 1, below every job
    that has waited."""
    q, clock, go = held
    ran: list[str] = []
    clock.now = 0.0
    a = q.submit_costed(10.0, ran.append, "large at 0")
    clock.now = 4.0
    b = q.submit_costed(1.0, ran.append, "small at 4")
    clock.now = 20.0
    c = q.submit_costed(0.0, ran.append, "free at 20")
    go.set()
    for f in (a, b, c):
        f.result(60)
    assert ran == ["small at 4", "large at 0", "free at 20"]


def test_next_job_is_the_highest_response_ratio():
    assert next_job([(0.0, 1.0)], 0.0) == 0
    assert next_job([(0.0, 10.0), (8.0, 1.0)], 10.0) == 1  # ratios 2.0 and 3.0
    assert next_job([(0.0, 10.0), (9.5, 1.0)], 10.0) == 0  # 2.0 against 1.5
    assert next_job([(0.0, 1.0), (0.0, 1.0)], 5.0) == 0  # tied: the earlier arrival
    assert next_job([(0.0, 0.0), (0.0, MIN_COST_S)], 1.0) == 0  # a cost below the floor counts as it
    with pytest.raises(ValueError, match="no job queued"):
        next_job([], 0.0)


def test_equal_costs_run_in_arrival_order(held):
    q, clock, go = held
    ran: list[int] = []
    futs = [q.submit(ran.append, i) for i in range(5)]
    go.set()
    for f in futs:
        f.result(60)
    assert ran == [0, 1, 2, 3, 4]


def test_a_job_cancelled_while_queued_never_runs(held):
    q, clock, go = held
    ran: list[str] = []
    gone = q.submit_costed(0.0, ran.append, "gone")
    assert q.pending() == 1
    assert gone.cancel() and gone.cancelled()
    assert q.pending() == 0  # a cancelled job no longer counts
    kept = q.submit_costed(1.0, ran.append, "kept")
    go.set()
    kept.result(60)
    assert ran == ["kept"]


def test_a_job_that_raises_fails_its_future_and_the_queue_goes_on(held):
    q, clock, go = held
    bad = q.submit(int, "not a number")
    good = q.submit(int, "7")
    go.set()
    with pytest.raises(ValueError):
        bad.result(60)
    assert good.result(60) == 7


def test_the_jobs_run_on_the_queues_thread():
    q = CompileQueue(threads=1, name="named-compile")
    try:
        assert q.submit(lambda: threading.current_thread().name).result(60) == "named-compile_0"
    finally:
        q.shutdown()


def test_no_job_after_shutdown_and_queued_ones_can_be_cancelled():
    q = CompileQueue(threads=1)
    go = threading.Event()
    busy = _hold(q, go)
    queued = q.submit(int, "1")
    done = threading.Thread(target=q.shutdown, kwargs={"cancel_futures": True})
    done.start()
    with pytest.raises(RuntimeError, match="shut down"):
        _wait_closed(q)
    go.set()
    done.join(60)
    assert busy.result(60) is True and queued.cancelled()


def _hold(q: CompileQueue, go: threading.Event):
    """A job that holds ``q``'s thread until ``go``; returns once it runs (its future)."""
    started = threading.Event()

    def hold() -> bool:
        started.set()
        return go.wait(60)

    busy = q.submit(hold)
    assert started.wait(60)
    return busy


def _wait_closed(q: CompileQueue) -> None:
    """Submit until the queue refuses (shutdown runs on another thread; it closes the queue
    before anything else)."""
    while True:
        q.submit(int, "1").cancel()


def test_threads_must_be_at_least_one():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        CompileQueue(threads=0)
