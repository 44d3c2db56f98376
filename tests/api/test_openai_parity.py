"""The official openai client against a running pdd topology (P -> RLD -> MD, handoff forced
after 4 tokens): streaming chat with usage, seeded reproducibility, a stop string that completes
after the handoff, logprobs from every tier, n = 2, and OpenAI-style 400s."""

from __future__ import annotations


import httpx
import pytest

from tests.e2e.conftest import make_cfg, settled_stats

pytestmark = pytest.mark.slow

HANDOFF_AT = 4
PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def topo(tmp_path_factory, small_model):
    from pdd.launch import Topology

    # every request relayed (budget 0) and RLD's step held to >= 20 ms, so MD's KV (a fast WAN)
    # lands long before RLD's last token even on a busy machine: the handoffs below happen
    cfg = make_cfg(small_model, "pdd", link={"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0},
                   policy={"handoff_min_tokens": HANDOFF_AT, "pipeline_ttft_budget_ms": 0},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}})
    t = Topology(cfg, log_dir=tmp_path_factory.mktemp("logs"))
    t.start()
    yield t
    t.stop()


@pytest.fixture(scope="module")
def oa(topo):
    from openai import OpenAI

    return OpenAI(base_url=topo.url + "/v1", api_key="none", max_retries=0)


def _wait_idle(topo) -> dict:
    """The instances' stats once none runs a request."""
    return settled_stats(topo, timeout_s=30.0)["instances"]


def test_streaming_chat_completion_with_usage(oa):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]
    stream = oa.chat.completions.create(model="pdd-small", messages=msgs, max_completion_tokens=48, temperature=0.7,
                                        seed=1, stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    chunks = list(stream)  # 48 tokens: room for the handoff even on a loaded machine
    assert chunks[0].choices[0].delta.role == "assistant"
    toks = [c for c in chunks if c.choices and c.model_extra.get("pdd")]
    assert len(toks) == 48 and toks[-1].choices[0].finish_reason == "length"
    tiers = [c.model_extra["pdd"]["tier"] for c in toks]
    assert tiers[0] == "rld" and "md" in tiers  # handed over mid-stream
    usage = chunks[-1].usage
    assert usage.completion_tokens == 48 and usage.total_tokens == usage.prompt_tokens + 48
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = oa.chat.completions.create(model="pdd-small", messages=msgs, max_completion_tokens=48, temperature=0.7,
                                       seed=1, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == text and again.usage.prompt_tokens == usage.prompt_tokens


def test_identical_seeded_requests_return_identical_text(oa):
    kw = dict(model="pdd-small", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 100, "repetition_penalty": 1.1})
    a = oa.completions.create(**kw)
    b = oa.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 24
    assert a.model_extra["pdd"]["handoff_pos"] is not None  # RLD and MD both sampled it
    c = oa.completions.create(**{**kw, "seed": 1235})
    assert c.choices[0].text != a.choices[0].text


def test_stop_string_honoured_across_the_handoff(topo, oa):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 77, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    full = _stream(topo, body)
    hp = full["handoff_pos"]
    assert hp is not None and hp >= HANDOFF_AT
    # a stop string made of the text of two tokens MD produced, well after the handoff
    pieces = full["pieces"]
    k = next(i for i in range(hp + 2, 38) if pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    text = "".join(pieces)
    expected = text[:text.index(stop)]
    before = {n: v["engine_steps"] for n, v in _wait_idle(topo).items()}
    r = oa.completions.create(model="pdd-small", prompt=PROMPT, max_tokens=400, temperature=1.0, seed=77, stop=[stop],
                              extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= k + 2
    # streamed: no chunk carries text of or after the stop string
    got = _stream(topo, {**body, "max_tokens": 400, "stop": stop})
    assert "".join(got["pieces"]) == expected and got["finish"] == "stop"
    # and the tiers stopped decoding: the request is gone everywhere, not 400 tokens long. MD's
    # steps are not held: it decodes on while the stop's abort crosses (a busy machine can stall
    # the gateway or MD's loop for a while), so the bound is half of the 2 x 400 decode steps two
    # unstopped requests would take, not the ~2 x (k + 4) a prompt abort costs
    after = _wait_idle(topo)
    steps = sum(after[n]["engine_steps"] - before[n] for n in before)
    assert steps < 400, steps


def test_logprobs_from_every_tier(oa):
    r = oa.completions.create(model="pdd-small", prompt=PROMPT, max_tokens=10, temperature=0.9, seed=3, logprobs=3,
                              extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 10
    assert all(v is not None and v <= 0 for v in lp.token_logprobs)  # position 0 (P), RLD's and MD's
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    c = oa.chat.completions.create(model="pdd-small", messages=[{"role": "user", "content": "Hi"}],
                                   max_completion_tokens=8, seed=3, logprobs=True, top_logprobs=2,
                                   extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 8 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    g = oa.completions.create(model="pdd-small", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                              extra_body={"ignore_eos": True})
    glp = g.choices[0].logprobs
    assert all(v == max(t.values()) for v, t in zip(glp.token_logprobs, glp.top_logprobs))


def test_n_two(oa, topo):
    r = oa.completions.create(model="pdd-small", prompt=PROMPT, max_tokens=12, n=2, temperature=1.0, seed=50,
                              extra_body={"ignore_eos": True})
    ch = sorted(r.choices, key=lambda c: c.index)
    assert [c.index for c in ch] == [0, 1] and all(c.finish_reason == "length" for c in ch)
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(PROMPT)
    assert ch[0].text != ch[1].text
    # choice i is the request with seed + i (so RLD, MD and a replay agree on it)
    one = oa.completions.create(model="pdd-small", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=51,
                                extra_body={"ignore_eos": True})
    assert one.choices[0].text == ch[1].text
    # the sibling reused the first choice's prompt KV from P's prefix cache (whole pages)
    assert r.model_extra["pdd"]["choices"][1]["p_cached_tokens"] == (len(PROMPT) // 16) * 16
    stream = oa.chat.completions.create(model="pdd-small", messages=[{"role": "user", "content": "Hi"}], n=2,
                                        max_completion_tokens=6, seed=9, stream=True,
                                        extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    fins = {}
    for c in stream:
        for x in c.choices:
            texts[x.index] += x.delta.content or ""
            if x.finish_reason:
                fins[x.index] = x.finish_reason
    assert fins == {0: "length", 1: "length"}
    _wait_idle(topo)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.2}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
])
def test_out_of_range_parameters_get_400(topo, body, param):
    r = httpx.post(topo.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
    r = httpx.post(topo.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            **{k: v for k, v in body.items() if k != "prompt"}},
                   timeout=30)
    assert r.status_code == 400


def _stream(topo, body) -> dict:
    import json

    r = httpx.post(topo.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    toks = [c for c in chunks if c.get("choices")]
    summary = next((c["pdd"] for c in chunks if "usage" in c), {})
    return {"pieces": [c["choices"][0]["text"] for c in toks], "tiers": [c["pdd"]["tier"] for c in toks],
            "finish": toks[-1]["choices"][0]["finish_reason"], "handoff_pos": summary.get("handoff_pos")}


def test_same_prompt_twice_sends_only_the_partial_last_page_over_the_wan(topo, oa):
    """The second of two identical requests: every whole page hits MD's cache (MD's hit
    counters), only the partial last page crosses the WAN, as its 8 filled token slots (half a
    page's bytes), and ``cached_tokens`` is P's hit."""
    prompt = list(range(600, 800))  # 200 tokens: 12 whole pages of 16 and 8 tokens
    kw = dict(model="pdd-small", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    a = oa.completions.create(**kw)
    assert a.model_extra["pdd"]["cut_off"] is False and a.usage.completion_tokens == 12
    before = _wait_idle(topo)
    b = oa.completions.create(**kw)
    after = _wait_idle(topo)
    assert b.choices[0].text == a.choices[0].text
    page_bytes = int(after["p0"]["page_bytes"])
    assert b.usage.prompt_tokens_details.cached_tokens == 192  # P: 12 pages (it computes >= 1 token)
    assert after["p0"]["prefix_hit_tokens"] - before["p0"]["prefix_hit_tokens"] == 192
    assert after["md0"]["prefix_hit_tokens"] - before["md0"]["prefix_hit_tokens"] == 192  # MD's counters
    assert b.model_extra["pdd"]["md_cached_tokens"] == 192
    slot_bytes = page_bytes // 16
    assert b.model_extra["pdd"]["wan_bytes_expected"] == 8 * slot_bytes  # the last page's 8 tokens planned ...
    assert after["p0"]["wan_bytes_sent"] - before["p0"]["wan_bytes_sent"] == 8 * slot_bytes  # ... and sent


def test_prompt_shorter_than_one_page_completes_transfer_and_handoff(topo, oa):
    # 160 tokens: RLD decodes long enough for the page to cross the WAN even on a loaded machine
    r = oa.completions.create(model="pdd-small", prompt=[11, 12, 13, 14, 15], max_tokens=160, temperature=0,
                              extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 160 and r.choices[0].finish_reason == "length"
    summary = r.model_extra["pdd"]
    assert summary["handoff_pos"] is not None and summary["handoff_pos"] >= HANDOFF_AT  # MD took over
    assert summary["wan_bytes_expected"] == 5 * int(topo.stats()["instances"]["p0"]["page_bytes"]) // 16  # 5 slots
    _wait_idle(topo)


def test_prompt_just_over_max_input_len_is_400_before_any_tier_works(topo):
    e = topo.cfg.engine
    n = e.max_input_len + 1
    assert n + 8 <= e.max_model_len  # inside the context window
    before = {k: v["counters"]["requests"] for k, v in topo.stats()["instances"].items()}
    r = httpx.post(topo.url + "/v1/completions", json={"prompt": list(range(10, 10 + n)), "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    after = {k: v["counters"]["requests"] for k, v in topo.stats()["instances"].items()}
    assert after == before  # no tier saw it
