"""schemathesis against the gateway's OpenAPI schema, on a live topology: requests generated from
the schema (valid and invalid bodies) must never get a server error (5xx), and the gateway must
stay healthy afterwards, with every instance process alive (no crash) and every call answered
within its timeout (no hang). Examples per operation and generation mode:
``PDD_API_FUZZ_EXAMPLES`` (default 25, for CI). ``max_tokens`` / ``max_completion_tokens`` above
``MAX_TOKENS_CAP`` are capped in this profile so a large campaign stays affordable on a CPU:
``PDD_API_FUZZ_EXAMPLES=160 pytest -s tests/security/test_api_fuzz.py`` runs > 2000 cases and
prints the total and the status codes."""

from __future__ import annotations

import os

import httpx
import pytest

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("PDD_API_FUZZ_EXAMPLES", "25"))
MAX_TOKENS_CAP = 8
CALL_TIMEOUT_S = 60  # a call not answered within this is a hang (the test fails on it)


def test_gateway_openapi_schema_fuzz(tiny_model, tmp_path):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable

    from pdd.config import ClusterConfig
    from pdd.launch import Topology

    from pdd.topology import free_port_block

    base = free_port_block()
    cfg = ClusterConfig.model_validate({
        "mode": "colocated", "model_path": tiny_model, "model_preset": "tiny", "served_model_name": "tiny",
        "base_port": base, "gateway_port": base + 99, "request_timeout_s": 30,
        "engine": {"num_pages": 256, "max_model_len": 96, "max_input_len": 64}})
    topo = Topology(cfg, log_dir=tmp_path / "logs")
    topo.start()
    try:
        schema = schemathesis.openapi.from_url(f"{topo.url}/openapi.json")
        errors: list[str] = []
        codes: dict = {}
        calls = 0
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
        for op, mode in [(r.ok(), m) for r in schema.get_all_operations() for m in modes]:

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode), fix=st.integers(0, 2))
            def run(case, fix):
                nonlocal calls
                calls += 1
                if fix and isinstance(case.body, dict):  # reach past the model / prompt checks too
                    case.body["model"] = cfg.served_model_name
                    if fix == 2 and op.path.endswith("/chat/completions"):
                        case.body["messages"] = [{"role": "user", "content": "hello there"}]
                    elif fix == 2:
                        case.body["prompt"] = "hello there"
                if isinstance(case.body, dict):
                    for k in ("max_tokens", "max_completion_tokens"):
                        v = case.body.get(k)
                        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS_CAP:
                            case.body[k] = MAX_TOKENS_CAP
                r = case.call(base_url=topo.url, timeout=CALL_TIMEOUT_S)
                codes[(op.path, r.status_code)] = codes.get((op.path, r.status_code), 0) + 1
                if r.status_code >= 500:
                    errors.append(f"{op.method.upper()} {op.path} -> {r.status_code}: {r.text[:300]} "
                                  f"(body {str(case.body)[:300]})")

            try:
                run()
            except Unsatisfiable:  # no invalid request exists (an operation without parameters)
                assert mode == schemathesis.GenerationMode.NEGATIVE
        print(f"schemathesis cases: {calls}; 5xx: {len(errors)}")
        print("status codes:", sorted(codes.items()))  # pytest -s shows how far the requests got
        assert calls >= EXAMPLES
        assert not errors, "\n".join(errors[:10])
        assert httpx.get(f"{topo.url}/health", timeout=10, trust_env=False).status_code == 200
        dead = {n: p.returncode for n, p in topo.procs.items() if p.poll() is not None}
        assert not dead, f"instance processes died during the fuzz run: {dead}"
    finally:
        topo.stop()
