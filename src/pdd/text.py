"""Echoing a value in a one-line refusal: :func:`shown`, shared by the config's messages
(``pdd.config``) and the HTTP API's (``pdd.gateway``); finding text that is not valid Unicode
(:func:`lone_surrogate`, :func:`surrogate_at`), shared by the gateway's request checks and
``pdd.structured``. Imports nothing of pdd."""

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


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate (U+D800-U+DFFF, which JSON's ``\\ud800`` escapes can
    carry but no UTF-8 text can) in ``text``, or None when it is valid Unicode text."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def surrogate_at(v, path: str = "") -> tuple[str, str, int] | None:
    """``(where, param, index)`` of the first lone surrogate (:func:`lone_surrogate`) in the
    strings of ``v``, a JSON value (dicts and lists walked in order, dict keys included), whose
    own path is ``path`` (``"messages[2]"``; "" for a root, whose items are then ``key`` and
    ``[0]``): ``where`` names it for a message (a key by its ``ascii()``, so the message holds no
    surrogate: ``messages[2] key 'k\\ud800'``), ``param`` is its path (for a key, the object
    holding it), ``index`` the character. None when every string is valid Unicode text. Other
    values (numbers, models) are not looked into. Recursion: one frame per nesting level (a
    request body's depth is bounded before this runs)."""
    if isinstance(v, str):
        i = lone_surrogate(v)
        return (path, path, i) if i is not None else None
    if isinstance(v, dict):
        for k, x in v.items():
            if isinstance(k, str) and (i := lone_surrogate(k)) is not None:
                return f"{path} key {ascii(k)}" if path else f"key {ascii(k)}", path, i
            if isinstance(x, (str, dict, list)):  # a path is written only where a string can be
                found = surrogate_at(x, f"{path}.{k}" if path else str(k))
                if found is not None:
                    return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            if isinstance(x, (str, dict, list)):
                found = surrogate_at(x, f"{path}[{i}]")
                if found is not None:
                    return found
    return None
