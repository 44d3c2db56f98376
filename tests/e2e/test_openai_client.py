"""The official openai client against a running pdd topology (P -> RLD -> MD over the WAN)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import make_cfg, settled_stats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pdd_topology(tmp_path_factory, small_model):
    from pdd.launch import Topology

    # RLD's step held to >= 20 ms: the 200-token request below is handed over to MD (its KV, ~0.1 s
    # on the default line, lands long before RLD's last token) on a busy machine too
    cfg = make_cfg(small_model, "pdd", tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}})
    topo = Topology(cfg, log_dir=tmp_path_factory.mktemp("logs"))
    topo.start()
    yield topo
    topo.stop()


def test_streaming_completion_with_usage(pdd_topology):
    from openai import OpenAI

    client = OpenAI(base_url=pdd_topology.url + "/v1", api_key="none")
    stream = client.completions.create(model="pdd-small", prompt=list(range(200, 420)), max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 40
    assert text_chunks[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == 220 and usage.completion_tokens == 40 and usage.total_tokens == 260
    assert usage.prompt_tokens_details.cached_tokens == 0
    tiers = [c.model_extra["pdd"]["tier"] for c in text_chunks]
    assert tiers[0] == "rld"  # the relay answers first: TTFT does not wait for the WAN
    assert set(tiers) <= {"rld", "md"}
    positions = [c.model_extra["pdd"]["pos"] for c in text_chunks]
    assert positions == list(range(40))


def test_non_streaming_completion_and_prefix_hit(pdd_topology):
    from openai import OpenAI

    client = OpenAI(base_url=pdd_topology.url + "/v1", api_key="none")
    prompt = list(range(500, 700))
    # long enough that MD's KV arrives before RLD finishes (RLD held to >= 20 ms a step: >= 4 s)
    a = client.completions.create(model="pdd-small", prompt=prompt, max_tokens=200, temperature=0,
                                  extra_body={"ignore_eos": True})
    settled_stats(pdd_topology, timeout_s=30.0)
    b = client.completions.create(model="pdd-small", prompt=prompt + [5, 6, 7], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 200 and a.choices[0].finish_reason == "length"
    assert a.model_extra["pdd"]["handoff_pos"] is not None
    # the second prompt shares 200 tokens = 12 whole pages of 16 with the first
    assert b.usage.prompt_tokens_details.cached_tokens == 192
    assert b.model_extra["pdd"]["md_cached_tokens"] == 192
    # only the KV MD lacked crossed the WAN: 203 tokens -> 13 pages, 12 cached -> the last page's
    # 11 filled slots of 2048 bytes (32768 / 16)
    assert b.model_extra["pdd"]["wan_bytes_expected"] == 11 * 2048


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": [], "max_tokens": 3}, "prompt"),
    ({"prompt": [1, 2, 999999], "max_tokens": 3}, "prompt"),
    ({"prompt": list(range(10, 4011)), "max_tokens": 3}, "prompt"),
    ({"prompt": list(range(10, 3000)), "max_tokens": 2000}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
])
def test_bad_requests_get_openai_400(pdd_topology, body, param):
    r = httpx.post(pdd_topology.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_malformed_json_then_still_serving(pdd_topology):
    r = httpx.post(pdd_topology.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(pdd_topology.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_models_and_health(pdd_topology):
    assert httpx.get(pdd_topology.url + "/health").json()["status"] == "ok"
    ids = [m["id"] for m in httpx.get(pdd_topology.url + "/v1/models").json()["data"]]
    assert ids == ["pdd-small"]


def test_client_disconnect_frees_every_page(pdd_topology):
    """A client that goes away mid-stream cancels the request on every tier; once idle and
    flushed, every instance has all its pages free."""
    import time

    with httpx.stream("POST", pdd_topology.url + "/v1/completions", timeout=60,
                      json={"prompt": list(range(300, 900)), "max_tokens": 3000, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break  # leave mid-stream: closing the response drops the connection
    # decoding all 3,000 tokens would take far longer than this bound: the abort must free them.
    # A flush under traffic lists the instances still holding the request as busy (their pages
    # are not counted as leaked), so wait until nothing is busy and the abort has been counted:
    # on a loaded machine the gateway may see the disconnect after the first flush
    deadline = time.monotonic() + 8
    aborted = 0
    while time.monotonic() < deadline:
        flushed = httpx.post(pdd_topology.url + "/pdd/flush", timeout=30).json()
        aborted = sum(v["counters"].get("aborted", 0) for v in pdd_topology.stats()["instances"].values())
        if flushed["leaked_pages"] == 0 and not flushed.get("busy") and aborted >= 1:
            break
        time.sleep(0.2)
    assert flushed["leaked_pages"] == 0 and not flushed.get("busy"), flushed
    assert aborted >= 1
    # and it keeps serving
    ok = httpx.post(pdd_topology.url + "/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_every_engine_instance_serves_prometheus_metrics(pdd_topology):
    httpx.post(pdd_topology.url + "/v1/completions", json={"prompt": list(range(50, 90)), "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
    for spec in pdd_topology.layout.engines:
        text = httpx.get(f"http://{pdd_topology.cfg.host}:{spec.metrics_port}/metrics", timeout=10).text
        assert f'pdd_kv_pages{{instance="{spec.name}",role="{spec.role}",state="total"}} 2048.0' in text
        for name in ("pdd_prefix_hit_rate", "pdd_requests_live", "pdd_events_total", "pdd_forward_calls_total"):
            assert name in text, (spec.name, name)


def test_gateway_metrics_and_edge_input(pdd_topology):
    # one request of its own, so the latency histograms have a sample whichever tests ran first
    r = httpx.post(pdd_topology.url + "/v1/completions", timeout=120, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    r = httpx.get(pdd_topology.url + "/metrics", timeout=10)
    assert r.status_code == 200
    text = r.text
    for name in ("pdd_gateway_ttft_seconds_bucket", "pdd_gateway_itl_seconds_bucket", "pdd_gateway_requests_total",
                 "pdd_wan_kv_bytes_total"):
        assert name in text, name
    # a lone surrogate is not text: 400, not a 500
    r = httpx.post(pdd_topology.url + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                   content=b'{"prompt": "hi \\ud800", "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # a huge body is refused before it is read; a huge text prompt before it is tokenized
    r = httpx.post(pdd_topology.url + "/v1/completions", timeout=30, headers={"content-type": "application/json"},
                   content=b'{"prompt": "' + b"a" * (40 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(pdd_topology.url + "/v1/completions", timeout=30, json={"prompt": "hello " * 100_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # unknown routes and methods keep the OpenAI error shape
    r = httpx.get(pdd_topology.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(pdd_topology.url + "/v1/nope", timeout=10).json()["error"]["message"]
