"""``pdd.policy.membership.decide``: the elastic topology's state machine, every transition."""

import pytest

from pdd.policy.membership import ACTIVE, DRAINING, REMOVED, STANDBY, decide


@pytest.mark.parametrize("state", [STANDBY, REMOVED])
def test_add_takes_a_free_slot_to_active(state):
    d = decide("add", "md1", "main_decode", state)
    assert (d.ok, d.new_state, d.status) == (True, ACTIVE, 200)


@pytest.mark.parametrize("state", [ACTIVE, DRAINING])
def test_add_of_a_member_is_a_duplicate(state):
    d = decide("add", "md1", "main_decode", state)
    assert (d.ok, d.new_state, d.status) == (False, state, 409)
    assert d.message == f"instance md1 is already a member ({state})"


def test_drain_active_to_draining_and_idempotent():
    assert decide("drain", "md0", "main_decode", ACTIVE, others_active=1) == decide("drain", "md0", "main_decode",
                                                                                   ACTIVE, others_active=3)
    d = decide("drain", "md0", "main_decode", ACTIVE, others_active=1)
    assert (d.ok, d.new_state, d.status, d.message) == (True, DRAINING, 200, "")
    d = decide("drain", "md0", "main_decode", DRAINING, others_active=0)
    assert (d.ok, d.new_state, d.message) == (True, DRAINING, "instance md0 is already draining")


def test_drain_of_the_last_active_instance_needs_force():
    d = decide("drain", "p0", "prefill", ACTIVE, others_active=0)
    assert (d.ok, d.new_state, d.status) == (False, ACTIVE, 409)
    assert d.message == "instance p0 is the last active prefill instance: add another first (or force)"
    assert decide("drain", "p0", "prefill", ACTIVE, others_active=0, force=True).new_state == DRAINING


@pytest.mark.parametrize("op", ["drain", "remove"])
@pytest.mark.parametrize("state", [STANDBY, REMOVED])
def test_a_non_member_cannot_be_drained_or_removed(op, state):
    d = decide(op, "md1", "main_decode", state, force=True)
    assert (d.ok, d.new_state, d.status) == (False, state, 409)
    assert (d.message, d.code) == (f"instance md1 is {state}: not a member", "conflict")
    # however busy it still is (a removed instance's forced requests, still recovering)
    assert decide(op, "md1", "main_decode", state, busy=2, force=True).code == "conflict"


def test_remove_refused_while_busy_unless_forced():
    d = decide("remove", "md0", "main_decode", DRAINING, busy=2, others_active=1)
    assert (d.ok, d.new_state, d.status) == (False, DRAINING, 409)
    assert d.message.startswith("instance md0 still has 2 in-flight request(s)") and d.code == "in_flight"
    d = decide("remove", "md0", "main_decode", DRAINING, busy=2, others_active=1, force=True)
    assert (d.ok, d.new_state) == (True, REMOVED)


def test_remove_of_the_last_active_instance_while_busy_names_both_reasons_as_a_conflict():
    """Found by a new user: it answered ``in_flight`` alone, though draining and waiting would not
    do (the last active instance cannot be drained either)."""
    d = decide("remove", "md0", "main_decode", ACTIVE, busy=3, others_active=0)
    assert (d.ok, d.new_state, d.status, d.code) == (False, ACTIVE, 409, "conflict")
    assert d.message == ("instance md0 is the last active main_decode instance and still has 3 in-flight request(s) "
                         "or transfer(s): add another first, then drain it and wait until in_flight is 0 (or force)")
    assert decide("remove", "md0", "main_decode", ACTIVE, busy=3, others_active=0, force=True).new_state == REMOVED
    assert decide("remove", "md0", "main_decode", ACTIVE, busy=3, others_active=1).code == "in_flight"
    assert decide("remove", "md0", "main_decode", DRAINING, busy=3, others_active=0).code == "in_flight"


def test_remove_idle_draining_or_active():
    assert decide("remove", "md0", "main_decode", DRAINING, busy=0, others_active=0).new_state == REMOVED
    assert decide("remove", "md0", "main_decode", ACTIVE, busy=0, others_active=1).new_state == REMOVED
    d = decide("remove", "md0", "main_decode", ACTIVE, busy=0, others_active=0)
    assert (d.ok, d.status) == (False, 409)


def test_unknown_op_or_state_raises():
    with pytest.raises(ValueError, match="unknown membership operation 'grow'"):
        decide("grow", "md0", "main_decode", ACTIVE)
    with pytest.raises(ValueError, match="unknown membership state 'asleep'"):
        decide("add", "md0", "main_decode", "asleep")


def test_rerole_decisions():
    from pdd.policy.membership import decide_rerole

    ok = decide_rerole("rld0", "relay_decode", "main_decode", ACTIVE, "A", allowed=True, others_active=1)
    assert (ok.ok, ok.changed, ok.status) == (True, True, 200)
    same = decide_rerole("rld0", "main_decode", "main_decode", ACTIVE, "A", allowed=True, others_active=0)
    assert (same.ok, same.changed, same.status) == (True, False, 200)
    cases = {
        ("relay_decode", "prefill", ACTIVE, "A", True, 1, False): 400,
        ("relay_decode", "main_decode", ACTIVE, "A", False, 1, False): 403,  # not listed in rerole
        ("main_decode", "relay_decode", ACTIVE, "B", True, 1, False): 403,  # an MD in B is not an RLD
        ("prefill", "main_decode", ACTIVE, "A", True, 1, False): 403,
        ("relay_decode", "main_decode", DRAINING, "A", True, 1, False): 409,
        ("relay_decode", "main_decode", STANDBY, "A", True, 1, False): 409,
        ("relay_decode", "main_decode", ACTIVE, "A", True, 0, False): 409,  # the last RLD
    }
    for (role, to, state, dc, allowed, others, force), status in cases.items():
        d = decide_rerole("rld0", role, to, state, dc, allowed=allowed, others_active=others, force=force)
        assert (d.ok, d.status) == (False, status), (role, to, state, dc, d)
    forced = decide_rerole("rld0", "relay_decode", "main_decode", ACTIVE, "A", allowed=True, others_active=0,
                           force=True)
    assert (forced.ok, forced.changed) == (True, True)
    with pytest.raises(ValueError):
        decide_rerole("rld0", "relay_decode", "main_decode", "gone", "A", allowed=True, others_active=1)


def test_a_refused_rerole_names_the_real_reason():
    from pdd.policy.membership import decide_rerole

    md = decide_rerole("md0", "main_decode", "relay_decode", ACTIVE, "B", allowed=False, others_active=1)
    assert md.status == 403 and md.message == ("instance md0 is a main_decode instance: only relay decoders "
                                               "the config's rerole lists may change role")
    rld = decide_rerole("rld1", "relay_decode", "main_decode", ACTIVE, "A", allowed=False, others_active=1)
    assert rld.status == 403 and "add it: rerole: [rld1]" in rld.message
