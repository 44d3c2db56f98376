"""Loading a checkpoint and serving a request does not import ``torch._dynamo``: the model is built
on the meta device and its weights assigned from the checkpoint, and drawing the embedding's
throw-away initial values there (``normal_``, whose meta decomposition lives in ``torch._refs``)
imported it, ~1.5 s of CPU in every engine process's start (3 per topology the slow tests start)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pdd.engine.engine import Engine
from pdd.types import SamplingParams
eng = Engine.from_pretrained(sys.argv[1], num_pages=64, page_size=16, device="cpu")
s = eng.new_sequence("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True), use_cache=False)
eng.add(s)
while eng.has_work():
    eng.step()
print(len(s.output_ids), sorted(m for m in sys.modules if m.startswith("torch._dynamo"))[:3])
"""


def test_engine_load_and_a_request_do_not_import_torch_dynamo(tiny_model):
    r = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3 []"
