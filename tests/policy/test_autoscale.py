"""pdd.policy.autoscale: the autoscaling rule, exact decisions."""

import pytest

from pdd.policy.autoscale import DOWN, HOLD, UP, AutoscaleInputs, AutoscaleRule, RoleLoad, decide_mix

RULE = AutoscaleRule(cooldown_s=10.0, min_n={"main_decode": 1}, max_n={"main_decode": 3}, up_at=0.75, down_at=0.25)


def md(active, u, since=None, pending=False):
    return decide_mix(AutoscaleInputs((RoleLoad("main_decode", active, u),), since_last_change_s=since,
                                      pending=pending), RULE)


def one(d):
    (r,) = d.roles
    return r.action, r.current, r.target, r.reason


def test_scale_up_under_sustained_load():
    assert one(md(1, 0.9)) == (UP, 1, 2, "utilisation 0.90 >= 0.75")
    assert one(md(2, 0.75, since=10.0)) == (UP, 2, 3, "utilisation 0.75 >= 0.75")


def test_scale_down_when_idle():
    assert one(md(2, 0.0, since=60.0)) == (DOWN, 2, 1, "utilisation 0.00 <= 0.25")
    assert one(md(3, 0.25, since=60.0)) == (DOWN, 3, 2, "utilisation 0.25 <= 0.25")


def test_nothing_within_cooldown_or_while_pending():
    d = md(1, 1.0, since=9.9)
    assert one(d) == (HOLD, 1, 1, "cool-down: 9.9 s since the last change < 10 s")
    assert d.changes == ()
    assert one(md(2, 0.0, since=9.0))[0] == HOLD
    d = md(1, 1.0, since=100.0, pending=True)
    assert one(d) == (HOLD, 1, 1, "a change is under way (an instance starting or draining)")


def test_bounds_respected():
    assert one(md(3, 1.0)) == (HOLD, 3, 3, "utilisation 1.00 >= 0.75 but at max 3")
    assert one(md(1, 0.0)) == (HOLD, 1, 1, "utilisation 0.00 <= 0.25 but at min 1")
    assert one(md(4, 0.5)) == (DOWN, 4, 3, "4 active > max 3")
    rule = AutoscaleRule(min_n={"prefill": 2}, max_n={"prefill": 4})
    d = decide_mix(AutoscaleInputs((RoleLoad("prefill", 1, 0.0),)), rule)
    assert one(d) == (UP, 1, 2, "1 active < min 2")
    # a role without bounds holds its count
    d = decide_mix(AutoscaleInputs((RoleLoad("relay_decode", 1, 1.0),)), RULE)
    assert one(d) == (HOLD, 1, 1, "utilisation 1.00 >= 0.75 but at max 1")


def test_hold_in_band():
    assert one(md(2, 0.5)) == (HOLD, 2, 2, "utilisation 0.50 within (0.25, 0.75)")


def test_no_flapping_under_hysteresis():
    """A constant offered load (in requests, spread over the active instances): after each change
    the next decision, once the cool-down has passed, holds."""
    for load in (0.75, 0.8, 1.0, 1.4, 2.2):  # busy-instance equivalents
        n = 1
        u = load / n
        d = md(n, u)
        if d.changes:
            n = d.roles[0].target
            assert one(md(n, load / n, since=100.0))[0] != DOWN, load
    for load in (0.0, 0.2, 0.5, 0.75):
        n = 3
        d = md(n, load / n, since=100.0)
        if d.changes and d.roles[0].action == DOWN:
            n = d.roles[0].target
            assert one(md(n, load / n, since=100.0))[0] != UP, load
    # a ramp up and back down: never an up right after a down or the reverse
    seq, n, since = [], 1, None
    for load in (0.2, 0.9, 0.9, 1.6, 1.6, 1.6, 0.9, 0.4, 0.4, 0.1, 0.1):
        d = md(n, load / n, since=since)
        seq.append((load, d.roles[0].action, d.roles[0].target))
        if d.changes:
            n, since = d.roles[0].target, 0.0
        since = (since or 0.0) + 10.0 if since is not None else None
    assert [a for _l, a, _t in seq] == [HOLD, UP, HOLD, UP, HOLD, HOLD, HOLD, DOWN, DOWN, HOLD, HOLD]
    assert [t for _l, _a, t in seq] == [1, 2, 2, 3, 3, 3, 3, 2, 1, 1, 1]


def test_several_roles_decided_independently():
    d = decide_mix(AutoscaleInputs((RoleLoad("prefill", 1, 0.9), RoleLoad("main_decode", 2, 0.1)),
                                   since_last_change_s=30.0),
                   AutoscaleRule(cooldown_s=10, max_n={"prefill": 2, "main_decode": 2}))
    assert [(r.role, r.action, r.target) for r in d.roles] == [("prefill", UP, 2), ("main_decode", DOWN, 1)]
    assert d.as_dict()["roles"][0] == {"role": "prefill", "action": UP, "current": 1, "target": 2,
                                       "reason": "utilisation 0.90 >= 0.75"}


@pytest.mark.parametrize("kw,msg", [
    ({"down_at": 0.4}, "down_at must be >= 0 and < up_at / 2"),
    ({"up_at": 0.0}, "up_at must be in"),
    ({"cooldown_s": -1}, "cooldown_s must be >= 0"),
    ({"min_n": {"prefill": 0}}, "never remove a role's last instance"),
    ({"min_n": {"prefill": 3}, "max_n": {"prefill": 2}}, "below min_n"),
])
def test_rule_validation(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        AutoscaleRule(**kw)
