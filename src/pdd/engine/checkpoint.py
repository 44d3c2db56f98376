"""Check a checkpoint directory before any process of a topology loads it.

A truncated or corrupted ``*.safetensors``, a missing ``tokenizer.json`` or a config.json whose
shape disagrees with the weights was found only as each process loaded it: ``pdd launch`` ended in
a traceback (``SafetensorError``, ``Exception: No such file or directory (os error 2)`` from the
gateway's tokenizer), ``pdd serve`` after starting the instances, and a config.json claiming
100,000 layers over a 2-layer file ran until killed. :func:`checkpoint_problem` reads only the
config, the safetensors headers (not the weights) and checks that the tokenizer file is there.
"""

from __future__ import annotations

import glob
import json
import os
import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be served, in one line naming the file and field,
    or None. Checks: config.json parses and :meth:`ModelConfig.from_pretrained` accepts it;
    ``tokenizer.json`` is a file; there is at least one ``*.safetensors`` and each has a readable
    header; the weights hold ``num_hidden_layers`` layers and ``model.embed_tokens.weight`` is
    ``[vocab_size, hidden_size]``."""
    from pdd.engine.config import ModelConfig

    try:
        cfg = ModelConfig.from_pretrained(path)
    except json.JSONDecodeError as e:
        return f"config.json: not valid JSON: {e}"
    except (ValueError, NotImplementedError, TypeError) as e:
        return str(e)
    except OSError as e:
        return f"config.json: cannot read it: {e.strerror or e}"
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "tokenizer.json missing (the gateway tokenizes with it; pdd make-model writes one)"
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return "no *.safetensors weights file"
    from safetensors import safe_open

    layers: set[int] = set()
    embed = None
    for fn in files:
        try:
            with safe_open(fn, framework="pt", device="cpu") as f:
                for k in f.keys():
                    m = _LAYER.match(k)
                    if m:
                        layers.add(int(m.group(1)))
                    elif k == "model.embed_tokens.weight":
                        embed = list(f.get_slice(k).get_shape())
        except Exception as e:  # SafetensorError (truncated, garbage, empty), OSError
            return f"{os.path.basename(fn)}: not a readable safetensors file ({e})"
    if len(layers) != cfg.num_hidden_layers:
        return (f"config.json num_hidden_layers: {cfg.num_hidden_layers}, but the weights hold {len(layers)} "
                f"layer(s)")
    want = [cfg.vocab_size, cfg.hidden_size]
    if embed is None:
        return "the weights have no model.embed_tokens.weight"
    if embed != want:
        return (f"config.json vocab_size / hidden_size: {want[0]} / {want[1]}, but model.embed_tokens.weight is "
                f"{embed[0]} x {embed[1]}")
    return None
