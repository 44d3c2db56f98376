"""``pdd serve --autoscale`` on a live pdd topology (issue #22 item 2): sustained load on the only
MD makes the gateway's loop add the standby slot md1 (it starts the process itself); once the load
stops, the loop drains one MD and removes it when idle. Every request finishes with all its tokens,
and the decision log holds exactly one scale-up and one scale-down, each with its inputs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import make_cfg
from tests.e2e.test_elastic import H, KEY, MAX_TOKENS, _members, _stats, _stream, _wait

pytestmark = pytest.mark.slow


def _log(url: str) -> dict:
    r = httpx.get(url + "/pdd/autoscale", timeout=30, headers=H)
    assert r.status_code == 200, r.text
    return r.json()


def _applied(url: str, op: str) -> list[dict]:
    return [a for d in _log(url)["decisions"] for a in d["applied"] if a.get("op") == op and "error" not in a]


def test_autoscale_up_under_load_then_down_when_idle(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", instances={"prefill": 1, "relay_decode": 1, "main_decode": 2},
                   standby=["md1"], engine={"device": "cpu", "min_step_ms": 30, "max_running": 4},
                   security={"api_keys": [KEY]},
                   autoscale={"enabled": True, "interval_s": 1.0, "sample_s": 0.1, "cooldown_s": 2.0,
                              "max": {"main_decode": 2}, "up_at": 0.5, "down_at": 0.2})
    topo = topology_factory(cfg)
    url = topo.url
    assert _log(url)["enabled"] is True
    assert {n: v["state"] for n, v in _members(url).items()}["md1"] == "standby"

    stop = threading.Event()
    done: list[int] = []
    seq = iter(range(10**6))

    def client(i: int) -> None:
        while not stop.is_set():
            k = next(seq)  # a new prompt each time: no prefix hit pulls the requests to one MD
            done.append(_stream(url, [100 + k % 400, 100 + k // 400] * 20))  # raises on any failure

    pool = ThreadPoolExecutor(4)
    clients = [pool.submit(client, i) for i in range(4)]  # 4 streams on md0 (max_running 4): utilisation ~1
    up = _wait(lambda: _applied(url, "add"), "a scale-up in the decision log", timeout_s=300)
    assert up == [{"role": "main_decode", "op": "add", "instance": "md1"}]
    try:
        _wait(lambda: _members(url)["md1"]["routed"] >= 1, "a request routed to the new md1", timeout_s=120)
    except AssertionError:
        print(_log(url)["decisions"], _members(url))
        raise
    stop.set()
    for f in clients:
        f.result(timeout=600)
    down = _wait(lambda: _applied(url, "drain"), "a scale-down in the decision log", timeout_s=120)
    assert len(down) == 1 and down[0]["remove_when_idle"] is True
    gone = down[0]["instance"]
    _wait(lambda: _members(url)[gone]["state"] == "removed", f"{gone} removed when idle", timeout_s=120)

    log = _log(url)
    ups = [d for d in log["decisions"] if any(a["op"] == "add" for a in d["applied"])]
    downs = [d for d in log["decisions"] if any(a["op"] == "drain" for a in d["applied"])]
    assert len(ups) == 1 and len(downs) == 1, log["decisions"]
    ui, di = ups[0]["inputs"], downs[0]["inputs"]
    assert ui["roles"][0]["role"] == "main_decode" and ui["roles"][0]["active"] == 1
    assert ui["roles"][0]["utilisation"] >= 0.5
    assert any(d["inputs"]["arrival_rps"] > 0 and d["inputs"]["prompt_tokens_mean"] == 40
               for d in log["decisions"][:log["decisions"].index(ups[0]) + 1])
    assert di["roles"][0]["active"] == 2 and di["roles"][0]["utilisation"] <= 0.2
    assert log["applied"] == {"up": 1, "down": 1, "errors": 0}
    assert done and all(n == MAX_TOKENS for n in done)
    st = _stats(url)["totals"]
    print(f"AUTOSCALE requests={len(done)} completed={st['completed']} failed={st['failed']} "
          f"up_util={ui['roles'][0]['utilisation']} down_util={di['roles'][0]['utilisation']} drained={gone}")
    assert st["failed"] == 0 and st["completed"] == len(done)
    members = _members(url)
    assert sum(1 for m in members.values() if m["role"] == "main_decode" and m["state"] == "active") == 1
