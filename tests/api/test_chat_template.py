"""Chat templates render (text and token ids) exactly as transformers' apply_chat_template does
for the same checkpoint directory."""

from __future__ import annotations

import json
import shutil

import pytest

from pdd.gateway.openai_chat import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")

# ChatML with tools, in the style of Qwen2.5 / Qwen3: whitespace control, namespace, loop
# controls, tojson, raise_exception, chat_template_kwargs (enable_thinking), reasoning_content
QWEN_STYLE = r"""
{%- if tools %}
    {{- '<|system|>\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools></s>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|system|>\n' + messages[0]['content'] + '</s>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant', 'system', 'tool'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'assistant' and message.reasoning_content is defined and loop.index0 > ns.last_user %}
        {{- '<|assistant|>\n<think>\n' + message.reasoning_content.strip() + '\n</think>\n\n' + message.content + '</s>\n' }}
    {%- else %}
        {{- '<|' + message.role + '|>\n' + message.content + '</s>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama-style: bos_token variable, trim_blocks / lstrip_blocks sensitivity (no '-' markers)
LLAMA_STYLE = """{{ bos_token }}
{% for message in messages %}
    {% if loop.index0 == 0 and message['role'] == 'system' %}
<<SYS>>{{ message['content'] | trim }}<</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }} {{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you today?"}],
    [{"role": "system", "content": "Be brief. \u00fcber \u4f60\u597d"}, {"role": "user", "content": "What is the weather like?"},
     {"role": "assistant", "content": "It is sunny and warm.", "reasoning_content": " check the sky "},
     {"role": "user", "content": "And <s> tomorrow?"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": None},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "ok"}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _with_template(src: str, dst, template) -> str:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


def _check(path: str, conv, **kw):
    from tokenizers import Tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours = ChatTemplate.from_model_dir(path)
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    ctk = kw.pop("chat_template_kwargs", None) or {}
    text = ours.render(conv, chat_template_kwargs=ctk, **kw)
    assert text == hf.apply_chat_template(conv, tokenize=False, **kw, **ctk)
    ref_ids = hf.apply_chat_template(conv, tokenize=True, **kw, **ctk)
    ref_ids = ref_ids["input_ids"] if not isinstance(ref_ids, list) else ref_ids
    assert tok.encode(text, add_special_tokens=False).ids == ref_ids
    return text


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["one", "reasoning", "tool"])
def test_generated_checkpoint_template_matches_transformers(tiny_model, conv):
    text = _check(tiny_model, conv, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    _check(tiny_model, conv, add_generation_prompt=False)


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["one", "reasoning", "tool"])
@pytest.mark.parametrize("name,template", [("qwen", QWEN_STYLE), ("llama", LLAMA_STYLE)])
def test_third_party_style_templates_match_transformers(tiny_model, tmp_path, conv, name, template):
    path = _with_template(tiny_model, tmp_path / name, template)
    _check(path, conv, add_generation_prompt=True)
    if name == "qwen":
        _check(path, conv, add_generation_prompt=True, tools=TOOLS)
        _check(path, conv, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False})


def test_continue_final_message_matches_transformers(tiny_model, tmp_path):
    path = _with_template(tiny_model, tmp_path / "q", QWEN_STYLE)
    conv = [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "The moon "}]
    text = _check(path, conv, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|assistant|>\nThe moon ")  # no end-of-turn: the model continues it


def test_named_templates_and_jinja_file_precedence(tiny_model, tmp_path):
    path = _with_template(tiny_model, tmp_path / "named", [{"name": "default", "template": LLAMA_STYLE},
                                                           {"name": "tool_use", "template": QWEN_STYLE}])
    _check(path, CONVERSATIONS[0], add_generation_prompt=True)
    _check(path, CONVERSATIONS[0], add_generation_prompt=True, tools=TOOLS)
    # a chat_template.jinja file wins over tokenizer_config.json (transformers' loader)
    (tmp_path / "named" / "chat_template.jinja").write_text(QWEN_STYLE)
    assert ChatTemplate.from_model_dir(path).templates == QWEN_STYLE
    _check(path, CONVERSATIONS[1], add_generation_prompt=True)


def test_openai_content_parts_and_errors(tiny_model):
    ct = ChatTemplate.from_model_dir(tiny_model)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ct.render(parts) == ct.render([{"role": "user", "content": "a\nb"}])
    with pytest.raises(ChatTemplateError, match="'image_url' is not supported"):
        ct.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match=r"\[0\]\.text: a text content part needs a string 'text'"):
        ct.render([{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(ChatTemplateError):
        ct.render([])
    bad = ChatTemplate("{{ raise_exception('no system messages') }}", {})
    with pytest.raises(ChatTemplateError, match="no system messages"):
        bad.render([{"role": "system", "content": "x"}])


def test_make_model_writes_a_chat_template(tiny_model):
    assert ChatTemplate.from_model_dir(tiny_model) is not None


def test_a_tool_call_turn_without_content_renders_as_empty_content():
    """The second turn of a tool flow: the assistant's turn carries only ``tool_calls`` (content
    null or left out), then the tool's result. Templates that read ``message.content`` failed
    on it (a 400 "'dict object' has no attribute 'content'"); vLLM renders the content as ""."""
    ct = ChatTemplate(QWEN_STYLE, {})  # '<|' + message.role + '|>\n' + message.content + ...
    call = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    want = ct.render([{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": call},
                      tool])
    for turn in ({"role": "assistant", "content": None, "tool_calls": call}, {"role": "assistant", "tool_calls": call}):
        assert ct.render([{"role": "user", "content": "weather?"}, turn, tool]) == want
