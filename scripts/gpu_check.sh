#!/usr/bin/env bash
# GPU check for a lent CUDA machine (see the device tool): engine tests on CUDA, the output
# contract through a live pdd topology whose engines all run on the GPU, and a short demo.
# Missing pure-Python packages travel as wheels in .whl/ (installed to /tmp/site).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
if [ -z "${SKIP_ENGINE:-}" ]; then
  echo "== engine tests (CUDA cases included)"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine -x 2>&1 | tail -5
fi
echo "== output contract through pdd with every engine on CUDA"
PDD_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -s tests/e2e/test_output_contract.py 2>&1 | tail -8
echo "== short demo on CUDA"
printf 'engine:\n  device: cuda\nmodel_path: /tmp/models/small\n' > /tmp/cuda.yaml
timeout 150 python3 -m pdd.cli demo --config /tmp/cuda.yaml --requests 40 --out "$OUT/demo-cuda" 2>&1 | tail -30
