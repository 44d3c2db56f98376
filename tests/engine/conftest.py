"""Fixtures for the engine tests: devices, engines and prompts on the session's tiny checkpoint
(``tiny_model``, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))]


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def prompts(tiny_model) -> list[list[int]]:
    from pdd.engine.engine import load_tokenizer

    tok = load_tokenizer(tiny_model)
    texts = [
        "Hello, how are you today?",
        "The prefill stage reads the whole prompt at once and is bound by compute, while",
        "x",
        "Once upon a time there was a small robot who wanted to learn how to read. Every morning",
    ]
    return [tok.encode(t).ids for t in texts]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def make_engine(tiny_model, device):
    """``make_engine(num_pages=128, page_size=4, **kw)`` -> Engine on the tiny model and ``device``."""
    from pdd.engine import Engine

    def _make(num_pages=128, page_size=4, **kw):
        return Engine.from_pretrained(tiny_model, num_pages=num_pages, page_size=page_size, device=device, **kw)

    return _make
