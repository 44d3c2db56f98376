"""Output text at the gateway: incremental detokenization, stop strings, token strings/bytes.

Stop strings are applied here, on the detokenized stream, whichever tier produced the tokens:
text that could still be the start of a stop string is held back, so text after (or of) a stop
string is never streamed, including stop strings that span token boundaries or complete only
after the handoff from RLD to MD. A stop string matches as soon as the text of the ids so far
(``decode(ids)``) contains it, but for a U+FFFD at its end: the text the detokenizer holds back
with an incomplete UTF-8 character takes part in the match (so a token carrying a stop string's
last characters and the first byte of the next character ends the request on that token), the
trailing U+FFFD itself does not, since the next token may complete it into another character.
A stop string that holds U+FFFD (an invalid byte sequence) therefore matches one token after the
one completing it, once the replacement character is final (as vLLM's held-back detokenizer).
"""

from __future__ import annotations

from pdd.token_bytes import is_byte_level, token_bytes


class Detokenizer:
    """Incremental text of a growing list of ids (``tokenizers.Tokenizer``).

    Decodes a short window (vLLM's prefix/read offsets) rather than every id each time, and holds
    back text that ends in a partial UTF-8 character until the next token completes it (or the
    stream ends). The concatenation of everything returned equals ``decode(all ids)``;
    ``pending`` is the text held back after the last :meth:`add` (``decode(all ids)`` = what was
    returned + ``pending``), for stop strings to match on before it is released.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.pending = ""
            return new[len(prefix):]
        if final:
            return self.flush()
        self.pending = new[len(prefix):] if len(new) > len(prefix) else ""
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a partial character at the end of the stream)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        self.pending = ""
        return new[len(prefix):] if len(new) > len(prefix) else ""


class StopMatcher:
    """Finds the first stop string to complete in a text stream fed piece by piece (the
    earliest end; on a tie the earliest start), however the stream is split.

    ``feed(text, pending="") -> (releasable text, matched stop or None)``: the text returned can
    never be part of a stop string; the longest tail that is a proper prefix of some stop string
    is held back until more text decides it. On a match, the text up to the stop string (plus the
    stop string if ``include_stop``) is returned and nothing after it ever is. ``pending`` is text
    that follows ``text`` for now but is not final (the detokenizer's held-back partial
    character, :attr:`Detokenizer.pending`): a stop string may match in it (or across it), which
    ends the stream there, but not in its trailing U+FFFD characters (an incomplete character the
    next token may complete: a stop string holding U+FFFD would match every multi-byte character
    split across tokens); otherwise it is ignored, and fed again as ``text`` once final.

    ``match=False`` feeds text in which no stop string may end (a choice's first ``min_tokens``
    tokens, vLLM's rule): it is released or held back as any other, and a stop string that
    begins in it and ends in text fed later still matches (vLLM looks back as far).
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop
        self.buf = ""
        self.floor = 0  # characters at the start of buf in which no stop string may end (match=False)
        self.done = False

    def feed(self, text: str, pending: str = "", match: bool = True) -> tuple[str, str | None]:
        if self.done:
            return "", None
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, None
        if not match:
            self.floor = len(self.buf)
            return self._release(), None
        seen = self.buf + pending.rstrip("\ufffd")
        best, which = None, None  # the stop string that completes first (then the longer one)
        for s in self.stops:
            i = seen.find(s, max(0, self.floor - len(s) + 1))  # it ends after the floor
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best, which = (i + len(s), i), s
        if which is not None:
            out = seen[:best[1]] + (which if self.include else "")
            self.buf, self.done = "", True
            return out, which
        return self._release(), None

    def _release(self) -> str:
        """The text of ``buf`` that cannot begin a stop string; the longest tail that is a proper
        prefix of one stays in ``buf``."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        out = self.buf[:len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold:]
        self.floor = max(0, self.floor - len(out))
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.done else self.buf), ""
        return out


class TokenText:
    """Strings and raw bytes of single tokens (for logprobs), cached per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self.tok.decode([token_id], skip_special_tokens=False)
        raw = list(token_bytes(self.tok, token_id, self.byte_level))
        if "\ufffd" in text and raw is not None:
            try:
                text = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:  # a partial character: name its bytes (as vLLM does)
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._cache[token_id] = (text, raw)
        return text, raw
