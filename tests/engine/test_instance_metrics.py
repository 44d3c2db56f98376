"""An engine instance's Prometheus metrics (``pdd.metrics.InstanceCollector``) over a real engine:
``pdd_kv_pages`` by state with pages only the prefix cache holds as ``cached``, not ``in_use`` (an
idle MD whose cache kept two long prompts read 255 of 256 pages "in_use", as a full pool would),
``pdd_kv_cache_usage_ratio`` as vLLM's ``kv_cache_usage_perc``, and ``pdd_preemptions_total``;
an instance's counter of bytes is a ``_bytes_total`` family, not an "event"."""

from __future__ import annotations

from types import SimpleNamespace

from pdd.engine import Engine
from pdd.metrics import InstanceCollector
from pdd.types import SamplingParams

PS = 4


def _inst(engine) -> SimpleNamespace:
    """What InstanceCollector reads of an instance (``pdd.roles.base.Instance``), around ``engine``."""
    hits = {"prefix_hit_tokens": 0, "prompt_tokens": 0, "prefix_hit_rate": 0.0, "prefix_hit_rate_window": 0.0}
    return SimpleNamespace(spec=SimpleNamespace(name="md0", role="main_decode"), engine=engine, reqs={},
                           hit_stats=lambda: hits, worker=None, counters={})


def _samples(inst) -> dict:
    return {(s.name, s.labels.get("state")): s.value for fam in InstanceCollector(inst).collect() for s in fam.samples}


def test_kv_pages_count_the_prefix_cache_apart_from_pages_requests_hold(tiny_model):
    eng = Engine.from_pretrained(tiny_model, num_pages=16, page_size=PS)
    inst = _inst(eng)
    prompt = list(range(40, 50))  # 10 tokens: 2 whole pages + a partial one
    eng.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))  # released into the cache
    # prompt + 3 outputs = 13 tokens, of which 12 computed (the last sampled token has no KV): 3 whole pages
    m = _samples(inst)
    assert {k[1]: v for k, v in m.items() if k[0] == "pdd_kv_pages"} == {
        "total": 16.0, "free": 13.0, "cached": 3.0, "in_use": 0.0}
    assert m[("pdd_kv_cache_usage_ratio", None)] == 0.0  # idle: nothing held by a request
    # a live sequence matching 2 of the cached pages and holding 1 page of its own
    seq = eng.new_sequence("s1", prompt[:8] + [7, 7], SamplingParams(max_tokens=2))
    m = _samples(inst)
    assert {k[1]: v for k, v in m.items() if k[0] == "pdd_kv_pages"} == {
        "total": 16.0, "free": 12.0, "cached": 1.0, "in_use": 3.0}
    assert m[("pdd_kv_cache_usage_ratio", None)] == 3 / 16
    assert m[("pdd_preemptions_total", None)] == 0.0
    eng.release(seq, cache=False)
    assert eng.flush_cache() == 3
    m = _samples(inst)
    assert {k[1]: v for k, v in m.items() if k[0] == "pdd_kv_pages"} == {
        "total": 16.0, "free": 16.0, "cached": 0.0, "in_use": 0.0}


def test_a_counter_of_bytes_is_not_an_event(tiny_model):
    """P's ``kv_bytes_before_first_token`` counts bytes: it was ``pdd_events_total{event=...}``
    beside request counts, so a sum of events added bytes to requests."""
    inst = _inst(Engine.from_pretrained(tiny_model, num_pages=4, page_size=PS))
    inst.spec.role = "prefill"
    inst.counters.update(requests=3, kv_bytes_before_first_token=12288)
    fams = {f.name: f for f in InstanceCollector(inst).collect()}
    assert [(s.labels["event"], s.value) for s in fams["pdd_events"].samples] == [("requests", 3)]
    assert [s.value for s in fams["pdd_kv_before_first_token_bytes"].samples
            if s.name == "pdd_kv_before_first_token_bytes_total"] == [12288]


def test_p_exports_its_bytes_counter_at_zero_from_the_start(tiny_model):
    """docs/SERVE.md lists ``pdd_kv_before_first_token_bytes_total`` on P: it was missing from P's
    /metrics until it was non-zero (a counter is exported at 0 from the start); other roles never
    count it and do not export it."""
    inst = _inst(Engine.from_pretrained(tiny_model, num_pages=4, page_size=PS))
    inst.spec.role = "prefill"
    fams = {f.name: f for f in InstanceCollector(inst).collect()}
    assert [(s.name, s.value) for s in fams["pdd_kv_before_first_token_bytes"].samples
            if s.name.endswith("_total")] == [("pdd_kv_before_first_token_bytes_total", 0)]
    inst.spec.role = "main_decode"
    assert "pdd_kv_before_first_token_bytes" not in {f.name for f in InstanceCollector(inst).collect()}
