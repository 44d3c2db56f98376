"""KV frames that reach MD before the request they belong to (a predicted MD send).

With ``policy.md_predicted_send`` P starts a relayed request's WAN send at once, beside the
gateway's ``reserve`` to MD, instead of a WAN round trip later. The reservation leaves first and
usually lands first, but the two travel on different connections, and MD admits a request on its
engine thread, so a ``kv`` or ``kv_done`` frame can find no request yet. Such frames are held
here, in arrival order, until the reservation admits the request (:meth:`EarlyFrames.take`), and
dropped when the request is known to have ended (:meth:`EarlyFrames.ended`), when they are older
than ``ttl_s`` seconds, or, oldest request first, when they would hold more than ``max_bytes``
bytes of payload.

Plain state: the caller passes the time (seconds, any monotonic clock).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_TTL_S = 30.0
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_KEEP_ENDED = 8192


@dataclass
class _Held:
    since_s: float
    frames: list = field(default_factory=list)  # (kind, header, payload)
    nbytes: int = 0


class EarlyFrames:
    """Frames held per request id until it is admitted.

    ``ttl_s``: frames of a request not admitted within this many seconds are dropped (> 0).
    ``max_bytes``: payload bytes held at most; the oldest requests' frames go first (>= 0).
    ``keep_ended``: how many ended request ids are remembered, so their late frames are dropped at
    once instead of held (>= 1). Raises ValueError for bounds outside these ranges.
    Counters: ``held_frames`` (frames ever held), ``dropped_frames`` (held frames dropped, or
    frames of ended requests refused).
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep_ended: int = DEFAULT_KEEP_ENDED):
        if not ttl_s > 0 or max_bytes < 0 or keep_ended < 1:
            raise ValueError(f"need ttl_s > 0, max_bytes >= 0, keep_ended >= 1; got {ttl_s}, {max_bytes}, {keep_ended}")
        self.ttl_s, self.max_bytes, self.keep_ended = ttl_s, max_bytes, keep_ended
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.nbytes = 0
        self.held_frames = 0
        self.dropped_frames = 0

    def hold(self, rid: str, kind: str, header: dict, payload: bytes, now_s: float) -> bool:
        """Hold a frame (``kind`` "kv" or "kv_done") of a request not admitted here. Returns False
        (and holds nothing) when ``rid`` already ended here or the frame alone exceeds
        ``max_bytes``."""
        self._expire(now_s)
        size = len(payload)
        if rid in self._ended or size > self.max_bytes:
            self.dropped_frames += 1
            return False
        held = self._held.get(rid)
        if held is None:
            held = self._held[rid] = _Held(now_s)
        held.frames.append((kind, header, payload))
        held.nbytes += size
        self.nbytes += size
        self.held_frames += 1
        while self.nbytes > self.max_bytes:
            self._drop_oldest()
        return True

    def take(self, rid: str) -> list:
        """The frames held for ``rid``, in arrival order, as ``(kind, header, payload)``; forgets them."""
        held = self._held.pop(rid, None)
        if held is None:
            return []
        self.nbytes -= held.nbytes
        return held.frames

    def ended(self, rid: str) -> None:
        """``rid`` ended here (released, dropped, aborted): drop its held frames and refuse later ones."""
        held = self._held.pop(rid, None)
        if held is not None:
            self.nbytes -= held.nbytes
            self.dropped_frames += len(held.frames)
        self._ended[rid] = None
        self._ended.move_to_end(rid)
        while len(self._ended) > self.keep_ended:
            self._ended.popitem(last=False)

    def __len__(self) -> int:
        return len(self._held)

    def _drop_oldest(self) -> None:
        _, held = self._held.popitem(last=False)
        self.nbytes -= held.nbytes
        self.dropped_frames += len(held.frames)

    def _expire(self, now_s: float) -> None:
        while self._held:
            held = next(iter(self._held.values()))
            if now_s - held.since_s < self.ttl_s:
                break
            self._drop_oldest()
