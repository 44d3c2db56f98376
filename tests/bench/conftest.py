"""Fixtures of the bench tests (the fakes live in bench_fakes.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fakes import server_url  # noqa: E402, F401
