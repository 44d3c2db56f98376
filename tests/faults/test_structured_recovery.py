"""A structured output survives a killed tier: RLD killed while it decodes, MD killed while it
decodes, each mid-way through a constrained greedy request (pdd mode, tiny model). The gateway's
recovery starts a new attempt whose prompt ends with the outputs streamed so far
(``SamplingParams.output_offset``); the new attempt's tiers replay them through the grammar, so
the stream ends by EOS with exactly the single engine's tokens under the same grammar, and the
text matches the constraint. Killed instances are restarted between the cells; every page is
free at the end."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from pdd.faults import FaultInjector, StreamClient
from pdd.launch import Topology
from pdd.structured import grammar_for
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = [pytest.mark.faults, pytest.mark.slow]

REGEX = r"[a-z]{40}\.[0-9]{8}"  # long enough to outlast RLD's K tokens and MD's first steps
K = 12  # handoff_min_tokens
MAX_TOKENS = 96


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(40)]


@pytest.fixture(scope="module")
def topo(tiny_model, tmp_path_factory):
    # both decode tiers held to >= 40 ms a step so each phase lasts several steps on any machine
    cfg = make_cfg(tiny_model, "pdd", instances={"prefill": 1, "relay_decode": 2, "main_decode": 2},
                   link={"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0},
                   policy={"handoff_min_tokens": K},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 40.0}},
                          "main_decode": {"engine": {"min_step_ms": 40.0}}},
                   liveness={"heartbeat_interval_s": 0.25, "dead_after_s": 1.5}, request_timeout_s=60.0)
    t = Topology(cfg, log_dir=Path(tmp_path_factory.mktemp("so-faults-logs")))
    t.start()
    yield t
    t.stop()


@pytest.mark.parametrize("role,phase,seed", [("relay_decode", "rld_decode", 1), ("main_decode", "md_decode", 2)])
def test_a_structured_output_survives_a_killed_decoder(topo, tiny_model, role, phase, seed):
    from tokenizers import Tokenizer

    prompt = _prompt(seed)
    (ref,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS, grammar=grammar_for("regex", REGEX))
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    end = next(i for i, t in enumerate(ref) if tok.id_to_token(t) == "</s>")
    want = ref[:end + 1]  # the oracle ignores EOS: the request ends at the first one
    assert K < end and re.fullmatch(REGEX, tok.decode(want[:-1])), tok.decode(want[:-1])
    landed = []
    for _ in range(3):  # a loaded machine can move the request on between the look and the kill
        landed.append(_kill_once(topo, prompt, role, phase, want, tok))
        if landed[-1] == phase:
            return
    pytest.fail(f"the kill landed in {landed}, never in {phase}")


def _kill_once(topo, prompt, role, phase, want, tok) -> str:
    inj = FaultInjector(topo)
    client = StreamClient(topo.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     "structured_outputs": {"regex": REGEX}}).start()
    killed = None
    try:
        rid, view = inj.wait_phase(phase, timeout_s=30, need=role)
        rec = inj.kill(view["names"][role], rid)
        killed = rec.target
        assert client.wait(60), f"stream hung after {len(client.tokens)} tokens: {rec}"
        assert client.error is None and client.status == 200, client.error
        assert client.tokens == want and client.finish_reason == "stop", (client.tokens, want)
        assert re.fullmatch(REGEX, tok.decode(client.tokens[:-1]))
    finally:
        client.close()
        if killed is not None:
            inj.restart(killed)
        inj.close()
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
    return rec.phase
