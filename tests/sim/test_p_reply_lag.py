"""P's reply lag (``SimConfig.p_reply_lag_s_per_token``): P's reply (its first token, and in whole
mode its KV sends) comes ``lag x min(computed tokens, chunk)`` after the prefill's last step,
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
