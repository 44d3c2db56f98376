"""Device check (run by hand on a CUDA machine: ``python3 tests/api/cuda_sampling_check.py``):
seeded sampling with top-p / top-k / min-p and penalties gives the same tokens on CPU and CUDA
engines, and logprobs agree to float noise. Prints one line per prompt."""
import sys, torch
sys.path[:0] = ["src", "."]
from pdd.modelgen import make_model
from pdd.engine.engine import Engine
from pdd.engine.sampler import decision_margin
from pdd.types import SamplingParams
torch.set_num_threads(4)
p = make_model("/tmp/m_small", preset="small", seed=0)
res = {}
for dev in ("cpu", "cuda"):
    eng = Engine.from_pretrained(p, num_pages=512, page_size=16, device=dev)
    outs = []
    for i in range(8):
        prompt = [(37 * i + 11 * j) % 4000 + 5 for j in range(20 + 30 * i)]
        sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=500 + i,
                            ignore_eos=True, presence_penalty=0.4, repetition_penalty=1.1, logprobs=3)
        s = eng.new_sequence(i, prompt, sp, use_cache=False); eng.add(s); evs = []
        while eng.has_work(): evs += eng.step()
        eng.release(s, cache=False)
        outs.append(([e.token_id for e in evs], [e.logprobs["lp"] for e in evs], prompt, sp))
    res[dev] = outs
same = 0
for i, (a, b) in enumerate(zip(res["cpu"], res["cuda"])):
    ok = a[0] == b[0]
    same += ok
    n = len(a[0]) if ok else next(j for j, (x, y) in enumerate(zip(a[0], b[0])) if x != y)
    dlp = max(abs(x - y) for x, y in zip(a[1][:n], b[1][:n])) if n else 0.0
    print(f"prompt {i}: tokens {'equal' if ok else 'differ at ' + str(n)}, max |dlogprob| {dlp:.2e}")
print(f"CPU vs CUDA seeded sampling: {same}/8 identical")
