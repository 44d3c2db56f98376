"""KV fingerprint in the connection handshake: instances that would exchange KV pages with a
different page size, KV dtype, KV layout or model weights are refused at connection time with an
error naming what differs (``EngineInstance.kv_fingerprint`` + ``rpc.default_handshake_check``)."""

from types import SimpleNamespace

import pytest

from pdd.config import ClusterConfig
from pdd.modelgen import make_model
from pdd.roles.base import EngineInstance, weights_digest
from pdd.transfer.rpc import HandshakeError, Server, connect


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp")
    for name, seed in (("a", 0), ("a_copy", 0), ("b", 1)):
        make_model(str(root / name), preset="tiny", seed=seed)
    return {k: str(root / k) for k in ("a", "a_copy", "b")}


def instance(model: str, page_size=16, dtype="float32", layers=2, kv_heads=2, head_dim=16) -> EngineInstance:
    inst = EngineInstance.__new__(EngineInstance)  # only what kv_fingerprint reads
    inst.cfg = ClusterConfig.model_validate({"model_path": model})
    inst.engine = SimpleNamespace(pool=SimpleNamespace(page_size=page_size, dtype_name=dtype, num_layers=layers,
                                                        num_kv_heads=kv_heads, head_dim=head_dim))
    return inst


def test_weights_digest_tells_checkpoints_apart(models):
    assert weights_digest(models["a"]) == weights_digest(models["a_copy"])
    assert weights_digest(models["a"]) != weights_digest(models["b"])


@pytest.mark.parametrize("field,other", [
    ("page_size", dict(page_size=32)),
    ("kv_dtype", dict(dtype="bfloat16")),
    ("kv_layout", dict(layers=4)),
    ("kv_layout", dict(head_dim=32)),
    ("weights", None),
])
async def test_mismatch_refused_at_connect_naming_the_field(models, field, other):
    md = instance(models["a"]).kv_fingerprint()
    p = instance(models["b"]).kv_fingerprint() if other is None else instance(models["a"], **other).kv_fingerprint()
    server = await Server(port=0, role="main_decode", fingerprint=md).start()
    try:
        with pytest.raises(HandshakeError) as e:
            await connect("127.0.0.1", server.port, role="prefill", fingerprint=p, retries=3)
        assert "KV fingerprint mismatch" in str(e.value) and field in str(e.value)
        assert server.refused == 1
        # the same checkpoint (another copy) and configuration: accepted
        ok = await connect("127.0.0.1", server.port, role="prefill", fingerprint=instance(models["a_copy"]).kv_fingerprint())
        assert ok.remote_fingerprint == md
        await ok.close()
    finally:
        await server.close()
