"""The vLLM MD endpoint in a whole topology without vLLM (CI): ``vllm.python`` points at a wrapper
that starts ``fake_vllm_server.py``, which checks each staged prompt KV against pdd's engine and
answers with pdd's engine's greedy tokens. So this covers pdd's side of MD on vLLM (the wire,
DRC, staging file, handoff completion, token positions, release) everywhere; the connector's
side in vLLM is ``test_connector_vllm.py`` and ``tests/e2e/test_vllm_md_slow.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import greedy_oracle, make_cfg, settled_stats

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fake_md(tmp_path_factory, small_model):
    from pdd.launch import Topology

    w = tmp_path_factory.mktemp("fake") / "python"
    w.write_text(_wrapper())
    os.chmod(w, 0o755)
    # the handoffs asserted below (40- and 64-token requests) need MD's KV to land and the handoff
    # call to reach RLD before RLD's last token: RLD's step held to >= 20 ms, so that holds on a
    # busy machine too (its 40 tokens take >= 0.8 s; the KV needs ~0.1 s on the default line)
    cfg = make_cfg(small_model, "pdd", vllm={"main_decode": True, "python": str(w), "start_timeout_s": 120},
                   policy={"handoff_mode": "one_shot"},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}})
    topo = Topology(cfg, log_dir=tmp_path_factory.mktemp("logs"))
    topo.start()
    yield topo, small_model
    topo.stop()


def _wrapper() -> str:
    """A shell script standing in for vLLM's Python: runs the stand-in server with this Python."""
    server = Path(__file__).with_name("fake_vllm_server.py")
    return f'#!/bin/sh\nexec "{sys.executable}" "{server}" "$@"\n'


def test_handoff_to_the_vllm_endpoint(fake_md):
    from openai import OpenAI

    topo, model = fake_md
    client = OpenAI(base_url=topo.url + "/v1", api_key="none")
    # counted from here: the module's topology may have served the other test first (a random order)
    md0 = settled_stats(topo)["instances"]["md0"]
    before = (md0["vllm_requests"], md0["vllm_cached_tokens"], md0["counters"].get("extends", 0))
    p, n = list(range(300, 520)), 40
    (ref,), _ = greedy_oracle(model, [p], n)
    chunks = list(client.completions.create(model="pdd-small", prompt=p, max_tokens=n, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    meta = [c.model_extra["pdd"] for c in chunks if c.choices]
    assert [m["pos"] for m in meta] == list(range(n)) and [m["token_id"] for m in meta] == ref
    tiers = [m["tier"] for m in meta]
    assert tiers[0] == "rld" and "md" in tiers and set(tiers[tiers.index("md"):]) == {"md"}, tiers
    assert chunks[-1].choices[0].finish_reason == "length"
    md = settled_stats(topo)["instances"]["md0"]
    assert md["engine"] == "vllm"
    assert (md["vllm_requests"], md["vllm_cached_tokens"], md["counters"]["extends"]) == \
        (before[0] + 1, before[1] + len(p), before[2] + 1)
    assert md["counters"].get("failed", 0) == 0


def test_drc_and_pages(fake_md):
    from openai import OpenAI

    topo, _ = fake_md
    client = OpenAI(base_url=topo.url + "/v1", api_key="none")
    prompt = list(range(1200, 1400))
    a = client.completions.create(model="pdd-small", prompt=prompt, max_tokens=64, temperature=0,
                                  extra_body={"ignore_eos": True})
    settled_stats(topo)
    b = client.completions.create(model="pdd-small", prompt=prompt + [5, 6, 7], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.model_extra["pdd"]["handoff_pos"] is not None and b.usage.completion_tokens == 24
    assert b.model_extra["pdd"]["md_cached_tokens"] == 192  # 12 whole pages held by MD's DRC
    assert b.model_extra["pdd"]["wan_bytes_expected"] == 11 * 2048  # only the last page's 11 slots cross
    settled_stats(topo)
    httpx.post(f"{topo.url}/pdd/flush", timeout=60)
    for name, v in topo.stats()["instances"].items():
        if "pages_total" in v:
            assert v["pages_free"] == v["pages_total"], (name, v["pages_free"], v["pages_total"])
    assert topo.stats()["instances"]["md0"]["staged_files"] == 0  # each deleted when its stream ended


def test_cross_dc_pd_p_to_vllm_md(tmp_path, small_model):
    """No relay (``cross_dc_pd``: MD is the only decoder): P's first token goes out from MD at once,
    then the completion on prompt + that token continues at position 1."""
    from openai import OpenAI

    from pdd.launch import Topology

    w = tmp_path / "python"
    w.write_text(_wrapper())
    os.chmod(w, 0o755)
    cfg = make_cfg(small_model, "cross_dc_pd", vllm={"main_decode": True, "python": str(w), "start_timeout_s": 120})
    p, n = list(range(700, 850)), 20
    (ref,), _ = greedy_oracle(small_model, [p], n)
    with Topology(cfg, log_dir=tmp_path / "logs") as topo:
        client = OpenAI(base_url=topo.url + "/v1", api_key="none")
        chunks = list(client.completions.create(model="pdd-small", prompt=p, max_tokens=n, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        meta = [c.model_extra["pdd"] for c in chunks if c.choices]
        assert [m["token_id"] for m in meta] == ref and [m["pos"] for m in meta] == list(range(n))
        assert {m["tier"] for m in meta} == {"md"}
        md = settled_stats(topo)["instances"]["md0"]
        assert md["vllm_requests"] == 1 and md["vllm_cached_tokens"] == len(p) and md["staged_files"] == 0
