"""``pdd make-model``: a deterministic random-weight Llama checkpoint with a real tokenizer.

The directory written is a normal HF checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``): our engine and
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` both load it. Same seed and preset
give byte-identical files.

Random models have flat logits; to make greedy decoding robust to float noise (batched vs
unbatched, CPU vs CUDA, recomputed vs transferred KV), the LM head is scaled up so the gap
between the top two logits is typically several units (see ``tests/engine/test_modelgen.py``).
"""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import save_file

PRESETS: dict[str, dict] = {
    # unit tests: ~0.3 M parameters
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=4096),
    # demo: ~4 M parameters; KV = 2*4*2*32*4 B = 2 KiB / token in fp32
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=8192),
}

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS, EOS = "<s>", "</s>"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Init scales (std of the normal draws). lm_head is large so that top-2 logit margins are wide.
EMBED_STD = 1.0
PROJ_STD = 0.08
LM_HEAD_STD = 2.0

_TEXT = """
The prefill stage reads the whole prompt at once and is bound by compute, while the decode
stage produces one token at a time and is bound by memory bandwidth. A request arrives at the
gateway, which turns its text into token ids and chooses where it will be served. When two
datacenters are linked by a wide area network, the key and value cache of a long prompt can
take seconds to cross the line, so the relay decoder close to the prefill machine starts to
answer at once and later hands the request over to the main decoder far away. The main decoder
keeps a radix tree of prefixes it has already seen, so only the missing part of a prompt has to
travel. Agents call tools many times in a row; each turn repeats the long history of the
conversation and adds a few new lines, which is why most of the prompt is usually cached.
Hello, how are you today? I am fine, thank you. What is the weather like in the city of
Shanghai? It is sunny and warm, with a light wind from the sea. Please write a short poem
about the moon, the river and the mountains. Once upon a time there was a small robot who
wanted to learn how to read. Every morning it opened a book, looked at the letters and tried
to guess the words. The numbers one two three four five six seven eight nine ten, and the
days Monday Tuesday Wednesday Thursday Friday Saturday Sunday. def main(): return 0
for i in range(10): print(i * i) # comment; x = [1, 2, 3]; y = {"key": "value"}
"""

_SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "un", "ba", "de",
              "fi", "go", "hu", "ja", "ke", "li", "mo", "nu", "pa", "qu", "ro", "si", "tu", "va",
              "we", "xi", "yo", "za", "th", "sh", "ch", "er", "in", "on", "at", "es"]


def _corpus() -> list[str]:
    """Deterministic training text: real sentences plus seeded pseudo-words (enough merges)."""
    rng = random.Random(1234)
    lines = [ln for ln in _TEXT.strip().splitlines()] * 4
    for _ in range(3000):
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(8)]
        lines.append(" ".join(words))
    return lines


def build_tokenizer(vocab_size: int):
    """A ByteLevel BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` entries (ids of
    special tokens first: ``<s>`` = 0, ``</s>`` = 1), adding ``<s>`` in front of every encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).contiguous()

    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, std=EMBED_STD)}
    # Residual branches are scaled by 1/sqrt(h) so activations stay O(1) whatever the width.
    ps = PROJ_STD * (64 / h) ** 0.5
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(nh * hd, h, std=ps * 2)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * hd, h, std=ps * 2)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * hd, h, std=ps * 2)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * hd, std=ps * 2)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=ps * 2)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=ps * 2)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=ps * 2)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(v, h, std=LM_HEAD_STD * (64 / h) ** 0.5)
    return w


def _family_weights(cfg: dict, seed: int, family: str) -> dict[str, torch.Tensor]:
    """Extra tensors of qwen2 (q/k/v biases) and qwen3 (q/k norms), from their own generator so
    the llama tensors stay the same for a seed."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1_000_003)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if family == "qwen2":
            for name, n in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)):
                w[p + name + ".bias"] = torch.randn(n * hd, generator=g) * 0.1
        elif family == "qwen3":
            for name in ("q_norm", "k_norm"):
                w[p + name + ".weight"] = 1.0 + 0.1 * torch.randn(hd, generator=g)
    return w


FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
              "sliding_window": None, "max_window_layers": 0},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
              "sliding_window": None, "max_window_layers": 0},
}


def make_model(out_dir: str, preset: str = "tiny", seed: int = 0, family: str = "llama",
               tie_word_embeddings: bool = False) -> str:
    """Write a random-weight checkpoint to ``out_dir`` and return ``out_dir``.

    preset: ``"tiny"`` (unit tests) or ``"small"`` (demo); see :data:`PRESETS`.
    family: ``"llama"`` (default), ``"qwen2"`` (q/k/v biases) or ``"qwen3"`` (q/k norms).
    tie_word_embeddings: the LM head is the input embedding matrix (as in the small Qwen2 /
    Qwen3 checkpoints); ``lm_head.weight`` is then not written.
    """
    if family not in FAMILIES:
        raise NotImplementedError(f"family {family!r}; choose from {sorted(FAMILIES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]
    with _Writing(out_dir) as w:
        _write_preset(w, out_dir, p, preset, seed, family, tie_word_embeddings)
    return out_dir


def _write_preset(w: "_Writing", out_dir: str, p: dict, preset: str, seed: int, family: str,
                  tie_word_embeddings: bool) -> None:
    tok = build_tokenizer(p["vocab_size"])
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = {
        **FAMILIES[family],
        **p,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "initializer_range": 0.02,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
        "pdd_preset": preset,
        "pdd_seed": seed,
    }
    w.dump("config.json", config)
    w.dump("generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False})
    w.dump("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": "<unk>", "pad_token": EOS,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": p["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    w.dump("special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": "<unk>", "pad_token": EOS})
    tok.save(w.path("tokenizer.json"))
    weights = _weights(p, seed)
    weights.update(_family_weights(p, seed, family))
    if tie_word_embeddings:
        del weights["lm_head.weight"]
    save_file(weights, w.path("model.safetensors"), metadata={"format": "pt"})


def build_family_tokenizer(spec: dict, base_vocab: int):
    """A ByteLevel BPE ``tokenizers.Tokenizer``: ``base_vocab`` synthetic BPE entries plus the
    family's special tokens (``spec`` is a :data:`pdd.families.TOKENIZERS` entry), those first
    (ids 0..) or after the BPE entries, as the family has them; ``spec["bos"]`` is prepended
    to every encode when ``spec["add_bos"]``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(spec["specials"])
    first = specials if spec["specials_first"] else []
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab + len(first), special_tokens=first, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if not spec["specials_first"]:
        tok.add_special_tokens(specials)
    want = base_vocab + len(specials)
    if tok.get_vocab_size() != want:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {want}")
    if spec["add_bos"]:
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def make_like(out_dir: str, like: str, seed: int = 0, vocab: int = 1024, **scale) -> str:
    """Write a random-weight checkpoint shaped like the released model ``like`` (a name of
    :data:`pdd.families.PUBLISHED`) to ``out_dir`` and return ``out_dir``.

    The config.json is the published one with the size fields shrunk by
    :func:`pdd.families.scaled_config` (``**scale``: layers, hidden, heads, kv_heads, head_dim,
    intermediate, max_positions, original_max_positions, sliding_window, rope_scaling); every
    family feature (rope scaling, q/k norms, q/k/v biases, tied embeddings, sliding window)
    is kept. vocab: synthetic BPE entries; the family's special tokens are added, so
    ``vocab_size`` = vocab + their count. KeyError for an unknown ``like``; ValueError naming
    the argument for a bad shape.
    """
    from pdd import families

    pub = families.published(like)
    cfg = families.scaled_config(like, **scale)
    spec = families.TOKENIZERS[pub["tokenizer"]]
    if vocab < 300:
        raise ValueError(f"--vocab {vocab}: at least 300 entries (the 256 byte symbols and some merges)")
    from pdd.engine.config import ModelConfig

    # refuse what the engine cannot load before anything is written (message names the field)
    ModelConfig.from_dict({**cfg, "vocab_size": vocab + len(spec["specials"])})
    # ... and weights that cannot be held in memory to be written (else a torch allocator
    # traceback after config.json and the tokenizer are written)
    _check_fits(like, {**scale, "vocab": vocab}, config_shape({**cfg, "vocab_size": vocab + len(spec["specials"])}),
                cfg["model_type"], bool(cfg.get("tie_word_embeddings")))
    with _Writing(out_dir) as w:
        _write_like(w, like, pub, cfg, spec, seed, vocab)
    return out_dir


def _write_like(w: "_Writing", like: str, pub: dict, cfg: dict, spec: dict, seed: int, vocab: int) -> None:
    tok = build_family_tokenizer(spec, vocab)
    ids = {t: tok.token_to_id(t) for t in spec["specials"]}
    # the published bos / eos ids name tokens (PUBLISHED[...]["ids"]); use this vocabulary's ids
    bos_id, eos_id = ids[pub["ids"]["bos_token_id"]], ids[pub["ids"]["eos_token_id"]]
    cfg.update(vocab_size=tok.get_vocab_size(), bos_token_id=bos_id, eos_token_id=eos_id,
               torch_dtype="float32", pdd_like=like, pdd_seed=seed)
    w.dump("config.json", cfg)
    gen_eos = [ids[t] for t in pub["generation_eos"]]
    w.dump("generation_config.json",
          {"bos_token_id": bos_id, "eos_token_id": gen_eos if len(gen_eos) > 1 else gen_eos[0],
           "do_sample": False})
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec["bos"], "eos_token": spec["eos"], "pad_token": spec["pad"],
        "add_bos_token": spec["add_bos"], "add_eos_token": False,
        "model_max_length": cfg["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "chat_template": spec["chat_template"],
    }
    if spec["specials_first"]:
        tc["unk_token"] = "<unk>"
    w.dump("tokenizer_config.json", tc)
    w.dump("special_tokens_map.json",
           {k: tc[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tc.get(k)})
    tok.save(w.path("tokenizer.json"))
    shape = config_shape(cfg)
    weights = _weights(shape, seed)
    weights.update(_family_weights(shape, seed, cfg["model_type"]))
    if cfg.get("tie_word_embeddings"):
        del weights["lm_head.weight"]
    save_file(weights, w.path("model.safetensors"), metadata={"format": "pt"})


def config_shape(cfg: dict) -> dict:
    """The size fields of a config.json ``cfg`` that :func:`_weights` reads (``head_dim``
    defaults to hidden / heads)."""
    return dict(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
                num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                vocab_size=cfg["vocab_size"])


def like_shape(like: str, vocab: int = 1024, **scale) -> dict:
    """:func:`config_shape` of the checkpoint ``make_like(out, like, vocab=vocab, **scale)``
    writes, without writing it. KeyError / ValueError as :func:`make_like`."""
    from pdd import families

    spec = families.TOKENIZERS[families.published(like)["tokenizer"]]
    return config_shape({**families.scaled_config(like, **scale), "vocab_size": vocab + len(spec["specials"])})


def weight_bytes(shape: dict, family: str, tied: bool) -> int:
    """Bytes (float32) of the tensors :func:`_weights` + :func:`_family_weights` make for ``shape``
    (:func:`config_shape`) and ``family`` (``model_type``), less ``lm_head.weight`` when ``tied``."""
    h, inter, v, n = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    nh, nkv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    layer = 2 * nh * hd * h + 2 * nkv * hd * h + 3 * inter * h + 2 * h
    if family == "qwen2":
        layer += (nh + 2 * nkv) * hd
    elif family == "qwen3":
        layer += 2 * hd
    return 4 * (v * h * (1 if tied else 2) + n * layer + h)


MEMORY_SOURCE = "MemAvailable, /proc/meminfo"


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is no such file (then
    :func:`make_like` does not bound the weights)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_SIZE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def _check_fits(like: str, given: dict, shape: dict, family: str, tied: bool) -> None:
    """ValueError naming the size flags ``given`` (with their values) and the bytes when the
    weights of ``shape``, plus the serialised copy ``safetensors`` makes of them while writing
    (about as much again), exceed :func:`available_memory_bytes`."""
    need = weight_bytes(shape, family, tied)
    avail = available_memory_bytes()
    if avail is None or 2 * need <= avail:
        return
    named = [f"--{f.replace('_', '-')} {given[f]}" for f in _SIZE_FLAGS
             if given.get(f) is not None and not (f == "vocab" and given[f] == 1024)]
    raise ValueError(f"{' '.join(named) or f'--like {like}'}: the weights would take {need:,} bytes (float32) "
                     f"and writing them about twice that, over the {avail:,} bytes of memory available "
                     f"({MEMORY_SOURCE}); give smaller --layers / --hidden / --intermediate / --vocab"
                     + (" / --head-dim" if given.get("head_dim") is not None else ""))


class _Writing:
    """The files one run writes into ``out_dir`` (made if missing). If the ``with`` block raises
    (a full disk, Ctrl-C, ...), every file it wrote is removed, and ``out_dir`` too when this run
    made it and it is then empty: no directory is left that looks like a checkpoint but lacks
    its weights. Files it did not write stay. The exception propagates."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.made_dir = not os.path.exists(out_dir)
        self.written: list[str] = []

    def __enter__(self) -> "_Writing":
        os.makedirs(self.out_dir, exist_ok=True)
        return self

    def path(self, name: str) -> str:
        """The path of ``name`` in ``out_dir``, noted as written by this run (before it is)."""
        p = os.path.join(self.out_dir, name)
        self.written.append(p)
        return p

    def dump(self, name: str, obj: dict) -> None:
        with open(self.path(name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            for p in self.written:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            if self.made_dir:
                try:
                    os.rmdir(self.out_dir)
                except OSError:
                    pass
        return False


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="pdd make-model", description=make_model.__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    ap.add_argument("--tie-embeddings", action="store_true")
    a = ap.parse_args(argv)
    print(make_model(a.out_dir, a.preset, a.seed, a.family, a.tie_embeddings))


if __name__ == "__main__":
    main()
