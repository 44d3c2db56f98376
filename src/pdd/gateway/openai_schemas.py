"""OpenAI (and vLLM-extension) request bodies, their ranges, and what they become.

Ranges are checked by pydantic (``Field`` bounds, so the 400 names the parameter) and by
:func:`sampling_for`; every bad parameter gets HTTP 400 ``{"error": {"message", "type":
"invalid_request_error", "param", "code"}}`` before any tier does work.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      field_validator, model_validator)

from pdd.text import lone_surrogate, shown, surrogate_at
from pdd.types import SamplingParams

MAX_N = 16  # choices per request
# chat message roles (OpenAI's API: system, developer, user, assistant, tool; function: its older tool role)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default max_logprobs)
# Bounds on list-valued parameters, so one request cannot make the gateway (stop strings are
# matched on the event loop for every token) or the tiers (the sampling parameters travel in every
# message header, ``pdd.transfer.wire.MAX_HEADER_BYTES``) do unbounded work. vLLM bounds none of them.
MAX_STOP = 64  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids entries per request
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request (OpenAI: typically up to 300 tokens)
MAX_ALLOWED_TOKEN_IDS = 1024  # allowed_token_ids entries per request (as MAX_LOGIT_BIAS)
MAX_BAD_WORDS = 64  # bad_words per request
MAX_BAD_WORD_CHARS = 1024  # characters per bad word
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions batch (each is admitted as a request of n choices)

_MASK64 = (1 << 64) - 1


def media_type(content_type: str | None) -> str:
    """A ``Content-Type`` header's media type, lower case, without its parameters
    (``"Application/JSON; charset=utf-8"`` -> ``"application/json"``); "" for none."""
    return (content_type or "").split(";")[0].strip().lower()


def not_utf8(body: bytes) -> str | None:
    """Why ``body`` is not JSON text in UTF-8 (RFC 8259 section 8.1: JSON exchanged between
    systems MUST be UTF-8), else None: the first byte that is not UTF-8 and its offset (a UTF-16
    or UTF-32 byte-order mark is one: ``\\xff`` / ``\\xfe``), or the NUL byte that makes
    ``json.loads`` read the bytes as UTF-16 or UTF-32 (its encoding detection: ASCII text in
    UTF-16 without a byte-order mark is valid UTF-8, but no JSON text as UTF-8). A UTF-8
    byte-order mark is ignored (the RFC allows it; ``json.loads`` skips it)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        why = f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
    else:
        enc = json.detect_encoding(body)
        if enc in ("utf-8", "utf-8-sig"):
            return None
        why = f"byte 0x00 at offset {body.index(0)}: it reads as {enc.upper()}"
    return f"request body is not valid JSON: it is not UTF-8 text ({why}); send JSON encoded as UTF-8"


MAX_JSON_DEPTH = 512  # arrays and objects nested in a request body (no OpenAI body needs 20)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``body`` (JSON text, UTF-8) is refused for nesting arrays and objects more than
    ``limit`` levels deep, else None. Python's parser fails past about 1000 levels with a
    RecursionError, which FastAPI reported as "There was an error parsing the body"; this check
    comes first and names the limit. Cost: two ``bytes.count`` passes for a body with at most
    ``limit`` brackets (every OpenAI body); else a regex pass to drop strings (their brackets are
    text) and a numpy running sum over the brackets left, in 1 MiB chunks: O(body) at C speed
    and bounded memory. Exact for valid JSON; for other text a best effort (it fails to parse
    anyway). Raises nothing."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    import numpy as np

    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth, chunk = 0, 1 << 20
    for i in range(0, len(brackets), chunk):
        c = np.frombuffer(brackets[i:i + chunk], dtype=np.uint8)
        run = np.cumsum(np.where((c == ord("[")) | (c == ord("{")), 1, -1)) + depth
        if int(run.max()) > limit:
            return (f"request body is nested too deeply: JSON arrays and objects may nest at most {limit} levels "
                    "deep")
        depth = int(run[-1])
    return None


_JSON_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def too_many_digits(body: bytes, limit: int | None = None) -> str | None:
    """Why ``body`` (JSON text) cannot be parsed for an integer with more than ``limit`` digits
    (default: Python's ``sys.get_int_max_str_digits()``, 4300; 0 is no limit), else None. The
    parser's ``int()`` refuses one (a ValueError, which FastAPI reported as "There was an error
    parsing the body"; pydantic's as "number out of range"); a number with a fraction or an
    exponent is a float and has no such limit. Meant for a body that failed to parse: O(body),
    a regex pass to drop strings (their digits are text) and one over the numbers left.
    Raises nothing."""
    import sys

    limit = sys.get_int_max_str_digits() if limit is None else limit
    if not limit or len(body) <= limit:
        return None
    most = 0
    for m in _JSON_NUMBER.finditer(_JSON_STRING.sub(b'""', body)):
        if m.group(1) is None and m.group(2) is None:
            most = max(most, m.end() - m.start() - (m.group().startswith(b"-")))
    if most <= limit:
        return None
    return (f"request body has a number with too many digits ({most}): a JSON integer may have at most {limit} "
            "digits")


def not_strict_json(text: str) -> str | None:
    """The first number of JSON text ``text`` that strict JSON (RFC 8259) has no value for, as
    written: ``NaN``, ``Infinity`` or ``-Infinity`` (Python's ``json.loads`` accepts them, no
    JSON parser elsewhere does) or a literal too large for a float (``1e999``, which
    ``json.loads`` reads as infinity); None when there is none, and for text that is no JSON
    at all (``json.loads`` says why). Parses ``text`` once; raises nothing."""
    import math

    found: list[str] = []

    def constant(tok: str):
        found.append(tok)

    def number(tok: str) -> float:
        v = float(tok)
        if not math.isfinite(v):
            found.append(tok)
        return v

    try:
        json.loads(text, parse_constant=constant, parse_float=number)
    except (ValueError, RecursionError):
        return None
    return found[0] if found else None


class ApiError(Exception):
    """An OpenAI-style error: ``status`` (400 unless said), ``param``, ``code``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 etype: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.etype = message, param, status, code, etype

    def body(self) -> dict:
        return error_body(self.message, self.param, self.code, self.etype)


def error_body(message: str, param: str | None = None, code: str | None = None,
               etype: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


# how pydantic names a union's branch in an error's loc: a type (``str``, ``dict[any,any]``,
# ``list[int]``, ``constrained-str``, ``function-after[f(), str]``) or a model's class name; no
# request field is spelt so (OpenAI's names are lower-case words joined by underscores), and a
# dict's keys (``logit_bias``'s) are told apart from a union's branches by first_error: among
# a union's, some branch is a type
_BRANCH = re.compile(r"(str|int|float|bool|bytes|none|constrained-[a-z]+|[a-z][a-z-]*\[.*\]|[A-Z][A-Za-z0-9_]*)",
                     re.S)
_KIND_WORDS = (("list", "an array"), ("tuple", "an array"), ("set", "an array"), ("dict", "an object"),
               ("str", "a string"), ("int", "an integer"), ("float", "a number"), ("bool", "a boolean"),
               ("none", "null"))


def _kind_of(tag: str) -> str | None:
    """The JSON kind a union branch ``tag`` takes ("a string", "an object", ...), None if unknown.
    ``function-after[f(), str]`` (a validator over a type) takes its type's."""
    inner = re.fullmatch(r"function-(?:after|before|wrap|plain)\[.*, (.+)\]", tag, re.S)
    if inner:
        return _kind_of(inner.group(1))
    if tag[:1].isupper():
        return "an object"  # a model
    head = tag.removeprefix("constrained-").split("[", 1)[0]
    return next((w for k, w in _KIND_WORDS if head == k), None)


def first_error(errs: list[dict]) -> dict:
    """The error a 400 reports out of pydantic's ``errs`` (``ValidationError.errors()``), its
    ``loc`` holding no union branch's name (``tool_choice.str`` was what a client read). Where
    the first error is one branch of a union field's: the branch that took the value's type and
    refused something inside it (a deeper ``loc``, or not a type error), its branch name dropped
    from ``loc``; else, every branch refusing the type, one error at the field, ``msg`` "must
    be a string or an object, got 5" (type ``union_type``). Any other first error as it is;
    ``{}`` for none. Raises nothing."""
    if not errs:
        return {}
    first = errs[0]
    loc = tuple(first.get("loc", ()))
    for k, tag in enumerate(loc):
        if not isinstance(tag, str) or not _BRANCH.fullmatch(tag):
            continue
        branches = [e for e in errs if tuple(e.get("loc", ()))[:k] == loc[:k] and len(e.get("loc", ())) > k
                    and isinstance(e["loc"][k], str) and _BRANCH.fullmatch(e["loc"][k])]
        tags = {e["loc"][k] for e in branches}
        if len(tags) < 2 or all(t[:1].isupper() for t in tags):
            continue  # one error there (a field's own name), or a dict's keys: not a union's branches
        inside = [e for e in branches if len(e["loc"]) > k + 1
                  or not str(e.get("type", "")).endswith(("_type", "_parsing"))]
        if inside:
            e = inside[0]
            return first_error([{**e, "loc": (*loc[:k], *e["loc"][k + 1:])}])  # a union inside it too
        kinds = list(dict.fromkeys(_kind_of(e["loc"][k]) for e in branches))
        if None in kinds:  # a branch of a kind not known here: the first branch's message, unnamed
            return {**first, "loc": loc[:k]}
        return {"loc": loc[:k], "type": "union_type", "input": first.get("input"),
                "msg": f"must be {' or '.join(kinds)}, got {shown(first.get('input'))}"}
    return first


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's extension: usage so far on every chunk too


class _Sampling(BaseModel):
    """Parameters shared by completions and chat (OpenAI names, then vLLM's extensions).
    Floats must be finite: NaN or infinity is a 400 "Input should be a finite number"."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    prompt_logprobs: int | None = None  # vLLM's extra parameter: refused (_check_prompt_logprobs), not ignored
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # None: the checkpoint's generation_config.json value, else 1.0 (sampling_for, openai_defaults)
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    logit_bias: dict[str, StrictFloat] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]; at most 1,024 entries "
                          "(MAX_LOGIT_BIAS; OpenAI: typically up to 300)")
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)  # int64, as vLLM
    stop: str | list[str] | None = Field(
        None, description="stop string(s): at most 64 strings (MAX_STOP; OpenAI allows 4, vLLM sets no bound), "
                          "each at most 1,024 characters (MAX_STOP_CHARS)")
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=(1 << 63) - 1)  # -1 or 0: off; int64 (>= vocab: no limit)
    min_p: float | None = Field(None, ge=0.0, le=1.0, strict=True)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, strict=True)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = Field(
        None, description="token ids that end a choice: at most 1,024 ids (MAX_STOP_TOKEN_IDS)")
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    add_special_tokens: StrictBool = False  # chat: the template writes the special tokens (vLLM's default)
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep only the prompt's last k tokens (vLLM: left truncation); -1: the "
                                 "maximum input length; 0 is refused (nothing would be left)")
    allowed_token_ids: list[StrictInt] | None = Field(
        None, description="only these token ids can be sampled: 1 to 1,024 ids (MAX_ALLOWED_TOKEN_IDS), each "
                          "in the vocabulary")
    bad_words: list[StrictStr] | None = Field(
        None, description="words never generated (each tokenised with and without a leading space, as vLLM): "
                          "at most 64 words (MAX_BAD_WORDS), each 1 to 1,024 characters (MAX_BAD_WORD_CHARS)")
    return_token_ids: StrictBool = False  # vLLM: prompt_token_ids and each choice's token_ids in the response
    # structured outputs (structured_constraint): vLLM's structured_outputs and its older guided_*
    # extras; at most one constraint a request (response_format's included)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None  # vLLM 0.11's structured_outputs.whitespace_pattern
    # vLLM's parameters pdd cannot honour: refused with a value that asks for something
    # (check_unhonoured, UNHONOURED), accepted with their defaults (what clients may send)
    guided_decoding_backend: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_tokens_as_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    cache_salt: Any = None
    modalities: Any = None  # OpenAI's: ["text"] is all pdd outputs
    audio: Any = None
    # SGLang's structured outputs (structured_constraint): a regex, an EBNF grammar, a JSON schema's text
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    # SGLang's parameters pdd cannot honour (check_unhonoured, UNHONOURED)
    stop_regex: Any = None
    custom_logit_processor: Any = None
    lora_path: Any = None
    return_hidden_states: Any = None
    # SGLang's name for include_stop_str_in_output (either keeps the stop string or token's text)
    no_stop_trim: StrictBool = False

    @field_validator("*", mode="before")
    @classmethod
    def _json_number(cls, v, info):
        """A JSON ``true``/``false`` or a string given for a number parameter (``max_tokens``,
        ``n``, ``seed``, ``top_k``, ``logprobs`` of completions, ``temperature``, ``top_p``, the
        penalties, ...) is refused (ValueError, HTTP 400 naming the field), as OpenAI's API does;
        pydantic's lax mode would read ``true`` as 1 (``"temperature": true`` sampled at 1.0) and
        ``"5"`` as 5. The float fields and the booleans are strict in pydantic itself
        (``strict=True``, ``StrictBool``: ``"stream": "yes"`` or ``1`` is refused; an integer is
        still a number); the integer fields stay lax for a JSON number without a fraction
        (``"max_tokens": 5.0`` is 5, as before and as vLLM; 2.5 is refused), so their strings are
        refused here."""
        if isinstance(v, bool) and info.field_name in _int_not_bool(cls):
            raise ValueError(f"must be an integer, got {str(v).lower()}")
        if isinstance(v, bool) and info.field_name in _float_not_bool(cls):
            raise ValueError(f"must be a number, got {str(v).lower()}")
        if isinstance(v, str) and info.field_name in _int_not_bool(cls):
            raise ValueError(f"must be an integer, got a string {shown(v)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """An explicit JSON ``null`` for a field that has a non-null default (``n``, ``stream``,
        chat ``logprobs``, ``echo``, ``ignore_eos``, ...) means that default, as in vLLM's request
        models and OpenAI's API: the official client sends ``null`` for a parameter passed as
        ``None``. Fields where ``null`` has a meaning of its own (``max_tokens``: no limit) keep it."""
        if isinstance(data, dict):
            drop = [k for k, v in data.items() if v is None and k in _non_nullable(cls)]
            if drop:
                data = {k: v for k, v in data.items() if k not in drop}
        return data

    # Size bounds, checked on the raw JSON value before its items are validated (so an oversized
    # list is refused at the cost of len()); a violation is HTTP 400 with ``param`` naming the field.
    @field_validator("stop", mode="before")
    @classmethod
    def _bound_stop(cls, v):
        """``stop``: one string or a list of at most ``MAX_STOP`` (64) strings, each at most
        ``MAX_STOP_CHARS`` (1,024) characters. OpenAI allows 4 strings; vLLM sets no bound."""
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError(f"must be a string or a list of strings, got {type(v).__name__} {shown(v)}")
        stops = [v] if isinstance(v, str) else _at_most(v, MAX_STOP, "stop strings") if isinstance(v, list) else []
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}]: must be a string, got {type(s).__name__} {shown(s)}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop string {i} has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
            if (bad := lone_surrogate(s)) is not None:
                raise ValueError(f"stop string {i} is not valid Unicode text (a lone surrogate at character {bad})")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _bound_stop_token_ids(cls, v):
        """``stop_token_ids``: at most ``MAX_STOP_TOKEN_IDS`` (1,024) token ids."""
        return _at_most(v, MAX_STOP_TOKEN_IDS, "stop token ids")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bound_logit_bias(cls, v):
        """``logit_bias``: at most ``MAX_LOGIT_BIAS`` (1,024) token ids (OpenAI: typically up to
        300), each bias in [-100, 100] (checked by :func:`sampling_for`)."""
        return _at_most(v, MAX_LOGIT_BIAS, "logit_bias entries")

    @field_validator("allowed_token_ids", mode="before")
    @classmethod
    def _bound_allowed_token_ids(cls, v):
        """``allowed_token_ids``: at least one and at most ``MAX_ALLOWED_TOKEN_IDS`` (1,024) token
        ids (vLLM refuses an empty list too; ids outside the vocabulary: :func:`sampling_for`)."""
        if isinstance(v, list) and not v:
            raise ValueError("must hold at least one token id (an empty list would allow none)")
        return _at_most(v, MAX_ALLOWED_TOKEN_IDS, "allowed token ids")

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bound_bad_words(cls, v):
        """``bad_words``: at most ``MAX_BAD_WORDS`` (64) strings, each 1 to ``MAX_BAD_WORD_CHARS``
        (1,024) characters of valid Unicode text, not only white space (it would tokenise to
        nothing)."""
        words = _at_most(v, MAX_BAD_WORDS, "bad words")
        for i, w in enumerate(words if isinstance(words, list) else []):
            if not isinstance(w, str):
                raise ValueError(f"bad_words[{i}]: must be a string, got {type(w).__name__} {shown(w)}")
            if not w.strip():
                raise ValueError(f"bad_words[{i}]: must not be empty or only white space")
            if len(w) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad word {i} has {len(w)} characters; at most {MAX_BAD_WORD_CHARS} are allowed")
            if (bad := lone_surrogate(w)) is not None:
                raise ValueError(f"bad word {i} is not valid Unicode text (a lone surrogate at character {bad})")
        return v


@functools.lru_cache(maxsize=None)
def _non_nullable(model: type[BaseModel]) -> frozenset[str]:
    """Names of ``model``'s fields whose type does not admit None (their default applies to a null)."""
    out = set()
    for name, f in model.model_fields.items():
        ann = f.annotation
        if ann is not type(None) and type(None) not in typing.get_args(ann) and not f.is_required():
            out.add(name)
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def _fields_admitting(cls, want: type, excluded: frozenset) -> frozenset:
    """Names of ``cls``'s fields whose type admits ``want`` but none of ``excluded``."""
    out = set()
    for name, f in cls.model_fields.items():
        args = set(typing.get_args(f.annotation)) or {f.annotation}
        if want in args and not args & excluded:
            out.add(name)
    return frozenset(out)


def _int_not_bool(cls) -> frozenset:
    """Names of ``cls``'s fields whose type admits ``int`` but not ``bool``."""
    return _fields_admitting(cls, int, frozenset({bool}))


def _float_not_bool(cls) -> frozenset:
    """Names of ``cls``'s fields whose type admits ``float`` but neither ``int`` nor ``bool``."""
    return _fields_admitting(cls, float, frozenset({int, bool}))


def _at_most(v, n: int, what: str):
    """``v`` unchanged unless it is a list or mapping of more than ``n`` items (ValueError)."""
    if isinstance(v, (list, dict)) and len(v) > n:
        raise ValueError(f"at most {n} {what} are allowed, got {len(v)}")
    return v


class CompletionRequest(_Sampling):
    # token ids must be JSON integers: lax parsing would serve [true, false] as ids 1 and 0
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # vLLM's default for completions: a text prompt gets the tokenizer's special tokens (a Llama
    # BOS), so the same prompt is the same token ids (and output) as on vLLM; token-id prompts
    # are never changed
    add_special_tokens: StrictBool = True
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """A list prompt is one kind throughout: token ids (JSON integers only, not booleans or
        floats), texts, or token-id lists. The first item sets the kind; an item that breaks it
        is named (``prompt[1]: ...``, ``prompt[1][0]: ...``; ValueError, a 400 with param
        ``prompt``), instead of the union's first branch ("Input should be a valid string")."""
        if not isinstance(v, (str, list)):
            raise ValueError("prompt: must be a text, a list of token ids, a list of texts or a list of token-id "
                             f"lists, got {type(v).__name__} {shown(v)}")
        if not isinstance(v, list) or not v:
            return v
        if isinstance(v[0], (str, list)):
            _at_most(v, MAX_BATCH_PROMPTS, "prompts in a batch")
        if isinstance(v[0], str):
            for i, p in enumerate(v):
                if not isinstance(p, str):
                    raise ValueError(f"prompt[{i}]: a batch of texts must hold strings only "
                                     f"(prompt[0] is a string), got {shown(p)}")
        elif isinstance(v[0], list):
            for i, ids in enumerate(v):
                if not isinstance(ids, list):
                    raise ValueError(f"prompt[{i}]: a batch of token-id lists must hold lists only "
                                     f"(prompt[0] is a list), got {shown(ids)}")
                for j, t in enumerate(ids):
                    if isinstance(t, bool) or not isinstance(t, int):
                        raise ValueError(f"prompt[{i}][{j}]: token ids must be integers, got {shown(t)}")
        else:
            for i, t in enumerate(v):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"prompt[{i}]: token ids must be integers, got {shown(t)}")
        return v


class _Message(BaseModel):
    """A chat message as OpenAI's API defines it for its role (:data:`_MESSAGES` picks the class
    by ``role``; :func:`check_messages` validates). Keys it does not define (a template's own,
    e.g. ``reasoning_content``) go to the template unchecked; a null value counts as absent."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    name: StrictStr | None = None
    content: Any = None  # a string or a list of content parts (their kinds: openai_chat.flatten_content)

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v):
        if v is None or isinstance(v, (str, list)):
            return v
        raise ValueError(f"must be a string or a list of content parts, got {type(v).__name__} {shown(v)}")


class _ContentMessage(_Message):
    """system, developer, user: ``content`` required."""

    content: Any


class _ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it back


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr
    type: Literal["function"]
    function: _ToolCallFunction


class _AssistantMessage(_Message):
    """``content``, or ``tool_calls`` (at least one; or the older ``function_call``) instead."""

    tool_calls: list[_ToolCall] | None = Field(None, min_length=1)
    function_call: _ToolCallFunction | None = None


class _ToolMessage(_Message):
    """The result of a tool call: ``tool_call_id`` names the call, ``content`` holds the result."""

    content: Any
    tool_call_id: StrictStr


class _FunctionMessage(_Message):
    """The older tool result: ``name`` of the function; ``content`` a string or null."""

    name: StrictStr
    content: StrictStr | None = None


_MESSAGES: dict[str, type[_Message]] = {"system": _ContentMessage, "developer": _ContentMessage,
                                        "user": _ContentMessage, "assistant": _AssistantMessage,
                                        "tool": _ToolMessage, "function": _FunctionMessage}
assert set(_MESSAGES) == CHAT_ROLES


def not_unicode(where: str, param: str, at: int) -> ApiError:
    """The 400 for a lone surrogate at character ``at`` of the string ``where`` names (its path,
    or an object's key), ``param`` the field's path (:func:`pdd.text.surrogate_at`'s triple)."""
    return ApiError(f"{where}: not valid Unicode text (a lone surrogate at character {at})", param)


def check_unicode(body: BaseModel, skip: frozenset[str] = frozenset()) -> None:
    """ApiError (400, :func:`not_unicode`) for the first lone surrogate in the strings (keys
    included) of ``body``'s fields, in their declared order, but those in ``skip`` (checked
    where they are read: a prompt by the tokenizer's check, messages by :func:`check_messages`);
    ``param`` is its exact path (``user``, ``tools[0].function.parameters.properties.a``,
    ``guided_choice[1]``). A lone surrogate (JSON's ``\\ud800``) is no UTF-8 text: in ``user``
    it was served, in a constraint it got the compiler's words ("unexpected end of hex escape")."""
    for name in type(body).model_fields:
        if name in skip:
            continue
        found = surrogate_at(getattr(body, name), name)
        if found is not None:
            raise not_unicode(*found)


def check_messages(messages: list) -> None:
    """Each chat message has the shape OpenAI's API requires for its role (:class:`_Message`
    and its subclasses): a known ``role``; ``content`` for system, developer, user and tool;
    ``tool_call_id`` for tool; ``content`` or ``tool_calls`` for assistant; ``name`` for function;
    each of the right type; every string of it (keys included) valid Unicode text
    (:func:`not_unicode`). ApiError (400) whose ``param`` is the field, e.g.
    ``messages[2].tool_call_id``, and whose message says what is wrong with it."""
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{at}: must be an object with a role and content, got {type(m).__name__}", at)
        role = m.get("role")
        if role is None:
            raise ApiError(f"{at}.role: required", f"{at}.role")
        if not isinstance(role, str):
            raise ApiError(f"{at}.role: must be a string, got {type(role).__name__} {shown(role)}", f"{at}.role")
        if role not in CHAT_ROLES:
            raise ApiError(f"{at}.role: {shown(role)} is not one of {', '.join(sorted(CHAT_ROLES))}", f"{at}.role")
        try:
            msg = _MESSAGES[role].model_validate({k: v for k, v in m.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            where = at + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
            if err["type"] == "missing":
                whose = f" for role {role!r}" if len(err["loc"]) == 1 else ""  # else a tool call's key
                raise ApiError(f"{where}: required{whose}", where) from None
            raise ApiError(f"{where}: {err['msg'].removeprefix('Value error, ')}", where) from None
        if isinstance(msg, _AssistantMessage) and msg.content is None and msg.tool_calls is None \
                and msg.function_call is None:
            raise ApiError(f"{at}.content: required for role 'assistant' unless tool_calls is given", f"{at}.content")
        # every string of the message (its name, tool call ids, a tool_call_id, a template's own
        # keys) reaches the chat template: a lone surrogate was served (200) or refused at its
        # position in the rendered prompt, naming no field
        found = surrogate_at(m, at)
        if found is not None:
            raise not_unicode(*found)


class ChatCompletionRequest(_Sampling):
    messages: list[Any]  # each checked by check_messages (400 naming the message's field)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # checked by check_chat: its 400 names the values allowed
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused (below), as vLLM without --trust-request-chat-template
    echo: StrictBool = False  # vLLM: prepend the last message to the reply; refused (below)
    best_of: int | None = Field(None, ge=1)  # refused unless equal to n (below)
    input_ids: Any = None  # SGLang: a prompt of token ids in place of the rendered messages; refused (UNHONOURED)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completion ``prompt`` (text) or chat ``messages`` (rendered
    with the model's chat template, as ``/v1/chat/completions`` does), cut as those endpoints cut
    it with ``truncate_prompt_tokens``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # checked by check_messages
    add_special_tokens: StrictBool | None = None  # None: as the matching endpoint (prompt True, messages False)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="the ids the matching endpoint serves with it: the last k tokens (-1: the "
                                 "maximum input length); 0 is refused, as there")

    @field_validator("truncate_prompt_tokens", mode="before")
    @classmethod
    def _json_integer(cls, v):
        """``true`` or a string is refused (ValueError, a 400 naming the field), as
        :meth:`_Sampling._json_number` refuses them for completions: lax pydantic reads them as
        1 / the number."""
        if isinstance(v, bool):
            raise ValueError(f"must be an integer, got {str(v).lower()}")
        if isinstance(v, str):
            raise ValueError(f"must be an integer, got a string {shown(v)}")
        return v

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' (text) or 'messages' (chat)")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


INT64_RANGE = (-(1 << 63), (1 << 63) - 1)  # what the instance protocol (msgpack) carries


def int_range(model: type[BaseModel], field: str) -> tuple[int, int]:
    """The integers ``model``'s parameter ``field`` accepts, ``(low, high)`` inclusive: its
    ``ge``/``gt``/``le``/``lt`` bounds, :data:`INT64_RANGE` where it has none. For the 400 of a
    number with a fraction or exponent too large for an integer (``"seed": 1e30``: pydantic says
    "Unable to parse input string as an integer, exceeded maximum size"). Raises KeyError for a
    field ``model`` does not have."""
    lo, hi = INT64_RANGE
    for m in model.model_fields[field].metadata:
        lo = max(lo, getattr(m, "ge", lo), getattr(m, "gt", lo - 1) + 1)
        hi = min(hi, getattr(m, "le", hi), getattr(m, "lt", hi + 1) - 1)
    return lo, hi


@dataclass
class TextOptions:
    """What the gateway does with each choice's tokens (not sent to the tiers)."""

    stop: list[str]
    include_stop: bool
    skip_special_tokens: bool
    min_tokens: int
    logprobs: int | None  # None: no logprobs in the response
    # the field the request's structured-output constraint came in (Constraint.param: response_format,
    # structured_outputs, guided_json, tool_choice, ...), None for none: the param of its 400 when its
    # grammar fails at run time (the API's _failure_param)
    constraint_param: str | None = None


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(stops):
        if not s:
            raise ApiError(f"stop[{i}]: stop strings must not be empty", "stop")
    return stops


def bad_words_token_ids(words: list[str], encode: typing.Callable[[str], list[int]], vocab: int) -> list[list[int]]:
    """The token-id sequences ``bad_words`` bans, as vLLM's ``SamplingParams.update_from_tokenizer``
    makes them: each word, left-stripped, tokenised without special tokens by ``encode``; then
    with a leading space too, kept when that gives a different first id and as many ids (the
    word as it appears inside a text). ApiError (param ``bad_words``) for a word that tokenises to
    nothing or to an id outside ``[0, vocab)``."""
    out: list[list[int]] = []
    for i, w in enumerate(words):
        bare = list(encode(w.lstrip()))
        if not bare:
            raise ApiError(f"bad_words[{i}]: {shown(w)} tokenises to no tokens", "bad_words")
        out.append(bare)
        spaced = list(encode(" " + w.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    for seq in out:
        for t in seq:
            if not 0 <= t < vocab:
                raise ApiError(f"bad_words: token id {t} is outside the vocabulary [0, {vocab})", "bad_words")
    return out


def _ids(ids) -> str:
    ids = sorted(ids)
    return ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} ids)" if len(ids) > 8 else "")


def check_something_allowed(allowed: list[int] | None, bad_ids: list[list[int]], min_tokens: int,
                            stop_ids: list[int], eos_ids: typing.Iterable[int], vocab: int) -> None:
    """ApiError (400) when the request's masks leave no id to generate from its first output on,
    which the engine would otherwise meet with its fallback (``process_logits``): every id
    ``allowed_token_ids`` allows (the whole vocabulary ``[0, vocab)`` without it) is a
    single-token ``bad_words`` id (param ``bad_words``), or, with ``min_tokens`` > 0, one of
    those, an EOS id (``eos_ids``) or a ``stop_token_ids`` id (param ``min_tokens``: the engine
    masks EOS and the stop ids for the first ``min_tokens`` outputs, ``ignore_eos`` or not).
    Multi-token bad words ban an id only after their other ids: not refused here."""
    single = {w[0] for w in bad_ids if len(w) == 1}
    what = f"allowed_token_ids ({_ids(allowed)})" if allowed is not None else "the vocabulary"

    def none_left(banned: set[int]) -> bool:
        if allowed is not None:
            return set(allowed) <= banned
        return len({t for t in banned if 0 <= t < vocab}) >= vocab

    if single and none_left(single):
        raise ApiError(f"bad_words: every id of {what} is a single-token bad word, so no token could be "
                       "generated", "bad_words")
    if min_tokens > 0:
        stops = set(stop_ids) | {int(t) for t in eos_ids}
        if none_left(single | stops):
            raise ApiError(f"min_tokens ({min_tokens}): EOS and stop_token_ids are masked for the first "
                           f"{min_tokens} outputs, which leaves no id of {what}"
                           + (" that is not a single-token bad word" if single else ""),
                           "min_tokens")


def sampling_for(body: _Sampling, max_tokens: int, vocab: int, logprobs: int | None,
                 max_tokens_param: str = "max_tokens",
                 defaults: dict | None = None,
                 encode: typing.Callable[[str], list[int]] | None = None,
                 eos_ids: typing.Iterable[int] = (),
                 constraint: "Constraint | None" = None) -> tuple[list[SamplingParams], TextOptions]:
    """One :class:`SamplingParams` per choice (seeds ``seed + i``; an unseeded request gets a
    random seed so every tier draws the same numbers) and the gateway's text options.
    ``defaults``: the checkpoint's values for ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty`` the request leaves out (:func:`pdd.gateway.openai_defaults.generation_defaults`).
    ``encode``: text -> token ids without special tokens, for ``bad_words``
    (:func:`bad_words_token_ids`); ApiError when a request has bad words and none is given.
    ``eos_ids``: the checkpoint's EOS ids, which ``min_tokens`` masks as the engine does
    (:func:`check_something_allowed`). ``constraint``: the request's structured output
    (:func:`structured_constraint`), set on every choice (``grammar``, ``structured``)."""
    d = defaults or {}

    def given(name: str, api_default):
        v = getattr(body, name)
        return d.get(name, api_default) if v is None else v

    if body.min_tokens > max_tokens:
        raise ApiError(f"min_tokens ({body.min_tokens}) must be at most {max_tokens_param} ({max_tokens})",
                       "min_tokens")
    stop_ids = list(body.stop_token_ids or [])
    for t in stop_ids:
        if not 0 <= t < vocab:
            raise ApiError(f"stop_token_ids: token id {t} is outside the vocabulary [0, {vocab})", "stop_token_ids")
    bias: dict[int, float] = {}
    for k, v in (body.logit_bias or {}).items():
        try:
            t = int(k)
        except ValueError:
            raise ApiError(f"logit_bias: key {shown(k)} is not a token id", "logit_bias") from None
        if not 0 <= t < vocab:
            raise ApiError(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab})", "logit_bias")
        if not -100.0 <= v <= 100.0:
            raise ApiError(f"logit_bias: bias {v} for token {t} is outside [-100, 100]", "logit_bias")
        bias[t] = float(v)
    allowed = None
    if body.allowed_token_ids is not None:
        for t in body.allowed_token_ids:
            if not 0 <= t < vocab:
                raise ApiError(f"allowed_token_ids: token id {t} is outside the vocabulary [0, {vocab})",
                               "allowed_token_ids")
        allowed = sorted(set(body.allowed_token_ids))
    bad_ids: list[list[int]] = []
    if body.bad_words:
        if encode is None:
            raise ApiError("bad_words: this endpoint has no tokenizer to tokenise them", "bad_words")
        bad_ids = bad_words_token_ids(body.bad_words, encode, vocab)
    check_something_allowed(allowed, bad_ids, body.min_tokens, stop_ids, eos_ids, vocab)
    stops = stop_list(body.stop)
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    base = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(given("temperature", 1.0)),
        top_p=float(given("top_p", 1.0)),
        top_k=int(given("top_k", -1)) or -1,  # 0: off, as -1
        seed=seed,
        ignore_eos=body.ignore_eos,
        stop_token_ids=stop_ids,
        min_p=float(given("min_p", 0.0)),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=float(given("repetition_penalty", 1.0)),
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        logit_bias=bias,
        allowed_token_ids=allowed,
        bad_words_token_ids=bad_ids,
        bad_words=list(body.bad_words or []),
        grammar=constraint.grammar if constraint is not None else None,
        structured=constraint.structured if constraint is not None else None,
    )
    sps = [SamplingParams.from_dict({**base.to_dict(), "seed": (seed + i) & _MASK64}) for i in range(body.n)]
    opts = TextOptions(stop=stops, include_stop=body.include_stop_str_in_output or body.no_stop_trim,
                       skip_special_tokens=body.skip_special_tokens, min_tokens=body.min_tokens, logprobs=logprobs,
                       constraint_param=constraint.param if constraint is not None else None)
    return sps, opts


def _check_stream_options(body: _Sampling) -> None:
    """``stream_options`` only with ``stream: true`` (vLLM refuses it otherwise too); ApiError."""
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options can only be set when stream is true", "stream_options")


def prompt_batch(prompt) -> list:
    """The prompts of a ``/v1/completions`` ``prompt``: its items when it is a batch (a list of
    texts or of token-id lists), else ``[prompt]`` (a text, or one list of token ids)."""
    return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]


def check_completion(body: CompletionRequest) -> None:
    """Completion-only checks (ApiError naming the parameter), then a lone surrogate in any
    field but ``prompt`` (:func:`check_unicode`)."""
    _check_stream_options(body)
    if body.suffix:
        raise ApiError("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError("best_of other than n is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise ApiError("echo with logprobs (prompt logprobs) is not supported", "echo")
    _check_prompt_logprobs(body)
    _check_response_format(body.response_format)
    check_unhonoured(body)
    check_unicode(body, frozenset({"prompt"}))  # a prompt's own check says where in a batch, after its length


def _empty(v) -> bool:
    return isinstance(v, list) and not v


def _is(value):
    """A default test: the JSON value ``value`` itself (a boolean is not a number: ``true`` is not
    1, ``0`` is not ``false``; an integer equals its float, ``1`` is ``1.0``)."""
    def test(v) -> bool:
        if isinstance(value, bool) or isinstance(v, bool):
            return v is value
        return isinstance(v, (int, float)) and v == value

    return test


# vLLM's and SGLang's request parameters that pdd cannot honour: name -> (what it asks for, a test
# of the values that ask nothing: their default, which vLLM's, SGLang's and the openai client may
# send; null is one for each). Any other value is a 400 naming the parameter (check_unhonoured),
# not ignored.
UNHONOURED: dict[str, tuple[str, Any]] = {
    # vLLM 0.11 ignores it (the backend is the server's --structured-outputs-config); pdd's is
    # llguidance, vLLM's "guidance": those names ask for what is done, any other for what is not
    "guided_decoding_backend": ("structured-output backends other than llguidance (vLLM's 'guidance'; "
                                "'auto' picks it)", lambda v: v in STRUCTURED_BACKENDS),
    "logits_processors": ("custom logits processors", _empty),
    "use_beam_search": ("beam search", _is(False)),
    "length_penalty": ("beam search's length penalty", _is(1.0)),
    "return_tokens_as_token_ids": ("tokens as token ids in logprobs", _is(False)),
    "spaces_between_special_tokens": ("detokenizing without spaces between special tokens", _is(True)),
    "priority": ("priority scheduling", _is(0)),
    "cache_salt": ("prefix-cache isolation by salt", None),
    "modalities": ("output modalities other than text", lambda v: isinstance(v, list) and all(x == "text" for x in v)),
    "audio": ("audio output", None),
    # SGLang's
    "stop_regex": ("stop regular expressions", None),
    "custom_logit_processor": ("custom logits processors", None),
    "lora_path": ("LoRA adapters", None),
    "return_hidden_states": ("hidden states in the response", _is(False)),
    "input_ids": ("a chat prompt of token ids in place of the messages (send them to /v1/completions as prompt)",
                  None),
}


def check_unhonoured(body) -> None:
    """ApiError (400, ``param`` naming it) for the first of vLLM's and SGLang's parameters pdd
    cannot honour (:data:`UNHONOURED`: guided / constrained decoding, custom logits processors,
    beam search, LoRA, ...) given with a value that asks for something; its default
    (``use_beam_search: false``, ``length_penalty: 1.0``, ``logits_processors: []``, null) passes.
    Silently ignoring one would answer 200 with output that does not do what was asked. Fields
    unknown to vLLM and SGLang too stay ignored."""
    for name, (what, harmless) in UNHONOURED.items():
        v = getattr(body, name, None)  # input_ids: chat's only
        if v is None or (harmless is not None and harmless(v)):
            continue
        raise ApiError(f"{name} is not supported: pdd does not support {what}; leave {name} out", name)


def _check_prompt_logprobs(body) -> None:
    """vLLM's ``prompt_logprobs`` would be silently dropped (unknown fields are ignored): refused."""
    if body.prompt_logprobs is not None:
        raise ApiError("prompt_logprobs is not supported (logprobs of the sampled tokens are: logprobs)",
                       "prompt_logprobs")


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# guided_decoding_backend values that ask for what pdd does (pdd.structured compiles with llguidance)
STRUCTURED_BACKENDS = ("auto", "guidance")
# structured_outputs keys (vLLM's StructuredOutputsParams) that are no constraint, and the values
# pdd honours: their defaults (disable_fallback: pdd has one backend, so never falls back)
_STRUCTURED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_any_whitespace": (None, False), "disable_additional_properties": (None, False),
    "structural_tag": (None,), "disable_fallback": (None, False, True)}
# the older extras, each one constraint kind (vLLM 0.11 folds them into structured_outputs), and
# SGLang's three (its EBNF is a GBNF-style grammar; its json_schema the schema's JSON text)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "regex": "regex", "ebnf": "grammar", "json_schema": "json"}


def _check_response_format(rf: dict | None) -> tuple[str, Any] | None:
    """``response_format``'s constraint as ``(kind, value)`` of :data:`pdd.structured.KINDS`:
    ``{"type": "json_object"}`` any JSON object, ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}`` the schema; None for ``{"type": "text"}`` or
    no format. ApiError (param ``response_format``) for another type (``structural_tag``
    included), a ``json_schema`` without a string ``name`` or an object ``schema``, or a
    ``strict`` that is not a boolean (the grammar is enforced either way)."""
    if rf is None:
        return None
    t = rf.get("type")
    if t not in RESPONSE_FORMATS:
        raise ApiError(f"response_format.type: must be one of {', '.join(map(repr, RESPONSE_FORMATS))}, got "
                       f"{shown(t)}", "response_format")
    if t == "text":
        return None
    if t == "json_object":
        return "json_object", True
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError("response_format.json_schema: required for type 'json_schema': an object with name and "
                       "schema", "response_format")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise ApiError("response_format.json_schema.name: required, a non-empty string", "response_format")
    if not isinstance(js.get("schema"), dict):
        raise ApiError(f"response_format.json_schema.schema: required, a JSON schema object, got "
                       f"{shown(js.get('schema'))}", "response_format")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ApiError(f"response_format.json_schema.strict: must be a boolean, got {shown(js['strict'])}",
                       "response_format")
    return "json", js["schema"]


def _structured_outputs(so) -> tuple[str, Any] | None:
    """vLLM's ``structured_outputs`` as ``(kind, value)``; None for null. ApiError (param
    ``structured_outputs``) for a value that is not an object, a key vLLM does not define, an
    option pdd cannot honour (``disable_any_whitespace``, ``disable_additional_properties``,
    ``structural_tag``; ``whitespace_pattern`` is :func:`structured_constraint`'s), no
    constraint or more than one (vLLM's rule:
    ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)."""
    from pdd.structured import KINDS

    if so is None:
        return None
    if not isinstance(so, dict):
        raise ApiError(f"structured_outputs: must be an object with one of {', '.join(KINDS)}, got "
                       f"{type(so).__name__} {shown(so)}", "structured_outputs")
    for k, v in so.items():
        if k in KINDS or k == "whitespace_pattern":
            continue
        if k not in _STRUCTURED_OPTIONS:
            raise ApiError(f"structured_outputs.{k}: unknown key (constraints: {', '.join(KINDS)})",
                           "structured_outputs")
        if not any(v is x for x in _STRUCTURED_OPTIONS[k]):
            raise ApiError(f"structured_outputs.{k}: {shown(v)} is not supported: pdd's structured outputs "
                           f"(llguidance) honour only its default; leave {k} out", "structured_outputs")
    # json_object: false asks for nothing (vLLM reads it as a boolean)
    given = [k for k in KINDS if so.get(k) is not None and not (k == "json_object" and so[k] is False)]
    if len(given) > 1:
        raise ApiError(f"structured_outputs: only one kind of constraint can be used, got {', '.join(given)}",
                       "structured_outputs")
    if not given:
        raise ApiError(f"structured_outputs: must give one constraint, one of {', '.join(KINDS)}",
                       "structured_outputs")
    k = given[0]
    if k == "json_object" and so[k] is not True:
        raise ApiError(f"structured_outputs.json_object: must be true, got {shown(so[k])}", "structured_outputs")
    return k, so[k]


def tool_schema(tool_choice, tools: list[dict], parallel: bool = True, copied: bool = True) -> dict | None:
    """The JSON schema a forced ``tool_choice`` constrains a chat choice to, as vLLM builds it
    (``get_json_schema_from_tools``): a named function (``{"type": "function", "function":
    {"name": F}}``): F's ``parameters`` (the output is its arguments; none: an object with no
    properties); ``"required"``: a JSON array of at least one ``{"name": one tool's name,
    "parameters": its parameters}`` object with no other key (vLLM's allows others; at most one
    with ``parallel`` False), each tool's ``$defs`` gathered at the top. None for ``none`` / ``auto`` / null. ``tools`` is not
    changed. ApiError (400) for a named function no tool has (param ``tool_choice``),
    ``parameters`` that are not an object (param ``tools[i].function.parameters``; chat's
    :func:`check_chat` refuses them first), ``parameters`` nested past the recursion limit (param
    ``tools[i].function.parameters``), or two tools defining one ``$defs``
    name differently (param ``tools``). ``copied`` False: the schema shares the tools' nested
    objects (not copied, so never the recursion refusal; for reading only, as
    :func:`check_constraint_size` measures it)."""
    import copy

    if tool_choice in (None, "none", "auto"):
        return None
    empty = {"type": "object", "properties": {}}

    def params(i: int, fn: dict) -> dict | None:
        p = fn.get("parameters")
        if p is not None and not isinstance(p, dict):
            raise ApiError(f"tools[{i}].function.parameters: must be a JSON schema object, got {shown(p)}",
                           f"tools[{i}].function.parameters")
        if not p:
            return None
        if not copied:
            return dict(p)  # its own top level: $defs is popped from it
        try:
            return copy.deepcopy(p)
        except RecursionError:  # deeper than copying can recurse (within the body's depth): never a 500
            raise ApiError(f"tools[{i}].function.parameters: recursion limit exceeded (nested too deeply to "
                           "compile)", f"tools[{i}].function.parameters") from None

    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        for i, fn in enumerate(fns):
            if fn["name"] == name:
                return params(i, fn) or empty
        raise ApiError(f"tool_choice: function {shown(name)} is not one of the tools "
                       f"({', '.join(repr(f['name']) for f in fns)})", "tool_choice")
    defs: dict[str, Any] = {}
    alts = []
    for i, fn in enumerate(fns):
        p = params(i, fn)
        for dname, dschema in (p.pop("$defs", None) or {}).items() if p else ():
            if dname in defs and defs[dname] != dschema:
                raise ApiError(f"tools[{i}].function.parameters.$defs.{dname}: another tool defines {dname!r} "
                               "differently; one schema per name is supported", "tools")
            defs[dname] = dschema
        # additionalProperties false: vLLM's schema leaves it out, which lets a weak model write keys
        # beside name and parameters until max_tokens (the call is the same without them)
        alts.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": p or empty},
                     "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alts}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output constraint: ``param`` the field it came in, ``kind`` and
    ``value`` as :func:`pdd.structured.grammar_for` takes them, ``grammar`` its llguidance text."""

    param: str
    kind: str
    value: Any
    grammar: str
    whitespace_pattern: str | None = None

    @property
    def structured(self) -> dict:
        """``{kind: value}`` (and ``whitespace_pattern`` when given: vLLM's structured_outputs
        shape), :attr:`pdd.types.SamplingParams.structured`."""
        out = {self.kind: self.value}
        if self.whitespace_pattern is not None:
            out["whitespace_pattern"] = self.whitespace_pattern
        return out


def constraint_requested(body) -> bool:
    """Whether a completion or chat request sets a field :func:`structured_constraint` reads a
    constraint (or a whitespace pattern) from: a ``response_format`` other than ``text``,
    ``structured_outputs``, a ``guided_*`` field or SGLang's ``regex`` / ``ebnf`` /
    ``json_schema``, a whitespace pattern, or a ``tool_choice`` that forces a call (``required``,
    a named function). False: :func:`structured_constraint` returns None without compiling, so
    the gateway serves such a request without waiting for the compiler thread
    (``pdd.structured.compiler``: one thread, which other clients' grammars may hold for
    seconds). Pure and cheap: no validation, no compiling."""
    rf = getattr(body, "response_format", None)
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        return True
    if body.structured_outputs is not None or body.guided_whitespace_pattern is not None:
        return True
    if any(getattr(body, name) is not None for name in _GUIDED):
        return True
    return getattr(body, "tool_choice", None) not in (None, "none", "auto")


def _constraint_fields(body) -> list[tuple[str, Any]]:
    """``(field, value)`` of each field a request's constraint comes from (:func:`constraint_requested`'s),
    ``tools`` when ``tool_choice`` forces a call; [] for a request with none."""
    if not constraint_requested(body):
        return []
    names = ["response_format", "structured_outputs", "guided_whitespace_pattern", *_GUIDED]
    out = [(name, getattr(body, name, None)) for name in names if getattr(body, name, None) is not None]
    if getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        out += [("tool_choice", body.tool_choice), ("tools", getattr(body, "tools", None))]
    return out


def _field_chars(v) -> int:
    """Characters of one constraint field: a string's length, else its JSON's; 0 for None or a
    value JSON cannot hold."""
    if v is None:
        return 0
    if isinstance(v, str):
        return len(v)
    try:
        return len(json.dumps(v, ensure_ascii=False, default=str))
    except (TypeError, ValueError, RecursionError):
        return 0


def constraint_summary(body) -> tuple[str | None, int]:
    """``(constraint_key(body), constraint_chars(body))`` from one walk of the request's
    constraint fields, each field's JSON written once: what the gateway's compile queue reads per
    constrained request (:func:`checked_constraint_summary` reads them with the size check).
    Pure."""
    return _summary(_constraint_fields(body), {})


def _dumps(v) -> str:
    """``v``'s JSON as :func:`constraint_key` writes it: keys sorted, characters unescaped."""
    return json.dumps(v, ensure_ascii=False, sort_keys=True, default=str)


def _summary(fields: list[tuple[str, Any]], written: dict[str, str]) -> tuple[str | None, int]:
    """:func:`constraint_summary` of ``fields``; ``written``: field -> its JSON text (:func:`_dumps`),
    written already, not again. The key is ``json.dumps(fields)`` (keys sorted, characters
    unescaped), built from each field's text; the count each field's length (a string's own),
    ``tool_choice`` not counted."""
    if not fields:
        return None, 0
    texts: list[str | None] = []
    chars = 0
    for name, v in fields:
        try:
            text = written[name] if name in written else _dumps(v)
        except (TypeError, ValueError, RecursionError):
            text = None
        texts.append(text)
        if name != "tool_choice":
            chars += len(v) if isinstance(v, str) else len(text) if text is not None else _field_chars(v)
    if any(t is None for t in texts):
        return None, chars
    return "[" + ", ".join(f'["{name}", {t}]' for (name, _), t in zip(fields, texts)) + "]", chars


class _MarkFound(Exception):
    """A value holds the text :func:`_spliced` marks a hole with: it is written whole instead."""


_HOLE = "\x00pdd-constraint-hole-{}\x00"  # a value's place in its container's JSON while that is written


def _spliced(v, holes: dict[tuple, str]) -> str:
    """``v``'s JSON (:func:`_dumps`) with the value at each path of ``holes`` written as the text
    given there (written already, not again): the containers along the paths are copied (one
    level each), the rest of ``v`` written here. A path ``()`` is ``v`` itself. :class:`_MarkFound`
    when ``v`` holds a hole's mark itself."""
    if () in holes:
        return holes[()]
    if not holes:
        return _dumps(v)
    root = dict(v) if isinstance(v, dict) else list(v)
    marks: dict[str, str] = {}
    for i, (path, text) in enumerate(holes.items()):
        node = root
        for k in path[:-1]:
            node[k] = dict(node[k]) if isinstance(node[k], dict) else list(node[k])
            node = node[k]
        node[path[-1]] = _HOLE.format(i)
        marks[json.dumps(_HOLE.format(i))] = text
    out = _dumps(root)
    if any(out.count(m) != 1 for m in marks):
        raise _MarkFound()
    return re.sub("|".join(map(re.escape, marks)), lambda m: marks[m.group()], out)


def _written(param: str, value, fields: list[tuple[str, Any]]) -> tuple[str, dict[str, str]]:
    """The JSON text (:func:`_dumps`, without ``default``: TypeError for a value JSON cannot
    hold) of the constraint ``value`` from field ``param``, and ``{field: its JSON text}`` of the
    constraint field holding it, written around that text (:func:`_spliced`; :func:`_summary`'s
    ``written``). A forced tool call's schema is built from ``tools``: each tool's ``parameters``
    that the schema holds as they are is written once, for both."""
    text_of = functools.partial(json.dumps, ensure_ascii=False, sort_keys=True)
    found = dict(fields)
    if param == "tool_choice":
        tools = found.get("tools") or []
        params = [t["function"].get("parameters") for t in tools]
        if isinstance(found["tool_choice"], str):  # "required": every tool's (those with $defs lose them there)
            own = {i: text_of(p) for i, p in enumerate(params) if isinstance(p, dict) and p and "$defs" not in p}
            in_value = {("items", "anyOf", i, "properties", "parameters"): t for i, t in own.items()}
        else:  # a named function: its parameters are the schema
            name = found["tool_choice"]["function"]["name"]
            i = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
            own = {i: text_of(params[i])} if isinstance(params[i], dict) and params[i] else {}
            in_value = {(): own[i]} if own else {}
        if not own:  # nothing written twice
            return text_of(value), {}
        try:
            text = _spliced(value, in_value)
        except _MarkFound:
            text = text_of(value)
        try:
            return text, {"tools": _spliced(tools, {(i, "function", "parameters"): t for i, t in own.items()})}
        except _MarkFound:
            return text, {}
    text = text_of(value)
    if param == "response_format":
        path = ("json_schema", "schema")
    elif param == "structured_outputs":
        path = next((k,) for k, v in found[param].items() if v is value)
    else:  # a guided_* field: the value itself
        path = ()
    try:
        return text, {param: _spliced(found[param], {path: text})}
    except _MarkFound:
        return text, {}


def _escaped_len(text: str) -> int:
    """The length of ``text`` (JSON written with characters unescaped, :func:`_dumps`) as
    ``json.dumps`` writes it by default (``ensure_ascii``): each character outside ASCII and DEL
    as ``\\uXXXX``, one past U+FFFF as two of them. Key order does not change a length."""
    n = len(text)
    extra = 5 * text.count("\x7f")
    if not text.isascii():
        astral = len(text.encode("utf-16-le", "surrogatepass")) // 2 - n
        wide = n - len(text.encode("ascii", "ignore"))
        extra += 5 * (wide - astral) + 11 * astral
    return n + extra


def constraint_chars(body) -> int:
    """Characters of constraint text a completion or chat request sends: the JSON of each field
    :func:`constraint_requested` reads (a grammar or regex string counted as its length), and of
    ``tools`` when ``tool_choice`` forces a call (the call's schema is built from them); 0 for a
    request with none. What the compile queue's cost estimate reads
    (``pdd.structured.compile_cost_s``). Pure and cheap: no validation, no compiling."""
    return constraint_summary(body)[1]


def constraint_key(body) -> str | None:
    """A request's constraint fields as one JSON text (keys sorted): equal for two requests whose
    constraints compile alike; None for a request with none or fields JSON cannot hold. The
    gateway remembers the keys it compiled, so a constraint sent again queues at the cost of a
    cached one. Pure."""
    return constraint_summary(body)[0]


def structured_constraint(body, lltok=None) -> Constraint | None:
    """The one structured-output constraint of a completion or chat request, compiled, else None.

    Where one comes from: ``response_format`` (``json_object``, ``json_schema``), vLLM's
    ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), its
    older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and for chat
    a forced ``tool_choice`` (:func:`tool_schema`). ApiError (400, ``param`` the field, the
    message why) for a malformed one (:func:`_check_response_format`, :func:`_structured_outputs`),
    one llguidance cannot compile (``GrammarError``'s reason), or more than one: vLLM refuses two
    kinds in ``structured_outputs`` and constraints with a forced tool choice; pdd refuses any
    two, where vLLM 0.11 would let one field silently override another. With ``lltok`` (the
    model's ``pdd.structured.ll_tokenizer``) a constraint no token can begin is refused too
    (``pdd.structured.check_start``: an empty language, ``start: start``, a ``$ref`` cycle). Compiling
    costs about a millisecond for a small schema, a second for a 32 KiB GBNF grammar (whose
    conversion to Lark is Python): call it off the event loop (``pdd.structured.compiler``)."""
    from pdd.structured import GrammarError, check_start, grammar_for

    chosen = _chosen_constraint(body)
    _refuse_uncompiled(body, chosen, _size_refusal)  # as the gateway did before queueing it
    ws, _ = _whitespace_pattern(body)  # its regex compiles
    if chosen is None:
        return None
    param, kind, value = chosen
    try:
        g = grammar_for(kind, None if kind == "json_object" else value, whitespace_pattern=ws)
        if lltok is not None:  # over the model's vocabulary: some token must be able to begin it
            check_start(lltok, g)  # (kept per grammar text, beside the compiled grammars)
    except GrammarError as e:
        raise _grammar_refusal(param, kind, str(e)) from None
    return Constraint(param, kind, value, g, ws)


def _size_refusal(kind: str, value, ws: str | None) -> str | None:
    """``pdd.structured.size_refusal``, None for a value that is no JSON (its compile refuses it)."""
    from pdd.structured import size_refusal

    try:
        return size_refusal(kind, value, ws)
    except (TypeError, ValueError, RecursionError):
        return None


def _grammar_refusal(param: str, kind: str, why: str) -> ApiError:
    """The 400 for a constraint of ``kind`` from field ``param`` that does not compile (``why``):
    a response format's names its schema (``response_format.json_schema.schema``) in the
    message and ``param``; a forced call's names ``the tools' parameters`` (param ``tools``: its
    schema is made of them); ``structured_outputs.KIND`` in the message only."""
    where = {"response_format": "response_format.json_schema.schema",
             "structured_outputs": f"structured_outputs.{kind}",
             "tool_choice": "the tools' parameters"}.get(param, param)
    return ApiError(f"{where}: {why}", {"tool_choice": "tools", "response_format": where}.get(param, param))


def check_constraint_size(body) -> None:
    """The refusal :func:`structured_constraint` would give ``body`` before compiling its
    constraint, found without compiling, so the gateway refuses it before queueing for the
    compiler thread (a constraint over ``pdd.structured.MAX_CONSTRAINT_CHARS`` waited behind
    every compile queued before it for its 400): ApiError for a malformed or second constraint
    (the same checks, in the same order), a whitespace pattern given twice, not a string, over the
    limit, with no JSON constraint or beside another kind, or a constraint over the limit (with
    the pattern's characters: the same message and param as the compile's). A whitespace
    pattern's regex compiles after these (:func:`structured_constraint`). Returns None when they
    pass. Pure: no compiling; a forced tool call's schema is measured without copying the tools.
    :func:`checked_constraint_summary` is this and :func:`constraint_summary` at once."""
    checked_constraint_summary(body)


def checked_constraint_summary(body) -> tuple[str | None, int]:
    """:func:`check_constraint_size`'s refusals (ApiError, the same ones in the same order), then
    :func:`constraint_summary`'s ``(key, chars)``, from one JSON writing of the constraint: what
    the gateway does on its event loop per constrained request before the compile queue. The
    constraint's value is written once (keys sorted, characters unescaped), its size read from
    that text as ``pdd.structured.size_refusal`` counts it (:func:`_escaped_len`), and each
    constraint field's JSON written around it (:func:`_spliced`). Pure. Only a tool whose
    ``parameters`` have ``$defs`` (moved to the call's schema) is written twice."""
    chosen = _chosen_constraint(body, copied=False)
    fields = _constraint_fields(body)
    written: dict[str, str] = {}

    def size(kind: str, value, ws: str | None) -> str | None:
        from pdd.structured import chars_refusal, size_refusal

        if not ((kind == "json" and not isinstance(value, str)) or (kind == "choice" and isinstance(value, list))):
            return size_refusal(kind, value, ws)  # a text's own length: nothing written
        try:
            text, around = _written(chosen[0], value, fields)
        except (TypeError, ValueError, RecursionError):  # not JSON: the compile refuses it as it does
            return None
        written.update(around)
        return chars_refusal(_escaped_len(text) + len(ws or ""))

    _refuse_uncompiled(body, chosen, size)
    return _summary(fields, written)


def _refuse_uncompiled(body, chosen: tuple[str, str, Any] | None, size) -> None:
    """What :func:`structured_constraint` refuses without compiling, after
    :func:`_chosen_constraint`'s checks (``chosen`` its answer), in this order: a whitespace
    pattern given twice or not a non-empty string (:func:`_whitespace_given`), over the size
    limit, with no JSON constraint or beside a constraint of another kind; then the constraint
    over the limit, its pattern's characters counted (``size(kind, value, pattern)``: why, as
    ``pdd.structured.size_refusal`` says it, or None). ApiError naming the field."""
    from pdd.structured import size_refusal

    given = _whitespace_given(body)
    ws = None
    if given is not None:
        ws, ws_param, where = given
        why = size_refusal("regex", ws)
        if why is not None:
            raise ApiError(f"{where}: {why}", ws_param)
        if chosen is None:
            raise ApiError(f"{ws_param}: a whitespace pattern lays out JSON output, and the request has no JSON "
                           "constraint", ws_param)
        if chosen[1] not in ("json", "json_object"):
            raise ApiError(f"{ws_param}: a whitespace pattern lays out JSON output, and {chosen[0]} gives a "
                           f"{chosen[1]} constraint", ws_param)
    if chosen is None:
        return
    param, kind, value = chosen
    why = size(kind, None if kind == "json_object" else value, ws)
    if why is not None:
        raise _grammar_refusal(param, kind, why)


def _chosen_constraint(body, copied: bool = True) -> tuple[str, str, Any] | None:
    """``(field, kind, value)`` of a request's one constraint (:func:`structured_constraint`),
    None for none; ApiError for a malformed one or more than one. Pure. ``copied``: as
    :func:`tool_schema`'s."""
    found: list[tuple[str, str, Any]] = []
    rf = _check_response_format(getattr(body, "response_format", None))
    if rf is not None:
        found.append(("response_format", *rf))
    so = _structured_outputs(body.structured_outputs)
    if so is not None:
        found.append(("structured_outputs", *so))
    found += [(name, kind, getattr(body, name)) for name, kind in _GUIDED.items() if getattr(body, name) is not None]
    tc = getattr(body, "tool_choice", None)
    ts = tool_schema(tc, body.tools or [], body.parallel_tool_calls is not False,
                     copied) if tc is not None else None
    if ts is not None:
        if found:
            raise ApiError(f"tool_choice {shown(tc)} forces a tool call, which is a constraint of its own: it cannot be "
                           f"combined with {found[0][0]}; send one or the other", "tool_choice")
        found.append(("tool_choice", "json", ts))
    if len(found) > 1:
        raise ApiError(f"{found[1][0]}: only one structured-output constraint can be used in a request, and "
                       f"{found[0][0]} gives one already", found[1][0])
    return found[0] if found else None


def _whitespace_given(body) -> tuple[str, str, str] | None:
    """``(pattern, its field, its name in a message)`` of the whitespace pattern a request gives,
    not compiled (:func:`_whitespace_pattern`); None for none. ApiError for both fields, or a value
    that is not a non-empty string. Pure."""
    so = body.structured_outputs if isinstance(body.structured_outputs, dict) else {}
    given = [(v, name) for v, name in ((so.get("whitespace_pattern"), "structured_outputs"),
                                       (body.guided_whitespace_pattern, "guided_whitespace_pattern")) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError("guided_whitespace_pattern: structured_outputs.whitespace_pattern gives one already",
                       "guided_whitespace_pattern")
    (ws, param), = given
    where = "structured_outputs.whitespace_pattern" if param == "structured_outputs" else param
    if not isinstance(ws, str) or not ws:
        raise ApiError(f"{where}: must be a non-empty string (a regex), got {shown(ws)}", param)
    return ws, param, where


def _whitespace_pattern(body) -> tuple[str | None, str | None]:
    """``(pattern, the field it came in)`` of ``structured_outputs.whitespace_pattern`` or vLLM
    0.11's ``guided_whitespace_pattern`` (the whitespace JSON output may have around ``,`` and
    ``:``, a regex), ``(None, None)`` for neither. ApiError (param the field) for both, a value
    that is not a non-empty string, or a regex llguidance rejects."""
    from pdd.structured import GrammarError, grammar_for

    given = _whitespace_given(body)
    if given is None:
        return None, None
    ws, param, where = given
    try:
        grammar_for("regex", ws)
    except GrammarError as e:
        raise ApiError(f"{where}: {e}", param) from None
    return ws, param


def check_truncate(k: int | None, max_input_len: int) -> None:
    """ApiError for a ``truncate_prompt_tokens`` of 0 (nothing would be left) or above
    ``max_input_len`` (vLLM refuses a k past the model's limit too); None and -1 pass."""
    if k == 0:
        raise ApiError("truncate_prompt_tokens: 0 would leave no prompt; use k >= 1, or -1 for the maximum "
                       "input length", "truncate_prompt_tokens")
    if k is not None and k > max_input_len:
        raise ApiError(f"truncate_prompt_tokens: {k} is above the maximum input length {max_input_len}",
                       "truncate_prompt_tokens")


def truncated_prompt(ids: list[int], k: int | None, max_input_len: int) -> list[int]:
    """``truncate_prompt_tokens`` (vLLM's extension): the last ``k`` prompt tokens (left
    truncation; -1: the last ``max_input_len``); ``ids`` unchanged for None. ApiError for a bad
    ``k`` (:func:`check_truncate`)."""
    if k is None:
        return ids
    check_truncate(k, max_input_len)
    k = max_input_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def _check_tools(tools) -> None:
    """``tools``: each an OpenAI function tool, ``{"type": "function", "function": {"name": a
    non-empty string, ...}}`` (the only kind chat completions define); ApiError naming
    ``tools`` otherwise, ``tools[i].function`` for a ``function`` that is no object,
    ``tools[i].function.name`` for a name that is no string or not OpenAI's
    ``^[a-zA-Z0-9_-]{1,64}$`` (:func:`bad_function_name`) or that an earlier tool has (a call
    names one of them: the client could not tell which; Anthropic's and Gemini's APIs refuse
    that too), ``tools[i].function.description`` for a ``description`` given (not null) that is
    no string (:func:`bad_description`), ``tools[i].function.parameters`` for ``parameters``
    given (not null) that is not a JSON object (:func:`bad_parameters`; whatever
    ``tool_choice`` is: the chat template renders them)."""
    first: dict[str, int] = {}
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ApiError(f"tools[{i}]: must be an object with type 'function', got {shown(t)}", "tools")
        fn = t.get("function")
        at = f"tools[{i}].function"
        if not isinstance(fn, dict):
            raise ApiError(f"{at}: must be an object with a non-empty string name, got {shown(fn)}", at)
        for field, check in (("name", bad_function_name), ("description", bad_description),
                             ("parameters", bad_parameters)):
            bad = check(fn.get(field), f"{at}.{field}")
            if bad:
                raise ApiError(bad, f"{at}.{field}")
        dup = duplicate_name(first, fn["name"], i, f"{at}.name")
        if dup:
            raise ApiError(dup, f"{at}.name")


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def bad_function_name(name, where: str) -> str | None:
    """Why a tool's function ``name`` is refused, named as ``where``
    (``tools[2].function.name``), when it is no string (absent: None) or not OpenAI's
    ``^[a-zA-Z0-9_-]{1,64}$`` (the pattern OpenAI's API enforces; a model's chat template and a
    client's dispatch assume it); else None."""
    if not isinstance(name, str):
        return (f"{where}: required, a string of 1 to 64 letters, digits, underscores or dashes "
                f"(^[a-zA-Z0-9_-]{{1,64}}$), got {shown(name)}")
    if _FUNCTION_NAME.fullmatch(name):
        return None
    return (f"{where}: must be 1 to 64 letters, digits, underscores or dashes (^[a-zA-Z0-9_-]{{1,64}}$), "
            f"got {shown(name)}")


def bad_description(description, where: str) -> str | None:
    """Why a tool's ``description``, named as ``where`` (``tools[2].function.description``), is
    refused: given (not None) and no string (the chat template renders it as text; OpenAI's
    API refuses others too); else None."""
    if description is None or isinstance(description, str):
        return None
    return f"{where}: must be a string, got {shown(description)}"


def bad_parameters(parameters, where: str) -> str | None:
    """Why a tool's function ``parameters``, named as ``where``
    (``tools[2].function.parameters``), is refused: given (not None) and not a JSON object (a
    JSON schema; OpenAI's API refuses others too); else None."""
    if parameters is None or isinstance(parameters, dict):
        return None
    return f"{where}: must be a JSON schema object, got {shown(parameters)}"


def duplicate_name(first: dict[str, int], name: str, i: int, where: str) -> str | None:
    """Why tool ``i``'s function ``name`` is refused, named as ``where`` (``tools[2].function.name``),
    when an earlier tool has it (``first``: name -> index, updated here); else None."""
    j = first.setdefault(name, i)
    return None if j == i else f"{where}: {shown(name)} is tools[{j}]'s too; function names must be unique"


def check_chat(body: ChatCompletionRequest, tool_parser: str | None = None) -> None:
    """Chat-only checks (ApiError naming the parameter), then a lone surrogate in any field
    (:func:`check_messages`, :func:`check_unicode`). ``tool_parser``: the gateway's tool-call
    parser for the model (``pdd.gateway.tool_parsers.PARSERS``), None when it parses none."""
    _check_stream_options(body)
    if not body.messages:
        raise ApiError("messages: must contain at least one message", "messages")
    check_messages(body.messages)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", "top_logprobs")
    tc = body.tool_choice
    _check_tools(body.tools)
    named = (isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict)
             and isinstance(tc["function"].get("name"), str) and tc["function"]["name"] != "")
    if tc is not None and tc not in ("none", "auto", "required") and not named:
        raise ApiError(f"tool_choice: must be 'none', 'auto', 'required' or "
                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {shown(tc)}", "tool_choice")
    if (tc == "required" or named) and not body.tools:
        raise ApiError(f"tool_choice {shown(tc)} needs tools: the request has none", "tool_choice")
    # "required" and a named function force a call: a JSON-schema constraint (structured_constraint)
    if body.tools and tc in (None, "auto") and tool_parser is None:
        # tools with "auto" (also the default when tools are given) asks for tool calls parsed out
        # of the output (message.tool_calls, finish_reason "tool_calls"); without a parser the
        # call would come back as plain content. vLLM refuses it too unless started with a parser.
        raise ApiError("tool_choice 'auto' (the default when tools are given) is not supported for this model: "
                       "the server parses no tool calls for it; set tool_call_parser (hermes, llama3_json or "
                       "mistral) in the gateway's config, or send tool_choice 'none' to pass the tools to the "
                       "model's chat template only", "tool_choice")
    if body.chat_template is not None:
        # a request's own Jinja template is code run on the server; vLLM refuses it unless started
        # with --trust-request-chat-template
        raise ApiError("chat_template: a request's own chat template is not accepted; the model's template "
                       "is used (chat_template_kwargs pass variables to it)", "chat_template")
    _check_response_format(body.response_format)
    _check_prompt_logprobs(body)
    check_unhonoured(body)
    if body.echo:
        raise ApiError("echo (prepending the last message to the reply) is not supported", "echo")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError("best_of other than n is not supported", "best_of")
    check_unicode(body, frozenset({"messages"}))  # check_messages checked the messages
