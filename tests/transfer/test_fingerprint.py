"""KV fingerprint in the connection handshake: instances of a different model (architecture,
layers, KV heads, head dim or weights) are refused at connection time with an error naming what
differs; a different KV layout (page size, KV dtype) is accepted and announced, for the sender to
convert to (``EngineInstance.kv_fingerprint`` + ``pdd.transfer.layout.kv_handshake_check``)."""

from types import SimpleNamespace

import pytest

from pdd.config import ClusterConfig
from pdd.modelgen import make_model
from pdd.roles.base import EngineInstance, weights_digest
from pdd.transfer.layout import kv_handshake_check
from pdd.transfer.client import connect
from pdd.transfer.handshake import HandshakeError
from pdd.transfer.server import Server


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model):
    """``a``: the session's tiny checkpoint; ``a_copy``: the same built again in another
    directory; ``b``: another seed."""
    root = tmp_path_factory.mktemp("fp")
    for name, seed in (("a_copy", 0), ("b", 1)):
        make_model(str(root / name), preset="tiny", seed=seed)
    return {"a": tiny_model, "a_copy": str(root / "a_copy"), "b": str(root / "b")}


def instance(model: str, page_size=16, dtype="float32", layers=2, kv_heads=2, head_dim=16,
             arch="llama") -> EngineInstance:
    inst = EngineInstance.__new__(EngineInstance)  # only what kv_fingerprint reads
    inst.cfg = ClusterConfig.model_validate({"model_path": model})
    inst.engine = SimpleNamespace(pool=SimpleNamespace(page_size=page_size, dtype_name=dtype, num_layers=layers,
                                                        num_kv_heads=kv_heads, head_dim=head_dim,
                                                        model_cfg=SimpleNamespace(model_type=arch)))
    return inst


def test_weights_digest_tells_checkpoints_apart(models):
    assert weights_digest(models["a"]) == weights_digest(models["a_copy"])
    assert weights_digest(models["a"]) != weights_digest(models["b"])


async def serve(fp):
    return await Server(port=0, role="main_decode", fingerprint=fp, handshake_check=kv_handshake_check).start()


@pytest.mark.parametrize("field,other", [
    ("num_layers", dict(layers=4)),
    ("head_dim", dict(head_dim=32)),
    ("num_kv_heads", dict(kv_heads=4)),
    ("architecture", dict(arch="qwen2")),
    ("weights", None),
])
async def test_other_model_refused_at_connect_naming_the_field(models, field, other):
    md = instance(models["a"]).kv_fingerprint()
    p = instance(models["b"]).kv_fingerprint() if other is None else instance(models["a"], **other).kv_fingerprint()
    server = await serve(md)
    try:
        with pytest.raises(HandshakeError) as e:
            await connect("127.0.0.1", server.port, role="prefill", fingerprint=p, retries=3,
                          handshake_check=kv_handshake_check)
        assert "KV fingerprint mismatch, another model" in str(e.value) and f"{field}: local=" in str(e.value)
        assert server.refused == 1
        # the same checkpoint (another copy) and configuration: accepted
        ok = await connect("127.0.0.1", server.port, role="prefill", handshake_check=kv_handshake_check,
                           fingerprint=instance(models["a_copy"]).kv_fingerprint())
        assert ok.remote_fingerprint == md
        await ok.close()
    finally:
        await server.close()


@pytest.mark.parametrize("other", [dict(page_size=32), dict(dtype="bfloat16"), dict(page_size=8, dtype="float16")])
async def test_other_layout_accepted_and_announced(models, other):
    """Page size and KV dtype are negotiated: each side learns the other's from the hello."""
    md_fp = instance(models["a"], **other).kv_fingerprint()
    server = await serve(md_fp)
    try:
        p_fp = instance(models["a_copy"]).kv_fingerprint()
        peer = await connect("127.0.0.1", server.port, role="prefill", fingerprint=p_fp,
                             handshake_check=kv_handshake_check)
        assert peer.remote_fingerprint["page_size"] == other.get("page_size", 16)
        assert peer.remote_fingerprint["kv_dtype"] == other.get("dtype", "float32")
        assert server.refused == 0
        await peer.close()
    finally:
        await server.close()


@pytest.mark.parametrize("bad,field", [({"page_size": 24}, "page_size"), ({"page_size": 0}, "page_size"),
                                       ({"kv_dtype": "int8"}, "kv_dtype")])
def test_unconvertible_layout_refused_naming_the_field(bad, field):
    fp = {"page_size": 16, "kv_dtype": "float32", "num_layers": 2}
    with pytest.raises(HandshakeError, match=field):
        kv_handshake_check(fp, {**fp, **bad})
