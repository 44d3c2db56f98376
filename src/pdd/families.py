"""Published ``config.json`` values of real model families, and their tokenizers' special tokens
and chat formats, for ``pdd make-model --like NAME``.

``PUBLISHED`` holds the field values of each model's released ``config.json`` (the base model's;
``generation_eos`` is the instruct model's ``generation_config.json`` stop list, by token text).
:func:`scaled_config` keeps every family feature (rope scaling and its parameters, q/k norms,
q/k/v biases, tied embeddings, head_dim given apart from hidden / heads, sliding window) and
shrinks the size fields, so a random-weight checkpoint of that shape fits a CPU test.

Tokenizers: the BPE vocabulary of a generated checkpoint is synthetic (trained on a built-in
corpus, see :mod:`pdd.modelgen`); the special tokens (their text and order), whether a BOS is
prepended, and the chat format are the family's. Special-token ids are the published ones
shifted to follow the smaller vocabulary (``TOKENIZERS[...]["specials"]`` in id order).
The chat templates are the families' published instruct formats without their tool-calling
branches.
"""

from __future__ import annotations

import copy
import math

_LLAMA3_RESERVED = [f"<|reserved_special_token_{i}|>" for i in range(248)]
# Llama 3.1 / 3.2: ids 128000..128255, in this order.
LLAMA3_SPECIALS = (
    ["<|begin_of_text|>", "<|end_of_text|>", _LLAMA3_RESERVED[0], _LLAMA3_RESERVED[1],
     "<|finetune_right_pad_id|>", _LLAMA3_RESERVED[2], "<|start_header_id|>", "<|end_header_id|>",
     "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + _LLAMA3_RESERVED[3:]
)
# Qwen2.5: ids 151643..151664; Qwen3 adds 151665..151668.
QWEN2_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN3_SPECIALS = QWEN2_SPECIALS + ["<tool_response>", "</tool_response>", "<think>", "</think>"]
# Mistral / Llama 2 (sentencepiece): ids 0, 1, 2 before the vocabulary.
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]

# Llama 3.1 / 3.2 Instruct format (system header with the knowledge-cutoff and date lines).
LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen2.5 Instruct (ChatML with the default system prompt).
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen3 (ChatML; earlier assistant turns lose their <think> part; enable_thinking=false
# pre-fills an empty think block).
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}\n"
    "    {%- if message.role == 'assistant' %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- if '</think>' in content %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

# Mistral-7B-Instruct-v0.1 ([INST] turns; roles must alternate).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

TOKENIZERS: dict[str, dict] = {
    # specials_first: the special tokens take the first ids (sentencepiece); else they follow the BPE.
    "llama3": dict(specials=LLAMA3_SPECIALS, specials_first=False, bos="<|begin_of_text|>",
                   eos="<|end_of_text|>", pad=None, add_bos=True, chat_template=LLAMA31_TEMPLATE),
    "qwen2.5": dict(specials=QWEN2_SPECIALS, specials_first=False, bos=None, eos="<|im_end|>",
                    pad="<|endoftext|>", add_bos=False, chat_template=QWEN25_TEMPLATE),
    "qwen3": dict(specials=QWEN3_SPECIALS, specials_first=False, bos=None, eos="<|im_end|>",
                  pad="<|endoftext|>", add_bos=False, chat_template=QWEN3_TEMPLATE),
    "mistral": dict(specials=SPM_SPECIALS, specials_first=True, bos="<s>", eos="</s>", pad=None,
                    add_bos=True, chat_template=MISTRAL_TEMPLATE),
}

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# config.json of each released model (the fields as published); "ids": the tokens its
# bos_token_id / eos_token_id name; "generation_eos": the instruct generation_config.json stop list.
PUBLISHED: dict[str, dict] = {
    "llama-3.2-1b": dict(
        tokenizer="llama3", generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        ids={"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|end_of_text|>"},
        config={
            "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
            "rms_norm_eps": 1e-05, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}, "rope_theta": 500000.0,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
        }),
    "llama-3.1-8b": dict(
        tokenizer="llama3", generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        ids={"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|end_of_text|>"},
        config={
            "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
            "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": dict(_LLAMA3_ROPE),
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
            "vocab_size": 128256,
        }),
    "qwen2.5-0.5b": dict(
        tokenizer="qwen2.5", generation_eos=["<|im_end|>", "<|endoftext|>"],
        ids={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|endoftext|>"},
        config={
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
            "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
            "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
            "vocab_size": 151936,
        }),
    "qwen3-0.6b": dict(
        tokenizer="qwen3", generation_eos=["<|im_end|>", "<|endoftext|>"],
        ids={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"},
        config={
            "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
            "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
            "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
        }),
    "mistral-7b": dict(  # Mistral-7B-v0.1: sliding-window attention over 4096 tokens
        tokenizer="mistral", generation_eos=["</s>"],
        ids={"bos_token_id": "<s>", "eos_token_id": "</s>"},
        config={
            "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
            "vocab_size": 32000,
        }),
}

LIKE_NAMES = tuple(sorted(PUBLISHED))


def published(name: str) -> dict:
    """A deep copy of ``PUBLISHED[name]``; KeyError naming the choices otherwise."""
    if name not in PUBLISHED:
        raise KeyError(f"--like {name!r}: unknown model; choose from {', '.join(LIKE_NAMES)}")
    return copy.deepcopy(PUBLISHED[name])


def scaled_config(name: str, layers: int = 2, hidden: int = 128, heads: int | None = None,
                  kv_heads: int | None = None, head_dim: int | None = None, intermediate: int | None = None,
                  max_positions: int | None = None, original_max_positions: int | None = None,
                  sliding_window: int | None = None, rope_scaling: dict | None | str = "published") -> dict:
    """The published config of ``name`` with its size fields shrunk (vocabulary fields are set by
    the tokenizer writer, :func:`pdd.modelgen.make_like`).

    heads: default 4 (8 when the published model has as many KV heads as heads, i.e. MHA: 4);
    kv_heads: default 2 under GQA, = heads under MHA; head_dim: default keeps the published ratio
    ``head_dim * heads / hidden`` (2 for Qwen3-0.6B, 1 elsewhere); intermediate: default keeps the
    published ``intermediate / hidden`` ratio (rounded to a multiple of 8).
    max_positions / original_max_positions: ``max_position_embeddings`` and the rope scaling's
    ``original_max_position_embeddings`` (small values make scaling matter at short prompts).
    sliding_window: replaces the published window (Mistral). rope_scaling: a dict replaces the
    published ``rope_scaling``, None removes it. ValueError naming the argument on a bad shape.
    """
    pub = published(name)["config"]
    c = dict(pub)
    p_heads, p_kv, p_hidden = pub["num_attention_heads"], pub["num_key_value_heads"], pub["hidden_size"]
    p_hd = pub.get("head_dim") or p_hidden // p_heads
    heads = heads or 4
    kv_heads = kv_heads or (heads if p_kv == p_heads else min(2, heads))
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    ratio = p_hd * p_heads / p_hidden
    if head_dim is None:
        from fractions import Fraction

        # head_dim = ratio * hidden / heads = a * hidden / b (a/b in lowest terms) is an even integer
        # (so >= 2) exactly when hidden is a multiple of 2b / gcd(a, 2)
        step = Fraction(p_hd * p_heads, p_hidden) / heads
        multiple = 2 * step.denominator // math.gcd(step.numerator, 2)
        if hidden % multiple:
            # no silent truncation, no error naming a --head-dim the user did not give, and no
            # fractional head_dim to puzzle over: what --hidden must be
            raise ValueError(f"--hidden {hidden}: must be a multiple of {multiple} for {name} with --heads {heads} "
                             f"(head_dim is {'' if ratio == 1 else f'{ratio:g} * '}hidden / heads and must be an even integer), "
                             "or give --head-dim")
        head_dim = int(step * hidden)
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"--head-dim {head_dim}: must be even and >= 2")
    intermediate = intermediate or max(8, round(pub["intermediate_size"] / p_hidden * hidden / 8) * 8)
    c.update(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
             intermediate_size=intermediate)
    if "head_dim" in pub or head_dim != hidden // heads:
        c["head_dim"] = head_dim
    if max_positions is not None:
        c["max_position_embeddings"] = max_positions
    if rope_scaling != "published":
        c["rope_scaling"] = copy.deepcopy(rope_scaling)
    if original_max_positions is not None:
        if not c.get("rope_scaling"):
            raise ValueError(f"--original-max-positions: {name} has no rope_scaling to apply it to")
        c["rope_scaling"]["original_max_position_embeddings"] = original_max_positions
    if sliding_window is not None:
        if c["model_type"] != "mistral" and not c.get("use_sliding_window"):
            raise ValueError(f"--sliding-window: {name} does not use sliding-window attention")
        c["sliding_window"] = sliding_window
    if c["model_type"] in ("qwen2", "qwen3"):
        c["max_window_layers"] = min(c.get("max_window_layers", layers), layers)
    return c
