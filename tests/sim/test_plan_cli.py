import json

from pdd.sim.cli import main
from pdd.sim.cluster import SimConfig
from pdd.sim.plan import WanOption, search
from pdd.workload.records import generate_agentic


def test_plan_finds_cheapest_feasible():
    recs = generate_agentic(150, seed=3, rate=1.0)
    base = SimConfig(mode="pdd", wan_gbps=25.0, slo_ttft_s=3.0, slo_tpot_s=0.1, warmup_frac=0.0)
    found = search(recs, base, md_counts=(1, 2), rld_counts=(1,), wans=(WanOption(10.0, 5.0), WanOption(25.0, 9.0)),
                   p_max=4)
    assert found
    costs = [r["cost_per_hour"] for r in found]
    assert costs == sorted(costs)
    assert all(r["attainment_at_target"] >= 0.9 for r in found)


def test_cli_run_and_agentic(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["sim", "run", "--mode", "pdd", "--agentic", "120", "--rate", "1", "--n-p", "1", "--n-rld", "1",
                 "--n-md", "1", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["completed"] > 0 and "p90_ttft_ms" in s
    trace = tmp_path / "a.jsonl"
    assert main(["sim", "agentic", "--n", "300", "--out", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 300
    assert "99.5-100%" in capsys.readouterr().out
