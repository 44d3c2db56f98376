"""llguidance's bitmask layout, read the same way everywhere: ``sampler.unpack_masks`` (a batch
of rows, and ``grammar_mask`` one) and ``structured.has_id`` / ``with_ids`` (the guide's EOS-only
mask, its refused specials, its first-mask check) agree bit for bit with the layout the guide
documents (bit ``i % 32`` of little-endian 32-bit word ``i // 32``), whatever the vocabulary's
size against the mask's width."""

from __future__ import annotations

import random

import pytest
import torch

from pdd.engine.sampler import grammar_mask, unpack_masks
from pdd.structured import has_id, with_ids


def _reference(bits: bytes, vocab: int) -> list[bool]:
    words = [int.from_bytes(bits[i:i + 4], "little") for i in range(0, len(bits), 4)]
    return [i // 32 < len(words) and bool(words[i // 32] >> (i % 32) & 1) for i in range(vocab)]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 1024, 1030])
@pytest.mark.parametrize("extra_words", [-1, 0, 2])
def test_the_torch_and_the_bytes_readings_are_the_documented_layout(vocab, extra_words):
    n_words = max(1, (vocab + 31) // 32 + extra_words)  # (never narrower than one word)
    rng = random.Random(vocab * 7 + extra_words)
    rows = [bytes(rng.randrange(256) for _ in range(4 * n_words)) for _ in range(3)]
    ref = [_reference(b, vocab) for b in rows]
    assert unpack_masks(rows, vocab).tolist() == ref
    assert [grammar_mask(b, vocab).tolist() for b in rows] == ref
    assert [[has_id(b, i) if i < 32 * n_words else False for i in range(vocab)] for b in rows] == ref


def test_with_ids_sets_and_clears_only_those_ids():
    bits = bytes(range(8))
    ids = [0, 9, 31, 32, 63]
    on, off = with_ids(bits, ids, True), with_ids(bits, ids, False)
    for i in range(64):
        assert has_id(on, i) == (i in ids or has_id(bits, i))
        assert has_id(off, i) == (i not in ids and has_id(bits, i))
    assert with_ids(bytes(8), [], True) == bytes(8)
    assert isinstance(on, bytes) and len(on) == len(bits)
    assert unpack_masks([on], 64, torch.device("cpu")).dtype == torch.bool
