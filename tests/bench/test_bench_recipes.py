"""scripts/bench_recipes.sh (docs/BENCH.md "Recipes") with a stand-in ``pdd`` (``$PDD``) that records
its command lines: every step runs one ``pdd bench`` whose ``--trace`` is a file of the checkout
(the bundled Mooncake trace) or one the script wrote into OUT, so the recipes run in any clone."""

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "bench_recipes.sh"
STEPS = ["gaps", "ramp", "prld", "routing", "routing_local", "routing_pdd", "agentic", "agentic_itl30",
         "gaps_itl30", "agentic_short", "mooncake"]


def test_every_step_replays_a_trace_of_the_checkout_or_out(tmp_path):
    log = tmp_path / "calls.txt"
    stub = tmp_path / "pdd"
    # `pdd workload agentic ... --out F` writes F (one record); every call is logged, one per line
    stub.write_text("#!/bin/sh\n"
                    f'printf "%s\\n" "$*" >> "{log}"\n'
                    'prev=""; for a in "$@"; do [ "$prev" = "--out" ] && [ "$1" = workload ] && echo "{}" > "$a"; '
                    'prev="$a"; done\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out), *STEPS], env={**os.environ, "PDD": str(stub)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    benches = [shlex.split(line) for line in log.read_text().splitlines() if line.startswith("bench ")]
    assert len(benches) == len(STEPS)
    for argv in benches:
        trace = Path(argv[argv.index("--trace") + 1])
        where = trace if trace.is_absolute() else ROOT / trace
        assert where.resolve().is_relative_to(ROOT.resolve()) or where.resolve().is_relative_to(out.resolve()), \
            f"{argv[argv.index('--out') + 1]}: --trace {trace} is outside the checkout and OUT"
        assert where.is_file(), trace
