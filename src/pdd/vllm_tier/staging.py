"""Staged KV: the prompt KV the pdd MD endpoint hands to vLLM's worker for one request.

One file per request (under /dev/shm where it exists: host memory, no disk), holding the
request's KV pages in pdd's page layout ``[page, layer, kv, slot, kv_head, head_dim]`` (pdd's
``KVPool.buffer`` rows), raw, no header. What the file holds travels in the completion's
``kv_transfer_params`` (:func:`params`), so the connector needs nothing else to read it.

Imports torch only: this module runs inside vLLM's processes too.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

import torch

KEY = "pdd_stage"  # kv_transfer_params key of the stage description

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stage_root(name: str) -> str:
    """A fresh directory for one MD endpoint's staged files (host memory where it can), named
    after this process; the directories of endpoints that died without cleaning up (killed) are
    removed first."""
    import shutil

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    for d in os.listdir(base):
        m = re.fullmatch(r"pdd-vllm-stage-(\d+)-.*", d)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(base, d), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"pdd-vllm-stage-{os.getpid()}-{name}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Stage:
    """A staged request: ``path`` holds ``shape`` = ``[pages, layers, 2, page_size, kv_heads,
    head_dim]`` elements of ``dtype``; its first ``num_tokens`` token slots are the prompt's KV
    (token ``t`` is page ``t // page_size``, slot ``t % page_size``)."""

    path: str
    num_tokens: int
    shape: tuple[int, ...]
    dtype: str

    def params(self) -> dict:
        return {KEY: {"path": self.path, "num_tokens": int(self.num_tokens), "shape": list(self.shape),
                      "dtype": self.dtype}}

    @classmethod
    def from_params(cls, params: dict | None) -> "Stage | None":
        """The stage named in a request's ``kv_transfer_params``, or None (not a pdd request).
        Raises ValueError for a malformed description."""
        if not params or KEY not in params:
            return None
        d = params[KEY]
        try:
            st = cls(str(d["path"]), int(d["num_tokens"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad {KEY} in kv_transfer_params: {d!r} ({e})") from None
        if len(st.shape) != 6 or st.dtype not in _DTYPES or not 0 < st.num_tokens <= st.shape[0] * st.shape[3]:
            raise ValueError(f"bad {KEY} in kv_transfer_params: {d!r}")
        return st

    @property
    def page_size(self) -> int:
        return self.shape[3]

    def load(self) -> torch.Tensor:
        """The staged pages as a tensor of ``shape`` (a read of the file, no copy beyond it)."""
        n = 1
        for x in self.shape:
            n *= x
        t = torch.from_file(self.path, shared=False, size=n, dtype=_DTYPES[self.dtype])
        return t.view(self.shape)


def write_stage(path: str, pages: torch.Tensor, num_tokens: int) -> Stage:
    """Write ``pages`` (``[pages, layers, 2, page_size, kv_heads, head_dim]``, pdd's layout) to
    ``path``; returns its :class:`Stage`."""
    t = pages.contiguous().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    tmp = path + ".part"
    t.view(torch.uint8).numpy().tofile(tmp)
    os.replace(tmp, path)  # the connector never sees a half-written file
    return Stage(path, int(num_tokens), tuple(t.shape), dtype)


def token_rows(stage_pages: torch.Tensor, layer: int, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens ``[t0, t1)`` of one layer, each ``[t1 - t0, kv_heads, head_dim]``."""
    n, _, _, ps, h, d = stage_pages.shape
    flat = stage_pages[:, layer].transpose(0, 1).reshape(2, n * ps, h, d)  # [kv, token, head, dim]
    return flat[0, t0:t1], flat[1, t0:t1]


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """pdd's layer index of a vLLM attention layer name (``model.layers.3.self_attn.attn`` -> 3).
    Raises ValueError for a name without one."""
    m = _LAYER_RE.search(layer_name)
    if m is None:
        raise ValueError(f"no layer index in attention layer name {layer_name!r}")
    return int(m.group(1))


def slot_mapping(block_ids: list[int], block_size: int, t0: int, t1: int) -> torch.Tensor:
    """vLLM's KV slot of each token ``t0 <= t < t1`` of a request whose blocks are ``block_ids``."""
    t = torch.arange(t0, t1, dtype=torch.long)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    if t1 > 0 and (t1 - 1) // block_size >= len(block_ids):
        raise ValueError(f"tokens up to {t1} need {(t1 - 1) // block_size + 1} blocks, the request has "
                         f"{len(block_ids)}")
    return blocks[t // block_size] * block_size + t % block_size
