"""colocated mode: one engine prefills and decodes; its greedy output is the single-engine one."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow


def test_colocated_serves_prefix_hits_and_frees_every_page(small_model, topology_factory):
    from pdd.engine.engine import Engine
    from pdd.types import SamplingParams

    topo = topology_factory(make_cfg(small_model, "colocated"))
    prompt = list(range(700, 900))
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    a = httpx.post(topo.url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(topo.url + "/v1/completions", json=body, timeout=60).json()
    assert a["pdd"]["pipeline"] == "colocated"
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 12 whole pages, one token left to compute
    eng = Engine.from_pretrained(small_model, num_pages=256, page_size=16)
    s = eng.new_sequence("ref", prompt, SamplingParams(max_tokens=12, ignore_eos=True), use_cache=False)
    eng.add(s)
    while eng.has_work():
        eng.step()
    ids = [c for c in s.output_ids]
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == eng.tokenizer.decode(ids, skip_special_tokens=True)
    assert topo.flush()["leaked_pages"] == 0
