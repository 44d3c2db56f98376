"""An instance frozen (SIGSTOP) past the heartbeat deadline while requests are queued for it,
then resumed: every request completes, and no KV page stays allocated on any instance.

Found by a new user: MD frozen for 20 s under load leaked exactly the pages of the reservations
queued while it was frozen (450 pages), and P frozen for 10 s leaked 345. The gateway dropped
the silent connection; on resume the instance read the queued requests, its RPC layer cancelled
their handlers when it saw the connection closed, and the sequences the engine thread created
for them had no owner (now ``EngineWorker.call_owned`` frees them)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest

from pdd.launch import Topology
from tests.e2e.conftest import make_cfg

pytestmark = [pytest.mark.faults, pytest.mark.slow]

N_FROZEN = 10  # requests sent to the frozen topology (4 over 3 s did not leak on MD before the fix)
FREEZE_S = 6.0  # seconds frozen after they were sent: 4x dead_after_s


@pytest.mark.parametrize("frozen", ["md0", "p0"])
def test_instance_frozen_past_the_heartbeat_leaks_no_pages(tmp_path, small_model, frozen):
    cfg = make_cfg(small_model, "pdd", link={"wan_gbps": 1.0, "wan_rtt_ms": 2.0, "wan_jitter_ms": 0.0},
                   liveness={"heartbeat_interval_s": 0.25, "dead_after_s": 1.5}, request_timeout_s=60.0,
                   limits={"max_inflight_requests": 0, "max_queue_wait_s": 0, "max_queued_prompt_tokens": 0})
    topo = Topology(cfg, log_dir=tmp_path / "logs")
    topo.start()
    rng = random.Random(5)
    results: list = []

    def one(i: int) -> None:
        prompt = [rng.randrange(5, 4000) for _ in range(300)]
        try:
            r = httpx.post(topo.url + "/v1/completions", timeout=90,
                           json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            results.append((i, r.status_code))
        except Exception as e:  # recorded, asserted below
            results.append((i, repr(e)))

    pid = topo.procs[frozen].pid
    try:
        one(-1)  # warm: every connection is up
        os.kill(pid, signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(N_FROZEN)]
            for t in threads:
                t.start()
                time.sleep(0.2)  # their requests reach the frozen instance's socket
            time.sleep(FREEZE_S)  # past dead_after_s: the gateway drops the silent connection
        finally:
            os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        # a frozen P fails the requests it held (only one P: 503, by design); a frozen MD's are
        # finished by RLD; either way, none may leave pages behind
        assert all(code in (200, 503) for _, code in results), results
        if frozen == "md0":
            assert all(code == 200 for _, code in results), results
        assert topo.wait_idle(timeout_s=30), topo.last_busy
        deadline = time.time() + 30
        while True:
            fl = topo.flush()
            unreachable = [n for n, v in fl["instances"].items() if "error" in v]
            if not unreachable and fl["leaked_pages"] == 0:
                break
            assert time.time() < deadline, fl
            time.sleep(1.0)
    finally:
        topo.stop()
