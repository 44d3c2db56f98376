"""A stand-in for vLLM's OpenAI server (tests without vLLM): ``/health``, ``/reset_prefix_cache``
and a streaming ``/v1/completions`` that, for a pdd request, first checks the staged KV
(``kv_transfer_params["pdd_stage"]``) against the KV pdd's engine computes for those prompt
tokens (HTTP 500 naming the difference if it differs), then answers with pdd's engine's greedy
tokens, one per chunk, as vLLM does with ``return_token_ids``. Started by the vLLM MD endpoint as
``PYTHON -m vllm.entrypoints.openai.api_server --model DIR --port N ...`` through a wrapper
script that runs this file instead."""



import argparse
import json
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    a, _ = ap.parse_known_args()

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from pdd.engine.engine import Engine
    from pdd.types import SamplingParams
    from pdd.vllm_tier.staging import Stage, token_rows

    torch.set_num_threads(1)
    eng = Engine.from_pretrained(a.model, num_pages=512, page_size=16)
    app = FastAPI()
    seen = {"requests": 0, "staged_tokens": 0}

    def run(prompt, n, keep_pages: int = 0):
        s = eng.new_sequence(f"f{seen['requests']}", prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                             use_cache=False)
        eng.add(s)
        while eng.has_work():
            eng.step()
        pages = eng.pool.buffer[eng.pool._index(s.page_table[:keep_pages])].clone() if keep_pages else None
        out = list(s.output_ids)
        eng.release(s, cache=False)
        return out, pages

    @app.get("/health")
    async def health():
        return {}

    @app.get("/stats")
    async def stats():
        return seen

    @app.post("/reset_prefix_cache")
    async def reset():
        return {}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        prompt = [int(t) for t in body["prompt"]]
        n = int(body["max_tokens"])
        stage = Stage.from_params(body.get("kv_transfer_params"))
        seen["requests"] += 1
        if stage is not None:
            staged = stage.load()
            npg = staged.shape[0]
            _, ref = run(prompt[: stage.num_tokens], 1, keep_pages=npg)
            k = stage.num_tokens
            for layer in range(staged.shape[1]):
                for a_, b_ in zip(token_rows(staged, layer, 0, k), token_rows(ref, layer, 0, k)):
                    if not torch.allclose(a_, b_, atol=1e-4, rtol=1e-4):
                        return JSONResponse({"error": f"staged KV of layer {layer} differs from pdd's engine's"},
                                            status_code=500)
            seen["staged_tokens"] += k
        out, _ = run(prompt, n)

        def gen():
            for i, t in enumerate(out):
                fin = "length" if i == len(out) - 1 else None
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [t],
                                                          "finish_reason": fin}]}) + "\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                     "prompt_tokens_details": {"cached_tokens": stage.num_tokens if stage else 0}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
