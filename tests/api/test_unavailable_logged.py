"""A request refused because no instance of a role it needs is reachable (HTTP 503 with
``Retry-After``, "no prefill instance is reachable") is counted once, ``rejected``, and leaves a
WARNING line in the gateway's log: it left none, so a gateway refusing everything while its only P
was down had a quiet log. A flood of them is summarised: one line per
``start.UNAVAILABLE_LOG_EVERY_S`` at most, the next one naming how many were refused meanwhile.
The real orchestrator's routing over instances whose connection is closed (no process, no socket,
no kill timing) and the real HTTP app through ``httpx.ASGITransport``."""

from __future__ import annotations

import logging

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import OUTCOMES, Orchestrator
from pdd.topology import layout
from tests.gateway.fake_peer import FakePeer

BODY = {"prompt": "hello there", "max_tokens": 4}


class DownOrch(Orchestrator):
    """The real orchestrator whose instances in ``down`` are closed (dead, not reconnected)."""

    def __init__(self, cfg: ClusterConfig, down: tuple[str, ...]):
        super().__init__(cfg, layout(cfg))
        self.peers = {s.name: FakePeer() for s in self.layout.engines}
        for name in down:
            self.peers[name].closed = True

    async def _reconnect(self, name):  # the instance stays down
        return None


@pytest.fixture
def make_app(tiny_model):
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    def make(down):
        cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "served_model_name": "pdd-tiny",
                                            "engine": {"max_model_len": 512, "max_input_len": 400}})
        orch = DownOrch(cfg, down)
        now = [100.0]
        orch.unavailable_log.clock = lambda: now[0]
        return create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json")), orch, now

    return make


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "pdd.gateway.orchestrator" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("down,role", [(("p0",), "prefill"), (("rld0", "md0"), "relay_decode"),
                                       (("p0", "rld0", "md0"), "prefill")])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_request_no_instance_can_take_is_counted_rejected_and_logged_once(make_app, caplog, down, role,
                                                                                   route):
    caplog.set_level(logging.INFO)
    app, orch, now = make_app(down)
    body = BODY if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    every = orch.unavailable_log.every_s
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        rs = [await client.post(route, json=body)]
        assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 1}
        rs += [await client.post(route, json=body) for _ in range(3)]  # within the interval: counted, not logged
        now[0] += every
        rs.append(await client.post(route, json=body))
    assert [(r.status_code, r.headers["retry-after"]) for r in rs] == [(503, "1")] * 5
    msgs = [r.json()["error"]["message"] for r in rs]
    assert all(m.endswith(f"failed while starting: no {role} instance is reachable") for m in msgs), msgs
    assert {k: orch.totals[k] for k in OUTCOMES} == {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 5}
    assert _warnings(caplog) == [
        f"{msgs[0]} (the client gets 503 with Retry-After; refused for lack of an instance: logged at most once "
        f"every {every:g} s)",
        f"{msgs[4]} (the client gets 503 with Retry-After; refused for lack of an instance: logged at most once "
        f"every {every:g} s; 3 more refused so since the last such line)"]
    assert not orch.reqs


def test_refusals_left_unlogged_when_requests_start_again_get_their_line(caplog):
    """An outage shorter than the interval after its first line: the refusals after that line are
    logged when the next request starts, not left to a line that never comes."""
    from pdd.gateway.start import UnavailableLog

    caplog.set_level(logging.INFO)
    now = [0.0]
    ul = UnavailableLog(every_s=10.0, clock=lambda: now[0])
    ul.started()  # nothing refused: no line
    for _ in range(3):
        ul.refused("request r1 failed while starting: no prefill instance is reachable")
        now[0] += 1.0
    ul.started()
    ul.started()  # told once
    assert _warnings(caplog) == [
        "request r1 failed while starting: no prefill instance is reachable (the client gets 503 with Retry-After; "
        "refused for lack of an instance: logged at most once every 10 s)",
        "2 more request(s) refused for lack of an instance since the last such line; requests start again"]
