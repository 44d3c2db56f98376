"""Structured outputs: vLLM's guided decoding (``structured_outputs`` / ``guided_json`` ...)
and OpenAI's ``response_format``, on every pdd tier.

A constraint (a JSON schema, a regex, a list of choices, a Lark or GBNF grammar) is compiled
once, by the gateway, into the grammar text of llguidance (the library behind vLLM's
``guidance`` structured-output backend; https://github.com/guidance-ai/llguidance). The text
travels in ``SamplingParams.grammar`` to whichever tier samples: P (the first token), RLD, MD,
a recovered attempt. Each keeps a :class:`Guide` per sequence, a matcher over the model's
tokenizer that it advances over the sequence's outputs *so far*, whoever sampled them. So a
handoff, which ships token ids and no grammar state, costs the receiving tier one replay of the
outputs it was handed (``LLMatcher.consume_tokens``; microseconds a token), and every tier
masks the same ids at the same output position: greedy outputs equal a single engine's.

At each position the guide's allowed ids (a bitmask, one bit per vocabulary id) are a hard mask
applied before the other logit processors (``pdd.engine.sampler.process_logits``). Once the
grammar is complete only EOS is allowed, so the request ends with finish reason ``stop`` one
token later, as in vLLM.

This module imports neither torch nor anything of pdd's runtime.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from functools import lru_cache

from pdd.text import lone_surrogate, surrogate_at

log = logging.getLogger(__name__)

# the constraint kinds of vLLM's StructuredOutputsParams (``json_object``: any JSON object)
KINDS = ("json", "regex", "choice", "grammar", "json_object")


# how a sequence whose grammar failed at run time fails its request (pdd.engine: the text of
# ``Engine.pop_failed``'s why; the gateway's 400 comes from the typed ``client_error`` it travels
# with, ``pdd.transfer.messages.ReqError``, never from this text)
FAILED_AT = "structured output failed at output"


class GrammarError(ValueError):
    """A constraint llguidance cannot compile; the message says why (for an HTTP 400)."""


# A constraint's text (a regex, grammar, the choices' or a schema's JSON) is at most this many
# characters. llguidance compiles recursively: on a thread's usual 8 MiB stack a chain of
# 3,000 Lark rules (92 KB) or of 1,000 $defs (75 KB) overflowed it and killed the process
# (SIGSEGV); compiling runs on :func:`compiler`'s threads (a 256 MiB stack) and the cap keeps
# every constraint far inside that, and its compile time to about a second.
MAX_CONSTRAINT_CHARS = 32 * 1024
COMPILER_STACK_BYTES = 256 << 20
_COMPILER_LOCK = threading.Lock()
_COMPILER = None


# The compile queue's cost estimate: seconds a character of constraint text, the slowest kind's
# (llguidance's GBNF -> Lark conversion, Python: a 26,735-character grammar of 1,000 chained
# rules took 0.79-0.93 s on the 2-core CPU machine, code 279040e; a regex, Lark grammar or JSON
# schema of that size compiles in Rust, several times faster), and the seconds any constraint
# takes (a 10-character regex: 13 ms through ``structured_constraint``, same machine). Only
# orders the queue.
COMPILE_S_PER_CHAR = 35e-6
COMPILE_BASE_S = 0.01


def compile_cost_s(chars: int) -> float:
    """Estimated seconds to compile a constraint of ``chars`` characters (its text, a schema's
    or the choices' JSON): :data:`COMPILE_BASE_S` + ``chars`` x :data:`COMPILE_S_PER_CHAR`.
    What :func:`compiler`'s queue orders jobs by (``pdd.compile_queue.next_job``); never a
    limit."""
    return COMPILE_BASE_S + max(0, int(chars)) * COMPILE_S_PER_CHAR


def compiler():
    """The queue that compiles grammars (:func:`grammar_for`, a guide's matcher): a
    :class:`pdd.compile_queue.CompileQueue` of one thread with a :data:`COMPILER_STACK_BYTES`
    stack, made on first use, that runs the highest response ratio next (``submit_costed(
    compile_cost_s(chars), fn, ...)``: a small constraint overtakes large ones queued before it;
    ``submit``: the least cost, ``pdd.compile_queue.next_job``). Use ``compiler().submit(fn, ...).result()`` from a thread, or
    ``asyncio.wrap_future(compiler().submit_costed(...))`` from the event loop (cancelling that
    future before the job starts drops the job)."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            from pdd.compile_queue import CompileQueue

            _COMPILER = CompileQueue(threads=1, stack_bytes=COMPILER_STACK_BYTES, name="grammar-compile")
        return _COMPILER


def on_compiler(fn, *args, **kw):
    """``fn(*args, **kw)`` on :func:`compiler`'s thread (directly when already on it)."""
    if threading.current_thread().name.startswith("grammar-compile"):
        return fn(*args, **kw)
    return compiler().submit(fn, *args, **kw).result()


def _text_of(kind: str, value) -> str:
    if kind == "json" and not isinstance(value, str):
        return json.dumps(value)
    if kind == "choice" and isinstance(value, list):
        return json.dumps(value)
    return value if isinstance(value, str) else ""


def _llg():
    import llguidance

    return llguidance


# JSON as ``json.dumps`` writes it (``{"a": 1, "b": [2, 3]}``): the form models write unprompted,
# and no run of free whitespace for a weak model to fill to max_tokens (vLLM added
# ``disable_any_whitespace`` for the same reason). A schema's own ``x-guidance`` options apply
# over these (llguidance's JsonCompileOptions).
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def grammar_for(kind: str, value=None, whitespace_pattern: str | None = None) -> str:
    """llguidance grammar text for one constraint.

    ``kind`` (:data:`KINDS`) and ``value``: ``json`` a JSON schema (a dict, or its JSON text);
    ``json_object`` none (any JSON object); ``regex`` a regular expression (Rust ``regex``
    syntax, matched against the whole output); ``choice`` a non-empty list of strings (the
    output is exactly one of them); ``grammar`` a Lark grammar (llguidance's dialect) or a GBNF
    grammar (llama.cpp's). JSON is laid out as :data:`JSON_LAYOUT`; ``whitespace_pattern`` (a
    regex, vLLM's ``guided_whitespace_pattern``) allows that whitespace around ``,`` and ``:``
    instead.

    Raises :class:`GrammarError` (a ``ValueError``) naming what is wrong: an unknown kind, a
    value of the wrong type, a text over :data:`MAX_CONSTRAINT_CHARS`, a lone surrogate (no
    Unicode text: the regex, grammar or choice, or a schema's string or key by its path, its
    JSON text's ``\\ud800`` escapes included), a schema / regex / grammar llguidance rejects.
    Compiles on :func:`compiler`'s thread (this call waits)."""
    too_large = size_refusal(kind, value, whitespace_pattern)
    if too_large is not None:
        raise GrammarError(too_large)
    try:
        key = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON: compiled (and refused) as it is
        return on_compiler(_grammar_for, kind, value, whitespace_pattern)
    return _grammar_cached(kind, key, whitespace_pattern)


def size_refusal(kind: str, value=None, whitespace_pattern: str | None = None) -> str | None:
    """Why :func:`grammar_for` refuses the constraint for its size (its text, a schema's or the
    choices' JSON, plus ``whitespace_pattern``, over :data:`MAX_CONSTRAINT_CHARS` characters),
    else None. Pure: nothing compiled, so the gateway refuses it before it queues for
    :func:`compiler`. Raises what ``json.dumps`` raises for a value that is no JSON."""
    return chars_refusal(len(_text_of(kind, value)) + len(whitespace_pattern or ""))


def chars_refusal(n: int) -> str | None:
    """:func:`size_refusal`'s answer for a constraint of ``n`` characters (counted as it counts
    them). Pure."""
    if n > MAX_CONSTRAINT_CHARS:
        return f"the constraint is {n:,} characters; at most {MAX_CONSTRAINT_CHARS:,} are compiled"
    return None


@lru_cache(maxsize=256)
def _grammar_cached(kind: str, key: str, whitespace_pattern: str | None) -> str:
    """:func:`grammar_for` of the value whose JSON is ``key``, kept for the 256 most recent
    constraints: the same 31 KB GBNF grammar sent again compiled again (1.4 s each) and held
    the one compiler thread from every other constrained request. Errors are not kept."""
    return on_compiler(_grammar_for, kind, json.loads(key), whitespace_pattern)


def check_start(lltok, grammar: str) -> None:
    """:meth:`Guide.check_start` of ``grammar`` over ``lltok`` (raises :class:`GrammarError`
    when no token can begin it, or ``grammar`` does not compile for ``lltok``), its answer kept
    for the 256 most recent (``lltok``, grammar text) pairs as :func:`_grammar_cached` keeps the
    compiled text: it depends on nothing else, and a fresh matcher per constrained request cost
    the compiler thread a compile each time (40 ms for a 1,500-rule grammar)."""
    refused = _start_refusal(lltok, grammar)
    if refused is not None:
        raise GrammarError(refused)


@lru_cache(maxsize=256)
def _start_refusal(lltok, grammar: str) -> str | None:
    """Why :func:`check_start` refuses ``grammar`` over ``lltok`` (None: it does not)."""
    try:
        Guide(lltok, grammar).check_start()
    except GrammarError as e:
        return str(e)
    return None


MAX_EMPTINESS_REFS = 256  # a schema with more distinct $refs is not checked by endless_required (it compiles)


def _pointer(root, ref: str):
    """The node of ``root`` a local ``$ref`` names (``#``, ``#/$defs/X``, any JSON pointer), or
    None for one it does not (a remote ``$ref``, a missing node)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def endless_required(schema) -> str | None:
    """Why JSON schema ``schema`` has no finite instance, when a required property or the items
    of an array of ``minItems`` >= 1 must hold a value of a schema that requires the same again
    (``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}``: ``{"a": {"a":
    ...``): llguidance compiles it and the request fails only at run time, after prefill, once
    its parser gives up (``Too many items``). None when it has one, when this cannot tell
    (keywords it does not read count as satisfiable: it only ever refuses a schema that has no
    finite instance), and for a bare ``$ref`` cycle (no token can begin it: ``check_start``).

    Which nodes have a finite instance is the least fixpoint over the local ``$ref`` targets
    (each assumed to have none, then re-evaluated until nothing changes); a schema with more
    than :data:`MAX_EMPTINESS_REFS` distinct ``$ref``s, or nested past the recursion limit, is
    not checked. Raises nothing."""
    refs: set[str] = set()

    def collect(node) -> None:
        if isinstance(node, dict):
            r = node.get("$ref")
            if isinstance(r, str):
                refs.add(r)
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    def types(node: dict) -> list:
        t = node.get("type")
        return [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []

    def sat(node, table: dict) -> bool:
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        r = node.get("$ref")
        if isinstance(r, str) and not table.get(r, True):
            return False
        if not all(sat(m, table) for m in node.get("allOf") or () if isinstance(node.get("allOf"), list)):
            return False
        for k in ("anyOf", "oneOf"):
            alts = node.get(k)
            if isinstance(alts, list) and alts and not any(sat(m, table) for m in alts):
                return False
        if "enum" in node or "const" in node or not types(node):
            return True  # no type: a value of another type satisfies an object's or array's keywords
        return any(_kind_sat(node, t, table) for t in types(node))

    def _kind_sat(node: dict, t, table: dict) -> bool:
        if t == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            req = node.get("required") if isinstance(node.get("required"), list) else []
            return all(sat(props.get(k, True), table) for k in req if isinstance(k, str))
        if t == "array":
            n = node.get("minItems", 0)
            return not (isinstance(n, int) and n >= 1 and isinstance(node.get("items"), (dict, bool))
                        and not sat(node["items"], table))
        return True

    def why(node, table: dict, seen: set) -> str | None:
        """The first required property (or array items) of ``node`` with no finite value."""
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and id(node) not in seen:
            seen.add(id(node))
            target = _pointer(schema, node["$ref"])
            if target is None or not isinstance(target, dict) or set(node) - {"$ref", "$defs", "definitions"}:
                break
            node = target
        if not isinstance(node, dict) or sat(node, table):
            return None
        if "object" in types(node):
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            for k in node.get("required") or ():
                if isinstance(k, str) and not sat(props.get(k, True), table):
                    return (f"required property {k!r} can hold no finite value: its schema requires a value of "
                            "the same schema again, without end")
        if "array" in types(node) and isinstance(node.get("items"), dict) and not sat(node["items"], table):
            return (f"an array of minItems {node.get('minItems')} whose items can hold no finite value: their schema "
                    "requires a value of the same schema again, without end")
        return None

    try:
        collect(schema)
        if not refs or len(refs) > MAX_EMPTINESS_REFS:
            return None
        table = {r: False for r in refs}
        changed = True
        while changed:
            changed = False
            for r in refs:
                target = _pointer(schema, r)
                v = True if target is None else sat(target, table)
                if v != table[r]:
                    table[r], changed = v, True
        if sat(schema, table):
            return None
        reason = why(schema, table, set())
        return f"no finite JSON value satisfies the schema: {reason}" if reason else None
    except RecursionError:
        return None


def _grammar_for(kind: str, value, whitespace_pattern: str | None) -> str:
    llg = _llg()
    M = llg.LLMatcher
    try:
        if kind == "json":
            if not isinstance(value, (dict, str)):
                raise GrammarError(f"a JSON schema must be an object, not {type(value).__name__}")
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise GrammarError(f"the JSON schema is not JSON: {e}") from None
                if not isinstance(value, dict):
                    raise GrammarError("a JSON schema must be an object")
            found = surrogate_at(value)  # (llguidance: "unexpected end of hex escape")
            if found is not None:
                where, _, at = found
                raise GrammarError(f"the schema's {where} is not valid Unicode text (a lone surrogate at character "
                                   f"{at})")
            endless = endless_required(value)  # llguidance compiles it and fails it at run time
            if endless is not None:
                raise GrammarError(endless)
            g = M.grammar_from_json_schema(json.dumps(value), defaults=dict(JSON_LAYOUT),
                                           overrides=_whitespace(whitespace_pattern))
        elif kind == "json_object":
            g = M.grammar_from_json_schema('{"type": "object"}', defaults=dict(JSON_LAYOUT),
                                           overrides=_whitespace(whitespace_pattern))
        elif kind == "regex":
            if not isinstance(value, str) or not value:
                raise GrammarError("a regex must be a non-empty string")
            _check_unicode(value)
            g = M.grammar_from_regex(value)
        elif kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            for j, c in enumerate(value):
                _check_unicode(c, f"choice {j} is ")
            # one lexeme matching any choice: the lexer's automaton shares their prefixes, where a
            # rule of one alternative per choice put them all in one parser row (llguidance's limit
            # of 2,000 items: 2,000 choices of one prefix failed after the first token)
            g = M.grammar_from_regex("|".join(re.escape(c) for c in value))
        elif kind == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise GrammarError("a grammar must be a non-empty string (Lark or GBNF)")
            _check_unicode(value)
            g = llg.grammar_from("grammar", value)
        else:
            raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError("the grammar nests too deeply to convert") from None
    except (ValueError, TypeError, RuntimeError) as e:
        if "maximum recursion depth" in str(e):  # GBNF -> Lark (Python) wraps its RecursionError
            raise GrammarError("the grammar nests too deeply to convert") from None
        raise GrammarError(str(e)) from None
    err = M.validate_grammar(g, limits=limits())
    if err:
        msg = one_line(err) or "invalid grammar"
        if kind != "grammar":  # a position in the grammar pdd wrapped the value in: meaningless to the client
            msg = re.sub(r"^(at )?\d+\(\d+\):\s*", "", msg)
        raise GrammarError(msg)
    return g


def _check_unicode(text: str, what: str = "") -> None:
    """GrammarError "``what``not valid Unicode text (a lone surrogate at character N)" for a
    lone surrogate in ``text`` (Python's codec's words, or llguidance's "unexpected end of hex
    escape", were the message)."""
    at = lone_surrogate(text)
    if at is not None:
        raise GrammarError(f"{what}not valid Unicode text (a lone surrogate at character {at})")


def _reason(m, no_extension: str) -> str:
    """Why matcher ``m`` is in error, in one line; ``no_extension`` when llguidance's reason is
    only that nothing can follow (its stop reasons ``NoExtension`` / ``NoExtensionBias``)."""
    msg = one_line(m.get_error())
    return no_extension if msg in ("", "NoExtension", "NoExtensionBias") else msg


def one_line(err: str | None) -> str:
    """llguidance's error text in one line: its first line with the ``error:`` line of a
    multi-line report (``invalid regex "[a-z" (in regex): regex parse error: unclosed character
    class``), without the source excerpt and carets; "" for none."""
    lines = [ln.strip() for ln in (err or "").strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    head = lines[0].rstrip(":").strip()
    detail = next((ln[len("error:"):].strip() for ln in lines[1:] if ln.startswith("error:")), "")
    return f"{head}: {detail}" if detail else head


def _whitespace(pattern: str | None) -> dict | None:
    if pattern is None:
        return None
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("a whitespace pattern must be a non-empty string (a regex)")
    _check_unicode(pattern, "the whitespace pattern is ")
    return {"item_separator": ",", "key_separator": ":", "whitespace_flexible": True,
            "whitespace_pattern": pattern}


class _Vocab:
    """llguidance's ``TokenizerWrapper`` protocol over a ``tokenizers.Tokenizer``: the bytes of
    every id (ByteLevel pieces mapped back to bytes), the special ids, the encoder."""

    def __init__(self, tokenizer, eos_id: int, vocab_size: int):
        from pdd.token_bytes import token_bytes

        self._tok = tokenizer
        self.eos_token_id = int(eos_id)
        self.bos_token_id = None
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = sorted(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special and i < vocab_size)
        self.tokens = [token_bytes(tokenizer, i) if i < n else b"" for i in range(vocab_size)]
        self.is_tokenizer_wrapper = True

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False).ids


_LOCK = threading.Lock()
_CACHE: dict = {}


def ll_tokenizer(tokenizer, eos_ids, vocab_size: int):
    """llguidance's ``LLTokenizer`` for a ``tokenizers.Tokenizer`` whose model has
    ``vocab_size`` logits (ids past the tokenizer's own entries are never allowed) and EOS ids
    ``eos_ids`` (the first is the one a complete grammar allows; all end the request). Built
    once per (tokenizer object, eos ids, vocab size): about 5 ms for 1k ids, 1 s for 150k.
    Raises ``ValueError`` when ``eos_ids`` is empty."""
    eos = [int(e) for e in eos_ids]
    if not eos:
        raise ValueError("structured outputs need the model's EOS token id (generation_config.json)")
    key = (id(tokenizer), tuple(eos), int(vocab_size))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        llg = _llg()
        t = llg.LLTokenizer(_Vocab(tokenizer, eos[0], int(vocab_size)), n_vocab=int(vocab_size), eos_token=eos)
        _CACHE[key] = (tokenizer, t)
        return t


def limits():
    """llguidance's parser limits for every matcher pdd builds: its defaults, but 200,000 of
    initial lexer fuel (its default 1,000,000): a 21-character regex such as
    ``((a{100}){100}){110}`` spent about a second of an engine's step thread on its first mask
    before failing ("too many expressions constructed"); with this it fails in tens of ms,
    while a 5,000-way alternation, 2,000 choices or a 300-property schema take 10 to 20 ms."""
    return _llg().LLParserLimits(initial_lexer_fuel=200_000)


_SPECIALS: dict = {}  # id(LLTokenizer) -> (it, its special token ids but EOS)


def _specials(lltok) -> tuple[int, ...]:
    """The special token ids of ``lltok`` other than its EOS ids, found once per tokenizer."""
    hit = _SPECIALS.get(id(lltok))
    if hit is not None and hit[0] is lltok:
        return hit[1]
    eos = set(lltok.eos_tokens)
    ids = tuple(i for i in range(lltok.vocab_size) if i not in eos and lltok.is_special_token(i))
    with _LOCK:
        _SPECIALS[id(lltok)] = (lltok, ids)
    return ids


def _fresh_matcher(lltok, grammar: str):
    """A matcher at the start of ``grammar``, compiled on :func:`compiler`'s thread (about a
    millisecond for a small schema, 40 ms for a 1,500-rule grammar). Never a copy of another
    request's: copies share the lexer's budget of built expressions, so one request's use of
    it failed the next copies of a grammar near llguidance's limit."""
    return on_compiler(_llg().LLMatcher, lltok, grammar, log_level=0, limits=limits())


def has_id(bits: bytes, i: int) -> bool:
    """Whether llguidance's bitmask ``bits`` (:class:`Guide`'s layout: little-endian 32-bit
    words, bit ``i % 32`` of word ``i // 32``, i.e. bit ``i % 8`` of byte ``i // 8``) allows id ``i``."""
    return bool(bits[i // 8] >> (i % 8) & 1)


def with_ids(bits: bytes, ids, allowed: bool) -> bytes:
    """``bits`` (as :func:`has_id`) with each of ``ids`` allowed (``allowed``) or not; the
    torch side of this layout is ``pdd.engine.sampler.unpack_masks``."""
    out = bytearray(bits)
    for i in ids:
        if allowed:
            out[i // 8] |= 1 << (i % 8)
        else:
            out[i // 8] &= ~(1 << (i % 8)) & 0xFF
    return bytes(out)


class Guide:
    """One sequence's place in its grammar, advanced over the outputs it has so far.

    ``allowed(outputs)`` brings the matcher up to ``outputs`` (the sequence's output ids, those
    another tier sampled included) and returns the ids allowed next as llguidance's bitmask:
    ``bytes`` of ``ceil(vocab / 32)`` little-endian 32-bit words, bit ``i % 32`` of word
    ``i // 32`` set when id ``i`` may come next. A token the grammar rejects (possible only if
    a tier sampled without the mask) puts the guide in error: from then on only EOS is allowed
    and :attr:`error` says why.

    Raises :class:`GrammarError` when ``grammar`` does not compile for ``lltok``."""

    def __init__(self, lltok, grammar: str):
        self._m = _fresh_matcher(lltok, grammar)
        self._special = _specials(lltok)  # special ids but EOS: checked one by one in a mask
        self._eos = list(lltok.eos_tokens) or [lltok.eos_token]
        self._vocab = int(lltok.vocab_size)
        self.consumed = 0  # outputs the matcher has consumed
        self.error: str | None = None
        if self._m.is_error():
            raise GrammarError(one_line(self._m.get_error()) or "invalid grammar")
        self._width = len(self._m.compute_bitmask())  # llguidance's own mask width, in bytes

    def _eos_only(self) -> bytes:
        """A mask of EOS alone, as wide as the matcher's own (every row of a batch stacks)."""
        return with_ids(bytes(self._width), [e for e in self._eos if 0 <= e < self._vocab], True)

    def advance(self, outputs: list[int]) -> None:
        """Consume ``outputs[self.consumed:]``. Raises ``ValueError`` if ``outputs`` is shorter
        than what was consumed (a sequence's outputs never shrink)."""
        if len(outputs) < self.consumed:
            raise ValueError(f"outputs shrank from {self.consumed} to {len(outputs)}")
        new = outputs[self.consumed:]
        self.consumed = len(outputs)
        if not new or self.error is not None:
            return
        if self._m.is_stopped():  # complete: only EOS came after it (it ends the request)
            return
        if not self._m.consume_tokens([int(t) for t in new]):
            self.error = one_line(self._m.get_error()) or "a token the grammar does not allow"
            log.warning("structured output: %s; only EOS is allowed from here", self.error)

    def allowed(self, outputs: list[int]) -> bytes:
        """The bitmask of the ids allowed after ``outputs`` (see the class). A matcher that fails
        computing it (a run-time limit of llguidance: ``Current row has 50001 items; max is
        2000`` for a rule of 2,000 alternatives of one shared prefix) sets :attr:`error`: the engine then fails
        the request with it rather than end it with output the grammar does not hold."""
        self.advance(outputs)
        if self.error is not None or self._m.is_stopped():
            return self._eos_only()
        bits = self._m.compute_bitmask()
        if not self._m.is_error():
            bits = self._without_refused_specials(bits)
        if self._m.is_error() or not any(bits):
            self.error = _reason(self._m, "the grammar allows no token after these outputs")
            log.warning("structured output: %s", self.error)
            return self._eos_only()
        return bits

    def _without_refused_specials(self, bits: bytes) -> bytes:
        """``bits`` without the special tokens the matcher would refuse: llguidance's mask allows
        a special token whose text a literal spells (``"<|system|>"``: token 5 on pdd's tiny
        checkpoint) and consuming it then fails the grammar; one written as ``<[5]>`` stays."""
        refused = [t for t in self._special if has_id(bits, t) and self._m.validate_tokens([t]) == 0]
        return with_ids(bits, refused, False) if refused else bits

    def check_start(self) -> None:
        """Raise :class:`GrammarError` unless the grammar allows some token at its start, EOS
        aside (a grammar whose language is empty or only the empty output: ``start: start``, a
        ``$ref`` cycle, ``[^\\s\\S]``), or when llguidance fails computing that first mask."""
        bits = self._m.compute_bitmask()
        if self._m.is_error():
            raise GrammarError(_reason(self._m, "the constraint allows no output: no token can begin it"))
        bits = self._without_refused_specials(bits)
        if not any(with_ids(bits, [e for e in self._eos if 0 <= e < self._vocab], False)):
            raise GrammarError("the constraint allows no output: no token can begin it")

    @property
    def complete(self) -> bool:
        """True when the grammar accepts the outputs consumed so far and allows nothing more."""
        return self._m.is_stopped()
