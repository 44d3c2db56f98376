"""KV page streaming over a :class:`~pdd.transfer.rpc.Peer`.

Wire messages (one-way, in this order per transfer; :mod:`pdd.transfer.messages`)::

    kv {rid, first_page, n_pages, layers: [l0, l1] | None, page_bytes [, last_page_bytes] [, dtype]}
        + payload of n_pages * page_bytes bytes (pages first_page .. first_page+n_pages-1
          of the request's page table, layer range [l0, l1) of each page; None = all layers),
          or (n_pages - 1) * page_bytes + last_page_bytes when the frame ends with the
          transfer's last page and that page is sent in part (a prompt ending inside its page:
          only its filled token slots cross, ``KVPool.export_pages(last_slots=...)``).
          Pages are the receiver's (its page size); ``dtype``: the payload's element type when
          the sender set one (a transfer between tiers of different KV dtype, pdd.transfer.layout:
          the receiver converts to its own on import)
    kv_done {rid, first_page, n_pages, layers, page_bytes, last_page_bytes, bytes [, dtype], **done_fields}
        after the last chunk ("bytes": payload bytes sent for this transfer)
    kv_cancel {rid, bytes, pages} instead of kv_done when cancelled or failed

Page indices are *request* page indices (positions in the request's page table), not pool
slots: each side maps them through its own page table.

Sender: one :class:`KVSender` per peer runs one loop that sends one chunk at a time, choosing
the next chunk's transfer with ``pick(active_transfers) -> Transfer`` (the send order policy:
:func:`pick_fifo`, :func:`pick_round_robin`, :func:`pick_shortest_remaining`, or any function
with the same signature, e.g. from ``pdd.policy.wan_order``). Optional pacing at ``rate_gbps``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from .messages import OMIT, Kv, KvCancel, KvDone
from .pacing import Pacer
from .peer import Peer
from .wire import payload_view

__all__ = [
    "Transfer",
    "TransferResult",
    "KVSender",
    "KVReceiver",
    "PageReader",
    "PickFn",
    "pick_fifo",
    "pick_round_robin",
    "pick_shortest_remaining",
    "pick_from_index",
    "ORDERS",
    "resolve_order",
    "kv_frame_bytes",
    "prompt_kv_bytes",
    "prompt_last_slots",
    "LayerProgress",
    "LayeredTransfer",
    "layer_groups",
]

log = logging.getLogger("pdd.transfer.kv")

PageReader = Callable[[int, int], Union[Any, Awaitable[Any]]]
"""``page_reader(i, n)`` -> bytes-like (or awaitable of it) holding pages [i, i+n) of the request."""

PickFn = Callable[[Sequence["Transfer"]], "Transfer"]

_RESERVED_DONE_KEYS = frozenset({"t", "rid", "first_page", "n_pages", "layers", "page_bytes", "last_page_bytes", "bytes",
                                 "cid", "reply", "dtype"})


@dataclass(frozen=True)
class TransferResult:
    """Outcome of a :class:`Transfer` (``done`` resolves to this)."""

    rid: Any
    bytes_sent: int  # payload bytes only (framing excluded)
    pages_sent: int
    cancelled: bool
    elapsed_s: float  # submit -> kv_done/kv_cancel handed to the transport


class Transfer:
    """One stream of pages of one request to one peer (created by :meth:`KVSender.submit`).

    ``await transfer`` (or ``await transfer.done``) -> :class:`TransferResult`; on connection
    loss or a page_reader error ``done`` raises instead (ConnectionError / the reader's error).
    Attributes read by pick functions: ``rid``, ``seq`` (submission order), ``submitted_at``
    (loop time, s), ``remaining_pages``, ``remaining_bytes``, ``bytes_sent``, ``last_sent_tick``
    (the sender's chunk counter when this transfer last sent; -1 never), ``meta`` (caller's dict).
    ``last_page_bytes``: bytes of the transfer's last page (``page_bytes`` unless it is sent in
    part).
    """

    def __init__(
        self,
        sender: "KVSender",
        rid: Any,
        first_page: int,
        n_pages: int,
        page_bytes: int,
        page_reader: PageReader,
        layers: Optional[tuple[int, int]],
        chunk_pages: int,
        done_fields: dict,
        meta: dict,
        seq: int,
        last_page_bytes: Optional[int] = None,
        dtype: Optional[str] = None,
    ):
        loop = asyncio.get_running_loop()
        self.dtype = dtype
        self.sender = sender
        self.rid = rid
        self.first_page = first_page
        self.n_pages = n_pages
        self.page_bytes = page_bytes
        self.last_page_bytes = page_bytes if last_page_bytes is None else last_page_bytes
        self.page_reader = page_reader
        self.layers = layers
        self.chunk_pages = chunk_pages
        self.done_fields = done_fields
        self.meta = meta
        self.seq = seq
        self.submitted_at = loop.time()
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.pages_sent = 0
        self.bytes_sent = 0
        self.chunks_sent = 0
        self.last_sent_tick = -1
        self.cancel_requested = False
        self.done: asyncio.Future = loop.create_future()
        # a failed transfer nobody awaits must not log "exception was never retrieved"
        self.done.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def enqueued_seq(self) -> int:
        """Alias of ``seq`` (the field name ``pdd.policy.wan_order.TransferView`` uses)."""
        return self.seq

    @property
    def next_page(self) -> int:
        return self.first_page + self.pages_sent

    @property
    def remaining_pages(self) -> int:
        return self.n_pages - self.pages_sent

    def frame_bytes(self, i: int, n: int) -> int:
        """Payload bytes of pages ``[i, i+n)`` of this transfer (the last page may be partial)."""
        if n <= 0:
            return 0
        short = self.page_bytes - self.last_page_bytes if i + n == self.first_page + self.n_pages else 0
        return n * self.page_bytes - short

    @property
    def remaining_bytes(self) -> int:
        return self.frame_bytes(self.next_page, self.remaining_pages)

    @property
    def total_bytes(self) -> int:
        return self.frame_bytes(self.first_page, self.n_pages)

    @property
    def finished(self) -> bool:
        return self.done.done()

    @property
    def cancelled(self) -> bool:
        d = self.done
        return d.done() and not d.cancelled() and d.exception() is None and d.result().cancelled

    def cancel(self) -> bool:
        """Stop sending further chunks (a chunk already being written completes and is counted);
        the sender then sends ``kv_cancel`` and ``done`` resolves with ``cancelled=True``.
        Returns False if the transfer had already finished."""
        if self.done.done() or self.cancel_requested:
            return False
        self.cancel_requested = True
        self.sender._wake.set()
        return True

    def __await__(self):
        return self.done.__await__()

    # the sender loop's view: what can go next (LayeredTransfer overrides these)
    prefilling = False  # whether its KV is still being computed (a layered transfer before the seal)

    def sendable(self) -> bool:
        """Whether a frame (or the closing ``kv_done``) can go now."""
        return True

    def next_frame(self) -> Optional[tuple[int, int, Optional[tuple[int, int]], int, int]]:
        """``(first_page, n_pages, layers, page_bytes, payload_bytes)`` of the next frame, or None
        when every page is sent (the transfer ends with ``kv_done``)."""
        if self.remaining_pages == 0:
            return None
        n = min(self.chunk_pages, self.remaining_pages)
        i = self.next_page
        return i, n, self.layers, self.page_bytes, self.frame_bytes(i, n)

    def read(self, frame: tuple) -> Any:
        """The page reader's bytes (or awaitable) for ``frame`` (from :meth:`next_frame`)."""
        return self.page_reader(frame[0], frame[1])

    def sent(self, frame: tuple, nbytes: int) -> None:
        """Account ``frame`` as written."""
        self.pages_sent += frame[1]
        self.bytes_sent += nbytes

    def closing_fields(self) -> dict:
        """Extra ``kv_done`` fields (``done_fields`` of :meth:`KVSender.submit`)."""
        return dict(self.done_fields)

    @property
    def all_pages_sent(self) -> bool:
        return self.remaining_pages == 0

    def __repr__(self) -> str:
        return (
            f"<Transfer rid={self.rid!r} pages {self.pages_sent}/{self.n_pages} "
            f"from {self.first_page} layers={self.layers} bytes_sent={self.bytes_sent}>"
        )


def layer_groups(num_layers: int, group: int) -> list[tuple[int, int]]:
    """Half-open layer ranges of ``group`` layers each (the last one shorter when ``group`` does
    not divide ``num_layers``): the layer part of layer-wise streaming's wire unit. Raises
    ValueError for ``num_layers`` < 1 or ``group`` < 1."""
    if num_layers < 1 or group < 1:
        raise ValueError(f"need num_layers >= 1 and a layer group >= 1, got {num_layers}, {group}")
    return [(l0, min(l0 + group, num_layers)) for l0 in range(0, num_layers, group)]


class LayerProgress:
    """How far one request's prompt KV is computed, per layer: the sender's side of layer-wise
    streaming (``policy.kv_stream: layerwise``). Plain state on the event loop.

    ``num_layers``: the model's layers; ``prompt_tokens``: the prompt's length (tokens);
    ``start_tokens``: tokens whose KV is in the pages before the prefill starts (a cached
    prefix), for every layer. :meth:`advance` moves one layer on; :meth:`seal` says the prompt's
    KV is complete and gives the closing ``kv_done`` fields (P's first token); :meth:`fail` says
    it never will be (the prefill was aborted or failed). Every change wakes the listeners
    (:meth:`listen`: a :class:`KVSender`'s loop). ``ready[l]``: the event (``torch.cuda.Event``
    on CUDA, None on CPU) recorded after layer ``l``'s last write, for readers to wait on.
    """

    def __init__(self, num_layers: int, prompt_tokens: int, start_tokens: int = 0):
        if num_layers < 1 or prompt_tokens < 0 or not 0 <= start_tokens <= prompt_tokens:
            raise ValueError(f"bad LayerProgress({num_layers}, {prompt_tokens}, {start_tokens})")
        self.num_layers = int(num_layers)
        self.prompt_tokens = int(prompt_tokens)
        self.tokens = [int(start_tokens)] * self.num_layers
        self.ready: list = [None] * self.num_layers
        self.done_fields: Optional[dict] = None  # set by seal
        self.error: Optional[BaseException] = None  # set by fail
        self._listeners: list[Callable[[], Any]] = []

    def listen(self, fn: Callable[[], Any]) -> None:
        self._listeners.append(fn)

    def _wake(self) -> None:
        for fn in self._listeners:
            fn()

    def advance(self, layer: int, tokens: int, ready=None) -> None:
        """Prompt tokens ``[0, tokens)`` of layer ``layer`` are in the pages (never moves back)."""
        if tokens > self.tokens[layer]:
            self.tokens[layer] = min(int(tokens), self.prompt_tokens)
            self.ready[layer] = ready
            self._wake()

    def ready_tokens(self, l0: int, l1: int) -> int:
        """Prompt tokens whose KV of every layer in ``[l0, l1)`` is in the pages."""
        return min(self.tokens[l0:l1])

    def events(self, l0: int, l1: int) -> list:
        """The events to wait on before reading layers ``[l0, l1)`` (none on CPU)."""
        return [e for e in self.ready[l0:l1] if e is not None]

    @property
    def sealed(self) -> bool:
        return self.done_fields is not None

    @property
    def settled(self) -> bool:
        """Sealed or failed: the prefill is over either way."""
        return self.done_fields is not None or self.error is not None

    def seal(self, done_fields: Optional[dict] = None) -> None:
        """Every layer now holds the whole prompt; ``done_fields`` go into each ``kv_done``."""
        self.tokens = [self.prompt_tokens] * self.num_layers
        self.done_fields = dict(done_fields or {})
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The KV will not be complete: transfers still waiting on it are cancelled."""
        if self.error is None and self.done_fields is None:
            self.error = error
            self._wake()


class LayeredTransfer(Transfer):
    """A transfer sent layer group by layer group as the prefill computes them
    (:meth:`KVSender.submit_layered`). Its units are (layer group ``[l0, l1)``, pages
    ``[i, i+n)``) frames; a unit goes once every page in it has all its token slots computed for
    those layers (``progress``), the lowest layer group with pages ready first. It ends with
    ``kv_done`` once every unit is sent and ``progress`` is sealed (the closing fields are the
    seal's), or is cancelled when ``progress`` fails. Until the seal it is ``prefilling``: the
    sender then sends its units only when no finished transfer has a frame ready. Payload bytes
    are those of a whole transfer of the same pages: the groups split each page's bytes by layer.

    ``page_reader(i, n, layers)`` returns the bytes of pages ``[i, i+n)`` for those layers.
    ``page_tokens``: tokens of one (receiver's) page; ``group_page_bytes``: bytes of one page of
    each group on the wire; ``last_slots``: filled token slots of the prompt's partial last page
    (None: it is sent whole).
    """

    def __init__(self, *a, progress: LayerProgress, groups: list[tuple[int, int]], group_page_bytes: list[int],
                 page_tokens: int, last_slots: Optional[int], **kw):
        super().__init__(*a, **kw)
        if len(groups) != len(group_page_bytes) or not groups:
            raise ValueError("one page size in bytes per layer group")
        self.progress = progress
        self.groups = [tuple(g) for g in groups]
        self.group_page_bytes = [int(b) for b in group_page_bytes]
        self.page_tokens = int(page_tokens)
        self.last_slots = last_slots
        self.group_sent = [0] * len(self.groups)  # pages of each group sent (a prefix)
        self.group_chunk = [max(1, min(self.chunk_pages, self.sender.max_frame_bytes // b))
                            if self.sender.max_frame_bytes is not None and b > 0 else self.chunk_pages
                            for b in self.group_page_bytes]
        self.wait_s = 0.0  # time (s), after its first frame, this transfer had nothing to send
        self._idle_since: Optional[float] = None
        progress.listen(self.sender._wake.set)

    @property
    def prefilling(self) -> bool:
        return not self.progress.sealed

    def _group_last_bytes(self, g: int) -> int:
        b = self.group_page_bytes[g]
        return b if self.last_slots is None else b // self.page_tokens * self.last_slots

    def _group_frame_bytes(self, g: int, i: int, n: int) -> int:
        if n <= 0:
            return 0
        end = i + n == self.first_page + self.n_pages
        short = self.group_page_bytes[g] - self._group_last_bytes(g) if end and self.last_page_bytes != self.page_bytes else 0
        return n * self.group_page_bytes[g] - short

    def _pages_ready(self, g: int) -> int:
        """This transfer's pages (from its first) whose tokens layer group ``g`` holds."""
        tok = self.progress.ready_tokens(*self.groups[g])
        if tok >= self.progress.prompt_tokens:
            ready = self.first_page + self.n_pages  # the partial last page too
        else:
            ready = tok // self.page_tokens
        return max(0, min(self.n_pages, ready - self.first_page))

    @property
    def remaining_pages(self) -> int:
        return sum(self.n_pages - s for s in self.group_sent)

    @property
    def remaining_bytes(self) -> int:
        return self.total_bytes - self.bytes_sent

    @property
    def all_pages_sent(self) -> bool:
        return all(s == self.n_pages for s in self.group_sent)

    def _frame(self) -> Optional[tuple]:
        for g, sent in enumerate(self.group_sent):
            avail = self._pages_ready(g) - sent
            if avail > 0:
                n = min(self.group_chunk[g], avail)
                i = self.first_page + sent
                return i, n, self.groups[g], self.group_page_bytes[g], self._group_frame_bytes(g, i, n), g
        return None

    def sendable(self) -> bool:
        if self.cancel_requested or self.progress.error is not None:
            return True  # the loop cancels it
        if self.all_pages_sent:
            ok = self.progress.sealed
        else:
            ok = self._frame() is not None
        loop_now = asyncio.get_running_loop().time()
        if not ok and self._idle_since is None and self.chunks_sent:
            self._idle_since = loop_now
        elif ok and self._idle_since is not None:
            self.wait_s += loop_now - self._idle_since
            self._idle_since = None
        return ok

    def next_frame(self) -> Optional[tuple]:
        if self.all_pages_sent:
            return None
        return self._frame()

    def read(self, frame: tuple) -> Any:
        return self.page_reader(frame[0], frame[1], frame[2])

    def sent(self, frame: tuple, nbytes: int) -> None:
        self.group_sent[frame[5]] += frame[1]
        self.pages_sent += frame[1]
        self.bytes_sent += nbytes

    def closing_fields(self) -> dict:
        return {**self.done_fields, **(self.progress.done_fields or {}), "kv_wait_s": round(self.wait_s, 6)}

    @property
    def next_page(self) -> int:
        return self.first_page + min(self.group_sent)

    def frame_bytes(self, i: int, n: int) -> int:
        """Payload bytes of pages ``[i, i+n)`` over all the groups."""
        return sum(self._group_frame_bytes(g, i, n) for g in range(len(self.groups)))

    def __repr__(self) -> str:
        return (f"<LayeredTransfer rid={self.rid!r} pages {self.group_sent}/{self.n_pages} per group "
                f"{self.groups} from {self.first_page} bytes_sent={self.bytes_sent}>")


# ------------------------------------------------------------------ order policies
def pick_fifo(transfers: Sequence[Transfer]) -> Transfer:
    """First submitted first: a transfer gets the whole line until it is done."""
    return min(transfers, key=lambda t: t.seq)


def pick_round_robin(transfers: Sequence[Transfer]) -> Transfer:
    """One chunk each in turn (the transfer that sent least recently goes next)."""
    return min(transfers, key=lambda t: (t.last_sent_tick, t.seq))


def pick_shortest_remaining(transfers: Sequence[Transfer]) -> Transfer:
    """Fewest remaining bytes first (ties: submission order); good for TTFT tails."""
    return min(transfers, key=lambda t: (t.remaining_bytes, t.seq))


ORDERS: dict[str, PickFn] = {
    "fifo": pick_fifo,
    "rr": pick_round_robin,
    "round_robin": pick_round_robin,
    "srf": pick_shortest_remaining,
    "shortest_remaining": pick_shortest_remaining,
}


def pick_from_index(index_fn: Callable[[Sequence["Transfer"]], int]) -> PickFn:
    """Adapt an index-returning policy, e.g. ``pick_from_index(lambda ts: wan_order.pick_next(ts, "srf"))``."""

    def pick(transfers: Sequence[Transfer]) -> Transfer:
        return transfers[index_fn(transfers)]

    return pick


def resolve_order(order: Union[str, PickFn]) -> PickFn:
    if callable(order):
        return order
    try:
        return ORDERS[order]
    except KeyError:
        raise ValueError(f"unknown order {order!r}; known: {sorted(ORDERS)} or a pick(transfers) function") from None


async def _maybe_await(x):
    if inspect.isawaitable(x):
        return await x
    return x


# ------------------------------------------------------------------ sender
class KVSender:
    """Streams KV pages of many requests to one peer, one chunk at a time.

    ``rate_gbps``: pace payload bytes at this rate (Gbit/s; None = as fast as the connection
    drains), or a shared :class:`~pdd.transfer.pacing.Pacer`.
    ``order``: ``"fifo"`` | ``"rr"`` | ``"srf"`` or ``pick(transfers) -> transfer``.
    ``chunk_pages``: default pages per ``kv`` frame. ``max_frame_bytes``: a frame carries at most
    this many payload bytes (but always at least one page; None: no limit): a frame once started
    is written whole, so on a slow line its size is how long a newly picked transfer can wait
    for the frame before it. ``crc``: checksum kv payloads.
    ``stall_timeout_s``: a chunk whose write (the transfer is the one scheduled to send) makes no
    progress for this long closes the connection and fails every transfer on it with
    :class:`ConnectionError` ("stalled"); a transfer waiting its turn, or one progressing slowly
    (each chunk written within the limit), is never timed out. None: no limit.
    """

    def __init__(
        self,
        peer: Peer,
        rate_gbps: Union[None, float, Pacer] = None,
        order: Union[str, PickFn] = "fifo",
        *,
        chunk_pages: int = 16,
        max_frame_bytes: Optional[int] = None,
        crc: Optional[bool] = None,
        stall_timeout_s: Optional[float] = None,
    ):
        if max_frame_bytes is not None and max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0 (or None)")
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self.stall_timeout_s = stall_timeout_s
        self.stalls = 0
        self.pacer = rate_gbps if isinstance(rate_gbps, Pacer) else Pacer(rate_gbps)
        self.pick: PickFn = resolve_order(order)
        self.chunk_pages = chunk_pages
        self.crc = crc
        self.active: list[Transfer] = []
        self.bytes_sent = 0  # payload bytes, all transfers
        self.chunks_sent = 0
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    def set_order(self, order: Union[str, PickFn]) -> None:
        self.pick = resolve_order(order)

    def submit(
        self,
        rid: Any,
        first_page_index: int,
        page_reader: PageReader,
        n_pages: int,
        page_bytes: int,
        layers: Optional[tuple[int, int]] = None,
        chunk_pages: Optional[int] = None,
        done_fields: Optional[dict] = None,
        meta: Optional[dict] = None,
        last_page_bytes: Optional[int] = None,
        dtype: Optional[str] = None,
    ) -> Transfer:
        """Queue pages ``[first_page_index, first_page_index + n_pages)`` of request ``rid``.

        ``page_reader(i, n)`` (sync or async) returns the bytes of pages ``[i, i+n)``, exactly
        ``n * page_bytes`` bytes (``page_bytes``: bytes per page for the ``layers`` range sent),
        less ``page_bytes - last_page_bytes`` when the range ends with the transfer's last page.
        ``last_page_bytes``: bytes of that last page when it is sent in part (``1..page_bytes``;
        None = whole).
        ``layers``: ``(l0, l1)`` half-open layer range, None = all layers.
        ``done_fields``: extra keys for the closing ``kv_done`` (e.g. ``{"first_token": 42}``).
        ``meta``: free dict for order policies. ``n_pages == 0`` sends only ``kv_done``.
        ``dtype``: the payload's element type, carried in every frame header and ``kv_done``
        (None: not said, the receiver's own).
        Raises ConnectionError if the peer is closed.
        """
        self._check_open()
        if n_pages < 0 or first_page_index < 0 or page_bytes < 0:
            raise ValueError("n_pages, first_page_index and page_bytes must be >= 0")
        if last_page_bytes is not None and not 0 < last_page_bytes <= page_bytes:
            raise ValueError(f"last_page_bytes must be in [1, page_bytes={page_bytes}], got {last_page_bytes}")
        done_fields, cp = self._done_and_chunk(done_fields, chunk_pages)
        if self.max_frame_bytes is not None and page_bytes > 0:
            cp = max(1, min(cp, self.max_frame_bytes // page_bytes))
        t = Transfer(
            self,
            rid,
            int(first_page_index),
            int(n_pages),
            int(page_bytes),
            page_reader,
            tuple(layers) if layers is not None else None,
            cp,
            done_fields,
            dict(meta or {}),
            next(self._seq),
            last_page_bytes,
            dtype,
        )
        return self._enqueue(t)

    def submit_layered(
        self,
        rid: Any,
        first_page_index: int,
        page_reader: PageReader,
        n_pages: int,
        progress: LayerProgress,
        groups: list[tuple[int, int]],
        group_page_bytes: list[int],
        page_tokens: int,
        last_slots: Optional[int] = None,
        chunk_pages: Optional[int] = None,
        done_fields: Optional[dict] = None,
        meta: Optional[dict] = None,
        dtype: Optional[str] = None,
    ) -> "LayeredTransfer":
        """Queue pages ``[first_page_index, first_page_index + n_pages)`` of request ``rid`` to be
        sent layer group by layer group as ``progress`` says they are computed
        (:class:`LayeredTransfer`). ``page_reader(i, n, (l0, l1))`` (sync or async) returns the
        bytes of pages ``[i, i+n)`` for layers ``[l0, l1)``: ``n * group_page_bytes[g]`` bytes,
        the last page's ``last_slots`` token slots only when the range ends with the transfer's
        last page and ``last_slots`` is set. ``groups``: the layer ranges (:func:`layer_groups`),
        covering the layers sent; ``group_page_bytes``: bytes of one page of each on the wire;
        ``page_tokens``: tokens per page (the receiver's). The closing ``kv_done`` carries
        ``done_fields``, then ``progress``'s seal fields and ``kv_wait_s`` (seconds the transfer
        waited for the prefill after its first frame). Frames say their layer range; ``kv_done``
        says ``layers`` ``[groups[0][0], groups[-1][1])`` and ``page_bytes`` of a whole page.
        Raises as :meth:`submit`."""
        self._check_open()
        if n_pages < 0 or first_page_index < 0 or page_tokens < 1:
            raise ValueError("n_pages and first_page_index must be >= 0, page_tokens >= 1")
        if last_slots is not None and not 0 < last_slots < page_tokens:
            raise ValueError(f"last_slots must be in [1, page_tokens={page_tokens}), got {last_slots}")
        done_fields, cp = self._done_and_chunk(done_fields, chunk_pages)
        page_bytes = sum(int(b) for b in group_page_bytes)
        last = None if last_slots is None else page_bytes // page_tokens * last_slots
        t = LayeredTransfer(
            self, rid, int(first_page_index), int(n_pages), page_bytes, page_reader,
            (int(groups[0][0]), int(groups[-1][1])), cp, done_fields, dict(meta or {}), next(self._seq),
            last, dtype, progress=progress, groups=groups, group_page_bytes=group_page_bytes,
            page_tokens=page_tokens, last_slots=last_slots)
        return self._enqueue(t)

    def _check_open(self) -> None:
        """Raises RuntimeError if this sender is closed, ConnectionError if its peer is."""
        if self._closed:
            raise RuntimeError("KVSender is closed")
        self.peer._check_open()

    def _done_and_chunk(self, done_fields: Optional[dict], chunk_pages: Optional[int]) -> tuple[dict, int]:
        """A submit's ``kv_done`` extras (a copy; ValueError on a reserved key) and its pages per
        frame (``chunk_pages`` or the sender's; ValueError unless > 0)."""
        done_fields = dict(done_fields or {})
        bad = _RESERVED_DONE_KEYS & done_fields.keys()
        if bad:
            raise ValueError(f"done_fields may not set reserved keys {sorted(bad)}")
        cp = chunk_pages or self.chunk_pages
        if cp <= 0:
            raise ValueError("chunk_pages must be > 0")
        return done_fields, cp

    def _enqueue(self, t: Transfer) -> Transfer:
        """Make ``t`` active and wake (or start) the send loop."""
        self.active.append(t)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-sender-{peer_label(self.peer)}")
        return t

    def cancel(self, rid: Any) -> int:
        """Cancel every active transfer of ``rid``; returns how many were cancelled."""
        return sum(t.cancel() for t in list(self.active) if t.rid == rid)

    def transfers(self, rid: Any = None) -> list[Transfer]:
        return [t for t in self.active if rid is None or t.rid == rid]

    async def close(self) -> None:
        """Stop the loop; unfinished transfers fail with ConnectionError (no kv_cancel is sent)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(ConnectionError("KVSender closed"))

    # -------------------------------------------------------------- loop
    def _fail_all(self, exc: BaseException) -> None:
        for t in self.active:
            if not t.done.done():
                t.finished_at = asyncio.get_running_loop().time()
                t.done.set_exception(exc)
        self.active.clear()

    def _result(self, t: Transfer, cancelled: bool) -> TransferResult:
        t.finished_at = asyncio.get_running_loop().time()
        return TransferResult(t.rid, t.bytes_sent, t.pages_sent, cancelled, t.finished_at - t.submitted_at)

    async def _finish_cancel(self, t: Transfer, error: Optional[BaseException] = None) -> None:
        try:
            await self.peer.send(
                KvCancel(t.rid, t.bytes_sent, t.pages_sent).wire(), crc=self.crc
            )
        except ConnectionError:
            pass  # the receiver drops the request's state when the connection goes
        self.active.remove(t)
        if not t.done.done():
            if error is not None:
                t.finished_at = asyncio.get_running_loop().time()
                t.done.set_exception(error)
            else:
                t.done.set_result(self._result(t, True))
        self.peer._check_open()

    async def _finish_done(self, t: Transfer) -> None:
        h = KvDone(
            rid=t.rid,
            first_page=t.first_page,
            n_pages=t.n_pages,
            layers=list(t.layers) if t.layers is not None else None,
            page_bytes=t.page_bytes,
            last_page_bytes=t.last_page_bytes,
            bytes=t.bytes_sent,
            dtype=t.dtype if t.dtype is not None else OMIT,
            extra=t.closing_fields(),
        ).wire()
        await self.peer.send(h, crc=self.crc)  # on ConnectionError t stays active -> _fail_all
        self.active.remove(t)
        if not t.done.done():
            t.done.set_result(self._result(t, False))

    async def _run(self) -> None:
        try:
            while True:
                for t in [t for t in self.active
                          if t.cancel_requested or (isinstance(t, LayeredTransfer) and t.progress.error is not None)]:
                    t.cancel_requested = True  # a failed prefill: what was sent is cancelled
                    await self._finish_cancel(t)
                ready = [t for t in self.active if t.sendable()]  # a layered transfer waits for its layers
                if not ready:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                # a transfer whose prefill has ended is on its request's critical path: it goes
                # before the units of prefills still running, which fill the line's gaps (so a
                # long prompt's early layers never delay a finished short one, as in whole mode)
                t = self.pick([t for t in ready if not t.prefilling] or ready)
                if t not in self.active:
                    raise RuntimeError(f"pick function returned a transfer that is not active: {t!r}")
                frame = t.next_frame()
                if frame is None:
                    await self._finish_done(t)
                    continue
                i, n, layers, page_bytes, want = frame[:5]
                try:
                    data = payload_view(await _maybe_await(t.read(frame)))
                    if data.nbytes != want:
                        raise ValueError(
                            f"page_reader({i}, {n}) for rid {t.rid!r} returned {data.nbytes} bytes, "
                            f"expected {want} ({n} pages of {page_bytes}, the last of "
                            f"{t.last_page_bytes} over all layers)"
                        )
                except Exception as e:
                    log.error("transfer %r failed reading pages: %r", t, e)
                    await self._finish_cancel(t, e)
                    continue
                if t.cancel_requested:
                    continue
                await self.pacer.wait(data.nbytes)
                if t.cancel_requested:
                    continue
                if t.started_at is None:
                    t.started_at = asyncio.get_running_loop().time()
                # a last_page_bytes only when the frame ends with the transfer's partial last page
                header = Kv(t.rid, i, n, list(layers) if layers is not None else None, page_bytes,
                            data.nbytes - (n - 1) * page_bytes if data.nbytes != n * page_bytes else OMIT,
                            t.dtype if t.dtype is not None else OMIT).wire()
                try:
                    await asyncio.wait_for(self.peer.send(header, data, crc=self.crc), self.stall_timeout_s)
                except (asyncio.TimeoutError, TimeoutError):
                    # the frame is half written: the connection cannot carry anything else
                    self.stalls += 1
                    self.peer.abort()
                    raise ConnectionError(f"KV transfer {t.rid!r} to {peer_label(self.peer)} made no progress for "
                                          f"{self.stall_timeout_s} s while sending (stalled)") from None
                t.sent(frame, data.nbytes)
                t.chunks_sent += 1
                t.last_sent_tick = self.chunks_sent
                self.chunks_sent += 1
                self.bytes_sent += data.nbytes
                if t.all_pages_sent and not t.cancel_requested and t.sendable():
                    await self._finish_done(t)
        except asyncio.CancelledError:
            raise
        except ConnectionError as e:
            self._fail_all(e)
        except Exception as e:
            log.exception("KV sender loop to %s failed", peer_label(self.peer))
            self._fail_all(e)
        finally:
            self._task = None if not self._closed else self._task


def prompt_kv_bytes(prompt_tokens: int, first_page: int, page_size: int, page_bytes: int,
                    whole_pages: bool = False) -> int:
    """Payload bytes of a transfer of a prompt's KV from its page ``first_page`` on:
    ``max(0, prompt_tokens - first_page * page_size) * page_bytes / page_size``, because only the
    filled token slots of the prompt's last page are sent (``last_page_bytes``). ``whole_pages``
    (the ``kv_whole_pages`` ablation): that page is sent whole, ``max(0, pages - first_page) *
    page_bytes``. ``page_bytes``: bytes of one page over the layers sent; raises ValueError
    unless it is whole slots."""
    slot, rest = divmod(int(page_bytes), int(page_size))
    if rest or page_size <= 0:
        raise ValueError(f"page_bytes {page_bytes} is not a whole number of {page_size} token slots")
    if whole_pages:
        return max(0, -(-int(prompt_tokens) // int(page_size)) - int(first_page)) * int(page_bytes)
    return max(0, int(prompt_tokens) - int(first_page) * int(page_size)) * slot


def prompt_last_slots(prompt_tokens: int, page_size: int) -> Optional[int]:
    """Filled token slots of a prompt's last page when it is partial (``1..page_size-1``), else
    None (the prompt ends on a page boundary, or is empty)."""
    k = int(prompt_tokens) % int(page_size)
    return k or None


def kv_frame_bytes(h: dict) -> Optional[int]:
    """Payload bytes a ``kv`` frame header announces: ``n_pages * page_bytes``, less
    ``page_bytes - last_page_bytes`` when ``last_page_bytes`` is present (the frame ends with a
    partial last page). None for a malformed header (missing or non-integer fields, negative
    counts, ``last_page_bytes`` outside ``[1, page_bytes]``, a partial page in a 0-page frame)."""
    n, pb, lpb = h.get("n_pages"), h.get("page_bytes"), h.get("last_page_bytes")
    if type(n) is not int or type(pb) is not int or n < 0 or pb < 0:
        return None
    if lpb is None:
        return n * pb
    if type(lpb) is not int or not 0 < lpb <= pb or n < 1:
        return None
    return n * pb - (pb - lpb)


def peer_label(peer: Peer) -> str:
    try:
        return peer._label()
    except Exception:
        return "?"


# ------------------------------------------------------------------ receiver
class KVReceiver:
    """Dispatches incoming ``kv`` / ``kv_done`` / ``kv_cancel`` frames to callbacks.

    ``on_pages(rid, first_page, n_pages, layers, payload)``, ``on_done(rid, header)`` and
    ``on_cancel(rid)`` may be sync or async (one-way handlers of a peer run in arrival order, so
    a slow ``on_pages`` back-pressures the sender). ``layers`` is ``(l0, l1)`` or None.
    A ``kv`` frame whose payload is not :func:`kv_frame_bytes` of its header is dropped (logged).
    Counters: ``bytes_received[rid]``, ``pages_received[rid]`` (payload bytes / pages; kept for the
    last ``keep_finished`` finished rids, or until :meth:`forget`), ``total_bytes``.
    """

    def __init__(
        self,
        on_pages: Callable[..., Any],
        on_done: Optional[Callable[[Any, dict], Any]] = None,
        on_cancel: Optional[Callable[[Any], Any]] = None,
        *,
        keep_finished: int = 10000,
    ):
        self.on_pages = on_pages
        self.on_done = on_done
        self.on_cancel = on_cancel
        self.keep_finished = keep_finished
        self.bytes_received: dict[Any, int] = {}
        self.pages_received: dict[Any, int] = {}
        self.total_bytes = 0
        self.dropped_frames = 0
        self._finished: "OrderedDict[Any, None]" = OrderedDict()

    def handlers(self) -> dict:
        """``{"kv": ..., "kv_done": ..., "kv_cancel": ...}`` to merge into a handler table."""
        return {"kv": self._on_kv, "kv_done": self._on_done, "kv_cancel": self._on_cancel}

    def register(self, target) -> None:
        """Install the handlers on a Peer or Server (anything with ``.on(t, h)``) or a dict."""
        for t, h in self.handlers().items():
            if isinstance(target, dict):
                target[t] = h
            else:
                target.on(t, h)

    def forget(self, rid: Any) -> None:
        self.bytes_received.pop(rid, None)
        self.pages_received.pop(rid, None)
        self._finished.pop(rid, None)

    def _mark_finished(self, rid: Any) -> None:
        self._finished[rid] = None
        self._finished.move_to_end(rid)
        while len(self._finished) > self.keep_finished:
            old, _ = self._finished.popitem(last=False)
            self.bytes_received.pop(old, None)
            self.pages_received.pop(old, None)

    async def _on_kv(self, peer: Peer, h: dict, payload) -> None:
        rid = h.get("rid")
        n = h.get("n_pages")
        want = kv_frame_bytes(h)
        if want is None or len(payload) != want:
            self.dropped_frames += 1
            log.error("dropping kv frame rid=%r: payload %d bytes, header says %r (n_pages %r, page_bytes %r, "
                      "last_page_bytes %r)", rid, len(payload), want, n, h.get("page_bytes"), h.get("last_page_bytes"))
            return
        self.bytes_received[rid] = self.bytes_received.get(rid, 0) + len(payload)
        self.pages_received[rid] = self.pages_received.get(rid, 0) + n
        self.total_bytes += len(payload)
        layers = h.get("layers")
        await _maybe_await(self.on_pages(rid, h.get("first_page"), n, tuple(layers) if layers is not None else None, payload))

    async def _on_done(self, peer: Peer, h: dict, payload) -> None:
        rid = h.get("rid")
        self._mark_finished(rid)
        if self.on_done is not None:
            await _maybe_await(self.on_done(rid, h))

    async def _on_cancel(self, peer: Peer, h: dict, payload) -> None:
        rid = h.get("rid")
        self._mark_finished(rid)
        if self.on_cancel is not None:
            await _maybe_await(self.on_cancel(rid))
