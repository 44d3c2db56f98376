"""Tool calls read out of a chat choice's generated text, as vLLM's and SGLang's
``--tool-call-parser`` do, as it is generated: pure text in, content and calls out, no I/O.

Parsers (:data:`PARSERS`), by the format the model writes (sources: vLLM's
``entrypoints/openai/tool_parsers/{hermes,llama,mistral}_tool_parser.py``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the last one's closing tag optional; ``content`` is the text before the first
  ``<tool_call>`` (None when empty), the text between and after the blocks is dropped.
- ``llama3_json`` (Llama 3.1+): the text is, after an optional ``<|python_tag|>``, one or more JSON
  objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``; the first of the two) separated
  by ``;``; ``content`` is None. Text that does not start with ``{`` (or ``<|python_tag|>``) is no
  call, as vLLM's streaming parser decides.
- ``mistral`` (Mistral v0.3 and later instruct models): ``[TOOL_CALLS]`` then a JSON array of
  ``{"name": ..., "arguments": {...}}`` (tokenizers before v11), or, from tokenizer v11 on
  (Mistral Small 3.1+, Devstral, Magistral), one ``[TOOL_CALLS]name[ARGS]{...}`` per call
  (v13 puts ``[CALL_ID]id`` before ``[ARGS]``; decoded without special tokens, ``name{...}``);
  a name is 1 to 64 letters, digits, ``_`` or ``-`` (OpenAI's rule); ``content`` is the text
  before the first ``[TOOL_CALLS]``.

A forced ``tool_choice`` (:func:`parse_forced`): a named function's text is its arguments, the
call made whatever the text; ``"required"``'s is a JSON array of ``{"name", "parameters"}``.

When a call is made (the rule a stream can keep, the same for the whole text): a call object is
read strictly as JSON, one character at a time. The call is made (committed: its id and name go
out) once its ``name`` (a non-empty string with no ``\ud800``-style lone surrogate) and the start
of its arguments are read: the ``{`` of an object (then its text goes out as it is read, exactly
as the model wrote it), a whole ``null`` (``"{}"``), or a whole string holding an object's JSON
text (that text: some models write the arguments so); a call object that closes without
arguments is made with ``"{}"``. Once made, a call stands: text after it that breaks the format
(malformed JSON, ``NaN`` / ``Infinity``, nesting deeper than :data:`MAX_DEPTH`, the text cut by
``max_tokens``) ends its arguments where the JSON breaks off (they are then no whole JSON object,
as OpenAI's may not be) and the text from there is dropped; in ``hermes`` and ``mistral`` v11,
whose calls each have a marker, the calls after the next marker are read on. Text that breaks
the format before any call is made makes the whole text content, unchanged (the held text goes
out then), and so does a text that ends before any call is made. ``parallel`` False: the first
call only, the text after it dropped. vLLM's streaming parsers commit a call once its name is
read too; its non-streamed parse, which makes the whole text content when any call is
malformed, can disagree with its own stream, which pdd's cannot: the non-streamed answer
(:func:`parse`) is the stream's accumulation (:class:`ToolStream`).

Ids: ``call_`` + 24 lowercase hex digits (OpenAI's ``call_...`` shape; the openai client takes
any string); ``mistral``: 9 letters and digits, which Mistral's chat templates require of the
ids sent back to them (vLLM's ``MistralToolCall``).

Streaming (:class:`ToolStream`): each text delta gives an :class:`Emit`, content and
``delta.tool_calls`` items (:class:`CallDelta`: a call's first one carries its id and name and
the arguments text read so far, each later one a piece of its arguments). Content is passed on
as it comes, except text that may be the beginning of a call marker, which is held back, and the
text from the marker on, which is read for calls. What a stream hands out, whatever the chunks,
accumulated as the openai client does (:func:`accumulate`), is exactly what :func:`parse` /
:func:`parse_forced` return for the whole text.
"""


from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Callable

from pdd.gateway.openai_schemas import lone_surrogate

PARSERS = ("hermes", "llama3_json", "mistral")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_START = "[TOOL_CALLS]"
MISTRAL_ARGS, MISTRAL_CALL_ID = "[ARGS]", "[CALL_ID]"  # tokenizer v11+ (v13: the call id)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``id``, the function's ``name``, its ``arguments`` as a JSON string."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The ``message.tool_calls`` item of OpenAI's chat API."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """``content``: the message's text (None: none); ``calls``: the tool calls (empty: none, and
    ``content`` is then the whole text)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class CallDelta:
    """One ``delta.tool_calls`` item of a streamed chat choice: the call's ``index`` (0, 1, ...
    in the choice), a piece of its ``arguments`` text; a call's first item carries its ``id``
    and ``name`` too (None on the later ones)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        """The ``delta.tool_calls`` item of OpenAI's chat stream (``type`` "function" on the first)."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Emit:
    """What a streamed choice sends for some text: ``content`` ("" none) and ``calls`` (in order)."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __add__(self, other: "Emit") -> "Emit":
        return Emit(self.content + other.content, merge(self.calls + other.calls))


def merge(calls: tuple[CallDelta, ...]) -> tuple[CallDelta, ...]:
    """``calls`` with each run of items of one index joined into one (their arguments joined,
    the first's id and name kept): one chunk's ``delta.tool_calls``, one item per call."""
    out: list[CallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index and c.id is None:
            last = out[-1]
            out[-1] = CallDelta(last.index, last.arguments + c.arguments, last.id, last.name)
        else:
            out.append(c)
    return tuple(out)


def accumulate(emits) -> tuple[str, tuple[ToolCall, ...]]:
    """(content, calls) of a choice's :class:`Emit` s, joined as the openai client's stream
    accumulation does (a call by its index: the id and name of its first item, its arguments
    pieces joined). Raises ValueError on a piece of a call whose first item was not sent."""
    content, calls = "", {}
    for e in emits:
        content += e.content
        for c in e.calls:
            if c.id is not None:
                if c.index in calls:
                    raise ValueError(f"call {c.index} started twice")
                calls[c.index] = [c.id, c.name, c.arguments]
            elif c.index not in calls:
                raise ValueError(f"a piece of call {c.index} before its first item")
            else:
                calls[c.index][2] += c.arguments
    return content, tuple(ToolCall(*calls[i]) for i in sorted(calls))


def new_call_id() -> str:
    """``call_`` + 24 random lowercase hex digits."""
    return "call_" + secrets.token_hex(12)


def new_mistral_id() -> str:
    """9 random letters and digits (Mistral's templates check ids are ``[a-zA-Z0-9]{9}``)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def default_ids(parser: str) -> Callable[[], str]:
    return new_mistral_id if parser == "mistral" else new_call_id


class _Bad(ValueError):
    """The call text breaks its format at character ``args[0]`` (that character included)."""


class _Stop(Exception):
    """The choice's text ended (thrown into a reader by :meth:`ToolStream.finish`)."""


# strict JSON: Python's NaN / Infinity / -Infinity extensions are no JSON (JavaScript's JSON.parse
# refuses them in the arguments a client reads)
def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_WS, _DIGITS, _HEX = " \t\n\r", "0123456789", "0123456789abcdefABCDEF"
MAX_DEPTH = 64  # arrays and objects nested deeper in a call's arguments are malformed


def _drop(ch: str) -> None:
    pass


# The readers below are generators that take the call text one character at a time (``ch =
# yield``), so what they hand out is the same whatever the text's split into deltas. Each one
# that reads a JSON value is given its first character and returns the first character after it
# (``_call_object`` reads nothing past its closing brace). ``sink`` gets each character of the
# value once it is known to keep the text a prefix of valid JSON.
def _ws(ch: str, sink):
    while ch in _WS:
        sink(ch)
        ch = yield
    return ch


def _string(ch: str, sink, done=None):
    """A JSON string at ``ch``; ``done()`` is called once its closing quote is read."""
    if ch != '"':
        raise _Bad(ch)
    sink(ch)
    while True:
        ch = yield
        if ch == '"':
            sink(ch)
            if done is not None:
                done()
            return (yield)
        if ch == "\\":
            sink(ch)
            ch = yield
            if ch == "u":
                sink(ch)
                for _ in range(4):
                    ch = yield
                    if ch not in _HEX:
                        raise _Bad(ch)
                    sink(ch)
                continue
            if ch not in '"\\/bfnrt':
                raise _Bad(ch)
        elif ch < " ":  # a control character must be escaped
            raise _Bad(ch)
        sink(ch)


def _digits(ch: str, sink):
    """One or more digits at ``ch`` (a fraction's or an exponent's)."""
    if ch not in _DIGITS:
        raise _Bad(ch)
    while ch in _DIGITS:
        sink(ch)
        ch = yield
    return ch


def _value(ch: str, sink, depth: int = 0, done=None):
    """A JSON value at ``ch``; ``done()`` (a string or a literal's) is called once its last
    character is read."""
    if ch == "{" or ch == "[":
        if depth >= MAX_DEPTH:
            raise _Bad(ch)
        close = "}" if ch == "{" else "]"
        sink(ch)
        ch = yield from _ws((yield), sink)
        if ch == close:
            sink(ch)
            return (yield)
        while True:
            if close == "}":
                ch = yield from _string(ch, sink)
                ch = yield from _ws(ch, sink)
                if ch != ":":
                    raise _Bad(ch)
                sink(ch)
                ch = yield from _ws((yield), sink)
            ch = yield from _value(ch, sink, depth + 1)
            ch = yield from _ws(ch, sink)
            if ch == close:
                sink(ch)
                return (yield)
            if ch != ",":
                raise _Bad(ch)
            sink(ch)
            ch = yield from _ws((yield), sink)
    if ch == '"':
        return (yield from _string(ch, sink, done))
    if ch == "-" or ch in _DIGITS:
        if ch == "-":
            sink(ch)
            ch = yield
        if ch == "0":
            sink(ch)
            ch = yield
        elif ch in "123456789":
            while ch in _DIGITS:
                sink(ch)
                ch = yield
        else:
            raise _Bad(ch)
        if ch == ".":
            sink(ch)
            ch = yield from _digits((yield), sink)
        if ch == "e" or ch == "E":
            sink(ch)
            ch = yield
            if ch == "+" or ch == "-":
                sink(ch)
                ch = yield
            ch = yield from _digits(ch, sink)
        return ch
    for lit in ("true", "false", "null"):
        if ch == lit[0]:
            sink(ch)
            for want in lit[1:]:
                ch = yield
                if ch != want:
                    raise _Bad(ch)
                sink(ch)
            if done is not None:
                done()
            return (yield)
    raise _Bad(ch)


def _until(marker: str, tail: str = ""):
    """Reads (drops) text until ``marker`` has been read (``tail``: the text just read before)."""
    while not tail.endswith(marker):
        tail = (tail + (yield))[-len(marker):]


class _Call:
    """One call being read: committed (its first :class:`CallDelta` handed out) once its name
    and the start of its arguments are read; its arguments text before that is kept here."""

    def __init__(self, stream: "ToolStream"):
        self.stream = stream
        self.name: str | None = None
        self.args: list[str] | None = None  # None: no arguments read yet
        self.committed = False

    def sink(self, ch: str) -> None:
        if self.committed:
            self.stream.piece(ch)
        else:
            self.args.append(ch)

    def commit(self) -> None:
        if not self.committed and self.name is not None and self.args is not None:
            self.committed = True
            self.stream.begin(self.name, "".join(self.args))

    def set_name(self, name: str) -> None:
        if not name or lone_surrogate(name) is not None:
            raise _Bad('"')
        self.name = name
        self.commit()

    def arguments(self, ch: str):
        """Reads the arguments value at ``ch``: an object (its text as written, handed out as it
        comes once the call is committed), null (``{}``) or a string holding an object's JSON
        text (that text, once the string is whole)."""
        if ch == "{":
            self.args = []
            self.commit()
            return (yield from _value(ch, self.sink))
        if ch == "n":
            return (yield from _value(ch, _drop, done=lambda: self.whole("{}")))
        if ch == '"':  # some models write the arguments as a JSON string of them
            buf: list[str] = []
            return (yield from _string(ch, buf.append, lambda: self.whole(_DECODER.decode("".join(buf)), True)))
        raise _Bad(ch)

    def whole(self, text: str, check: bool = False) -> None:
        """The arguments read whole: ``text`` (``check``: only if it is a JSON object's text)."""
        if check:
            try:
                ok = isinstance(_DECODER.decode(text), dict) and lone_surrogate(text) is None
            except (ValueError, RecursionError):
                ok = False
            if not ok:
                raise _Bad('"')
        self.args = [text]
        self.commit()


def _call_object(ch: str, stream: "ToolStream", keys: tuple[str, ...]):
    """Reads one call object ``{"name": ..., <key>: {...}}`` at ``ch`` (``keys``: the names its
    arguments may have, the first one read is taken; other keys are skipped); nothing after
    its closing brace."""
    if ch != "{":
        raise _Bad(ch)
    call = _Call(stream)
    ch = yield from _ws((yield), _drop)
    if ch != "}":
        while True:
            buf: list[str] = []
            ch = yield from _string(ch, buf.append)
            key = _DECODER.decode("".join(buf))
            ch = yield from _ws(ch, _drop)
            if ch != ":":
                raise _Bad(ch)
            ch = yield from _ws((yield), _drop)
            if key == "name" and call.name is None:
                buf = []
                ch = yield from _string(ch, buf.append, lambda: call.set_name(_DECODER.decode("".join(buf))))
            elif key in keys and call.args is None:
                ch = yield from call.arguments(ch)
            else:
                ch = yield from _value(ch, _drop)
            ch = yield from _ws(ch, _drop)
            if ch == "}":
                break
            if ch != ",":
                raise _Bad(ch)
            ch = yield from _ws((yield), _drop)
    if call.name is None:
        raise _Bad(ch)
    if call.args is None:
        call.args = ["{}"]
        call.commit()


def _marked_calls(ch: str, stream: "ToolStream", marker: str, read_one):
    """Calls each after its own ``marker``, the first at ``ch`` (its marker read already):
    ``read_one(ch, stream)`` reads one and returns the text it read past it (searched for the
    next marker). A call that breaks the format before any call is made raises :class:`_Bad`;
    after one, the text to the next marker is dropped and the reading goes on there."""
    while True:
        try:
            tail = yield from read_one(ch, stream)
        except _Bad as e:
            if not stream.n:
                raise
            tail = e.args[0]
        if stream.full:
            return
        yield from _until(marker, tail)
        ch = yield


def _hermes_block(ch: str, stream: "ToolStream"):
    """One ``<tool_call>`` block's call object at ``ch``; reads nothing past its closing brace."""
    ch = yield from _ws(ch, _drop)
    yield from _call_object(ch, stream, ("arguments",))
    return ""


def _hermes(stream: "ToolStream"):
    """After the first ``<tool_call>``: a call object per block; text outside blocks dropped."""
    return (yield from _marked_calls((yield), stream, HERMES_START, _hermes_block))


def _llama3_json(stream: "ToolStream"):
    """After an opening ``<|python_tag|>`` if any: call objects separated by ``;``."""
    ch = yield
    while True:
        ch = yield from _ws(ch, _drop)
        yield from _call_object(ch, stream, ("arguments", "parameters"))
        if stream.full:
            return
        ch = yield from _ws((yield), _drop)
        if ch != ";":
            raise _Bad(ch)
        ch = yield


def _array(ch: str, stream: "ToolStream", keys: tuple[str, ...]):
    """A JSON array of call objects at ``ch`` (``[``); nothing after its ``]``."""
    if ch != "[":
        raise _Bad(ch)
    ch = yield from _ws((yield), _drop)
    while True:
        yield from _call_object(ch, stream, keys)
        if stream.full:
            return
        ch = yield from _ws((yield), _drop)
        if ch == "]":
            return
        if ch != ",":
            raise _Bad(ch)
        ch = yield from _ws((yield), _drop)


def _required(stream: "ToolStream"):
    ch = yield from _ws((yield), _drop)
    yield from _array(ch, stream, ("parameters",))


def _mistral_v11(ch: str, stream: "ToolStream"):
    """One call of tokenizer v11+ at ``ch``: ``name[ARGS]{...}``, ``name[CALL_ID]id[ARGS]{...}``
    or, with the special tokens decoded away, ``name{...}``; returns the character after it."""
    head = ""
    while ch != "{":
        head += ch
        if head.endswith(MISTRAL_ARGS):
            head = head[:-len(MISTRAL_ARGS)]
            ch = yield from _ws((yield), _drop)
            break
        if len(head) > 256:
            raise _Bad(ch)
        ch = yield
    call = _Call(stream)
    call.name = head.split(MISTRAL_CALL_ID, 1)[0].strip()
    if not _FUNCTION_NAME.fullmatch(call.name):
        raise _Bad(ch)
    return (yield from call.arguments(ch))


def _mistral(stream: "ToolStream"):
    """After the first ``[TOOL_CALLS]``: a JSON array of call objects (or one object), or
    tokenizer v11+'s calls, each after its own ``[TOOL_CALLS]`` (text between them dropped)."""
    ch = yield from _ws((yield), _drop)
    if ch == "[":
        return (yield from _array(ch, stream, ("arguments",)))
    if ch == "{":
        return (yield from _call_object(ch, stream, ("arguments",)))
    return (yield from _marked_calls(ch, stream, MISTRAL_START, _mistral_v11))


_READERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}
_MARKERS = {"hermes": HERMES_START, "mistral": MISTRAL_START}


def _reader(stream: "ToolStream", body):
    """``body`` run until the text ends: a malformed call before any call was committed makes the
    whole text content (``stream.plain``); after one, the rest of the text is dropped."""
    try:
        yield from body
    except _Bad:
        if not stream.n:
            stream.plain = True
    except _Stop:
        pass


def _named(stream: "ToolStream", function: str):
    """A named forced function: the call is made at once, the whole text is its arguments."""
    stream.begin(function, "")
    while True:
        stream.piece((yield))


class ToolStream:
    """One choice's text read for tool calls as it is generated: :meth:`feed` each text delta
    and send the :class:`Emit` it returns; at the choice's end :meth:`finish` gives the rest.
    ``parser`` (one of :data:`PARSERS`; KeyError otherwise), or ``forced``: ``function`` the
    named function (its text is the arguments) or None (``"required"``: a JSON array of
    ``{"name", "parameters"}``). ``parallel`` False: the first call only (the text after it is
    dropped). ``ids`` makes each call's id (default :func:`default_ids` / :func:`new_call_id`).
    The rules (the module's docstring) depend on the text alone, read one character at a time,
    so the Emits of any split of a text, accumulated (:func:`accumulate`), are the same;
    :func:`parse` is that accumulation for the whole text. ``called``: whether a call was made
    (committed) so far."""

    def __init__(self, parser: str | None = None, ids: Callable[[], str] | None = None, parallel: bool = True,
                 *, forced: bool = False, function: str | None = None):
        if not forced and parser not in _READERS:
            raise KeyError(parser)
        self.parser = None if forced else parser
        self.ids = ids or (new_call_id if forced else default_ids(parser))
        self.limit = None if parallel else 1
        self.text = ""
        self.sent = 0  # characters of text handed out as content
        self.held_from: int | None = None  # calls begin here: the text from here is read by the reader
        self.reader = None
        self.plain = False  # no call can come: the whole text is content
        self.n = 0  # calls committed
        self._out: list = []  # CallDeltas (a call's first item) and arguments pieces not yet handed out
        self._cur = -1  # the call the first pending piece belongs to
        if forced:
            self._start(0, _named(self, function) if function is not None else _required(self))

    @property
    def called(self) -> bool:
        return self.n > 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.n >= self.limit

    def begin(self, name: str, arguments: str) -> None:
        """Commits the next call: its first item (id, name, ``arguments`` read so far)."""
        self._out.append(CallDelta(self.n, arguments, self.ids(), name))
        self.n += 1

    def piece(self, s: str) -> None:
        """A piece of the last committed call's arguments."""
        self._out.append(s)

    def _start(self, at: int, body) -> None:
        self.held_from = at
        self.reader = _reader(self, body)
        next(self.reader)

    def _read(self, s: str) -> None:
        if self.reader is None:
            return
        send = self.reader.send
        try:
            for ch in s:
                send(ch)
        except StopIteration:
            self.reader = None  # no more calls: the rest is dropped (or content, plain)

    def _calls(self) -> tuple[CallDelta, ...]:
        items: list[list] = []
        for o in self._out:
            if isinstance(o, CallDelta):
                items.append([o.index, o.id, o.name, [o.arguments]])
            elif items:
                items[-1][3].append(o)
            else:
                items.append([self._cur, None, None, [o]])
        self._out, self._cur = [], self.n - 1
        return tuple(CallDelta(i, "".join(a), id_, name) for i, id_, name, a in items if id_ is not None or any(a))

    def _content(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def feed(self, delta: str) -> Emit:
        """What to send for ``delta``: its content ("" while held back) and call items."""
        start = len(self.text)
        self.text += delta
        t, content = self.text, ""
        if self.held_from is not None:
            self._read(delta)
        elif self.parser == "llama3_json":
            if t.startswith("{") or t.startswith(PYTHON_TAG):
                at = len(PYTHON_TAG) if t.startswith(PYTHON_TAG) else 0
                self._start(0, _llama3_json(self))
                self._read(t[at:])
            elif not PYTHON_TAG.startswith(t):  # "" or a beginning of <|python_tag|> may still be a call
                self.plain = True
        else:
            marker = _MARKERS[self.parser]
            at = t.find(marker, max(0, min(self.sent, start) - len(marker)))
            if at >= 0:
                content = self._content(at)
                self._start(at, _READERS[self.parser](self))
                self._read(t[at + len(marker):])
            else:
                content = self._content(len(t) - _held(t, marker))
        if self.plain:
            content += self._content(len(t))
        return Emit(content, self._calls())

    def finish(self) -> Emit:
        """At the choice's end: the text held back as content when no call was made, and the
        call items not yet handed out."""
        if self.reader is not None:
            try:
                self.reader.throw(_Stop)
            except StopIteration:
                pass
            self.reader = None
        calls = self._calls()
        return Emit(self._content(len(self.text)) if not self.n else "", calls)


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker`` (its longest proper prefix
    ending ``text``)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def ForcedStream(function: str | None, ids: Callable[[], str] | None = None, parallel: bool = True) -> ToolStream:
    """The :class:`ToolStream` of a forced ``tool_choice``: ``function`` named, or None (``"required"``)."""
    return ToolStream(None, ids, parallel, forced=True, function=function)


def _whole(stream: ToolStream, text: str) -> Parsed:
    content, calls = accumulate([stream.feed(text), stream.finish()])
    return Parsed(content or None, calls) if calls else Parsed(content)


def parse(parser: str, text: str, ids: Callable[[], str] | None = None, parallel: bool = True) -> Parsed:
    """The tool calls in ``text``, a choice's whole generated text, by ``parser`` (one of
    :data:`PARSERS`): what :class:`ToolStream` hands out for it, accumulated, so a stream and the
    non-streamed response cannot differ. Raises KeyError for an unknown parser; a text without
    calls is ``Parsed(text)``."""
    return _whole(ToolStream(parser, ids, parallel), text)


def parse_forced(function: str | None, text: str, ids: Callable[[], str] | None = None,
                 parallel: bool = True) -> Parsed:
    """The calls of a choice generated under a forced ``tool_choice`` (its output constrained to
    :func:`pdd.gateway.openai_schemas.tool_schema`), as :func:`parse`: ``function`` named (the
    ``{"type": "function", "function": {"name": F}}`` form): one call of F whose ``arguments``
    are ``text`` itself, whatever it is; None (``"required"``): ``text`` is a JSON array of
    ``{"name", "parameters"}`` objects, one call each (read as the parsers read theirs: a text
    cut before its first call is committed has no calls and is all content)."""
    return _whole(ForcedStream(function, ids, parallel), text)


@dataclass(frozen=True)
class CallMode:
    """How a chat request's choices are read for tool calls: by ``parser`` (tools given,
    ``tool_choice`` auto), or ``forced`` (``"required"``, or the named ``function``); with
    ``parallel`` False only the first call is made (one mechanism, :class:`ToolStream`'s, for
    the stream and the whole text alike). ``finish_reason``: "tool_calls" for a choice that made
    calls and ended by "stop", else its own ("length", "abort"); a named function's choice keeps
    its own."""

    parser: str | None = None
    forced: bool = False
    function: str | None = None
    parallel: bool = True

    def stream(self, ids: Callable[[], str] | None = None) -> ToolStream:
        """The :class:`ToolStream` of one streamed choice."""
        if self.forced:
            return ForcedStream(self.function, ids, self.parallel)
        return ToolStream(self.parser, ids, self.parallel)

    def parse(self, text: str, ids: Callable[[], str] | None = None) -> Parsed:
        """A whole choice's calls: :meth:`stream`'s, accumulated."""
        return _whole(self.stream(ids), text)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The finish_reason of a choice that made calls and ended with ``finish_reason``."""
        if self.function is None and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def family_default(model_type: str | None, tokens: set[str] | frozenset[str]) -> str | None:
    """The parser a checkpoint's family writes its calls for, or None: ``hermes`` for Qwen2 /
    Qwen3 (``model_type`` qwen2, qwen3, qwen2_moe, qwen3_moe) whose vocabulary has
    ``<tool_call>``; ``llama3_json`` for Llama (llama) whose vocabulary has ``<|python_tag|>``
    (Llama 3.1+); ``mistral`` for Mistral (mistral, mixtral) whose vocabulary has
    ``[TOOL_CALLS]`` (v0.3+; Mistral-7B v0.1 has none and calls no tools). ``tokens``: the
    tokenizer's added / special tokens."""
    mt = (model_type or "").lower()
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and HERMES_START in tokens:
        return "hermes"
    if mt == "llama" and PYTHON_TAG in tokens:
        return "llama3_json"
    if mt in ("mistral", "mixtral") and MISTRAL_START in tokens:
        return "mistral"
    return None
