"""Checks of ``PddConnector`` against vLLM's real classes, run by vLLM's own Python (``make
vllm``'s venv has no pytest): ``.venv-vllm/bin/python tests/vllm_tier/connector_checks.py``
prints one JSON object, check name -> "ok" or the failure. ``test_connector_vllm.py`` runs it
and turns each entry into a test (skipped where ``.venv-vllm`` is absent).

- ``load_lands_in_blocks``: pdd-layout staged pages loaded through the real CPU attention
  backend's ``do_kv_cache_update`` into vLLM's paged KV tensor (``[blocks, kv_heads, block_size,
  2 * head_dim]``, the CPU backend's per-ISA packing inside a block): equal to the backend writing
  the same K/V token by token at slots computed from the block ids; blocks the request does
  not own and tokens below the load's start stay untouched.
- ``scheduler_side``: a real ``vllm.v1.request.Request`` with ``kv_transfer_params`` from its
  ``SamplingParams``: tokens beyond vLLM's local hit, never the last prompt token; the step's
  metadata names the request's block ids; a request without pdd params loads nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from pdd.vllm_tier.staging import slot_mapping, token_rows, write_stage  # noqa: E402

L, H, D, PS = 4, 2, 32, 16  # the `small` checkpoint's KV shape, pdd's page size


def _config(block_size: int):
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="PddConnector", kv_role="kv_consumer",
                           kv_connector_module_path="pdd.vllm_tier.connector")
    return types.SimpleNamespace(kv_transfer_config=ktc, cache_config=types.SimpleNamespace(block_size=block_size))


def _connector(role, block_size=128):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdd.vllm_tier.connector import PddConnector

    return PddConnector(_config(block_size), getattr(KVConnectorRole, role), None)


def _cpu_layer():
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    impl = object.__new__(CPUAttentionBackendImpl)  # its __init__ wants a whole model config
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, "auto"
    layer = types.SimpleNamespace(impl=impl, isa=_get_attn_isa(torch.float32, 128, D), _k_scale_float=1.0,
                                  _v_scale_float=1.0)
    return layer


def check_load_lands_in_blocks(tmp):
    from pdd.vllm_tier.connector import PddLoad

    bs, nblocks, n_tokens, start = 128, 8, 300, 128  # vLLM already holds block 0 (its own prefix hit)
    block_ids = [6, 1, 4]
    g = torch.Generator().manual_seed(0)
    pages = torch.randn(-(-n_tokens // PS), L, 2, PS, H, D, generator=g)
    st = write_stage(os.path.join(tmp, "r.kv"), pages, n_tokens)
    conn = _connector("WORKER", bs)
    layers, ref = {}, {}
    for i in range(L):
        lay = _cpu_layer()
        lay.kv_cache = torch.zeros(nblocks, H, bs, 2 * D)
        layers[f"model.layers.{i}.self_attn.attn"] = lay
        ref[i] = torch.zeros(nblocks, H, bs, 2 * D)
    conn.load_into(PddLoad("r", st, block_ids, start, n_tokens), layers)
    for i in range(L):
        k, v = token_rows(pages, i, 0, n_tokens)
        probe = _cpu_layer()
        for t in range(start, n_tokens):  # one token at a time, its slot from the block table by hand
            slot = torch.tensor([block_ids[t // bs] * bs + t % bs])
            probe.impl.do_kv_cache_update(probe, k[t:t + 1].contiguous(), v[t:t + 1].contiguous(), ref[i], slot)
        got = layers[f"model.layers.{i}.self_attn.attn"].kv_cache
        assert torch.equal(got, ref[i]), f"layer {i}: loaded KV differs from the backend's own token-by-token write"
        for b in range(nblocks):
            if b not in block_ids[1:]:  # block 6 holds tokens < start (vLLM's): must stay as they were
                assert got[b].abs().sum() == 0, f"layer {i}: block {b} was written"
        assert got[block_ids[1]].abs().sum() > 0 and got[block_ids[2]].abs().sum() > 0
    # a different layer's K/V would not match: the layer index is read from the name
    assert not torch.equal(layers["model.layers.0.self_attn.attn"].kv_cache, layers["model.layers.1.self_attn.attn"].kv_cache)
    assert conn.loaded_tokens == n_tokens - start and conn.loads == 1
    assert slot_mapping(block_ids, bs, start, start + 1).item() == 1 * bs


def check_scheduler_side(tmp):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from pdd.vllm_tier.connector import PddConnectorMetadata

    pages = torch.zeros(-(-300 // PS), L, 2, PS, H, D)
    st = write_stage(os.path.join(tmp, "s.kv"), pages, 300)
    conn = _connector("SCHEDULER")
    prompt = list(range(1, 306))  # 300 staged prompt tokens + 5 handed-over ids
    req = Request("r1", prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": st.params()}), None)
    assert req.kv_transfer_params == st.params()
    assert conn.get_num_new_matched_tokens(req, 0) == (300, False)
    assert conn.get_num_new_matched_tokens(req, 128) == (172, False)  # beyond vLLM's own hit
    assert conn.get_num_new_matched_tokens(req, 384) == (0, False)  # vLLM's own cache holds more: nothing to load
    conn.update_state_after_alloc(req, None, 0)
    assert conn.build_connector_meta(types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id="r1", block_ids=([3, 9, 5],))],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                    num_computed_tokens=[]))).loads == []
    assert conn.get_num_new_matched_tokens(req, 128) == (172, False)
    conn.update_state_after_alloc(req, None, 172)
    new = types.SimpleNamespace(req_id="r1", block_ids=([3, 9, 5],))
    cached = types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    meta = conn.build_connector_meta(types.SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached))
    assert isinstance(meta, PddConnectorMetadata) and len(meta.loads) == 1
    ld = meta.loads[0]
    assert (ld.req_id, ld.block_ids, ld.start, ld.end) == ("r1", [3, 9, 5], 128, 300)
    meta2 = conn.build_connector_meta(types.SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached))
    assert meta2.loads == []  # a load is sent once
    # the prompt's last token is never loaded: vLLM needs one to compute and sample from
    short = Request("r2", list(range(1, 301)), SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": st.params()}), None)
    assert conn.get_num_new_matched_tokens(short, 0) == (299, False)
    plain = Request("r3", prompt, SamplingParams(max_tokens=4), None)
    assert conn.get_num_new_matched_tokens(plain, 0) == (0, False)
    bad = Request("r4", prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"pdd_stage": {}}}), None)
    assert conn.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert conn.request_finished(req, [3, 9, 5]) == (False, None)


def main() -> int:
    out = {}
    for name, fn in sorted((k[len("check_"):], v) for k, v in globals().items() if k.startswith("check_")):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fn(tmp)
                out[name] = "ok"
            except Exception:
                out[name] = traceback.format_exc(limit=6)
    print("PDD_CHECKS " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
