"""OpenAI's Responses API, ``POST /v1/responses``, served through the chat path.

A Responses request becomes a ``/v1/chat/completions`` request (:func:`chat_body`: the same chat
template, sampling, tool-call parsing and orchestrator call), and the chat result is turned back
into a Responses object (:func:`response_from_chat`) or, streamed, into the Responses API's
semantic SSE events (:func:`response_events`). Nothing about the tiers differs from chat.

Taken (OpenAI's names, as vLLM's ``/v1/responses``): ``model``, ``input`` (a string: one user
message; or a list of items: messages ``{role, content}`` whose content is a string or
``input_text`` / ``output_text`` parts, ``function_call`` items the model made before, and
``function_call_output`` items answering them), ``instructions`` (a system message first),
``max_output_tokens``, ``temperature``, ``top_p``, ``tools`` (function tools in the flat
Responses form ``{type: "function", name, description, parameters}``), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (as chat's ``response_format``), ``top_logprobs`` and
``include`` ``"message.output_text.logprobs"`` (chat's logprobs, on the ``output_text``),
``metadata`` and ``user`` (echoed), ``stream``, ``store`` and ``previous_response_id`` (:class:`ResponseStore`:
responses kept in the gateway's memory, bounded; ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``; ``POST /v1/responses/{id}/cancel`` is a 400), and
``background`` / ``reasoning`` / ``truncation`` and ``include`` values at the values that ask
for nothing. A forced tool call (``tool_choice`` "required" or a named function) and a JSON
``text.format`` are the chat path's structured outputs; what it refuses it refuses here too,
naming the Responses field (:func:`renamed`).

Refused with HTTP 400 naming the parameter (:func:`check_responses`), never ignored: what needs
state pdd does not keep (``conversation``, ``background: true``, ``prompt``, an
``item_reference``), built-in tools (``web_search``, ``file_search``, ``computer_use_preview``,
...) and a ``tool_choice`` naming one or ``allowed_tools``, image / file / audio inputs, a
``reasoning`` effort (the served models have no reasoning mode), an unknown ``include`` value,
``truncation: "auto"``.

The response (non-streamed, and in ``response.completed`` / ``response.incomplete``): ``id``
``resp_`` + 32 hex digits, new for each response (:func:`new_response_id`; the client's
``X-Request-Id`` names the request, as for chat, not the response), ``object``
"response", ``created_at`` (Unix seconds), ``status`` "completed", or "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when the output hit ``max_output_tokens``,
``output``: a ``message`` item (``output_text`` content) when the model wrote text, then one
``function_call`` item (``call_id``, ``name``, ``arguments`` as a JSON string) per parsed call;
``usage``: ``input_tokens`` (with ``input_tokens_details.cached_tokens``), ``output_tokens``
(``output_tokens_details.reasoning_tokens`` 0), ``total_tokens``. ``output_text`` is not sent:
the official client computes it from ``output``, as OpenAI's server leaves it out.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, field_validator

from pdd.gateway.openai_schemas import (MAX_LOGPROBS, ApiError, ChatCompletionRequest, bad_description,
                                        bad_function_name, bad_parameters, duplicate_name, lone_surrogate, not_strict_json,
                                        not_unicode)
from pdd.text import shown, surrogate_at

MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 4096  # items in one input list (chat's messages have no bound but the body's size)

# Responses tool types that are built-in tools, run by OpenAI's servers: pdd runs no tools
BUILTIN_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                           "web_search_2025_08_26", "file_search", "computer_use_preview", "computer_use",
                           "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                           "custom"})
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS = "message.output_text.logprobs"  # the include value that asks for the output's logprobs
# include values that ask for data of items pdd never outputs (or refuses as input): nothing to add
INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                             "web_search_call.action.sources", "message.input_image.image_url",
                             "computer_call_output.output.image_url", "code_interpreter_call.outputs"})
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (OpenAI's names). Unknown fields are ignored (as chat's
    body); the ones pdd cannot honour are declared so :func:`check_responses` refuses them."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: Any  # a string or a list of items: checked by read_input (a 400 naming what is allowed)
    instructions: StrictStr | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    tools: list[Any] | None = None
    tool_choice: Any = None  # checked by chat_tool_choice
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    stream: StrictBool | None = None
    # asked for nothing at their defaults; any other value is refused (check_responses)
    store: StrictBool | None = None
    background: StrictBool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncation: str | None = None
    # hints that change nothing pdd does: accepted (max_tool_calls bounds built-in tool calls, of which there are none)
    max_tool_calls: int | None = Field(None, ge=1)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("max_output_tokens", "max_tool_calls", "top_logprobs", mode="before")
    @classmethod
    def _json_integer(cls, v):
        """A JSON ``true`` or a string for an integer is refused (a 400 naming the field), as
        chat's body refuses them: pydantic's lax mode reads ``true`` as 1 and ``"5"`` as 5."""
        if isinstance(v, bool):
            raise ValueError(f"must be an integer, got {str(v).lower()}")
        if isinstance(v, str):
            raise ValueError(f"must be an integer, got a string {shown(v)}")
        return v


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(message, param)


def check_responses(body: ResponsesRequest) -> None:
    """ApiError (400, ``param`` naming the field) for what pdd cannot honour (module docstring),
    for bad ``metadata`` and for a lone surrogate in any field but ``input`` and
    ``instructions`` (checked as they are converted): the response echoes ``user``,
    ``metadata``, ``tools``, ``text``, and a surrogate there made its rendering a 500 after the
    model had run, and its stored copy a 500 on every ``GET``. ``input``, ``tools``,
    ``tool_choice`` and ``text.format`` are checked as they are converted
    (:func:`read_input`, :func:`chat_tools`, :func:`chat_tool_choice`,
    :func:`chat_response_format`); a function tool's name first (:func:`bad_function_name`,
    naming ``tools[i].name``: a lone surrogate there is a name OpenAI's pattern refuses)."""
    for i, t in enumerate(body.tools or ()):
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str) and t["name"]:
            bad = bad_function_name(t["name"], f"tools[{i}].name")
            if bad:
                raise _refuse(f"tools[{i}].name", bad)
    for name, value in body.model_dump(exclude={"input", "instructions"}).items():
        found = surrogate_at(value, name)
        if found is not None:
            raise not_unicode(*found)
    if body.background:
        raise _refuse("background", "background: true is not supported: pdd runs a request only while its "
                      "client waits; leave background out (stream: true gives the output as it is made)")
    if body.conversation is not None:
        raise _refuse("conversation", "conversation is not supported: pdd keeps no conversation state; send the "
                      "whole conversation in input")
    if body.prompt is not None:
        raise _refuse("prompt", "prompt (a stored prompt template) is not supported: pdd stores no prompts; send "
                      "instructions and input")
    r = body.reasoning or {}
    if r.get("effort") not in (None, "none") or r.get("summary") is not None or r.get("generate_summary") is not None:
        raise _refuse("reasoning", f"reasoning {shown(r)} is not supported: the served model has no reasoning "
                      "mode; leave reasoning out")
    verbosity = (body.text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise _refuse("text", f"text.verbosity {shown(verbosity)} is not supported: leave it out")
    for i, v in enumerate(body.include or ()):
        if not isinstance(v, str) or (v != LOGPROBS and v not in INCLUDE_NOTHING):  # a list is unhashable
            raise _refuse("include", f"include[{i}]: {shown(v)} is not one of {LOGPROBS!r}, "
                          f"{', '.join(repr(x) for x in sorted(INCLUDE_NOTHING))}")
    if body.truncation not in (None, "disabled"):
        raise _refuse("truncation", f"truncation {shown(body.truncation)} is not supported: a conversation "
                      "longer than the context window is refused, never cut; send truncation 'disabled'")
    md = body.metadata
    if md is not None:
        if len(md) > MAX_METADATA_KEYS:
            raise _refuse("metadata", f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(md)}")
        for k, v in md.items():
            if len(k) > MAX_METADATA_KEY_CHARS:
                raise _refuse("metadata", f"metadata: key {shown(k)} is longer than {MAX_METADATA_KEY_CHARS} "
                              "characters")
            if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_CHARS:
                raise _refuse("metadata", f"metadata[{shown(k)}]: must be a string of at most "
                              f"{MAX_METADATA_VALUE_CHARS} characters")


def _text_of(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string, or a list of text parts of ``kinds``) as one string (parts
    joined with newlines, as chat joins its text parts). ApiError whose ``param`` is the field
    (``where``, e.g. ``input[2].content``, or its part ``input[2].content[1]``) for media parts,
    a lone surrogate (not Unicode text) and anything else."""
    if isinstance(content, str):
        bad = lone_surrogate(content)
        if bad is not None:
            raise _refuse(where, f"{where}: not valid Unicode text (a lone surrogate at character {bad})")
        return content
    if not isinstance(content, list):
        raise _refuse(where, f"{where}: must be a string or a list of content parts, got "
                      f"{type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise _refuse(f"{where}[{j}]", f"{where}[{j}]: content of type {kind!r} is not supported: the served "
                          "model takes text only")
        if kind in kinds and "text" in part and not isinstance(part["text"], str):  # the part's own field
            raise _refuse(f"{where}[{j}].text", f"{where}[{j}].text: must be a string, got {shown(part['text'])}")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}[{j}]", f"{where}[{j}]: must be a text part ({' or '.join(kinds)} with a string "
                          f"'text'), got {shown(part)}")
        texts.append(_text_of(part["text"], f"{where}[{j}].text", kinds))
    return "\n".join(texts)


@dataclass
class Input:
    """A Responses request's ``input``, read once (:func:`read_input`): ``messages`` its chat
    messages, ``listed`` its items as ``GET /v1/responses/{id}/input_items`` lists them."""

    messages: list[dict]
    listed: list[dict]


def chat_messages(body: ResponsesRequest, prior: list[dict] | None = None,
                  read: Input | None = None) -> list[dict]:
    """The chat messages of a Responses request: ``instructions`` as a system message, then
    ``prior`` (the conversation of the ``previous_response_id``, :class:`ResponseStore`: its
    instructions are not carried over, as OpenAI's), then ``read``'s messages (``input`` read
    here, :func:`read_input`, when None)."""
    msgs: list[dict] = []
    if body.instructions:
        bad = lone_surrogate(body.instructions)
        if bad is not None:
            raise _refuse("instructions", f"instructions: not valid Unicode text (a lone surrogate at character "
                          f"{bad})")
        msgs.append({"role": "system", "content": body.instructions})
    msgs += [dict(m) for m in prior or ()]
    read = read if read is not None else read_input(body, prior)
    return msgs + copy.deepcopy(read.messages)


def _listed_message(given: str | None, role: str, content) -> dict:
    """A message item as ``input_items`` lists it: string content as one ``input_text`` part
    (``output_text``, with ``annotations`` [], an assistant's), parts as sent otherwise."""
    if isinstance(content, str):
        content = [{"type": "output_text", "text": content, "annotations": []} if role == "assistant"
                   else {"type": "input_text", "text": content}]
    else:
        content = [{**p, "annotations": p.get("annotations") or []} if p.get("type") == "output_text"
                   else dict(p) for p in content]
    return {"id": given or f"msg_{_hex()}", "type": "message", "role": role, "status": "completed",
            "content": content}


def read_input(body: ResponsesRequest, prior: list[dict] | None = None) -> Input:
    """``input`` read in one walk, as chat messages and as its listed items (:class:`Input`).

    Messages: a string is one user message; in a list, each message item is a chat message, a
    run of ``function_call`` items the ``tool_calls`` of one assistant message (the assistant
    message item just before them if there is one: the model's turn, its text, then its
    calls), each ``function_call_output`` a ``tool`` message. Listed items (input order): each
    keeps the ``id`` the client sent (a response's output items fed back), else gets one:
    ``msg_`` for a message (a string ``input`` is one user message), ``fc_`` for a
    ``function_call``, ``fco_`` for a ``function_call_output`` (+ 24 hex digits); ``status``
    "completed"; a message's string content one ``input_text`` part (``output_text``, with
    ``annotations`` [], an assistant's), its parts as sent otherwise.

    ApiError (400) whose ``param`` is the field at fault, as its message names it: ``input``
    for an ``input`` that is no string or non-empty list; ``input[i]`` for an item pdd cannot
    take (module docstring), ``input[i].type`` for an unknown item type, ``input[i].role`` /
    ``.content`` / ``.content[j]`` for a message's; for a ``function_call``, ``input[i].name``
    for a name that is not the tools' ``^[a-zA-Z0-9_-]{1,64}$`` (:func:`bad_function_name`),
    ``input[i].arguments`` for ``arguments`` that are not strict JSON text (``NaN``,
    ``Infinity``, a number too large for a float: :func:`not_strict_json`), ``input[i].call_id``
    for a ``call_id`` an earlier ``function_call`` item of ``input`` or a tool call of ``prior``'s
    assistant turns (the ``previous_response_id`` chain's conversation, chat messages) has; for a
    ``function_call_output``, ``input[i].call_id`` for a ``call_id`` that is no ``function_call``
    item's before it in ``input`` nor a tool call of ``prior``'s, or that an earlier
    ``function_call_output`` of ``input`` or a ``tool`` message of ``prior`` answers already, as
    OpenAI refuses them (an output before its call would put the result before the model asked
    for it in the rendered conversation); after those, the path of the first lone surrogate in any
    other string of the items or key (``input[0].id``, ``input[0].content[0].x``; a key: the
    object holding it, :func:`pdd.text.surrogate_at`), which ``input_items`` would list as sent."""
    items = body.input
    if isinstance(items, str):
        return Input([{"role": "user", "content": _text_of(items, "input", ())}],
                     [_listed_message(None, "user", items)])
    if not isinstance(items, list) or not items:
        got = "" if isinstance(items, list) else f", got {shown(items)}"
        raise _refuse("input", f"input: must be a string or a non-empty list of items{got}")
    if len(items) > MAX_INPUT_ITEMS:
        raise _refuse("input", f"input: at most {MAX_INPUT_ITEMS} items, got {len(items)}")
    msgs: list[dict] = []
    listed: list[dict] = []
    # the call ids an output may answer: the prior turns' tool calls, then input's function_call items
    calls = {c["id"] for m in prior or () if m.get("role") == "assistant" for c in m.get("tool_calls") or ()}
    chained = frozenset(calls)  # the chain's calls: input may answer them, not make them again
    done = {m.get("tool_call_id") for m in prior or () if m.get("role") == "tool"}  # the chain's answered calls
    made: dict[str, int] = {}  # call id -> the function_call item of input making it
    outputs: list[tuple[int, str, bool]] = []  # (input index, call id, its call came before) per function_call_output
    for i, it in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(it, dict):
            raise _refuse(at, f"{at}: must be an object (a message or a function call item), got "
                          f"{type(it).__name__}")
        kind = it.get("type", "message")
        given = it.get("id") if isinstance(it.get("id"), str) and it.get("id") else None
        if kind == "message":
            role = it.get("role")
            if role not in MESSAGE_ROLES:
                raise _refuse(f"{at}.role", f"{at}.role: must be one of {', '.join(MESSAGE_ROLES)}, got "
                              f"{shown(role)}")
            if "content" not in it:
                raise _refuse(f"{at}.content", f"{at}.content: required")
            kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            msgs.append({"role": role, "content": _text_of(it["content"], f"{at}.content", kinds)})
            listed.append(_listed_message(given, role, it["content"]))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(it.get(key), str) or (key != "arguments" and not it[key]):
                    raise _refuse(f"{at}.{key}", f"{at}.{key}: required, a string")
                _text_of(it[key], f"{at}.{key}", ())  # valid Unicode text
            bad = bad_function_name(it["name"], f"{at}.name")  # the tools' names' rule: a call names one
            if bad:
                raise _refuse(f"{at}.name", bad)
            bad = not_strict_json(it["arguments"])
            if bad is not None:
                raise _refuse(f"{at}.arguments", f"{at}.arguments: must be strict JSON text: {bad} is not a JSON "
                              f"number (JSON numbers are finite), got {shown(it['arguments'])}")
            try:
                json.loads(it["arguments"])
            except RecursionError:  # deeper than the decoder's recursion: never a 500
                raise _refuse(f"{at}.arguments", f"{at}.arguments: JSON nested too deeply to read (the call's "
                              f"arguments as JSON text), got {shown(it['arguments'])}") from None
            except ValueError as e:
                # valid JSON Python's int() refuses (sys.get_int_max_str_digits: 4,300 digits)
                why = "" if isinstance(e, json.JSONDecodeError) else " (it holds an integer of more than 4,300 digits)"
                raise _refuse(f"{at}.arguments", f"{at}.arguments: must be a JSON string (the call's arguments as "
                              f"JSON text){why}, got {shown(it['arguments'])}") from None
            if it["call_id"] in chained:
                raise _refuse(f"{at}.call_id", f"{at}.call_id: Duplicate function call with call_id "
                              f"{shown(it['call_id'])}: the previous_response_id chain has it already")
            j = made.setdefault(it["call_id"], i)
            if j != i:
                raise _refuse(f"{at}.call_id", f"{at}.call_id: Duplicate function call with call_id "
                              f"{shown(it['call_id'])}: input[{j}] has it already")
            calls.add(it["call_id"])
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # the model's turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            listed.append({"id": given or f"fc_{_hex()}", "type": "function_call", "status": "completed",
                           "call_id": it["call_id"], "name": it["name"], "arguments": it["arguments"]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not it["call_id"]:
                raise _refuse(f"{at}.call_id", f"{at}.call_id: required, a string")
            _text_of(it["call_id"], f"{at}.call_id", ())
            if "output" not in it:
                raise _refuse(f"{at}.output", f"{at}.output: required")
            output = it["output"]
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": _text_of(output, f"{at}.output", ("input_text",))})
            listed.append({"id": given or f"fco_{_hex()}", "type": "function_call_output", "status": "completed",
                           "call_id": it["call_id"], "output": output if isinstance(output, str) else list(output)})
            outputs.append((i, it["call_id"], it["call_id"] in calls))
        elif kind == "item_reference":
            raise _refuse(at, f"{at}: item_reference is not supported: send the item itself (or the "
                          "response's id as previous_response_id)")
        elif kind == "reasoning":
            raise _refuse(at, f"{at}: a reasoning item is not supported: the served model has no reasoning "
                          "mode")
        else:
            raise _refuse(f"{at}.type", f"{at}.type: item type {shown(kind)} is not supported (message, function_call and "
                          "function_call_output are)")
    answered: dict[str, int] = {}  # call id -> the input item answering it
    for i, cid, before in outputs:  # after the walk: an output before its call is named as such
        if cid in made and not before:
            raise _refuse(f"input[{i}].call_id", f"input[{i}].call_id: the function call output for call_id "
                          f"{shown(cid)} comes before its function call (input[{made[cid]}]); an output must "
                          "follow its call")
        if cid not in calls:
            raise _refuse(f"input[{i}].call_id", f"input[{i}].call_id: No tool call found for function call output "
                          f"with call_id {shown(cid)}")
        if cid in done:
            raise _refuse(f"input[{i}].call_id", f"input[{i}].call_id: Duplicate function call output for call_id "
                          f"{shown(cid)}: the previous_response_id chain answers it already")
        j = answered.setdefault(cid, i)
        if j != i:
            raise _refuse(f"input[{i}].call_id", f"input[{i}].call_id: Duplicate function call output for call_id "
                          f"{shown(cid)}: input[{j}] answers it already")
    # what the walk above did not read as text (an item's id, a part's other keys, annotations) is
    # kept as sent and listed by input_items: a lone surrogate there made every GET of it a 500
    found = surrogate_at(items, "input")
    if found is not None:
        raise not_unicode(*found)
    return Input(msgs, listed)


def chat_tools(tools: list | None) -> list[dict] | None:
    """Responses function tools (flat: ``{type, name, description, parameters, strict}``) as
    chat's (``{type: "function", function: {...}}``); ApiError naming ``tools`` for a built-in
    tool or one of another type, ``tools[i].name`` for a name that is no string or not OpenAI's
    (:func:`bad_function_name`) or an earlier tool's, ``tools[i].description`` for a
    ``description`` that is no string (:func:`bad_description`), ``tools[i].parameters`` for
    ``parameters`` that are not a JSON object (:func:`bad_parameters`, whatever ``tool_choice``
    is)."""
    if not tools:
        return None
    out = []
    first: dict[str, int] = {}
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in BUILTIN_TOOLS or (isinstance(kind, str) and kind.startswith(("web_search", "computer_use"))):
            raise _refuse("tools", f"tools[{i}]: the built-in tool {kind!r} is not supported: pdd runs no tools; "
                          "only function tools (type 'function'), which the client runs")
        if kind != "function":
            raise _refuse("tools", f"tools[{i}]: must be a function tool (type 'function'), got {shown(t)}")
        for field, check in (("name", bad_function_name), ("description", bad_description),
                             ("parameters", bad_parameters)):
            bad = check(t.get(field), f"tools[{i}].{field}")
            if bad:
                raise _refuse(f"tools[{i}].{field}", bad)
        dup = duplicate_name(first, t["name"], i, f"tools[{i}].name")
        if dup:
            raise _refuse(f"tools[{i}].name", dup)
        fn = {"name": t["name"]}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(tc):
    """``tool_choice`` as chat's: "auto", "none" and "required" as they are, ``{"type": "function",
    "name": N}`` as ``{"type": "function", "function": {"name": N}}`` (a forced call: the chat
    path's structured output, whose checks hold). ApiError naming ``tool_choice`` for
    ``allowed_tools``, a built-in tool's and anything else."""
    if tc is None or tc in ("auto", "none", "required"):
        return tc
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind == "function":
        if not isinstance(tc.get("name"), str) or not tc["name"]:
            raise _refuse("tool_choice", "tool_choice.name: required, a non-empty string (the function to call)")
        return {"type": "function", "function": {"name": tc["name"]}}
    if kind == "allowed_tools":
        raise _refuse("tool_choice", "tool_choice allowed_tools is not supported: send 'auto' with the tools the "
                      "model may call")
    if isinstance(tc, dict):
        raise _refuse("tool_choice", f"tool_choice {shown(tc)} is not supported: pdd runs no built-in tools; send "
                      "'auto' or 'none'")
    raise _refuse("tool_choice", f"tool_choice: must be 'auto', 'none', 'required' or an object, got {shown(tc)}")


def chat_response_format(text: dict | None) -> dict | None:
    """``text.format`` as chat's ``response_format`` (None for plain text): ``json_schema`` (its
    ``name``, ``schema``, ``strict``, ``description``) as ``{"type": "json_schema", "json_schema":
    {...}}``, ``json_object`` as it is (the chat path's structured outputs, whose checks hold).
    ApiError naming ``text`` for another type."""
    fmt = (text or {}).get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise _refuse("text", f"text.format: must be an object of type 'text', 'json_schema' or 'json_object', got "
                  f"{shown(fmt)}")


def chat_body(body: ResponsesRequest, prior: list[dict] | None = None) -> tuple[ChatCompletionRequest, Input]:
    """The ``/v1/chat/completions`` request a Responses request runs as (one choice; streamed
    with usage when ``stream``), and its ``input`` as read (:func:`read_input`); ``prior``: the
    previous response's conversation (chat messages, :class:`ResponseStore`). ApiError (400)
    for what :func:`check_responses` refuses and for bad ``input``, ``tools`` or
    ``tool_choice``."""
    check_responses(body)
    read = read_input(body, prior)
    messages = chat_messages(body, prior, read)
    tools = chat_tools(body.tools)
    tool_choice = chat_tool_choice(body.tool_choice)
    response_format = chat_response_format(body.text)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    for src, dst in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("user", "user"), ("parallel_tool_calls", "parallel_tool_calls")):
        v = getattr(body, src)
        if v is not None:
            chat[dst] = v
    if tools is not None:
        chat["tools"] = tools
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if response_format is not None:
        chat["response_format"] = response_format
    if wants_logprobs(body):
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(chat), read
    except ValidationError as e:  # checked above; a difference between the two bodies' rules still says so
        err = e.errors()[0]
        raise ApiError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}", None) from None


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output's logprobs are asked for: ``include`` has
    ``"message.output_text.logprobs"``, or ``top_logprobs`` is above 0 (which asks for them:
    never dropped silently)."""
    return LOGPROBS in (body.include or ()) or bool(body.top_logprobs)


# chat's names in an error raised by the chat path -> the Responses request's: in its param, in its message
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text"}
_WORDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format.json_schema": "text.format", "response_format": "text.format"}


# chat's tools[i].function.parameters is Responses' tools[i].parameters (its tools are flat)
_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\.")


def renamed(e: ApiError) -> ApiError:
    """``e`` (raised by the chat path) with chat's parameter names replaced by the Responses
    request's (``messages`` -> ``input``, ``max_completion_tokens`` and ``max_tokens`` ->
    ``max_output_tokens``, ``response_format`` -> ``text`` / ``text.format``, its
    ``json_schema`` fields being ``text.format``'s own, a tool's ``tools[i].function.X`` ->
    ``tools[i].X``), in ``param`` and in the message: ``param``
    ``response_format.json_schema.schema`` is ``text.format.schema``."""
    param = e.param
    if param is not None and param.startswith("response_format."):
        param = "text.format." + param.removeprefix("response_format.").removeprefix("json_schema.")
    elif param is not None:
        head, sep, tail = param.partition("[")
        param = _CHAT_TOOL.sub(r"tools[\1].", _PARAMS.get(head, head) + sep + tail)
    msg = _CHAT_TOOL.sub(r"tools[\1].", e.message)
    for old, new in _WORDS.items():
        msg = msg.replace(old, new)
    e.message, e.param = msg, param
    e.args = (msg,)
    return e


def _renamed_failure(out: JSONResponse) -> JSONResponse:
    """The chat path's failed-after-start answer ``out`` with its ``param`` (a 400's: the field
    of the constraint whose grammar failed at run time) and message in the Responses request's
    names (:func:`renamed`: ``response_format`` -> ``text``); ``out`` itself when it names no
    field."""
    err = json.loads(out.body).get("error") or {}
    if err.get("param") is None:
        return out
    e = renamed(ApiError(err.get("message", ""), err["param"], out.status_code, err.get("code"),
                         err.get("type", "invalid_request_error")))
    return JSONResponse(e.body(), status_code=out.status_code)


def new_response_id() -> str:
    """A response's id: ``resp_`` + a fresh uuid4's 32 hex digits, unique per response (the
    client's ``X-Request-Id`` correlates the request in logs and headers, but one header sent
    twice must not make two responses one id: the second would replace the first in the store)."""
    return "resp_" + uuid.uuid4().hex


def _hex() -> str:
    return secrets.token_hex(12)


class Shell:
    """What a response object repeats from its request, and the response's id (``rid``:
    :func:`new_response_id` when None)."""

    def __init__(self, body: ResponsesRequest, model: str, stored: bool = False, rid: str | None = None):
        self.body, self.model, self.stored = body, model, stored
        self.rid = rid if rid is not None else new_response_id()

    def response(self, rid: str, created: int, status: str, output: list, usage: dict | None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        b = self.body
        tc = b.tool_choice if b.tool_choice is not None else "auto"
        return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
                "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "max_tool_calls": b.max_tool_calls, "model": self.model, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": self.stored, "temperature": b.temperature,
                "text": {"format": (b.text or {}).get("format") or {"type": "text"}}, "tool_choice": tc,
                "tools": list(b.tools or []), "top_logprobs": b.top_logprobs, "top_p": b.top_p,
                "truncation": "disabled", "usage": usage, "user": b.user, "metadata": dict(b.metadata or {})}


def usage_from_chat(u: dict | None) -> dict | None:
    """Chat's ``usage`` in the Responses API's names."""
    if u is None:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete_details.reason) for a chat choice's finish reason: "length" is the
    output cut at max_output_tokens; "abort" (its stream ended without a finish token) is
    incomplete with no reason OpenAI names."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def _text_part(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, list(logprobs or []))]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def response_from_chat(shell: Shell, chat: dict) -> dict:
    """The Responses object of a non-streamed chat completion ``chat`` (one choice): when it is
    ``incomplete`` (cut by ``max_output_tokens``), its last output item (a call's arguments cut,
    or the message) is ``incomplete``, the items before it ``completed``, as streamed. Its
    logprobs (when asked: :func:`wants_logprobs`) are the message's ``output_text.logprobs``,
    chat's entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``) for every generated
    token, a tool call's text included; [] when not asked."""
    (choice,) = chat["choices"]
    lps = (choice.get("logprobs") or {}).get("content") or []
    msg = choice["message"]
    status, reason = _status(choice["finish_reason"])
    output = []
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        output.append(_message_item(f"msg_{_hex()}", msg.get("content") or "", "completed", lps))
    for c in calls:
        output.append(_call_item(f"fc_{_hex()}", c["id"], c["function"]["name"], c["function"]["arguments"],
                                 "completed"))
    if status == "incomplete":  # the item the output was cut in (a message before a call was whole)
        output[-1]["status"] = "incomplete"
    return shell.response(shell.rid, chat["created"], status, output, usage_from_chat(chat.get("usage")), reason)


def _event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"


async def response_events(shell: Shell, chat_sse, created: int, on_done=None):
    """The Responses API's SSE events (``event: <type>`` then ``data: {type, sequence_number,
    ...}``, sequence numbers 0, 1, ...) of a streamed chat completion ``chat_sse`` (its
    ``data:`` lines, one choice, usage chunk included): ``response.created``,
    ``response.in_progress``; for text, ``response.output_item.added`` (a message item),
    ``response.content_part.added``, one ``response.output_text.delta`` per chat content delta
    (its ``logprobs``: those of its tokens and of tokens held back before it, when asked),
    then ``response.output_text.done``, ``response.content_part.done``,
    ``response.output_item.done``; per tool call, ``response.output_item.added`` (a
    function_call item), ``response.function_call_arguments.delta`` per chat arguments piece,
    then, once the call is whole (the next call starts or the stream ends),
    ``response.function_call_arguments.done`` and ``response.output_item.done`` (the item
    ``incomplete`` when the output was cut by ``max_output_tokens`` in it); last
    ``response.completed`` (``response.incomplete`` when the output hit ``max_output_tokens``)
    with the whole response, which is handed to ``on_done`` first (the store's, when stored). A
    chat error chunk ends it with ``response.failed`` (``error.code`` the chunk's type when it is
    the request's own failure, "invalid_request_error" as the non-streamed 400's, else
    "server_error"; a call still open is ``incomplete``). However the stream ends, the chat
    stream is closed, which aborts what still runs on the tiers (as chat does)."""
    seq = 0
    rid = None
    output: list[dict] = []
    msg: dict | None = None  # the open message item
    texts: list[str] = []
    lps: list[dict] = []  # every token's logprobs (when asked), the message's at its end
    pending: list[dict] = []  # those of tokens whose text is not out yet (held back), sent with the next delta
    calls: dict[int, dict] = {}  # chat tool call index -> its function_call item
    finish = None
    usage = None

    def ev(kind, **fields):
        nonlocal seq
        s = _event(kind, seq, **fields)
        seq += 1
        return s

    def close_message():
        nonlocal msg
        if msg is None:
            return []
        text = "".join(texts)
        i = output.index(msg)
        status = "incomplete" if _status(finish)[0] == "incomplete" else "completed"
        part = _text_part(text, list(lps))
        done = _message_item(msg["id"], text, status, lps)
        output[i] = done
        out = [ev("response.output_text.done", item_id=msg["id"], output_index=i, content_index=0, text=text,
                  logprobs=list(lps)),
               ev("response.content_part.done", item_id=msg["id"], output_index=i, content_index=0, part=part),
               ev("response.output_item.done", output_index=i, item=done)]
        msg = None
        return out

    def close_calls(cut: bool = False):
        """``.done`` events of the open calls: whole (the next call starts), or, ``cut``, the
        output's end, which leaves an ``incomplete`` response's open call ``incomplete``."""
        out = []
        for item in calls.values():
            if item["status"] == "in_progress":
                i = output.index(item)
                out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              arguments=item["arguments"]))
                item["status"] = "incomplete" if cut and _status(finish)[0] == "incomplete" else "completed"
                out.append(ev("response.output_item.done", output_index=i, item=dict(item)))
        return out

    async with contextlib.aclosing(chat_sse) as chunks:
        async for raw in chunks:
            line = raw.decode() if isinstance(raw, bytes) else raw
            if not line.startswith("data: ") or line.startswith("data: [DONE]"):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                err = chunk["error"]
                if rid is None:  # failed before its first chunk: nothing was sent yet
                    rid = shell.rid
                    yield ev("response.created", response=shell.response(rid, created, "in_progress", [], None))
                for s in close_message():
                    yield s
                for item in calls.values():  # arguments cut by the failure
                    if item["status"] == "in_progress":
                        item["status"] = "incomplete"
                # the request's own failure (its grammar failed) reads as the non-streamed 400 does
                code = "invalid_request_error" if err.get("type") == "invalid_request_error" else "server_error"
                yield ev("response.failed", response=shell.response(
                    rid, created, "failed", output, None, error={"code": code, "message": err.get("message", "")}))
                return
            if rid is None:
                rid, shell.model = shell.rid, chunk.get("model", shell.model)
                head = shell.response(rid, created, "in_progress", [], None)
                yield ev("response.created", response=head)
                yield ev("response.in_progress", response=head)
            if chunk.get("usage") is not None and not chunk.get("choices"):
                usage = usage_from_chat(chunk["usage"])
                continue
            for ch in chunk.get("choices", ()):
                delta = ch.get("delta") or {}
                if ch.get("finish_reason") is not None:
                    finish = ch["finish_reason"]
                text = delta.get("content")
                got = (ch.get("logprobs") or {}).get("content") or []
                lps.extend(got)
                pending.extend(got)
                if text:
                    if msg is None:
                        msg = {"id": f"msg_{_hex()}", "type": "message", "role": "assistant",
                               "status": "in_progress", "content": []}
                        output.append(msg)
                        i = len(output) - 1
                        yield ev("response.output_item.added", output_index=i, item=dict(msg))
                        yield ev("response.content_part.added", item_id=msg["id"], output_index=i, content_index=0,
                                 part=_text_part("", []))
                    texts.append(text)
                    yield ev("response.output_text.delta", item_id=msg["id"], output_index=output.index(msg),
                             content_index=0, delta=text, logprobs=pending)
                    pending = []
                for tc in delta.get("tool_calls") or ():
                    fn = tc.get("function") or {}
                    if tc.get("id") is not None:  # a call's first chunk: its id and name
                        for s in close_message():
                            yield s
                        for s in close_calls():  # a call starts once the ones before it are whole
                            yield s
                        item = _call_item(f"fc_{_hex()}", tc["id"], fn.get("name", ""), "", "in_progress")
                        calls[tc["index"]] = item
                        output.append(item)
                        yield ev("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                    if fn.get("arguments"):
                        item = calls[tc["index"]]
                        item["arguments"] += fn["arguments"]
                        yield ev("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=output.index(item), delta=fn["arguments"])
    for s in close_message():
        yield s
    for s in close_calls(cut=True):
        yield s
    if rid is None:  # the chat stream ended with no chunk at all (it always sends its role chunk first)
        return
    status, reason = _status(finish)
    done = shell.response(rid, created, status, output, usage, reason)
    if on_done is not None:
        on_done(done)
    yield ev("response.incomplete" if status == "incomplete" else "response.completed", response=done)


MAX_STORED_RESPONSES = 1024  # responses kept for previous_response_id and GET /v1/responses/{id}
MAX_STORED_CHARS = 64 * 1024 * 1024  # their JSON (response and conversation), characters in all


def output_turn(output: list[dict]) -> dict:
    """A response's ``output`` items as the assistant chat message the model's turn was: its
    text (``content``, "" for none) and its ``function_call`` items as ``tool_calls``."""
    text = "".join(p.get("text", "") for o in output if o["type"] == "message" for p in o["content"])
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


MAX_LIST_LIMIT = 100  # input_items' limit: 1 to 100, 20 by default (OpenAI's)
DEFAULT_LIST_LIMIT = 20


def list_page(items: list[dict], query, rid: str) -> dict:
    """OpenAI's list object (``object`` "list", ``data``, ``first_id``, ``last_id``,
    ``has_more``) of ``items`` (input order) for the query parameters ``query`` (a mapping of
    strings): ``limit`` (1 to 100, default 20), ``order`` ("asc": input order, or "desc", the
    default), ``after`` (an item id: the page starts after it). ApiError (400) naming the
    parameter for a bad value, an ``after`` no item of response ``rid`` has included."""
    raw = query.get("limit")
    limit = DEFAULT_LIST_LIMIT
    if raw is not None:
        if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_LIST_LIMIT:
            raise _refuse("limit", f"limit: must be an integer from 1 to {MAX_LIST_LIMIT}, got {shown(raw)}")
        limit = int(raw)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _refuse("order", f"order: must be 'asc' or 'desc', got {shown(order)}")
    seq = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, it in enumerate(seq) if it["id"] == after), None)
        if at is None:
            raise _refuse("after", f"after: {shown(after)} is not an input item of response {shown(rid)}")
        seq = seq[at + 1:]
    data = seq[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(seq) > limit}


class ResponseStore:
    """Responses kept in this gateway's memory (not across gateways or restarts), newest last:
    at most ``max_items`` and ``max_chars`` characters of JSON (each response, its
    conversation, the chat messages after its instructions, its output turn included, and its
    input items as ``input_items`` lists them: :func:`read_input`); the oldest go first, and
    one larger than ``max_chars`` alone is not kept. OpenAI's ``store`` default is true: a
    response is kept unless its request sends ``store: false``."""

    def __init__(self, max_items: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_items, self.max_chars = max_items, max_chars
        # id -> (response, conversation, input items, chars)
        self.items: dict[str, tuple[dict, list[dict], list[dict], int]] = {}
        self.chars = 0

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> None:
        input_items = list(input_items or ())
        size = len(json.dumps(response)) + len(json.dumps(conversation)) + len(json.dumps(input_items))
        if size > self.max_chars:
            return
        self.delete(response["id"])
        self.items[response["id"]] = (response, conversation, input_items, size)
        self.chars += size
        while len(self.items) > self.max_items or self.chars > self.max_chars:
            self.delete(next(iter(self.items)))

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        """(response, conversation) of ``rid``, None when it is not kept."""
        got = self.items.get(rid)
        return None if got is None else got[:2]

    def input_items(self, rid: str) -> list[dict] | None:
        """The input items of ``rid`` (input order), None when it is not kept."""
        got = self.items.get(rid)
        return None if got is None else got[2]

    def delete(self, rid: str) -> bool:
        got = self.items.pop(rid, None)
        if got is not None:
            self.chars -= got[3]
        return got is not None


def _not_found(rid: str, param: str | None) -> ApiError:
    return ApiError(f"response {shown(rid)} not found: this gateway keeps the last {MAX_STORED_RESPONSES} responses "
                    "sent without store: false, in memory (not across gateways or restarts)", param, status=404,
                    code="response_not_found")


def add_responses_route(app: FastAPI, chat_completions, store: ResponseStore | None = None) -> ResponseStore:
    """Register ``POST /v1/responses`` on ``app``: each request runs as ``chat_completions(body,
    request)`` (the gateway's chat endpoint, :func:`chat_body`) and its answer is turned back
    (:func:`response_from_chat`, :func:`response_events`); the chat path's errors come back
    with the Responses request's parameter names (:func:`renamed`). A completed or incomplete
    response is kept in ``store`` (a new :class:`ResponseStore` if None; returned) unless its
    request sent ``store: false``: ``previous_response_id`` continues its conversation, ``GET`` /
    ``DELETE /v1/responses/{id}`` read and drop it, ``GET /v1/responses/{id}/input_items`` lists
    its input items (:func:`read_input`, :func:`list_page`) and ``POST
    /v1/responses/{id}/cancel`` is a 400 (only a background response can be cancelled, and
    ``background: true`` is refused); each a 404 ``response_not_found`` for one not kept."""
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        prior: list[dict] = []
        if body.previous_response_id is not None:
            found = surrogate_at(body.previous_response_id, "previous_response_id")
            if found is not None:  # no response's id: a 400, not a 404 echoing it
                raise not_unicode(*found)
            got = store.get(body.previous_response_id)
            if got is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            prior = got[1]
        chat, read = chat_body(body, prior)
        keep = body.store is not False
        turns = [*prior, *read.messages]  # the conversation after the instructions
        listed = read.listed if keep else []
        rid = new_response_id()

        def kept(response: dict) -> None:
            if keep and response["status"] in ("completed", "incomplete"):
                store.put(response, [*turns, output_turn(response["output"])], listed)

        try:
            out = await chat_completions(chat, request)
        except ApiError as e:
            raise renamed(e) from None
        if isinstance(out, StreamingResponse):
            shell = Shell(body, chat.model or "", keep, rid)  # the served model's name, from the first chunk on
            return StreamingResponse(response_events(shell, out.body_iterator, int(time.time()), kept),
                                     media_type="text/event-stream")
        if isinstance(out, JSONResponse):  # the chat path's failure (503; 400: its grammar failed) or a client gone (499)
            return _renamed_failure(out)
        response = response_from_chat(Shell(body, out["model"], keep, rid), out)
        kept(response)
        return response

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        got = store.get(response_id)
        if got is None:
            raise _not_found(response_id, None)
        return got[0]

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request):
        items = store.input_items(response_id)
        if items is None:
            raise _not_found(response_id, None)
        return list_page(items, request.query_params, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        if store.get(response_id) is None:
            raise _not_found(response_id, None)
        raise ApiError(f"response {shown(response_id)} cannot be cancelled: only background responses can be "
                       "cancelled, and pdd refuses background: true", None)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    return store
