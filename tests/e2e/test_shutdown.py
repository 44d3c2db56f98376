"""Graceful shutdown of a live pdd topology (``Topology.stop``, ``pdd.gateway.shutdown``): the
gateway drains first, on live instances. A stream in flight when the stop begins finishes with
the single engine's greedy tokens, while a new request is refused with 503 ``shutting_down``;
with ``shutdown_timeout_s: 0`` the stream ends at once with the gateway's mid-stream error event
and ``[DONE]``, and a gateway started again finds no page leaked on any instance. Engines step at
``min_step_ms`` so a stream is still running when the test stops it; the test waits on the
stream's tokens and on processes, never on a clock."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from pdd.gateway.openai_schemas import error_body
from pdd.gateway.shutdown import expired_message, refusal_body
from pdd.launch import Topology
from tests.e2e.conftest import TEST_DEVICE, greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

PROMPT = list(range(300, 340))
MAX_TOKENS = 60


class RawStream:
    """One streamed ``/v1/completions`` request in a thread: every ``data:`` payload as it came
    (``events``), the token ids (``tokens``), an event set once ``k`` tokens arrived (``after``)
    and ``done`` once the stream ended (however)."""

    def __init__(self, url: str, model: str, k: int):
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        self.url, self.k = url, k
        self.events: list[str] = []
        self.tokens: list[int] = []
        self.status: int | None = None
        self.error: str | None = None
        self.after, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120,
                              trust_env=False) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.events.append(line[len("data: "):])
                    c = json.loads(line[len("data: "):]) if line != "data: [DONE]" else {}
                    if c.get("choices"):
                        self.tokens.append(c["pdd"]["token_id"])
                        if len(self.tokens) >= self.k:
                            self.after.set()
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.after.set()
            self.done.set()


def _cfg(small_model: str, timeout_s: float, min_step_ms: float = 20.0):
    return make_cfg(small_model, "pdd", shutdown_timeout_s=timeout_s,
                    engine={"device": TEST_DEVICE, "min_step_ms": min_step_ms}, request_timeout_s=60.0)


def test_a_stream_in_flight_at_stop_finishes_on_live_instances_and_new_requests_get_503(small_model, tmp_path):
    # 100 ms steps: the stream's last 57 tokens take >= 5.7 s, far more than the test's few HTTP calls
    # to the draining gateway, which answers them only while the stream still runs
    topo = Topology(_cfg(small_model, 120.0, min_step_ms=100.0), log_dir=tmp_path / "logs")
    topo.start()
    stopper = threading.Thread(target=topo.stop)
    try:
        want = greedy_oracle(small_model, [PROMPT], MAX_TOKENS)[0][0]
        s = RawStream(topo.url, topo.cfg.served_model_name, k=3)
        assert s.after.wait(60) and len(s.tokens) >= 3 and not s.done.is_set(), (s.error, s.events[-2:])
        stopper.start()  # the gateway drains: the stream goes on meanwhile
        health = None
        while health != 503:  # the drain has begun once /health says so (the gateway still listens)
            health = httpx.get(topo.url + "/health", timeout=10, trust_env=False).status_code
        r = httpx.post(topo.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=10,
                       trust_env=False)
        assert (r.status_code, r.json(), r.headers["connection"]) == (503, refusal_body(), "close")
        assert s.done.wait(120)
        assert s.error is None and s.status == 200
        assert s.tokens == want
        assert s.events[-1] == "[DONE]" and "error" not in "".join(s.events)
        stopper.join(120)
        assert not stopper.is_alive() and topo.procs == {}
    finally:
        if stopper.is_alive():
            stopper.join(120)
        topo.stop()


# SIGHUP: a `pdd launch --role gateway` whose terminal closed drains as on SIGTERM
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_timeout_0_ends_a_stream_with_the_error_event_and_frees_every_page(signum, small_model, tmp_path):
    # the gateway at SIGHUP's default whatever this run inherited (a suite under nohup ignores it,
    # and pdd leaves an ignored SIGHUP ignored): its processes inherit the disposition at start
    topo = Topology(_cfg(small_model, 0.0), log_dir=tmp_path / "logs")
    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        topo.start()
    finally:
        signal.signal(signal.SIGHUP, hup)
    try:
        s = RawStream(topo.url, topo.cfg.served_model_name, k=3)
        assert s.after.wait(60) and len(s.tokens) >= 3 and not s.done.is_set(), (s.error, s.events[-2:])
        topo.kill("gateway", signum)  # the gateway alone: the instances hold what it left behind
        assert s.done.wait(60) and s.error is None and s.status == 200
        assert len(s.tokens) < MAX_TOKENS
        assert json.loads(s.events[-2]) == error_body(expired_message(0), etype="server_error")
        assert s.events[-1] == "[DONE]"
        topo.restart("gateway")
        fl = topo.flush()  # every instance's pages, with the request's aborts answered before the gateway exited
        assert (fl["leaked_pages"], fl["busy"], fl["unreachable"]) == (0, [], []), fl
        assert sorted(fl["instances"]) == ["md0", "p0", "rld0"]
    finally:
        topo.stop()
