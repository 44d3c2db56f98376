"""Every protocol message of pdd, one small dataclass per kind, and their one encode/decode path.

A message travels as a frame's msgpack header (:mod:`pdd.transfer.wire`) ``{"t": kind, field:
value, ...}``: :meth:`Msg.wire` builds that dict (the ``"t"`` first, then the fields in their
declared order; an optional field left at :data:`OMIT` is not sent at all, so a frame's bytes
are what the dict literals it replaces sent), :func:`decode` / ``Kind.decode(header)`` read one
back and refuse, with a :class:`MessageError` naming the kind and field, an unknown kind, a
missing field, a field of the wrong type, or a field the kind does not have. The envelope
(:data:`ENVELOPE`: the peer's ``"cid"``, ``"reply"``, the wire's ``"crc32"``) is not part of a
message and is ignored.

Who sends what (G: gateway, P: prefill, RLD: relay decode, MD: main decode, C: colocated):

  G -> P:        Prefill (-> PrefillOk), Target, Cancel
  G -> RLD:      Expect (-> ExpectOk), Handoff (-> HandoffOk)
  G -> MD:       Reserve (-> ReserveOk), Extend (-> ExtendOk when called), Finish, Drop
  G -> C:        Generate (-> GenerateOk)
  G -> any:      Peek (-> PeekOk), Stats (-> StatsOk), Flush (-> FlushOk), WaitIdle (-> IdleOk), Abort (-> AbortOk)
  tiers -> G:    Tok, Toks, KvReady, XferDone, ReqError, WanSample, KvProgress
  P -> RLD, MD:  Kv (+ payload: the pages), KvDone, KvCancel
  transport:     Hello, Heartbeat, Ok, Error (:mod:`pdd.transfer.peer`, :mod:`pdd.transfer.handshake`); LinkSet (the WAN
                 emulator's control port, :mod:`pdd.transfer.link`; its stats are asked with Stats)

Nested plan entries (``Prefill.targets``, ``Toks.msgs``: each a Tok header) stay plain dicts
inside their message; ``Toks.tok_messages()`` decodes its entries.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from pdd.text import shown


class MessageError(ValueError):
    """A header that is not a well-formed message: the text names the kind and the field."""


class _Omit:
    """The value of an optional field that is absent from the header (not sent)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "OMIT"

    def __bool__(self) -> bool:
        return False


OMIT: Any = _Omit()
# not message fields: the peer's call id and reply mark, the wire's payload checksum (a CRC'd frame)
ENVELOPE = ("cid", "reply", "crc32")

KINDS: dict[str, type] = {}


def _tname(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_tname(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_tname(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _ok(v, tp) -> bool:
    """Whether ``v`` (as msgpack decodes it) is of type ``tp``: int excludes bool, float takes an
    int too, list/dict check their items."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_ok(v, a) for a in typing.get_args(tp))
    if tp is type(None):
        return v is None
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    if tp is bytes:
        return isinstance(v, (bytes, bytearray))
    if tp is list or origin is list:
        if not isinstance(v, (list, tuple)):
            return False
        (item,) = typing.get_args(tp) or (Any,)
        if item is int:  # token ids: the long lists, checked at C speed
            kinds = set(map(type, v))
            return kinds <= {int} or all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        return item is Any or all(_ok(x, item) for x in v)
    if tp is dict or origin is dict:
        if not isinstance(v, dict):
            return False
        args = typing.get_args(tp)
        return not args or all(_ok(k, args[0]) and _ok(x, args[1]) for k, x in v.items())
    raise TypeError(f"unsupported message field type {tp!r}")


@dataclass
class Msg:
    """Base of every message: ``T`` is its kind (the header's ``"t"``). ``OPEN`` kinds carry
    further keys besides their fields (``extra``: stats counters, a transfer's closing fields)."""

    T: ClassVar[str] = ""
    OPEN: ClassVar[bool] = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.T:
            if cls.T in KINDS:
                raise TypeError(f"message kind {cls.T!r} defined twice")
            KINDS[cls.T] = cls

    def wire(self) -> dict:
        """The header to send: ``{"t": T, **fields}`` without the :data:`OMIT` ones (an OPEN
        kind's ``extra`` keys after its fields)."""
        h = {"t": self.T}
        for name in _NAMES.get(type(self)) or _names(type(self)):
            v = getattr(self, name)
            if v is not OMIT:
                h[name] = v
        if self.OPEN:
            for k, v in self.extra.items():
                h.setdefault(k, v)
        return h

    @classmethod
    def decode(cls, h: dict) -> "Msg":
        """Read a header as this kind (or, on :class:`Msg` itself, as whichever kind its ``"t"``
        names). Raises :class:`MessageError` naming the kind and field when the header is not
        one: another or unknown kind, a missing, unknown or wrongly typed field."""
        if not isinstance(h, dict):
            raise MessageError(f"a message header must be a map, got {type(h).__name__}")
        t = h.get("t")
        if cls is Msg:
            kind = KINDS.get(t) if isinstance(t, str) else None
            if kind is None:
                raise MessageError(f"unknown message kind {t!r}")
            return kind.decode(h)
        if t != cls.T:
            raise MessageError(f"expected a {cls.T!r} message, got kind {t!r}")
        spec = _SPECS.get(cls) or _spec(cls)
        kw: dict = {}
        for name, check, required, tp in spec:
            v = h.get(name, _ABSENT)
            if v is _ABSENT:
                if required:
                    raise MessageError(f"message {cls.T!r}: missing field {name!r}")
                continue
            if check is not None and not check(v):
                raise MessageError(f"message {cls.T!r}: field {name!r} must be {_tname(tp)}, "
                                   f"got {type(v).__name__} {shown(v, 40)}")
            kw[name] = v
        if len(h) - 1 > len(kw):  # keys besides "t" and the fields: the envelope, or refused
            rest = {k: v for k, v in h.items() if k != "t" and k not in ENVELOPE and k not in _names(cls)}
            if rest:
                if not cls.OPEN:
                    raise MessageError(f"message {cls.T!r}: unknown field {next(iter(rest))!r}")
                kw["extra"] = rest
        return cls(**kw)


_HINTS: dict[type, dict] = {}
_NAMES: dict[type, tuple] = {}  # kind -> its field names, in order (not "extra")
_SPECS: dict[type, tuple] = {}  # kind -> ((name, check | None, required, type), ...)
_ABSENT = object()


def _names(cls) -> tuple:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")
    return names


def _checker(tp):
    """A fast test of a decoded value against ``tp`` (None: anything), as :func:`_ok`."""
    if tp is Any:
        return None
    if tp is int:
        return lambda v: type(v) is int or (isinstance(v, int) and not isinstance(v, bool))
    if tp is str:
        return lambda v: type(v) is str or isinstance(v, str)
    if tp is bool:
        return lambda v: v is True or v is False
    if tp is dict:
        return lambda v: isinstance(v, dict)
    if typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            c = _checker(inner[0])
            return None if c is None else (lambda v: v is None or c(v))
    return lambda v: _ok(v, tp)


def _spec(cls) -> tuple:
    hints = _hints(cls)
    spec = _SPECS[cls] = tuple(
        (f.name, _checker(hints[f.name]),
         f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, hints[f.name])
        for f in dataclasses.fields(cls) if f.name != "extra")
    return spec


def _hints(cls) -> dict:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def decode(h: dict) -> Msg:
    """The message ``h`` is, by its ``"t"`` (:meth:`Msg.decode`); raises :class:`MessageError`."""
    return Msg.decode(h)


# ---------------------------------------------------------------- gateway -> tiers
@dataclass
class Peek(Msg):
    """How many of ``prompt_ids`` the instance's prefix cache holds (no lock) -> :class:`PeekOk`."""
    T = "peek"
    prompt_ids: list[int]


@dataclass
class Stats(Msg):
    """An instance's counters -> :class:`StatsOk` (also the WAN link control port's stats query)."""
    T = "stats"


@dataclass
class WanProbe(Msg):
    """The gateway's timed probe of a WAN peer's path (``policy.wan_probe_interval_s``): answered
    at once with ``ok``; its payload (any bytes) is there to be timed, then dropped."""
    T = "wan_probe"


@dataclass
class Flush(Msg):
    """Empty the prefix cache, count pages -> :class:`FlushOk`."""
    T = "flush"


@dataclass
class WaitIdle(Msg):
    """Answer once every request the instance held when this arrived is gone, its pages freed
    (a request that arrives later is not waited for), or once ``timeout_s`` seconds have passed,
    whichever comes first -> :class:`IdleOk`. The instance answers on the requests' release,
    not by polling: what the gateway asks before a flush that must find the pages of requests
    still finishing (or being aborted) there freed."""
    T = "wait_idle"
    timeout_s: float


@dataclass
class Abort(Msg):
    """Drop tier rid ``rid`` and free its pages (idempotent) -> :class:`AbortOk`."""
    T = "abort"
    rid: str


@dataclass
class Reserve(Msg):
    """MD: admit the request and reserve its pages -> :class:`ReserveOk`. ``first_page``: a
    predicted send (P sends pages [first_page, n) at once); ``after``: a sibling choice waits for
    that tier rid's KV first."""
    T = "reserve"
    rid: str
    prompt_ids: list[int]
    sampling: dict
    first_page: int = OMIT
    after: str = OMIT


@dataclass
class Expect(Msg):
    """RLD: admit the request, its KV to come from P -> :class:`ExpectOk`."""
    T = "expect"
    rid: str
    prompt_ids: list[int]
    sampling: dict


@dataclass
class Prefill(Msg):
    """P: prefill and sample the first token -> :class:`PrefillOk`, then stream the KV to
    ``targets``: ``[{"name", "first_page", "relay"} | {"slot", "deferred": True}, ...]`` (a
    deferred slot waits for its :class:`Target`)."""
    T = "prefill"
    rid: str
    prompt_ids: list[int]
    sampling: dict
    targets: list[dict]


@dataclass
class Target(Msg):
    """P: where a deferred slot's pages go (``name``, pages [first_page, last_page), ``relay``),
    or that it sends nothing (``cancelled``; ``skip``: a confirmed prediction's empty fill)."""
    T = "target"
    rid: str
    slot: str
    name: Optional[str] = OMIT
    first_page: int = OMIT
    last_page: int = OMIT
    relay: bool = OMIT
    cancelled: bool = OMIT
    skip: bool = OMIT


@dataclass
class Cancel(Msg):
    """P: stop (or never start) the KV stream of ``rid`` to instance ``name``."""
    T = "cancel"
    rid: str
    name: Optional[str]


@dataclass
class Drop(Msg):
    """MD: forget ``rid`` and free what arrived of its KV, caching nothing."""
    T = "drop"
    rid: str


@dataclass
class Finish(Msg):
    """MD: RLD finished ``rid``; keep the prompt's KV in the cache, free the rest."""
    T = "finish"
    rid: str


@dataclass
class Extend(Msg):
    """MD: the relay's output ids (the handoff; no KV). ``final`` False: a catch-up round MD
    absorbs without sampling (-> :class:`ExtendOk`)."""
    T = "extend"
    rid: str
    token_ids: list[int]
    final: bool


@dataclass
class Generate(Msg):
    """Colocated: run the whole request -> :class:`GenerateOk` once its first token is sampled."""
    T = "generate"
    rid: str
    prompt_ids: list[int]
    sampling: dict


@dataclass
class Handoff(Msg):
    """RLD: every output id so far (round ``round``; MD holds ``sent`` of them) -> :class:`HandoffOk`."""
    T = "handoff"
    rid: str
    sent: int
    round: int


# ---------------------------------------------------------------- tiers -> gateway (one-way)
@dataclass
class Tok(Msg):
    """One output token: position ``pos`` of the attempt, id ``id``, finish reason ``fin`` (or
    None), the tier that sampled it; ``lp``: its logprob info ``{"lp", "top"}`` when asked."""
    T = "tok"
    rid: str
    pos: int
    id: int
    fin: Optional[str]
    tier: str
    lp: dict = OMIT


@dataclass
class Toks(Msg):
    """Several :class:`Tok` headers in one frame (one engine step's tokens), in order."""
    T = "toks"
    msgs: list[dict]

    def tok_messages(self) -> list[Tok]:
        return [Tok.decode(m) for m in self.msgs]


@dataclass
class KvReady(Msg):
    """MD holds the prompt's whole KV of ``rid``."""
    T = "kv_ready"
    rid: str


@dataclass
class XferDone(Msg):
    """P's KV streams of ``rid`` ended: payload bytes sent / planned but not sent (-1: the whole
    planned transfer) / errors, per target instance."""
    T = "xfer_done"
    rid: str
    bytes: dict[str, int]
    unsent: dict[str, int]
    errors: dict[str, str]


@dataclass
class ReqError(Msg):
    """A tier failed ``rid``: ``error`` says why. ``client_error`` True: the request's own failure
    (its structured output's grammar failed: the same request fails the same way again; the
    gateway answers 400); absent: the server's (503, a client may retry)."""
    T = "req_error"
    rid: str
    error: str
    client_error: bool = OMIT


@dataclass
class WanSample(Msg):
    """MD's receive rate of one request's KV, first frame to last, Gbit/s."""
    T = "wan_sample"
    gbps: float


@dataclass
class KvProgress(Msg):
    """MD's progress receiving ``rid``'s KV, while it arrives: ``bytes`` payload bytes received
    so far, lately at ``gbps`` Gbit/s (over the time since its previous report, or since the
    first frame). The cut-off reads the remaining time from it
    (``pdd.policy.wan_estimate.inflight_remaining_s``)."""
    T = "kv_progress"
    rid: str
    bytes: int
    gbps: float


# ---------------------------------------------------------------- replies
@dataclass
class PeekOk(Msg):
    T = "peek_ok"
    hit_tokens: int


@dataclass
class StatsOk(Msg):
    """An instance's counters (``extra``: its role's own, e.g. P's WAN lanes)."""
    T = "stats_ok"
    OPEN = True
    name: str
    role: str
    dc: str
    pages_total: int
    pages_free: int
    page_bytes: int
    hardware: dict  # its emulated hardware profile, KV dtype, page size, pages (ClusterConfig.hardware_profile)
    running: int
    forward_calls: int
    engine_steps: int
    engine_busy_s: float
    engine_held_s: float
    preemptions: int
    cpu_seconds: float
    counters: dict
    extra: dict = field(default_factory=dict)


@dataclass
class FlushOk(Msg):
    """``pages_dropped``: the pages this flush evicted from the prefix cache, counted on the
    engine thread in one step with the flush (a difference of two calls would count pages that
    requests took or freed in between)."""
    T = "flush_ok"
    name: str
    pages_total: int
    pages_free: int
    live_requests: int
    pages_dropped: int = OMIT


@dataclass
class IdleOk(Msg):
    """The answer to :class:`WaitIdle`: ``waited_for``, the requests the instance held when it
    arrived; ``left``, those of them still held at the answer (0: every one gone, its pages
    freed; more: ``timeout_s`` ran out); ``running``, the requests it holds now (later arrivals
    included)."""
    T = "idle_ok"
    name: str
    waited_for: int
    left: int
    running: int


@dataclass
class AbortOk(Msg):
    """``found``: the instance held ``rid``; P: the KV streams it cancelled and ``streams``,
    whether it ever started streaming the attempt's KV (False: it will never report that
    transfer in :class:`XferDone`, so the gateway writes off its planned WAN bytes)."""
    T = "abort_ok"
    rid: str
    found: bool
    cancelled_transfers: int = OMIT
    streams: bool = OMIT


@dataclass
class ReserveOk(Msg):
    """MD's reservation: the prompt tokens (and whole pages) its cache holds, the prompt's pages,
    tokens, page size, one page's bytes and the KV dtype of its pool (the gateway predicts the WAN
    bytes in MD's layout with them, ``pdd.transfer.layout``)."""
    T = "reserve_ok"
    rid: str
    md_cached_tokens: int
    md_cached_pages: int
    n_pages: int
    prompt_tokens: int
    page_size: int
    page_bytes: int
    kv_dtype: str


@dataclass
class ExpectOk(Msg):
    T = "expect_ok"
    rid: str
    n_pages: int


@dataclass
class PrefillOk(Msg):
    """P's first token (``fin``: it finished the request), its cache hit, the prompt's pages."""
    T = "prefill_ok"
    rid: str
    first_token: int
    fin: Optional[str]
    p_cached_tokens: int
    n_pages: int
    page_bytes: int


@dataclass
class ExtendOk(Msg):
    """``found`` False: MD no longer holds the request. A catch-up round's engine steps and the
    step's time (ms) and its excess over the median step (ms)."""
    T = "extend_ok"
    found: bool
    steps: int = OMIT
    extend_step_ms: float = OMIT
    extra_step_ms: float = OMIT


@dataclass
class GenerateOk(Msg):
    T = "generate_ok"
    rid: str
    p_cached_tokens: int


@dataclass
class HandoffOk(Msg):
    """RLD's output ids so far and its decision (``mode`` one_shot | catch_up, ``final``);
    ``finished``: RLD finished the request first (no ids). ``not_started`` (sent only as true,
    with ``finished`` false and no ids): RLD holds the request but has not started decoding it,
    so no round was applied. ``inputs``: the decision's inputs (replayed by ``pdd sim
    validate``), ``load``, ``rld_ms``: time RLD took to answer."""
    T = "handoff_ok"
    rid: str
    finished: bool
    token_ids: list[int]
    mode: Optional[str]
    final: bool
    load: float = OMIT
    inputs: dict = OMIT
    rld_ms: float = OMIT
    not_started: bool = OMIT


# ---------------------------------------------------------------- P -> RLD, MD: KV pages
@dataclass
class Kv(Msg):
    """Pages [first_page, first_page + n_pages) of ``rid``'s page table, layers ``layers``
    ([l0, l1), None: all) in the payload: n_pages * page_bytes bytes, or (n_pages - 1) *
    page_bytes + last_page_bytes when the frame ends with a partial last page."""
    T = "kv"
    rid: str
    first_page: int
    n_pages: int
    layers: Optional[list[int]]
    page_bytes: int
    last_page_bytes: int = OMIT
    dtype: str = OMIT  # the payload's element type when it is not the receiver's (pdd.transfer.layout)
    stripe: list[int] = OMIT  # [transfer seq, frame seq] when sent over several connections (transfer.kv.KVReorder)


@dataclass
class KvDone(Msg):
    """A transfer's last frame: its pages, ``bytes`` of payload sent, and P's closing fields
    (the first token, its finish reason and logprob info, whether MD is relayed); ``extra``:
    any other sender's closing fields (``KVSender.submit(done_fields=...)``)."""
    T = "kv_done"
    OPEN = True
    rid: str
    first_page: int
    n_pages: int
    layers: Optional[list[int]]
    page_bytes: int
    last_page_bytes: Optional[int]
    bytes: int
    first_token: int = OMIT
    fin: Optional[str] = OMIT
    relay: bool = OMIT
    lp: dict = OMIT
    dtype: str = OMIT  # the transfer's element type when the sender set one (pdd.transfer.layout)
    stripe: list[int] = OMIT  # [transfer seq, frames sent] when striped (transfer.kv.KVReorder)
    extra: dict = field(default_factory=dict)


@dataclass
class KvCancel(Msg):
    """The transfer of ``rid`` was cancelled (or failed) after ``bytes`` / ``pages`` were sent."""
    T = "kv_cancel"
    rid: str
    bytes: int
    pages: int
    stripe: list[int] = OMIT  # [transfer seq, frames sent] when striped (transfer.kv.KVReorder)


# ---------------------------------------------------------------- transport
@dataclass
class Hello(Msg):
    """The handshake's first frame each way: rpc revision, role, instance name, engine
    fingerprint; ``hb``: heartbeat interval (s) this side keeps; ``nonce``: the fast path's."""
    T = "hello"
    proto: int
    role: str
    instance: str
    fingerprint: Optional[dict]
    hb: float = OMIT
    nonce: bytes = OMIT


@dataclass
class Heartbeat(Msg):
    T = "_hb"


@dataclass
class Ok(Msg):
    """The reply of a handler that returns nothing."""
    T = "ok"


@dataclass
class Error(Msg):
    """A failed call's reply (or a refused handshake): ``error`` says why."""
    T = "error"
    error: str
    detail: dict = OMIT  # fields the failed handler attached (an exception's ``detail``, peer.CallFailed)


@dataclass
class LinkSet(Msg):
    """The WAN emulator's control port: change rate (Gbit/s), RTT / jitter (ms), outage, packet
    loss rate (fraction of packets), cross traffic (Gbit/s, replacing its schedule from now on)."""
    T = "set"
    gbps: Optional[float] = OMIT
    rtt_ms: Optional[float] = OMIT
    jitter_ms: Optional[float] = OMIT
    outage: Optional[bool] = OMIT
    loss_rate: Optional[float] = OMIT
    cross_gbps: Optional[float] = OMIT
