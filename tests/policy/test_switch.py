"""pdd.policy.switch: the catch-up jitter buffer on plain state (no processes, no clocks)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pdd.policy.switch import (PaceParams, SwitchPacer, ewma_itl, hold_step_ms, next_hold, paced_gaps,
                               predicted_md_arrival_ms, release_ms, switch_ready)


def test_ewma_and_step():
    assert ewma_itl(None, 4.0) == 4.0
    assert ewma_itl(4.0, 8.0, alpha=0.25) == 5.0
    with pytest.raises(ValueError):
        ewma_itl(4.0, -1.0)
    with pytest.raises(ValueError):
        ewma_itl(4.0, 1.0, alpha=0.0)
    assert hold_step_ms(4.0, PaceParams(max_gap_factor=1.5)) == 2.0
    assert hold_step_ms(0.1, PaceParams(max_gap_factor=2.0, itl_floor_ms=1.0)) == 1.0  # floor
    assert hold_step_ms(5.0, PaceParams(max_gap_factor=1.5), itl_src_ms=4.0) == 3.5  # MD slower: 7.5 - 4
    assert hold_step_ms(5.0, PaceParams(max_gap_factor=1.5), itl_src_ms=9.0) == 2.5  # source capped at the reference


def test_params_validated():
    for bad in (dict(max_gap_factor=1.0), dict(max_hold_ms=-1), dict(switch_gap_factor=0.9),
                dict(max_gap_factor=1.5, switch_gap_factor=1.6), dict(max_ramp_tokens=0), dict(itl_floor_ms=0),
                dict(prior_lag_ms=-1)):
        with pytest.raises(ValueError):
            PaceParams(**bad)


def test_next_hold_caps():
    p = PaceParams(max_gap_factor=1.5, max_hold_ms=100, prior_lag_ms=30)
    assert next_hold(0.0, 4.0, None, p) == 2.0
    assert next_hold(29.0, 4.0, None, p) == 30.0  # prior lag caps while unknown
    assert next_hold(29.0, 4.0, 50.0, p) == 31.0  # measured lag replaces it
    assert next_hold(99.5, 4.0, 500.0, p) == 100.0  # max_hold_ms
    assert next_hold(40.0, 4.0, 20.0, p) == 40.0  # never shrinks


def test_switch_ready_rule():
    p = PaceParams(max_gap_factor=1.5, max_hold_ms=100, max_ramp_tokens=10)
    assert predicted_md_arrival_ms(100.0, 11, 18, 4.0) == 128.0
    assert predicted_md_arrival_ms(100.0, 11, 5, 4.0) == 100.0  # never before MD's latest token
    assert not switch_ready(None, 4.0, 0, 50.0, p)  # MD not live
    assert not switch_ready(4.1, 4.0, 3, 20.0, p)  # MD's next token later than one ITL
    assert switch_ready(4.0, 4.0, 3, 20.0, p)
    assert switch_ready(6.0, 4.0, 3, 20.0, PaceParams(max_gap_factor=1.5, switch_gap_factor=1.5))
    assert switch_ready(-3.0, 4.0, 3, 20.0, p)  # MD's token would already be there
    assert switch_ready(30.0, 4.0, 10, 20.0, p)  # ramp budget spent
    assert switch_ready(30.0, 4.0, 1, 100.0, p)  # hold cap reached


def test_release_and_paced_gaps():
    assert release_ms(10.0, 5.0, None) == 15.0
    assert release_ms(10.0, 5.0, 20.0) == 20.0
    assert paced_gaps([0, 4, 8, 12], [0, 2, 4, 6]) == [6, 6, 6]
    with pytest.raises(ValueError):
        paced_gaps([0, 1], [0])


@dataclass
class Tok:
    pos: int
    token_id: int
    tier: str
    fin: object = None


@dataclass
class FakeReq:
    """The fields of the gateway's request state the pacer reads, with a router of the same rules as
    Orchestrator._next_tokens for a catch-up handoff (MD behind RLD: switch at next_pos)."""

    handoff_mode: str | None = None
    switch_pos: int | None = None
    md_diverged: bool = False
    next_pos: int = 0
    emitted: list = field(default_factory=list)
    md_pending: dict = field(default_factory=dict)

    @property
    def handoff(self):
        """What the pacer reads of the gateway's ``ReqState.handoff`` (a HandoffState)."""
        return SimpleNamespace(mode=self.handoff_mode, switch_pos=self.switch_pos, md_diverged=self.md_diverged)

    def route(self, st, tok):
        assert st is self
        if tok.tier == "md":
            if tok.pos < self.next_pos:
                if self.emitted[tok.pos] != tok.token_id:
                    self.md_diverged = True
                    return []
                if self.switch_pos is None:
                    self.switch_pos = self.next_pos
                return self._drain()
            self.md_pending[tok.pos] = tok
            return self._drain()
        if self.switch_pos is not None or tok.pos != self.next_pos:
            return []
        self.next_pos += 1
        self.emitted.append(tok.token_id)
        return [tok]

    def _drain(self):
        out = []
        while self.switch_pos is not None and self.next_pos in self.md_pending:
            t = self.md_pending.pop(self.next_pos)
            self.next_pos += 1
            self.emitted.append(t.token_id)
            out.append(t)
        return out


def simulate(itl=4.0, lag=25.0, catch_up_at=10, n=80, pace=True, params=PaceParams(), itl_md=None):
    """RLD emits token p at p * itl; from the first catch-up round (at token ``catch_up_at``) MD's
    token q arrives at (catch_up_at + 1) * itl + lag + (q - catch_up_at - 1) * itl_md (MD's own pace,
    default RLD's); RLD stops two tokens after the switch. Returns (client release times by
    position, pacer, request)."""
    itl_md = itl if itl_md is None else itl_md
    st = FakeReq()
    pacer = SwitchPacer(params)
    q0 = catch_up_at + 1
    events = [(p * itl, 0, Tok(p, 100 + p, "rld")) for p in range(n)]
    events += [(q0 * itl + lag + (q - q0) * itl_md, 1, Tok(q, 100 + q, "md")) for q in range(q0, n)]
    events.sort(key=lambda e: (e[0], e[1]))
    rel: dict[int, float] = {}
    stop_rld_after = None
    for now, _, tok in events:
        if tok.pos == catch_up_at and tok.tier == "rld":
            st.handoff_mode = "catch_up"
        if tok.tier == "rld" and stop_rld_after is not None and tok.pos > stop_rld_after:
            continue
        if pace:
            pacer.feed(st, tok, now, st.route)
            for r, t in pacer._queue:
                rel.setdefault(t.pos, r)
        else:
            for t in st.route(st, tok):
                rel.setdefault(t.pos, now)
        if st.switch_pos is not None and stop_rld_after is None:
            stop_rld_after = st.next_pos + 1
    return rel, pacer, st


def gaps(rel):
    ts = [rel[p] for p in sorted(rel)]
    return [b - a for a, b in zip(ts, ts[1:])]


def test_unpaced_switch_gap_is_the_lag():
    rel, _, st = simulate(pace=False)
    # MD's first token (11) arrives at 69 ms, when RLD has streamed 0..17 (17 at 68 ms): MD streams from 18,
    # whose token arrives at 72 + 25 = 97 ms: one gap of ITL + lag
    assert st.switch_pos == 18
    assert max(gaps(rel)) == pytest.approx(4.0 + 25.0)


def test_paced_switch_keeps_every_gap_within_factor():
    rel, pacer, st = simulate(pace=True, params=PaceParams(max_gap_factor=1.5, prior_lag_ms=30.0))
    g = gaps(rel)
    assert sorted(rel) == list(range(80))  # every position once, in order
    assert max(g) <= 1.5 * 4.0 + 1e-9
    assert pacer.lag_ms == pytest.approx(25.0)
    assert st.switch_pos is not None and st.switch_pos > 18  # the switch waited for the hold
    assert pacer.max_hold_seen_ms <= 25.0 + 2.0 + 1e-9  # no token delayed by more than the lag + one step
    assert pacer.held_back > 0


def test_paced_switch_when_md_is_slower_than_rld():
    # MD decodes at 5 ms/token, RLD at 4: MD's lag grows while the switch waits; the hold still catches up
    rel, pacer, st = simulate(pace=True, itl_md=5.0, params=PaceParams(max_gap_factor=1.5, prior_lag_ms=30.0))
    assert sorted(rel) == list(range(80))
    assert max(gaps(rel)) <= 1.5 * 5.0 + 1e-9
    assert pacer.itl_md_ms == pytest.approx(5.0) and st.switch_pos is not None
    unpaced, _, _ = simulate(pace=False, itl_md=5.0)
    assert max(gaps(unpaced)) == pytest.approx(36.0)  # MD's token 18 at 69 + 7 x 5 = 104 ms, RLD's 17 went at 68


def test_one_shot_and_unrelayed_tokens_are_not_held():
    st = FakeReq()
    pacer = SwitchPacer()
    for p in range(5):
        pacer.feed(st, Tok(p, p, "rld"), 4.0 * p, st.route)
    assert [t.pos for t in pacer.due(16.0)] == [0, 1, 2, 3, 4]
    assert pacer.wait_ms(16.0) is None and pacer.ramp_tokens == 0


def test_divergent_md_token_is_routed_at_once():
    st = FakeReq(handoff_mode="catch_up")
    pacer = SwitchPacer()
    for p in range(5):
        pacer.feed(st, Tok(p, p, "rld"), 4.0 * p, st.route)
    pacer.feed(st, Tok(2, 999, "md"), 30.0, st.route)
    assert st.md_diverged and st.switch_pos is None and pacer.held_back == 0
