"""KVPool: ref counts, errors, raw page bytes."""

from __future__ import annotations

import pytest
import torch

from pdd.engine import DoubleFree, KVPool, ModelConfig, OutOfPages

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=4, name="t")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alloc_refcount_errors(dtype):
    pool = KVPool(CFG, num_pages=4, page_size=2, dtype=dtype)
    assert pool.buffer.shape == (4, 3, 2, 2, 2, 4)
    assert pool.page_bytes == 3 * pool.layer_page_bytes == 3 * 2 * 2 * 2 * 4 * (4 if dtype == "float32" else 2)
    assert CFG.kv_bytes_per_token(dtype) * pool.page_size == pool.page_bytes
    a = pool.alloc(3)
    assert pool.num_free == 1 and all(pool.refcount(p) == 1 for p in a)
    with pytest.raises(OutOfPages):
        pool.alloc(2)
    assert pool.num_free == 1  # failed alloc takes nothing
    pool.incref(a[:1])
    pool.decref(a)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 1
    pool.decref(a[:1])
    assert pool.num_free == 4
    with pytest.raises(DoubleFree):
        pool.decref(a[:1])
    with pytest.raises(DoubleFree):
        pool.incref(a[:1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_export_import_roundtrip(dtype):
    src = KVPool(CFG, 6, 2, dtype=dtype)
    dst = KVPool(CFG, 6, 2, dtype=dtype)
    src.buffer.copy_(torch.randn(src.buffer.shape).to(src.buffer.dtype))
    pages_s, pages_d = [4, 1, 2], [0, 5, 3]
    data = src.export_pages(pages_s)
    assert len(data) == 3 * src.page_bytes
    dst.import_pages(pages_d, bytes(data))
    assert torch.equal(dst.buffer[pages_d], src.buffer[pages_s])
    # layer ranges: contiguous page ids take the slice path
    dst.buffer.zero_()
    for l0, l1 in ((0, 1), (1, 3)):
        d = src.export_pages([2, 3], layers=(l0, l1))
        assert len(d) == 2 * (l1 - l0) * src.layer_page_bytes
        dst.import_pages([0, 1], d, layers=(l0, l1))
    assert torch.equal(dst.buffer[0:2], src.buffer[2:4])
    with pytest.raises(ValueError):
        dst.import_pages([0], data)  # wrong size
    with pytest.raises(ValueError):
        src.export_pages([0], layers=(2, 2))
    assert len(src.export_pages([])) == 0


def test_fingerprint():
    fp = KVPool(CFG, 2, 16, dtype="bf16").fingerprint()
    assert fp["page_size"] == 16 and fp["dtype"] == "bfloat16" and fp["num_layers"] == 3
    assert fp["num_kv_heads"] == 2 and fp["head_dim"] == 4
    assert fp["layout"] == "page,layer,kv,slot,kv_head,head_dim"
    assert fp != KVPool(CFG, 2, 8).fingerprint()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pages,last,layers", [([1, 2, 3], 2, None), ([5], 1, (1, 3)), ([0, 6], 4, None),
                                               ([7, 2, 4], 3, (0, 1))])
def test_export_import_partial_last_page(dtype, pages, last, layers):
    """``last_slots``: whole pages, then the last page's first ``last`` slots only; importing
    writes exactly those slots and leaves the rest of the last page as it was."""
    a = KVPool(CFG, num_pages=8, page_size=4, dtype=dtype)
    b = KVPool(CFG, num_pages=8, page_size=4, dtype=dtype)
    a.buffer.copy_(torch.randn(a.buffer.shape).to(a.buffer.dtype))
    l0, l1 = layers or (0, 3)
    data = a.export_pages(pages, layers, last_slots=last)
    assert len(data) == (len(pages) - 1) * (l1 - l0) * a.layer_page_bytes + last * a.slot_bytes(layers)
    assert a.slot_bytes(None) * a.page_size == a.page_bytes
    b.import_pages(pages, data, layers, last_slots=last)
    assert torch.equal(b.buffer[pages[:-1], l0:l1], a.buffer[pages[:-1], l0:l1])
    assert torch.equal(b.buffer[pages[-1], l0:l1, :, :last], a.buffer[pages[-1], l0:l1, :, :last])
    assert not b.buffer[pages[-1], :, :, last:].any() and not b.buffer[pages[-1], :l0].any()
    if last < a.page_size:
        with pytest.raises(ValueError, match="expected"):
            b.import_pages(pages, data, layers)  # read as whole pages: wrong length
    else:  # a full last page is a whole page
        assert bytes(data) == bytes(a.export_pages(pages, layers))
    with pytest.raises(ValueError, match="last_slots"):
        a.export_pages(pages, layers, last_slots=5)
