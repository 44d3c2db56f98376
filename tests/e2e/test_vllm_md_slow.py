"""MD on vLLM (docs/VLLM_TIER.md): P and RLD on pdd's engine, MD = pdd's MD endpoint in front of a
vLLM server loading P's KV through ``PddConnector``; the official openai client streams through
pdd's gateway. Skipped where ``.venv-vllm`` is absent (CI does not install vLLM: ``make vllm``)."""

from __future__ import annotations

import time

import httpx
import pytest

from pdd.vllm_tier import venv
from tests.e2e.conftest import greedy_oracle, make_cfg, settled_stats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_md(tmp_path_factory, small_model):
    try:
        venv.vllm_python()
    except venv.VllmMissing as ex:
        pytest.skip(f"vLLM's CPU build is not installed here ({ex})")
    from pdd.launch import Topology

    # the handoffs asserted below (40- and 64-token requests) need MD's KV to land and the handoff
    # call to reach RLD before RLD's last token: RLD's step held to >= 20 ms, so that holds on a
    # busy machine too (its 40 tokens take >= 0.8 s; the KV needs ~0.1 s on the default line)
    cfg = make_cfg(small_model, "pdd", vllm={"main_decode": True}, policy={"handoff_mode": "one_shot"},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}})
    topo = Topology(cfg, log_dir=tmp_path_factory.mktemp("logs"))
    topo.start()
    yield topo, small_model
    topo.stop()


def test_openai_stream_hands_over_to_vllm_md(vllm_md):
    from openai import OpenAI

    topo, model = vllm_md
    client = OpenAI(base_url=topo.url + "/v1", api_key="none")
    prompts = [list(range(200, 420)), list(range(900, 1000)) + list(range(30, 60))]
    n = 48
    want, margin = greedy_oracle(model, prompts, n)
    for p, ref in zip(prompts, want):
        chunks = list(client.completions.create(model="pdd-small", prompt=p, max_tokens=n, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        toks = [c for c in chunks if c.choices]
        meta = [c.model_extra["pdd"] for c in toks]
        ids = [m["token_id"] for m in meta]
        assert [m["pos"] for m in meta] == list(range(n))
        assert toks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == n
        tiers = [m["tier"] for m in meta]
        assert tiers[0] == "rld" and "md" in tiers, tiers  # the relay first, vLLM's MD after the handoff
        k = tiers.index("md")
        assert set(tiers[k:]) == {"md"}
        div = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
        assert div is None, f"differs from pdd's engine at {div} (margin {margin(p, ref[:div]):.3g}), handoff at {k}"
    st = settled_stats(topo)
    md = st["instances"]["md0"]
    assert md["engine"] == "vllm" and md["vllm_requests"] == 2  # the role's own stats, beside the counters
    print("md0 stats:", {k: md.get(k) for k in ("vllm_ready_s", "vllm_requests", "vllm_prompt_tokens",
                                                 "vllm_cached_tokens", "vllm_first_token_ms_median", "stage_write_ms_median",
                                                 "counters")})
    # vLLM computed neither prompt: their KV came through the connector (usage's cached_tokens counts
    # the tokens a request did not compute: the connector's load, vLLM's own prefix-cache hit)
    assert md["vllm_cached_tokens"] >= sum(len(p) for p in prompts), md
    assert md["counters"].get("failed", 0) == 0


def test_drc_sends_only_missing_pages(vllm_md):
    from openai import OpenAI

    topo, _ = vllm_md
    client = OpenAI(base_url=topo.url + "/v1", api_key="none")
    prompt = list(range(1200, 1400))
    a = client.completions.create(model="pdd-small", prompt=prompt, max_tokens=64, temperature=0,
                                  extra_body={"ignore_eos": True})
    settled_stats(topo)
    b = client.completions.create(model="pdd-small", prompt=prompt + [5, 6, 7], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.model_extra["pdd"]["handoff_pos"] is not None
    # 200 shared tokens = 12 whole pages of 16 held by MD's DRC: only the last page's 11 slots cross
    assert b.model_extra["pdd"]["md_cached_tokens"] == 192
    assert b.model_extra["pdd"]["wan_bytes_expected"] == 11 * 2048
    st = settled_stats(topo)
    flushed = httpx.post(f"{topo.url}/pdd/flush", timeout=60).json()
    assert flushed  # every tier's pages back after a flush: none leaked
    for name, v in topo.stats()["instances"].items():
        if "pages_total" in v:
            assert v["pages_free"] == v["pages_total"], (name, v["pages_free"], v["pages_total"])


def test_client_gone_aborts_vllm_request(vllm_md):
    """A client that closes its stream while vLLM's MD decodes: the gateway aborts the request on
    every tier; MD cancels its completion (vLLM aborts it: nothing left running there) and frees
    its pages; no staged file is left."""
    import re

    topo, _ = vllm_md
    body = {"model": "pdd-small", "prompt": list(range(2500, 2700)), "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    md_tokens = 0
    with httpx.stream("POST", f"{topo.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if '"tier": "md"' in line or '"tier":"md"' in line:
                md_tokens += 1
                if md_tokens >= 3:
                    break  # closes the connection mid-stream
    assert md_tokens >= 3
    st = settled_stats(topo)
    md = st["instances"]["md0"]
    assert md["counters"]["aborted"] >= 1 and md["staged_files"] == 0, md
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(f"{md['vllm_url']}/metrics", timeout=10, trust_env=False).text
        running = sum(float(x) for x in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)", metrics, re.M))
        if running == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert running == 0, "vLLM still runs the aborted request"


def test_killing_vllm_md_mid_stream_recovers(vllm_md):
    """docs/FAULTS.md, MD killed while it streams: the request is recovered (a new attempt from the
    streamed ids, relayed; with no MD reachable RLD finishes it, degraded) and the client gets every
    token; pdd's instances leak no page; the vLLM server dies with its MD endpoint. Last in this
    module: md0 stays down."""
    import os
    from pathlib import Path

    from openai import OpenAI

    topo, model = vllm_md
    md = topo.stats()["instances"]["md0"]
    port = md["vllm_url"].rsplit(":", 1)[1]
    client = OpenAI(base_url=topo.url + "/v1", api_key="none")
    p, n = list(range(2000, 2240)), 160
    (ref,), _ = greedy_oracle(model, [p], n)
    ids, tiers, killed_at = [], [], None
    for c in client.completions.create(model="pdd-small", prompt=p, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}):
        if not c.choices:
            continue
        m = c.model_extra["pdd"]
        ids.append(m["token_id"])
        tiers.append(m["tier"])
        if killed_at is None and m["tier"] == "md" and tiers.count("md") >= 3:
            killed_at = len(ids)
            topo.kill("md0")
    assert killed_at is not None, tiers
    assert len(ids) == n and ids == ref, (killed_at, tiers)
    settled_stats(topo)
    httpx.post(f"{topo.url}/pdd/flush", timeout=60)
    for name, v in topo.stats()["instances"].items():
        if name != "md0" and "pages_total" in v:
            assert v["pages_free"] == v["pages_total"], (name, v)

    def vllm_alive() -> bool:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"vllm.entrypoints.openai.api_server" in cmd and port.encode() in cmd:
                    return True
        return False

    deadline = time.monotonic() + 60
    while vllm_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not vllm_alive(), f"md0's vLLM server (port {port}) outlived it (pid {os.getpid()} ran the test)"
