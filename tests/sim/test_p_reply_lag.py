"""P's reply lag (``SimConfig.p_reply_lag_s_per_token``): P's reply (its first token, and in whole
mode its KV sends) comes ``lag x min(computed tokens, chunk)`` after the prefill's last step (the
largest such of the prefills that step finishes: P replies for them together, in batch order),
while P's engine goes on with the next prefill; and its checks in a config and a profile."""

import pytest

from pdd.sim.recorded import RecordedRunError, check_role_fits
from pdd.sim.sim_config import with_live_fit
from tests.sim.test_decode_interference import HOST, run

C1 = {"timestamp": 0, "input_length": 320, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4]}
C2 = {"timestamp": 1, "input_length": 192, "output_length": 4, "hash_ids": [10, 11, 12]}
LONG = {"timestamp": 0, "input_length": 9000, "output_length": 2, "hash_ids": list(range(20, 38))}


def test_the_reply_trails_the_step_and_p_goes_on():
    lag = 1e-4
    base = run(HOST, [C1, C2])
    slow = run(HOST.replace(p_reply_lag_s_per_token=lag), [C1, C2])
    p0, p1 = base.tiers["P"][0], slow.tiers["P"][0]
    assert (p1.busy_s, p1.steps) == (p0.busy_s, p0.steps)  # the lag holds no engine time
    # C1's reply lags its 320 computed tokens; C2 queued behind C1's step and ran when it ended, as
    # without the lag: its reply lags by its own 192 tokens only
    assert slow.reqs[0].t_prefill_done - base.reqs[0].t_prefill_done == pytest.approx(320 * lag, rel=1e-9)
    assert slow.reqs[1].t_prefill_done - base.reqs[1].t_prefill_done == pytest.approx(192 * lag, rel=1e-9)
    assert slow.reqs[0].t_first - base.reqs[0].t_first >= 320 * lag * (1 - 1e-9)


def test_prefills_finishing_in_one_step_reply_together_in_batch_order():
    """A short prompt joining a long one's last chunk gets its reply with the long one's, after it
    (the runtime's P resolves a step's first tokens in one pass, in batch order, and starts their
    KV sends in that order), not its own smaller lag earlier: a live run's relayed short request
    that finished beside a 3,904-token prefill sent its KV behind that one's 8 MB."""
    lag = 1e-4
    cfg = HOST.replace(prefill_chunk_tokens=512, max_batch_tokens=512)
    long_ = {"timestamp": 0, "input_length": 900, "output_length": 2, "hash_ids": list(range(40, 55))}
    short = {"timestamp": 1, "input_length": 64, "output_length": 2, "hash_ids": [60]}
    base, slow = run(cfg, [long_, short]), run(cfg.replace(p_reply_lag_s_per_token=lag), [long_, short])
    # one step finishes both (the long one's 388-token rest and the short 64), without a lag too
    assert base.tiers["P"][0].steps == slow.tiers["P"][0].steps == 2
    assert base.reqs[0].t_prefill_done == base.reqs[1].t_prefill_done
    # both replies trail that step by the long prefill's largest step (512 tokens)
    for i in (0, 1):
        assert slow.reqs[i].t_prefill_done - base.reqs[i].t_prefill_done == pytest.approx(512 * lag, rel=1e-9)


def test_the_lag_counts_one_chunk_at_most():
    lag = 1e-5
    cfg = HOST.replace(prefill_chunk_tokens=4096, max_batch_tokens=8192)
    base, slow = run(cfg, [LONG]), run(cfg.replace(p_reply_lag_s_per_token=lag), [LONG])
    assert slow.reqs[0].t_prefill_done - base.reqs[0].t_prefill_done == pytest.approx(4096 * lag, rel=1e-9)


@pytest.mark.parametrize("bad", [-1e-6, 0.011, float("inf"), float("nan"), True, "2e-5"])
def test_the_lag_is_checked(bad, tmp_path):
    with pytest.raises(ValueError, match=r"p_reply_lag_s_per_token must be a number of seconds in \[0, 0.01\]"):
        HOST.replace(p_reply_lag_s_per_token=bad)
    with pytest.raises(RecordedRunError, match=r"p_reply_lag_s_per_token must be a finite number >= 0 and <= 0.01"):
        check_role_fits({"p_reply_lag_s_per_token": bad}, tmp_path / "p.json")


def test_a_profile_s_lag_is_applied():
    assert with_live_fit(HOST, {"p_reply_lag_s_per_token": 2e-5}).p_reply_lag_s_per_token == 2e-5
    assert with_live_fit(HOST, {}).p_reply_lag_s_per_token == 0.0
