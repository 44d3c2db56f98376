"""scripts/sim_scale.py, the simulator's speed benchmark, on a tiny size: it runs, tiles a trace
beyond its length without sharing prefixes across copies, and reports the same results as
`pdd sim run` would. No timing is asserted (the machine is shared)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "sim_scale.py"
spec = importlib.util.spec_from_file_location("sim_scale", SCRIPT)
sim_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_scale)


def test_tiling_shifts_time_and_hashes():
    recs = [{"timestamp": 0.0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]},
            {"timestamp": 500.0, "input_length": 512, "output_length": 8, "hash_ids": [0]}]
    out = sim_scale.tiled(recs, 5)
    assert [r["timestamp"] for r in out] == [0.0, 500.0, 1500.0, 2000.0, 3000.0]
    assert [r["hash_ids"] for r in out] == [[0, 1], [0], [2, 3], [2], [4, 5]]
    assert sim_scale.tiled(recs, 1) == recs[:1]


def test_benchmark_rows_and_table(capsys):
    rows = sim_scale.measure([60, 120], n_p=2, n_rld=1, n_md=2)
    assert [r["requests"] for r in rows] == [60, 120]
    assert rows[0]["cost_ratio"] == 1.0 and rows[1]["cost_ratio"] > 0
    assert all(r["instances"] == 5 and r["completed"] > 0 and r["requests_per_s"] > 0 for r in rows)
    table = sim_scale.format_table(rows)
    assert table.count("\n") == 3 and "| 120 | 5 |" in table
    assert sim_scale.main(["--sizes", "40", "--n-p", "1", "--n-rld", "1", "--n-md", "1"]) == 0
    assert "largest: 40 requests on 3 instances" in capsys.readouterr().out
