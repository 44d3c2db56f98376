"""KV crossing layouts (``pdd.transfer.layout``, ``KVPool.export_tokens`` / ``import_pages``):
pages re-chunked to the receiver's page size, cast to the narrower dtype, exact byte counts
(missing receiver pages x the receiver's page bytes on the wire; the partial last page its filled
slots only), and values that survive the trip (exact for a same-dtype or widening trip, rounded
once for a narrowing one)."""

import pytest
import torch

from pdd.engine.config import ModelConfig
from pdd.engine.kv_pool import KVPool
from pdd.transfer.kv import prompt_kv_bytes
from pdd.transfer.layout import KVLayout, wire_dtype, wire_page_bytes, wire_slot_bytes
from pdd.transfer.messages import Kv

MC = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=4)
ELEMS = 2 * 2 * 2 * 4  # (K, V) x layers x kv heads x head dim per token


def test_wire_dtype_is_the_narrower_and_the_sender_casts_between_equal_widths():
    assert wire_dtype("float32", "bfloat16") == "bfloat16"  # sender casts
    assert wire_dtype("bfloat16", "float32") == "bfloat16"  # receiver widens
    assert wire_dtype("float16", "bfloat16") == "bfloat16"  # same width: the receiver's
    assert wire_dtype("float32", "float32") == "float32"
    with pytest.raises(ValueError, match="receiver kv_dtype 'int8'"):
        wire_dtype("float32", "int8")
    assert wire_slot_bytes(ELEMS * 4, "float32", "bfloat16") == ELEMS * 2
    assert wire_page_bytes(32 * ELEMS * 4, KVLayout(32, "float32"), "bfloat16") == 32 * ELEMS * 2


def _token(pool, table, t):
    return pool.buffer[table[t // pool.page_size], :, :, t % pool.page_size]


@pytest.mark.parametrize("src,dst", [((16, "float32"), (32, "float32")), ((16, "float32"), (4, "float32")),
                                     ((16, "float32"), (8, "bfloat16")), ((8, "bfloat16"), (32, "float32")),
                                     ((16, "float16"), (16, "bfloat16")), ((16, "float32"), (16, "float32"))])
@pytest.mark.parametrize("n_prompt,cached_tokens", [(100, 0), (103, 96), (96, 64), (5, 0)])
def test_missing_pages_cross_in_the_receivers_layout(src, dst, n_prompt, cached_tokens):
    torch.manual_seed(0)
    s = KVPool(MC, 64, src[0], src[1])
    r = KVPool(MC, 64, dst[0], dst[1])
    s.buffer.normal_()
    s_table = s.alloc(-(-n_prompt // s.page_size))
    r_table = r.alloc(-(-n_prompt // r.page_size))
    wdt = wire_dtype(s.dtype_name, r.dtype_name)
    first = cached_tokens // r.page_size  # the receiver's cache: whole pages of its own
    n_r = len(r_table)
    data = s.export_tokens(s_table, first * r.page_size, n_prompt, r.page_size, wdt)
    # bytes: the tokens the receiver lacks x a token on the wire (= missing pages x wire page bytes,
    # the partial last page its filled slots only) -- what the gateway predicts
    slot = ELEMS * {"float32": 4, "bfloat16": 2, "float16": 2}[wdt]
    assert data.nbytes == (n_prompt - first * r.page_size) * slot
    assert data.nbytes == prompt_kv_bytes(n_prompt, first, r.page_size, slot * r.page_size)
    k = n_prompt % r.page_size
    r.import_pages(r_table[first:n_r], data, last_slots=k or None, src_dtype=wdt)
    narrowing = torch.tensor([], dtype=s.dtype).element_size() > torch.tensor([], dtype=r.dtype).element_size() \
        or s.dtype_name != wdt
    for t in range(first * r.page_size, n_prompt):
        want = _token(s, s_table, t).to(getattr(torch, wdt)).to(r.dtype)  # rounded at most once
        assert torch.equal(_token(r, r_table, t), want), t
        if not narrowing:
            assert torch.equal(_token(r, r_table, t).to(s.dtype), _token(s, s_table, t)), t  # exact
    # whole-page ablation: the last page whole, its empty slots zero
    whole = s.export_tokens(s_table, first * r.page_size, n_prompt, r.page_size, wdt, whole_last=True)
    assert whole.nbytes == (n_r - first) * r.page_size * slot


def test_same_layout_is_export_pages_byte_for_byte():
    s = KVPool(MC, 16, 4)
    s.buffer.normal_()
    t = s.alloc(5)
    assert bytes(s.export_tokens(t, 4, 19, 4)) == bytes(s.export_pages(t[1:5], last_slots=3))


@pytest.mark.parametrize("bad", [(3, 10), (0, 200), (8, 4)])
def test_a_bad_token_range_is_refused(bad):
    s = KVPool(MC, 16, 4)
    with pytest.raises(ValueError, match="export_tokens"):
        s.export_tokens(s.alloc(2), bad[0], bad[1], 8)


def _receiver(pool):
    from types import SimpleNamespace

    from pdd.roles.base import EngineInstance

    inst = EngineInstance.__new__(EngineInstance)  # only what import_frame reads
    inst.engine = SimpleNamespace(pool=pool)
    return inst


def test_the_receiver_widens_a_frame_in_the_senders_dtype_and_refuses_another_page_size():
    from types import SimpleNamespace

    torch.manual_seed(1)
    s, r = KVPool(MC, 16, 8, "bfloat16"), KVPool(MC, 16, 16, "float32")
    s.buffer.normal_()
    st, rt = s.alloc(3), r.alloc(2)
    data = s.export_tokens(st, 0, 20, 16, "bfloat16")  # the wire dtype: the sender's, narrower
    ctx = SimpleNamespace(seq=SimpleNamespace(page_table=rt, num_cached_tokens=0, prompt_len=20), extra={})
    inst = _receiver(r)
    slot = ELEMS * 2
    h = {"rid": "a", "first_page": 0, "n_pages": 2, "layers": None, "page_bytes": 16 * slot,
         "last_page_bytes": 4 * slot, "dtype": "bfloat16"}
    inst.import_frame(ctx, Kv.decode({"t": "kv", **h}), data)  # the typed message (#24)
    for t in range(20):
        assert torch.equal(_token(r, rt, t), _token(s, st, t).float()), t
    assert ctx.extra["pages_received"] == 2
    with pytest.raises(ValueError, match=r"page_bytes 512 is not a page of 16 tokens in bfloat16 \(1024 bytes\)"):
        inst.import_frame(ctx, Kv.decode({"t": "kv", **h, "page_bytes": 8 * slot}), data)
