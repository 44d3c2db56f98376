"""What-if runner: ``pdd sim`` with ASSUMED (not datasheet-cited) Ascend 910B-class chip profiles
added in memory, for docs/SIM.md's third cost-table pair. data/hardware/chips.json holds cited
datasheet numbers only, so these stay out of it. Usage: the ``pdd sim`` arguments, e.g.
    .venv/bin/python scripts/sim_whatif_chips.py sim experiment cost-table --out DIR \
        --set chip_a=ASSUMED-910B3-64GB --set chip_b=H20-96GB
"""
import sys, json
import pdd.sim.models as hw  # the profile tables are read through pdd.sim.models._load

_orig = hw._load
ASSUMED = {
    # 910B3-class: 20 cube cores x 1.8 GHz x 4096 MAC x 2 ~ 295 TFLOPS (313 as marketed label), 64 GB, 1.6 TB/s
    "ASSUMED-910B3-64GB": {"bf16_tflops": 313, "hbm_gb": 64, "hbm_tbps": 1.6, "interconnect_gbps": 196,
                           "nic_gbps": 200, "usd_per_hour": 1.50, "source": "ASSUMED what-if, not a datasheet"},
    # 910B2-class: 24 cube cores, 376 TFLOPS label, same memory
    "ASSUMED-910B2-64GB": {"bf16_tflops": 376, "hbm_gb": 64, "hbm_tbps": 1.6, "interconnect_gbps": 196,
                           "nic_gbps": 200, "usd_per_hour": 1.50, "source": "ASSUMED what-if, not a datasheet"},
}

def _load(path):
    d = dict(_orig(path))
    if str(path).endswith("chips.json"):
        d.update(ASSUMED)
    return d

hw._load = _load
from pdd.sim.cli import main
sys.exit(main(sys.argv[1:]))
