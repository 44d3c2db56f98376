"""KV layouts across tiers: what a sender and a receiver of different hardware agree on.

Each instance's KV fingerprint (``EngineInstance.kv_fingerprint``, sent in the connection's
hello) has two parts:

- **the model**, which must be equal on both sides (:data:`MODEL_KEYS`: ``architecture``,
  ``num_layers``, ``num_kv_heads``, ``head_dim``, ``weights``): KV of another model cannot be
  converted, and :func:`kv_handshake_check` refuses the connection naming the field;
- **the layout**, which is negotiated (:data:`LAYOUT_KEYS`: ``page_size`` in tokens, a power of
  two, and ``kv_dtype``): the sender converts its pages to the receiver's layout.

On the wire a transfer is in the **receiver's pages**: page indices, ``page_size`` and the
partial last page (its filled token slots only) are the receiver's, so the receiver imports
frames into its own page table unchanged. The element type on the wire is :func:`wire_dtype`:
the narrower of the two dtypes, so the link always carries the smaller representation. A
sender wider than its receiver (float32 -> bfloat16) casts before sending; a receiver wider
than its sender (bfloat16 -> float32) gets the narrow elements and widens them on import
(exact); between two 2-byte types (float16 <-> bfloat16) the sender casts to the receiver's.
Bytes of one transfer: ``tokens x kv_elems_per_token x bytes(wire dtype)``
(:func:`wire_slot_bytes`), exactly what ``pdd.transfer.kv.prompt_kv_bytes`` predicts with the
receiver's page size and :func:`wire_page_bytes`.

No torch here: the conversion itself is ``pdd.engine.kv_pool.KVPool.export_tokens`` (sender)
and ``KVPool.import_pages(src_dtype=...)`` (receiver).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .handshake import HandshakeError

__all__ = ["DTYPE_BYTES", "KVLayout", "LAYOUT_KEYS", "MODEL_KEYS", "kv_handshake_check", "layout_of",
           "wire_dtype", "wire_page_bytes", "wire_slot_bytes"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MODEL_KEYS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "weights")
LAYOUT_KEYS = ("page_size", "kv_dtype")


@dataclass(frozen=True)
class KVLayout:
    """One side's KV page layout: tokens per page and element dtype name."""

    page_size: int
    dtype: str


def layout_of(fp: Optional[dict]) -> Optional[KVLayout]:
    """The layout a KV fingerprint announces, or None (no fingerprint, or one without it)."""
    if not isinstance(fp, dict) or "page_size" not in fp or "kv_dtype" not in fp:
        return None
    return KVLayout(int(fp["page_size"]), str(fp["kv_dtype"]))


def wire_dtype(sender: str, receiver: str) -> str:
    """The dtype a transfer crosses in: the receiver's when it is not wider than the sender's
    (the sender casts), else the sender's (the receiver widens). Raises ValueError for an
    unknown dtype name."""
    for side, d in (("sender", sender), ("receiver", receiver)):
        if d not in DTYPE_BYTES:
            raise ValueError(f"{side} kv_dtype {d!r} is not one of {sorted(DTYPE_BYTES)}")
    return receiver if DTYPE_BYTES[receiver] <= DTYPE_BYTES[sender] else sender


def wire_slot_bytes(slot_bytes: int, own_dtype: str, wire: str) -> int:
    """Bytes of one token's KV on the wire, from its bytes in ``own_dtype`` (``slot_bytes``)."""
    elems, rest = divmod(int(slot_bytes), DTYPE_BYTES[own_dtype])
    if rest:
        raise ValueError(f"slot_bytes {slot_bytes} is not whole {own_dtype} elements")
    return elems * DTYPE_BYTES[wire]


def wire_page_bytes(receiver_page_bytes: int, receiver: KVLayout, sender_dtype: str) -> int:
    """Bytes of one of the receiver's pages as it crosses from a sender of ``sender_dtype``
    (the receiver's page size, :func:`wire_dtype`), from the page's bytes in the receiver's pool."""
    return wire_slot_bytes(int(receiver_page_bytes) // receiver.page_size, receiver.dtype,
                           wire_dtype(sender_dtype, receiver.dtype)) * receiver.page_size


def kv_handshake_check(local_fp: Optional[dict], remote_fp: Optional[dict]) -> None:
    """The handshake check of two engine instances (``server.Server`` / ``client.connect``
    ``handshake_check``): the model keys must be equal, the layout keys may differ (the sender
    converts) but must be a page size that is a positive power of two and a known dtype. A side
    without a fingerprint (the gateway) is accepted. Raises :class:`HandshakeError` naming the
    field(s)."""
    if local_fp is None or remote_fp is None:
        return
    if not isinstance(local_fp, dict) or not isinstance(remote_fp, dict):
        raise HandshakeError(f"fingerprints must be dicts, got {type(local_fp).__name__}/{type(remote_fp).__name__}")
    diffs = {k: (local_fp[k], remote_fp[k]) for k in local_fp.keys() & remote_fp.keys()
             if k not in LAYOUT_KEYS and local_fp[k] != remote_fp[k]}
    if diffs:
        detail = ", ".join(f"{k}: local={a!r} remote={b!r}" for k, (a, b) in sorted(diffs.items()))
        raise HandshakeError(f"KV fingerprint mismatch, another model ({detail})")
    ps = remote_fp.get("page_size")
    if "page_size" in remote_fp and (type(ps) is not int or ps < 1 or ps & (ps - 1)):
        raise HandshakeError(f"KV fingerprint: page_size must be a positive power of two, got {ps!r}")
    dt = remote_fp.get("kv_dtype")
    if "kv_dtype" in remote_fp and dt not in DTYPE_BYTES:
        raise HandshakeError(f"KV fingerprint: kv_dtype {dt!r} is not one of {sorted(DTYPE_BYTES)}")
