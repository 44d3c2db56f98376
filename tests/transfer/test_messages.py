"""The typed protocol messages (pdd.transfer.messages): every kind round-trips through a wire
frame unchanged, and a malformed header (unknown kind, missing, unknown or wrongly typed field,
random values) is refused with a MessageError naming the kind and field, never another error."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.transfer import messages, wire
from pdd.transfer.messages import KINDS, OMIT, MessageError, Msg

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

_text = st.text(max_size=12)
_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), _text),
                     lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(_text, c, max_size=3)),
                     max_leaves=6)


def _strategy(tp):
    """Values msgpack carries for a field of type ``tp``."""
    if tp is typing.Any:
        return _json
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return st.one_of(*(_strategy(a) for a in typing.get_args(tp)))
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is str:
        return _text
    if tp is bytes:
        return st.binary(max_size=16)
    if tp is list or origin is list:
        (item,) = typing.get_args(tp) or (typing.Any,)
        return st.lists(_strategy(item), max_size=5)
    if tp is dict or origin is dict:
        k, v = typing.get_args(tp) or (str, typing.Any)
        return st.dictionaries(_strategy(k), _strategy(v), max_size=3)
    raise AssertionError(tp)


def _fields(cls):
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.name != "extra"]


@st.composite
def _message(draw, cls):
    kw = {}
    for f, tp in _fields(cls):
        optional = f.default is not dataclasses.MISSING
        if optional and draw(st.booleans()):
            continue  # left out (OMIT)
        kw[f.name] = draw(_strategy(tp))
    if cls.OPEN:
        names = {f.name for f, _ in _fields(cls)} | {"t", "extra"} | set(messages.ENVELOPE)
        kw["extra"] = draw(st.dictionaries(_text.filter(lambda k: k not in names), _json, max_size=3))
    return cls(**kw)


_any_message = st.sampled_from(sorted(KINDS.values(), key=lambda c: c.T)).flatmap(_message)


def _through_wire(h: dict) -> dict:
    header, payload, n = wire.decode_frame(wire.frame_bytes(h, b"", crc=True))
    return header


def test_every_kind_is_registered_once():
    assert len(KINDS) == 42
    assert all(KINDS[c.T] is c for c in KINDS.values())


@SETTINGS
@given(_any_message)
def test_round_trip_through_a_frame(m: Msg):
    h = m.wire()
    assert h["t"] == m.T and not any(v is OMIT for v in h.values())
    back = messages.decode(_through_wire(h))  # (the frame's CRC adds "crc32": not a field)
    assert type(back) is type(m)
    assert back.wire() == h
    assert type(m).decode({**h, "cid": 7, "reply": True}).wire() == h  # the rpc envelope is not a field


@SETTINGS
@given(_any_message, st.data())
def test_missing_required_field_is_named(m: Msg, data):
    required = [f.name for f, _ in _fields(type(m)) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if not required:
        return
    name = data.draw(st.sampled_from(required))
    h = {k: v for k, v in m.wire().items() if k != name}
    with pytest.raises(MessageError, match=f"message '{m.T}': missing field '{name}'"):
        messages.decode(h)


_WRONG = {int: "7", float: "x", str: 7, bool: 1, bytes: "b", list: {"a": 1}, dict: [1]}


def _wrong_value(tp):
    """A value msgpack could carry that ``tp`` does not admit."""
    base = typing.get_origin(tp) or tp
    if base in (list, dict):
        args = typing.get_args(tp)
        if base is list and args == (int,):
            return [1, "2"]
        if base is dict and args:
            return {"k": b"\x00"} if args[1] is not typing.Any else [1]
        return _WRONG[base]
    if base is typing.Union or str(base) == "<class 'types.UnionType'>":
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _wrong_value(inner)
    return _WRONG[tp]


@SETTINGS
@given(_any_message, st.data())
def test_wrongly_typed_field_is_named(m: Msg, data):
    fields = _fields(type(m))
    if not fields:
        return
    f, tp = data.draw(st.sampled_from(fields))
    h = {**m.wire(), f.name: _wrong_value(tp)}
    with pytest.raises(MessageError, match=f"message '{m.T}': field '{f.name}' must be "):
        messages.decode(h)


def test_unknown_kind_and_unknown_field_are_refused():
    with pytest.raises(MessageError, match="unknown message kind 'tokk'"):
        messages.decode({"t": "tokk", "rid": "r"})
    with pytest.raises(MessageError, match="unknown message kind None"):
        messages.decode({"rid": "r"})
    with pytest.raises(MessageError, match="message 'abort': unknown field 'ridd'"):
        messages.decode({"t": "abort", "rid": "r", "ridd": "r"})
    with pytest.raises(MessageError, match="expected a 'abort' message, got kind 'drop'"):
        messages.Abort.decode({"t": "drop", "rid": "r"})
    with pytest.raises(MessageError, match="must be a map"):
        messages.decode([1, 2])


def test_exact_wire_of_the_gateway_s_messages():
    """The headers are what the dict literals they replaced sent (same keys, values, order)."""
    assert messages.Target("r1", "md", "md0", first_page=3, relay=True).wire() == \
        {"t": "target", "rid": "r1", "slot": "md", "name": "md0", "first_page": 3, "relay": True}
    assert list(messages.Target("r1", "rld", cancelled=True).wire()) == ["t", "rid", "slot", "cancelled"]
    assert messages.Tok("r", 0, 5, None, "rld").wire() == {"t": "tok", "rid": "r", "pos": 0, "id": 5, "fin": None,
                                                           "tier": "rld"}
    assert messages.Kv("r", 0, 2, None, 64).wire() == {"t": "kv", "rid": "r", "first_page": 0, "n_pages": 2,
                                                       "layers": None, "page_bytes": 64}
    done = messages.KvDone("r", 0, 1, [0, 2], 64, 32, 96, extra={"first_token": 4, "fin": None, "relay": True})
    got = messages.decode(_through_wire(done.wire()))
    assert (got.first_token, got.fin, got.relay, got.lp) == (4, None, True, OMIT) and got.wire() == done.wire()


def test_decoding_a_token_list_checks_every_id():
    with pytest.raises(MessageError, match="field 'token_ids' must be list\\[int\\], got list"):
        messages.Extend.decode({"t": "extend", "rid": "r", "token_ids": [1, 2, True], "final": True})
    assert messages.Extend.decode({"t": "extend", "rid": "r", "token_ids": list(range(5000)), "final": False}).final \
        is False


@SETTINGS
@given(st.dictionaries(st.sampled_from(["t", "rid", "pos", "id", "fin", "tier", "lp", "x"]), _json, max_size=7),
       st.sampled_from(sorted(KINDS)))
def test_random_headers_decode_or_raise_message_error(h, kind):
    h = {**h, "t": kind} if "t" not in h else h
    try:
        m = messages.decode(h)
    except MessageError:
        return
    assert messages.decode(m.wire()).wire() == m.wire()
