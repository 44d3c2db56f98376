"""Chat templates: render a checkpoint's Jinja2 chat template exactly as its own tokenizer
configuration does under ``transformers`` (``tokenizer.apply_chat_template``), without
importing transformers.

Where the template comes from (transformers' precedence): ``chat_template.jinja`` (plus
``additional_chat_templates/*.jinja``, named templates) in the checkpoint, else
``tokenizer_config.json``'s ``chat_template`` (a string, a list of ``{name, template}``, or a dict).
With named templates, ``tool_use`` is chosen when tools are given and exists, else ``default``.

Rendering matches transformers: a sandboxed Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks`` and the loop-controls extension, a ``tojson`` filter that does not escape HTML
(``ensure_ascii=False``), ``raise_exception``, ``strftime_now``, ``namespace`` and ``dict``
globals, the ``{% generation %}`` tag; the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the named special tokens (``bos_token``, ``eos_token``, ...) and any
``chat_template_kwargs``; message keys whose value is null are dropped, but a missing or null
``content`` is the empty string (vLLM's rendering: an assistant turn of tool calls alone); ``reasoning_content`` /
``thinking`` / ``reasoning`` alias each other. The rendered text is tokenized without adding
special tokens (the template writes them).

OpenAI content parts (``[{"type": "text", "text": ...}, ...]``) are joined with newlines into one
string first, as vLLM does for string-content templates; other part types are refused.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdd.gateway.openai_schemas import lone_surrogate

SPECIAL_TOKENS_ATTRIBUTES = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The request cannot be rendered (bad messages, or the template raised); ``param``: the
    field at fault (``messages[0].content[1]``), None for the request's messages as a whole."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _token_str(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def flatten_content(content, where: str):
    """OpenAI content (string, null, or list of parts) -> what the template sees. Raises
    ChatTemplateError naming ``where`` for a part of another kind or a lone surrogate (not valid
    Unicode text: it would be found only in the rendered prompt, at a position the client never sent)."""
    if isinstance(content, str):
        bad = lone_surrogate(content)
        if bad is not None:
            raise ChatTemplateError(f"{where}: not valid Unicode text (a lone surrogate at character {bad})", where)
        return content
    if content is None:
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(flatten_content(part, f"{where}[{i}]"))
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(flatten_content(part["text"], f"{where}[{i}].text"))
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                raise ChatTemplateError(f"{where}[{i}].text: a text content part needs a string 'text'",
                                        f"{where}[{i}].text")
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"{where}[{i}]: content part of type {kind!r} is not supported (text only)",
                                        f"{where}[{i}]")
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}: content must be a string, a list of parts or null", where)


class ChatTemplate:
    def __init__(self, templates: str | dict[str, str], special_tokens: dict[str, str]):
        self.templates = templates
        self.special_tokens = special_tokens
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_model_dir(cls, path: str) -> "ChatTemplate | None":
        """The checkpoint's template, or None if it has none."""
        cfg: dict = {}
        fn = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(fn):
            with open(fn, encoding="utf-8") as f:
                cfg = json.load(f)
        templates: dict[str, str] = {}
        ct = cfg.get("chat_template")
        if isinstance(ct, str):
            templates["default"] = ct
        elif isinstance(ct, list):
            templates.update({t["name"]: t["template"] for t in ct})
        elif isinstance(ct, dict):
            templates.update(ct)
        files: dict[str, str] = {}
        jf = Path(path) / "chat_template.jinja"
        if jf.exists():
            files["default"] = jf.read_text(encoding="utf-8")
        extra = Path(path) / "additional_chat_templates"
        if extra.is_dir():
            for t in sorted(extra.glob("*.jinja")):
                files[t.stem] = t.read_text(encoding="utf-8")
        if files:  # template files replace tokenizer_config's templates (transformers' loader)
            templates = files
        if not templates:
            return None
        special = {a: s for a in SPECIAL_TOKENS_ATTRIBUTES if (s := _token_str(cfg.get(a))) is not None}
        return cls(templates["default"] if list(templates) == ["default"] else templates, special)

    def template_for(self, tools) -> str:
        if isinstance(self.templates, str):
            return self.templates
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"the model has several chat templates and no default: {sorted(self.templates)}")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list | None = None, documents: list | None = None, chat_template_kwargs: dict | None = None) -> str:
        if not messages:
            raise ChatTemplateError("messages: must not be empty")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        src = self.template_for(tools)
        tpl = self._compiled.get(src)
        if tpl is None:
            try:
                tpl = self._compiled[src] = _compile(src)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ChatTemplateError(f"messages[{i}]: must be an object", f"messages[{i}]")
            m = {k: v for k, v in m.items() if v is not None}
            # a missing or null content is the empty string, as vLLM renders it: an assistant turn
            # that only calls tools (content null) reaches templates that read message.content
            m["content"] = flatten_content(m.get("content", ""), f"messages[{i}].content")
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message: the last message has no text content to continue")
            chat[-1]["content"] = final + _CONTINUE_TAG
        # one context dict, not keyword arguments: a chat_template_kwargs key such as "self" must
        # not collide with render()'s own parameters; the request's own values come last, so
        # chat_template_kwargs cannot replace them
        ctx = {**self.special_tokens, **(chat_template_kwargs or {}), "messages": chat, "tools": tools,
               "documents": documents, "add_generation_prompt": add_generation_prompt}
        try:
            out = tpl.render(ctx)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # a template fed unexpected values (e.g. by chat_template_kwargs) fails in Python
            raise ChatTemplateError(f"chat template error ({type(e).__name__}): {e}") from e
        if continue_final_message:
            if final.strip() not in out or _CONTINUE_TAG.strip() not in out:
                raise ChatTemplateError("continue_final_message: the template dropped the final message")
            loc = out.rindex(_CONTINUE_TAG.strip())
            out = out[:loc] if out[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else out[:loc].rstrip()
        return out
