"""llama.cpp on the CPU through llama-cpp-python, measured the way bench/bench_engine.py measures ours: a fresh prompt
of exactly --prompt-tokens tokens, then exactly --output-tokens tokens picked greedily, on --threads threads. One
JSON line per run. llama-cpp-python is not one of the project's dependencies: install it (it builds llama.cpp from
source, a few minutes) in an environment of its own, e.g. `pip install llama-cpp-python==0.3.36`. Not a test.

    python bench/peer_llamacpp_cpu.py MODEL.gguf [--threads 2] [--prompt-tokens 512] [--output-tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from llama_cpp import Llama, llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    context = 256 * -(-(args.prompt_tokens + args.output_tokens + 1) // 256)  # llama.cpp pads the context to 256
    llm = Llama(args.model, n_ctx=context, n_threads=args.threads,
                n_threads_batch=args.threads, n_gpu_layers=0, verbose=False)
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    for run in range(args.runs):
        prompt = rng.integers(100, vocab - 100, args.prompt_tokens).tolist()  # fresh: nothing reused from the cache
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prompt_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.output_tokens):
            token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))  # the last token's
            llm.eval([token])
        output_s = time.perf_counter() - t
        print(json.dumps({"engine": "llama.cpp (llama-cpp-python)", "version": llama_cpp.__version__ if hasattr(
            llama_cpp, "__version__") else None, "model": os.path.basename(args.model), "threads": args.threads,
            "run": run, "prompt_tokens": args.prompt_tokens, "prompt_tokens_per_second": round(args.prompt_tokens / prompt_s, 1),
            "output_tokens": args.output_tokens, "output_tokens_per_second": round(args.output_tokens / output_s, 2)}),
            flush=True)


if __name__ == "__main__":
    main()
