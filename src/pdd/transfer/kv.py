"""KV page streaming over a :class:`~pdd.transfer.peer.Peer`.

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
    "KVReorder",
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
        # several connections (KVSender(peers=...)): a frame is *claimed* by the connection that
        # will write it before it is read, so no two connections take the same pages
        self.pages_claimed = 0
        self.inflight = 0  # frames claimed and not yet written (or given up)
        self.frames_numbered = 0  # stripe sequence numbers given out (frames committed to a connection)
        self.error: Optional[BaseException] = None  # a page reader's error: the transfer is cancelled with it
        self.closing = False  # its kv_done / kv_cancel is being sent (no connection's loop takes it)
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
        """``(first_page, n_pages, layers, page_bytes, payload_bytes)`` of the next frame not yet
        claimed, or None when every page is (the transfer ends with ``kv_done`` once they are
        written)."""
        left = self.n_pages - self.pages_claimed
        if left == 0:
            return None
        n = min(self.chunk_pages, left)
        i = self.first_page + self.pages_claimed
        return i, n, self.layers, self.page_bytes, self.frame_bytes(i, n)

    def claim(self, frame: tuple) -> None:
        """``frame`` (from :meth:`next_frame`) will be written by the calling connection."""
        self.pages_claimed += frame[1]
        self.inflight += 1

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
        self.group_claimed = [0] * len(self.groups)  # pages of each group claimed by a connection
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
        for g, sent in enumerate(self.group_claimed):
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
        if not ok and self._idle_since is None and self.chunks_sent and self.inflight == 0:
            self._idle_since = loop_now  # waiting for the prefill (not for another connection's frame)
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

    def claim(self, frame: tuple) -> None:
        self.group_claimed[frame[5]] += frame[1]
        self.inflight += 1

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


def _ending(t: Transfer) -> bool:
    """Whether ``t`` is to be cancelled (asked to, a page reader's error, or a failed prefill)."""
    return t.cancel_requested or (isinstance(t, LayeredTransfer) and t.progress.error is not None)


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

    ``peers``: further connections to the same peer (``link.wan_connections`` - 1 of them): the
    sender then *stripes*, one send loop per connection, each taking the next frame (by the
    send order) whenever its connection has written its previous one, so a connection that
    drains faster carries more frames (least-loaded). Frames of one transfer then go over all
    the connections; each carries ``stripe: [transfer seq, frame seq]`` (its transfer's frames
    numbered in the order they were committed to a connection), and its ``kv_done`` /
    ``kv_cancel`` ``stripe: [transfer seq, frames]``, so the receiver (:class:`KVReorder`)
    hands them on in that order, the closing message after the last frame. Why: one TCP
    connection's throughput is capped by its loss and window (Mathis et al. 1997; rate <=
    window / RTT), not by the line, and Prefill-as-a-Service (arXiv 2604.15039) streams KV over
    several connections for this reason. One connection dying fails every unfinished transfer
    of the sender (as one connection's loss does) and aborts the other connections: a stripe
    cannot be completed without its lost frames, and the caller's recovery handles a failed
    transfer already. Without ``peers`` nothing is added to the wire.
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
        peers: Sequence[Peer] = (),
    ):
        if max_frame_bytes is not None and max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0 (or None)")
        self.peer = peer
        self.peers: list[Peer] = [peer, *peers]
        self.striped = len(self.peers) > 1
        self.bytes_by_connection = [0] * len(self.peers)  # payload bytes each connection wrote
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
        self._tasks: list[Optional[asyncio.Task]] = [None] * len(self.peers)
        self._closed = False

    @property
    def connection_closed(self) -> bool:
        """Whether any of its connections is closed (a striped sender is then unusable)."""
        return any(p.closed for p in self.peers)

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes queued and not yet written, over every active transfer (a layered
        transfer's not-yet-computed layers included): what a new transfer finds ahead of it under
        FIFO order (``pdd.policy.wan_estimate.transfer_seconds(backlog_bytes=...)``)."""
        return sum(max(0, t.remaining_bytes) for t in self.active if not t.cancel_requested)

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
        for p in self.peers:
            p._check_open()

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
        for c, task in enumerate(self._tasks):
            if task is None:
                self._tasks[c] = asyncio.create_task(self._run(c), name=f"kv-sender-{peer_label(self.peer)}-{c}")
        return t

    def cancel(self, rid: Any) -> int:
        """Cancel every active transfer of ``rid``; returns how many were cancelled."""
        return sum(t.cancel() for t in list(self.active) if t.rid == rid)

    def transfers(self, rid: Any = None) -> list[Transfer]:
        return [t for t in self.active if rid is None or t.rid == rid]

    async def close(self) -> None:
        """Stop the loop; unfinished transfers fail with ConnectionError (no kv_cancel is sent)."""
        self._closed = True
        for task in self._tasks:
            if task is not None:
                task.cancel()
                try:
                    await task
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

    def _stripe(self, t: Transfer, n: int):
        """The ``stripe`` field: ``[t.seq, n]`` when striped, else omitted (the wire of one connection)."""
        return [t.seq, n] if self.striped else OMIT

    async def _finish_cancel(self, t: Transfer, peer: Peer, error: Optional[BaseException] = None) -> None:
        t.closing = True  # no other connection's loop takes it meanwhile
        try:
            await peer.send(
                KvCancel(t.rid, t.bytes_sent, t.pages_sent, stripe=self._stripe(t, t.frames_numbered)).wire(),
                crc=self.crc
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
        peer._check_open()

    async def _finish_done(self, t: Transfer, peer: Peer) -> None:
        t.closing = True  # no other connection's loop takes it meanwhile
        h = KvDone(
            rid=t.rid,
            first_page=t.first_page,
            n_pages=t.n_pages,
            layers=list(t.layers) if t.layers is not None else None,
            page_bytes=t.page_bytes,
            last_page_bytes=t.last_page_bytes,
            bytes=t.bytes_sent,
            dtype=t.dtype if t.dtype is not None else OMIT,
            stripe=self._stripe(t, t.frames_numbered),
            extra=t.closing_fields(),
        ).wire()
        await peer.send(h, crc=self.crc)  # on ConnectionError t stays active -> _fail_all
        self.active.remove(t)
        if not t.done.done():
            t.done.set_result(self._result(t, False))

    async def _run(self, c: int = 0) -> None:
        """Connection ``c``'s send loop (one per connection; they share ``active``)."""
        peer = self.peers[c]
        try:
            while True:
                for t in [t for t in self.active if t.inflight == 0 and not t.closing and _ending(t)]:
                    t.cancel_requested = True  # a failed prefill: what was sent is cancelled
                    if not t.closing:  # another connection's loop may have taken it meanwhile
                        await self._finish_cancel(t, peer, t.error)
                # a layered transfer waits for its layers; a transfer whose every frame another
                # connection has claimed waits for them to be written (then its kv_done goes)
                ready = [t for t in self.active if not t.closing and not _ending(t) and t.sendable()
                         and (t.inflight == 0 or t.next_frame() is not None)]
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
                    await self._finish_done(t, peer)
                    continue
                t.claim(frame)
                try:
                    await self._send_frame(t, frame, peer, c)
                finally:
                    t.inflight -= 1
                    if self.striped:
                        self._wake.set()  # a transfer this frame held may close or cancel now
                if t.all_pages_sent and t.inflight == 0 and not t.closing and not t.cancel_requested \
                        and t.sendable() and t in self.active:
                    await self._finish_done(t, peer)
        except asyncio.CancelledError:
            raise
        except ConnectionError as e:
            self._connection_lost(e)
        except Exception as e:
            log.exception("KV sender loop to %s failed", peer_label(self.peer))
            self._connection_lost(e)
        finally:
            if not self._closed:
                self._tasks[c] = None

    def _connection_lost(self, e: BaseException) -> None:
        """A connection failed: every unfinished transfer fails with ``e``; a striped sender's
        other connections are aborted (its stripes cannot complete without the lost frames)."""
        self._fail_all(e)
        if self.striped:
            for p in self.peers:
                if not p.closed:
                    p.abort()

    async def _send_frame(self, t: Transfer, frame: tuple, peer: Peer, c: int) -> None:
        """Read and write one claimed frame of ``t`` on connection ``c`` (``peer``)."""
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
            t.error, t.cancel_requested = e, True  # the cancel sweep sends kv_cancel once no frame is in flight
            self._wake.set()
            return
        if t.cancel_requested:
            return
        await self.pacer.wait(data.nbytes)
        if t.cancel_requested:
            return
        if t.started_at is None:
            t.started_at = asyncio.get_running_loop().time()
        # numbered here, with no await before the write: a numbered frame is written or its
        # connection is lost (and with it the transfer), so the receiver never waits for a gap
        stripe = self._stripe(t, t.frames_numbered)
        t.frames_numbered += 1
        # a last_page_bytes only when the frame ends with the transfer's partial last page
        header = Kv(t.rid, i, n, list(layers) if layers is not None else None, page_bytes,
                    data.nbytes - (n - 1) * page_bytes if data.nbytes != n * page_bytes else OMIT,
                    t.dtype if t.dtype is not None else OMIT, stripe).wire()
        try:
            await asyncio.wait_for(peer.send(header, data, crc=self.crc), self.stall_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            # the frame is half written: the connection cannot carry anything else
            self.stalls += 1
            peer.abort()
            raise ConnectionError(f"KV transfer {t.rid!r} to {peer_label(peer)} made no progress for "
                                  f"{self.stall_timeout_s} s while sending (stalled)") from None
        t.sent(frame, data.nbytes)
        t.chunks_sent += 1
        t.last_sent_tick = self.chunks_sent
        self.chunks_sent += 1
        self.bytes_sent += data.nbytes
        self.bytes_by_connection[c] += data.nbytes


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


# ------------------------------------------------------------------ striped receive
class _Stripe:
    __slots__ = ("next", "buf", "close", "lock", "peers")

    def __init__(self):
        self.next = 0  # the frame seq to hand on next
        self.buf: dict[int, tuple] = {}  # frame seq -> (handler, peer, header, payload), arrived early
        self.close: Optional[tuple] = None  # (handler, peer, header, payload, frames) of kv_done / kv_cancel
        self.lock = asyncio.Lock()
        self.peers: set = set()


class KVReorder:
    """The receiver's side of a striped sender (:class:`KVSender` with ``peers``): hands each
    transfer's ``kv`` frames to the wrapped handlers in the order they were numbered (``stripe:
    [transfer seq, frame seq]``), whatever connection each came over and whenever it arrived,
    and its ``kv_done`` / ``kv_cancel`` (``stripe: [transfer seq, frames]``) after the last of
    them, so the import sees exactly one connection's sequence. Frames without ``stripe`` (one
    connection) pass straight through.

    A frame that arrives ahead of its turn is held (its payload is its own ``bytes``): at most what
    the other connections carried while it was ahead. A transfer one of whose connections closes
    before it completes is forgotten (held frames dropped, later ones of it too): its sender fails
    it and the request's owner frees what was imported. Counters: ``reordered_frames`` (frames
    held for an earlier one), ``dropped_frames`` (duplicates, frames of a forgotten transfer,
    malformed ``stripe``). Per-transfer state lives until its closing message is handed on.
    """

    KINDS = ("kv", "kv_done", "kv_cancel")

    def __init__(self, keep_finished: int = 4096):
        self.keep_finished = keep_finished
        self.reordered_frames = 0
        self.dropped_frames = 0
        self._streams: dict[tuple, _Stripe] = {}
        self._finished: "OrderedDict[tuple, None]" = OrderedDict()
        self._watched: set[int] = set()

    def wrap(self, handlers: dict) -> dict:
        """``handlers`` with its ``kv`` / ``kv_done`` / ``kv_cancel`` entries reordered."""
        out = dict(handlers)
        for kind in self.KINDS:
            if kind in handlers:
                out[kind] = self._wrapped(kind, handlers[kind])
        return out

    @property
    def open_transfers(self) -> int:
        """Striped transfers with frames or a closing message still held."""
        return len(self._streams)

    def _wrapped(self, kind: str, h: Callable):
        async def handler(peer, header, payload):
            stripe = header.get("stripe")
            if stripe is None:
                return await _maybe_await(h(peer, header, payload))
            await self.push(kind, h, peer, header, payload)
            return None

        return handler

    def _finish(self, key: tuple) -> None:
        self._streams.pop(key, None)
        self._finished[key] = None
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)

    def _watch(self, peer) -> None:
        if id(peer) in self._watched or not hasattr(peer, "on_close"):
            return
        self._watched.add(id(peer))

        def gone(p) -> None:
            self._watched.discard(id(p))
            for key, st in list(self._streams.items()):
                if p in st.peers:
                    self.dropped_frames += len(st.buf)
                    st.buf.clear()
                    self._finish(key)

        peer.on_close(gone)

    async def push(self, kind: str, h: Callable, peer, header: dict, payload) -> None:
        """One striped message: held until its turn, then handed to ``h(peer, header, payload)``."""
        stripe = header.get("stripe")
        if (not isinstance(stripe, (list, tuple)) or len(stripe) != 2
                or not all(type(x) is int and x >= 0 for x in stripe)):
            self.dropped_frames += 1
            log.error("dropping %s rid=%r: bad stripe %r", kind, header.get("rid"), stripe)
            return
        key = (header.get("rid"), stripe[0])
        if key in self._finished:
            self.dropped_frames += 1
            return
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = _Stripe()
        self._watch(peer)
        st.peers.add(peer)
        if kind == "kv":
            seq = stripe[1]
            if seq < st.next or seq in st.buf:
                self.dropped_frames += 1
                log.error("dropping duplicate kv frame %d of rid %r", seq, key[0])
                return
            if seq != st.next:
                self.reordered_frames += 1
            st.buf[seq] = (h, peer, header, payload)
        else:
            st.close = (h, peer, header, payload, stripe[1])
        async with st.lock:
            while st.next in st.buf and self._streams.get(key) is st:
                item = st.buf.pop(st.next)
                st.next += 1
                await self._hand_on(item)
            if st.close is not None and st.next >= st.close[4] and self._streams.get(key) is st:
                self._finish(key)
                await self._hand_on(st.close[:4])

    @staticmethod
    async def _hand_on(item: tuple) -> None:
        h, peer, header, payload = item
        try:
            await _maybe_await(h(peer, header, payload))
        except Exception:
            log.exception("%s handler failed for rid %r", header.get("t"), header.get("rid"))
