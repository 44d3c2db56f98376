"""MD's hold of KV frames that arrive before their reservation (pdd.roles.early_frames)."""

from __future__ import annotations

import pytest

from pdd.roles.early_frames import EarlyFrames


def test_frames_are_held_in_order_and_taken_once():
    ef = EarlyFrames(ttl_s=10, max_bytes=100)
    assert ef.hold("r1", "kv", {"first_page": 3}, b"abc", now_s=0.0)
    assert ef.hold("r2", "kv", {"first_page": 0}, b"zz", now_s=0.1)
    assert ef.hold("r1", "kv_done", {"first_token": 7}, b"", now_s=0.2)
    assert ef.nbytes == 5 and len(ef) == 2 and ef.held_frames == 3
    assert ef.take("r1") == [("kv", {"first_page": 3}, b"abc"), ("kv_done", {"first_token": 7}, b"")]
    assert ef.take("r1") == []
    assert ef.nbytes == 2 and len(ef) == 1


def test_frames_of_an_ended_request_are_dropped_not_held():
    ef = EarlyFrames(ttl_s=10, max_bytes=100)
    ef.hold("r1", "kv", {}, b"abcd", now_s=0.0)
    ef.ended("r1")
    assert len(ef) == 0 and ef.nbytes == 0 and ef.dropped_frames == 1
    assert not ef.hold("r1", "kv", {}, b"x", now_s=0.1)
    assert ef.take("r1") == [] and ef.dropped_frames == 2


def test_old_frames_expire_and_the_byte_bound_drops_the_oldest_request():
    ef = EarlyFrames(ttl_s=1.0, max_bytes=10)
    ef.hold("old", "kv", {}, b"1234", now_s=0.0)
    ef.hold("mid", "kv", {}, b"1234", now_s=0.5)
    ef.hold("new", "kv", {}, b"12", now_s=1.2)  # "old" is 1.2 s old: expired
    assert ef.take("old") == [] and ef.nbytes == 6
    ef.hold("big", "kv", {}, b"123456", now_s=1.3)  # 12 bytes > 10: the oldest ("mid") goes
    assert ef.take("mid") == [] and ef.nbytes == 8
    assert [f[2] for f in ef.take("new")] == [b"12"]
    assert not ef.hold("huge", "kv", {}, b"x" * 11, now_s=1.4)  # alone over the bound
    assert ef.dropped_frames == 3


def test_the_ended_memory_is_bounded():
    ef = EarlyFrames(keep_ended=2)
    for rid in ("a", "b", "c"):
        ef.ended(rid)
    assert ef.hold("a", "kv", {}, b"x", now_s=0.0)  # forgotten: held again
    assert not ef.hold("c", "kv", {}, b"x", now_s=0.0)


@pytest.mark.parametrize("kw", [{"ttl_s": 0}, {"max_bytes": -1}, {"keep_ended": 0}])
def test_bad_bounds_are_refused(kw):
    with pytest.raises(ValueError):
        EarlyFrames(**kw)
