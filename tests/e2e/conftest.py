"""Fixtures that start real process topologies (marked slow)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from pdd.config import ClusterConfig
from pdd.launch import Topology


def free_port_block(n: int = 100) -> int:
    """A base port with ``n`` consecutive free ports above it (best effort)."""
    import random

    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    from pdd.modelgen import make_model

    d = tmp_path_factory.mktemp("models") / "small"
    make_model(str(d), preset="small", seed=0)
    return str(d)


TEST_DEVICE = os.environ.get("PDD_TEST_DEVICE", "cpu")  # "cuda" runs every engine of a topology on the GPU


def make_cfg(model: str, mode: str, **over) -> ClusterConfig:
    base = free_port_block()
    data = {"mode": mode, "model_path": model, "base_port": base, "gateway_port": base + 95,
            "engine": {"device": TEST_DEVICE}}
    data.update(over)
    return ClusterConfig.model_validate(data)


@pytest.fixture
def topology_factory(tmp_path):
    started: list[Topology] = []

    def start(cfg: ClusterConfig) -> Topology:
        t = Topology(cfg, log_dir=Path(tmp_path) / f"logs-{cfg.mode}-{len(started)}")
        t.start()
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()
