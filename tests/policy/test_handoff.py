import pytest

from pdd.policy.handoff import HandoffDecision, HandoffInputs, decide_handoff, effective_handoff_mode, rld_load


def test_one_shot_sends_everything_final():
    assert decide_handoff(HandoffInputs(tokens_pending=100, mode_config="one_shot")) == HandoffDecision("one_shot", 100, True)


def test_catch_up_rounds():
    assert decide_handoff(HandoffInputs(tokens_pending=100, mode_config="catch_up")) == HandoffDecision("catch_up", 100, False)
    assert decide_handoff(HandoffInputs(tokens_pending=64, mode_config="catch_up")) == HandoffDecision("catch_up", 64, True)
    assert decide_handoff(HandoffInputs(tokens_pending=12, mode_config="catch_up", round_index=1)) == HandoffDecision("catch_up", 12, True)
    assert decide_handoff(HandoffInputs(tokens_pending=0, mode_config="catch_up")) == HandoffDecision("catch_up", 0, True)


def test_catch_up_round_cap():
    d = decide_handoff(HandoffInputs(tokens_pending=500, mode_config="catch_up", round_index=8, max_rounds=8))
    assert d == HandoffDecision("catch_up", 500, True)


def test_rld_load():
    assert rld_load(HandoffInputs(0, rld_running=8, rld_capacity=16, rld_pages_used=90, rld_pages_total=100)) == pytest.approx(0.9)
    assert rld_load(HandoffInputs(0, rld_running=12, rld_capacity=16, rld_pages_used=10, rld_pages_total=100)) == pytest.approx(0.75)


def auto(running, current):
    return HandoffInputs(tokens_pending=200, rld_running=running, rld_capacity=100, rld_pages_used=0,
                         rld_pages_total=100, mode_config="auto", current_mode=current)


def test_auto_hysteresis():
    assert effective_handoff_mode(auto(84, "catch_up")) == "catch_up"
    assert effective_handoff_mode(auto(85, "catch_up")) == "one_shot"
    assert effective_handoff_mode(auto(70, "one_shot")) == "one_shot"  # between watermarks: stay
    assert effective_handoff_mode(auto(70, "catch_up")) == "catch_up"
    assert effective_handoff_mode(auto(60, "one_shot")) == "catch_up"
    assert decide_handoff(auto(90, "catch_up")) == HandoffDecision("one_shot", 200, True)
    assert decide_handoff(auto(10, "one_shot")) == HandoffDecision("catch_up", 200, False)


def test_bad_mode():
    with pytest.raises(ValueError):
        decide_handoff(HandoffInputs(tokens_pending=1, mode_config="sometimes"))


def test_early_handoff_waits_for_the_kv_s_last_byte_to_leave():
    from pdd.policy.handoff import early_handoff_delay_s

    # 625,000 bytes at 0.05 Gbit/s (6.25 MB/s) take 0.1 s; 0.03 s of it already elapsed
    assert early_handoff_delay_s(625_000, 0.05, 0.03) == pytest.approx(0.07)
    assert early_handoff_delay_s(625_000, 0.05, 0.5) == 0.0
    assert early_handoff_delay_s(0, 0.05, 0.0) == 0.0
    for bad in ((1, 0.0, 0.0), (-1, 0.05, 0.0)):
        with pytest.raises(ValueError):
            early_handoff_delay_s(*bad)
