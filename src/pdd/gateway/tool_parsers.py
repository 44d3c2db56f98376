"""Tool calls parsed out of a chat choice's generated text, as vLLM's and SGLang's
``--tool-call-parser`` do: pure text in, ``(content, tool calls)`` out, no I/O.

Parsers (:data:`PARSERS`), by the format the model writes (sources: vLLM's
``entrypoints/openai/tool_parsers/{hermes,llama,mistral}_tool_parser.py``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the last one's closing tag optional; ``content`` is the text before the first
  ``<tool_call>`` (None when empty), the text between and after the blocks is dropped.
- ``llama3_json`` (Llama 3.1+): the text is, after an optional ``<|python_tag|>``, one or more JSON
  objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) separated by ``;``
  (whitespace allowed around them and at the end); ``content`` is None. Text that does not start
  with ``{`` (or ``<|python_tag|>``) is no call, as vLLM's streaming parser decides.
- ``mistral`` (Mistral v0.3 and later instruct models): ``[TOOL_CALLS]`` then a JSON array of
  ``{"name": ..., "arguments": {...}}`` (tokenizers before v11), or, from tokenizer v11 on
  (Mistral Small 3.1+, Devstral, Magistral), one ``[TOOL_CALLS]name[ARGS]{...}`` per call
  (v13 puts ``[CALL_ID]id`` before ``[ARGS]``; decoded without special tokens, ``name{...}``);
  a name is 1 to 64 letters, digits, ``_`` or ``-`` (OpenAI's rule); ``content`` is the text
  before the first ``[TOOL_CALLS]``.

A text whose call cannot be parsed (malformed JSON, ``NaN`` / ``Infinity`` included, a number
beyond a float's range such as ``1e400``, which ``json.dumps`` would write ``Infinity``, a call
without a string ``name``, arguments that are not an object, a ``\ud800``-style escape of a lone
surrogate, which no response could encode) has no calls: it is all content, unchanged, as vLLM returns it.
``arguments`` is the call's arguments as a JSON string (``json.dumps(..., ensure_ascii=False)``);
an absent one is ``"{}"``.

Ids: ``call_`` + 24 lowercase hex digits (OpenAI's ``call_...`` shape; the openai client takes
any string); ``mistral``: 9 letters and digits, which Mistral's chat templates require of the
ids sent back to them (vLLM's ``MistralToolCall``).

Streaming (:class:`ToolStream`, :class:`ForcedStream`): each text delta gives an :class:`Emit`,
content and ``delta.tool_calls`` items (:class:`CallDelta`: a call's first one carries its id and
name, each one a piece of its arguments text). Under a parser, content is passed on as it comes,
except text that may be the beginning of a call marker, which is held back; from the marker on,
the rest of the choice is held and parsed at its end (any later call may be malformed, which
makes the whole text content, so no call is certain before the end). A named forced function's
text is its arguments: each delta is an arguments piece as it comes. What a stream hands out,
whatever the chunks, accumulated as the openai client does (:func:`accumulate`), is exactly what
:func:`parse` / :func:`parse_forced` return for the whole text.
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


class _NoCall(ValueError):
    """The text's call cannot be parsed: it is all content."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# strict JSON: Python's NaN / Infinity / -Infinity extensions are no JSON (JavaScript's JSON.parse
# refuses them in the arguments a client reads)
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _call(obj, ids: Callable[[], str], args_key: tuple[str, ...] = ("arguments",)) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _NoCall("a call needs a non-empty string name")
    keys = [k for k in args_key if k in obj]
    if len(keys) > 1:
        raise _NoCall("both parameters and arguments")
    args = obj[keys[0]] if keys else {}
    if args is None:
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = _DECODER.decode(args)
        except ValueError:
            raise _NoCall("arguments string is not JSON") from None
    if not isinstance(args, dict):
        raise _NoCall("arguments must be an object")
    try:  # a number beyond a float's range (1e400) loads as inf, which json.dumps would write Infinity
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise _NoCall("a number out of range") from None
    if lone_surrogate(obj["name"]) is not None or lone_surrogate(arguments) is not None:
        # a "\ud800" escape decodes to text no response can encode as UTF-8
        raise _NoCall("a lone surrogate in the call")
    return ToolCall(ids(), obj["name"], arguments)


def _loads(s: str):
    try:
        return _DECODER.decode(s)
    except ValueError:
        raise _NoCall("malformed JSON") from None


def _hermes(text: str, ids) -> Parsed:
    start = text.find(HERMES_START)
    if start < 0:
        return Parsed(text)
    calls, pos = [], start
    while pos >= 0:
        body_at = pos + len(HERMES_START)
        end = text.find(HERMES_END, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        calls.append(_call(_loads(body), ids))
        if end < 0:
            break
        pos = text.find(HERMES_START, end + len(HERMES_END))
    return Parsed(text[:start] or None, tuple(calls))


def _llama3_json(text: str, ids) -> Parsed:
    if not (text.startswith("{") or text.startswith(PYTHON_TAG)):
        return Parsed(text)
    dec = _DECODER
    pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    calls = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except ValueError:
            raise _NoCall("malformed JSON") from None
        calls.append(_call(obj, ids, ("arguments", "parameters")))
        rest = text[pos:].lstrip()
        if not rest:
            return Parsed(None, tuple(calls))
        if not rest.startswith(";"):
            raise _NoCall("text after a call")
        pos = len(text) - len(rest) + 1


def _mistral_v11(seg: str, ids) -> ToolCall:
    """One call of tokenizer v11+: ``name[ARGS]{...}``, ``name[CALL_ID]id[ARGS]{...}`` or, with
    the special tokens decoded away, ``name{...}``."""
    if MISTRAL_ARGS in seg:
        head, args = seg.split(MISTRAL_ARGS, 1)
    else:
        brace = seg.find("{")
        if brace < 0:
            raise _NoCall("a call needs [ARGS] or its arguments")
        head, args = seg[:brace], seg[brace:]
    name = head.split(MISTRAL_CALL_ID, 1)[0].strip()
    if not _FUNCTION_NAME.fullmatch(name):
        raise _NoCall("not a function name")
    return _call({"name": name, "arguments": _loads(args.strip())}, ids)


def _mistral(text: str, ids) -> Parsed:
    start = text.find(MISTRAL_START)
    if start < 0:
        return Parsed(text)
    body = text[start + len(MISTRAL_START):]
    if body.lstrip()[:1] not in ("[", "{"):  # tokenizer v11+: a marker before each call
        return Parsed(text[:start] or None, tuple(_mistral_v11(seg, ids) for seg in body.split(MISTRAL_START)))
    arr = _loads(body)
    if isinstance(arr, dict):
        arr = [arr]
    if not isinstance(arr, list) or not arr:
        raise _NoCall("[TOOL_CALLS] needs a list of calls")
    return Parsed(text[:start] or None, tuple(_call(o, ids) for o in arr))


_PARSE = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def parse(parser: str, text: str, ids: Callable[[], str] | None = None) -> Parsed:
    """The tool calls in ``text``, a choice's whole generated text, by ``parser`` (one of
    :data:`PARSERS`). ``ids``: makes each call's id (default :func:`default_ids`). Raises
    KeyError for an unknown parser; a text whose calls do not parse is ``Parsed(text)``."""
    fn = _PARSE[parser]
    try:
        return fn(text, ids or default_ids(parser))
    except (_NoCall, RecursionError):
        return Parsed(text)


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker`` (its longest proper prefix
    ending ``text``)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolStream:
    """One streamed choice's text through ``parser``: :meth:`feed` each text delta, send the
    :class:`Emit` it returns; at the choice's end :meth:`finish` gives the rest. Together,
    accumulated (:func:`accumulate`), they give exactly ``parse(parser, whole_text)``: the
    content ("" for None) and its calls, which all come at the end (each in one item: id, name
    and the whole arguments). ``called``: whether the choice made calls (known at its end)."""

    def __init__(self, parser: str, ids: Callable[[], str] | None = None):
        if parser not in _PARSE:
            raise KeyError(parser)
        self.parser, self.ids = parser, ids
        self.text = ""
        self.sent = 0  # characters of text handed out as content
        self.held_from: int | None = None  # a call may start here: the rest is held to the end
        self.plain = False  # llama3_json: the text cannot be a call, all of it is content
        self.called = False

    def feed(self, delta: str) -> Emit:
        """What to send for ``delta`` (its content, "" when it is held back)."""
        self.text += delta
        if self.held_from is not None:
            return Emit()
        t = self.text
        if self.parser == "llama3_json":
            if not self.plain:
                if t.startswith("{") or t.startswith(PYTHON_TAG):
                    self.held_from = 0
                    return Emit()
                if PYTHON_TAG.startswith(t):
                    return Emit()  # "" or a beginning of <|python_tag|>
                self.plain = True
            upto = len(t)
        else:
            marker = HERMES_START if self.parser == "hermes" else MISTRAL_START
            at = t.find(marker, max(0, self.sent - len(marker)))
            if at >= 0:
                self.held_from = at
                upto = at
            else:
                upto = len(t) - _held(t, marker)
        out, self.sent = t[self.sent:upto], max(self.sent, upto)
        return Emit(out)

    def finish(self) -> Emit:
        """At the choice's end: the content not yet sent, or the calls."""
        p = parse(self.parser, self.text, self.ids)
        if p.calls:
            self.called = True  # the content before the marker was sent already
            return Emit("", tuple(CallDelta(i, c.arguments, c.id, c.name) for i, c in enumerate(p.calls)))
        return Emit(self.text[self.sent:])


def parse_forced(function: str | None, text: str, ids: Callable[[], str] | None = None) -> Parsed:
    """The calls of a choice generated under a forced ``tool_choice`` (its output constrained to
    :func:`pdd.gateway.openai_schemas.tool_schema`), as vLLM reads them: ``function`` named (the
    ``{"type": "function", "function": {"name": F}}`` form): one call of F whose ``arguments``
    are ``text`` itself; None (``"required"``): ``text`` is a JSON array of ``{"name",
    "parameters"}`` objects, one call each (``arguments`` the parameters as JSON text). Content
    is None when there are calls. A ``required`` text that is no such array (cut by
    ``max_tokens``) has no calls and is all content (vLLM answers no calls and no content)."""
    ids = ids or new_call_id
    if function is not None:
        return Parsed(None, (ToolCall(ids(), function, text),))
    try:
        arr = _loads(text)
        if not isinstance(arr, list) or not arr:
            raise _NoCall("not a list of calls")
        return Parsed(None, tuple(_call(o, ids, ("parameters",)) for o in arr))
    except (_NoCall, RecursionError):
        return Parsed(text)


class ForcedStream:
    """:class:`ToolStream`'s interface for a forced ``tool_choice``: nothing is content while
    the choice generates (its text is the call). A named ``function``: the text is the call's
    arguments (:func:`parse_forced`), so its first delta sends the call's first item (id, name,
    the delta as the first arguments piece) and each later one an arguments piece; the call is
    made whatever the text (:meth:`finish` sends the first item, arguments "", if no delta came).
    ``"required"`` (``function`` None): the calls come at :meth:`finish`, one item each, or
    the whole text as content when it has none (an array cut by ``max_tokens``)."""

    def __init__(self, function: str | None, ids: Callable[[], str] | None = None):
        self.function, self.ids = function, ids
        self.text = ""
        self.called = False

    def _piece(self, delta: str) -> Emit:
        if not self.called:
            self.called = True
            return Emit("", (CallDelta(0, delta, (self.ids or new_call_id)(), self.function),))
        return Emit("", (CallDelta(0, delta),) if delta else ())

    def feed(self, delta: str) -> Emit:
        self.text += delta
        return self._piece(delta) if self.function is not None else Emit()

    def finish(self) -> Emit:
        if self.function is not None:
            return Emit() if self.called else self._piece("")
        p = parse_forced(None, self.text, self.ids)
        if not p.calls:
            return Emit(self.text)
        self.called = True
        return Emit("", tuple(CallDelta(i, c.arguments, c.id, c.name) for i, c in enumerate(p.calls)))


class _FirstCall:
    """A stream that hands out only call 0's items (``parallel_tool_calls`` false)."""

    def __init__(self, stream):
        self.stream = stream

    @property
    def called(self) -> bool:
        return self.stream.called

    @staticmethod
    def _first(e: Emit) -> Emit:
        return Emit(e.content, tuple(c for c in e.calls if c.index == 0))

    def feed(self, delta: str) -> Emit:
        return self._first(self.stream.feed(delta))

    def finish(self) -> Emit:
        return self._first(self.stream.finish())


@dataclass(frozen=True)
class CallMode:
    """How a chat request's choices are read for tool calls: by ``parser`` (tools given,
    ``tool_choice`` auto), or ``forced`` (``"required"``, or the named ``function``); with
    ``parallel`` False only the first call is kept. ``finish_reason`` as vLLM's serving_chat
    gives it: "tool_calls" for parsed calls under auto, and under required when the choice
    ended by "stop"; a named function's choice keeps its own ("stop", "length")."""

    parser: str | None = None
    forced: bool = False
    function: str | None = None
    parallel: bool = True

    def parse(self, text: str, ids: Callable[[], str] | None = None) -> Parsed:
        p = parse_forced(self.function, text, ids) if self.forced else parse(self.parser, text, ids)
        return Parsed(p.content, p.calls[:1]) if p.calls and not self.parallel else p

    def stream(self, ids: Callable[[], str] | None = None):
        """A :class:`ForcedStream` or :class:`ToolStream` for one streamed choice (``parallel``
        False: handing out only the first call)."""
        s = ForcedStream(self.function, ids) if self.forced else ToolStream(self.parser, ids)
        return s if self.parallel else _FirstCall(s)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The finish_reason of a choice that made calls and ended with ``finish_reason``."""
        if not self.forced:
            return "tool_calls"
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
