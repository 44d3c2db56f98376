"""Echoing a value in a one-line refusal: :func:`shown`, shared by the config's messages
(``pdd.config``) and the HTTP API's (``pdd.gateway``). Imports nothing of pdd."""

from __future__ import annotations

SHOWN_CHARS = 120  # a value an error message echoes is cut to about this many characters (:func:`shown`)


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, bounded: at most ``limit`` characters of it, then
    ``...`` and the value's full length (``'aaaa... (1000002 characters)``: a str's characters,
    a bytes' bytes, a list's or dict's items, else its repr's characters), so a refusal of a
    huge input is not huge itself (an address of 1,000,000 characters made a 2 MB 409) and
    says that it was cut. Raises nothing."""
    s = repr(value)
    if len(s) <= limit:
        return s
    if isinstance(value, (str, bytes, list, tuple, dict)):
        n, what = len(value), {str: "characters", bytes: "bytes"}.get(type(value), "items")
    else:
        n, what = len(s), "characters"
    return f"{s[:limit]}... ({n} {what})"
