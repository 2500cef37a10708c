"""Our engine and llama.cpp's llama-bench on the same GGUF files, one after the other, with the ratios: the
measurement every speed target of ours is written against (shared/reference/peer-llamacpp.md says how llama.cpp
is built on the GPU machine). Not a test.

For each model: llama-bench's prompt of --prompt tokens at depth 0 (`-p P -n 0 -d 0`) and its output of --output
tokens at depth --prompt (`-p 0 -n N -d P`), two runs with `-ngl 99 -fa 1` (flash attention on, every layer on the
GPU; with --experts-in-ram N also `-ncmoe N -t THREADS`), then bench/bench_gpu.py's run on the same file with the
same lengths (its prompt from position 0, its output after the prompt). One JSON line per model: both sides' tokens/s and ours over theirs.

    python bench/peer_llamacpp.py MODEL.gguf [...] --llama-bench build/bin/llama-bench [--prompt 512]
        [--output 128] [--repeats 5] [--experts-in-ram N] [--threads 16] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu import run  # noqa: E402


def llama_bench_args(binary: Path, model: Path, prompt: int, output: int, repeats: int, experts_in_ram: int,
                     threads: int) -> list[list[str]]:
    """Two llama-bench runs: the prompt at depth 0, then the output at depth `prompt` (one run of `-d 0,P` would also
    time the prompt at depth P and the output at depth 0, which at 32K tokens cost minutes and are not used)."""
    common = ["-m", str(model), "-ngl", "99", "-fa", "1", "-r", str(repeats), "-o", "jsonl"]
    if experts_in_ram:
        common += ["-ncmoe", str(experts_in_ram), "-t", str(threads)]
    return [[str(binary), *common, "-p", str(prompt), "-n", "0", "-d", "0"],
            [str(binary), *common, "-p", "0", "-n", str(output), "-d", str(prompt)]]


def llama_bench_speeds(runs: list[list[str]], prompt: int, output: int) -> tuple[float, float]:
    """(prompt tokens/s at depth 0, output tokens/s at depth `prompt`) from llama-bench's runs; RuntimeError with
    its own words when one fails or none prints one of the two."""
    rows, printed = [], []
    for args in runs:
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        printed.append(done.stdout.strip())
        for line in done.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
            elif line.startswith("["):  # -o json prints one array
                rows.extend(json.loads(line))

    def pick(n_prompt: int, n_gen: int, depth: int) -> float:
        for row in rows:
            if (row.get("n_prompt"), row.get("n_gen"), row.get("n_depth", 0)) == (n_prompt, n_gen, depth):
                return float(row["avg_ts"])
        raise RuntimeError(f"llama-bench printed no row for {n_prompt} prompt and {n_gen} output tokens at depth "
                           f"{depth}; it printed: {' '.join(printed)[-500:]}")

    return pick(prompt, 0, 0), pick(0, output, prompt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--llama-bench", type=Path, required=True, help="a built llama-bench")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--experts-in-ram", type=int, default=0, help="MoE layers whose experts stay in RAM, both sides")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's CPU threads (-t)")
    parser.add_argument("--device", default="cuda", help="ours: cuda, or cpu")
    args = parser.parse_args()
    failed = False
    for model in args.models:
        line = {"file": model.name, "prompt_tokens": args.prompt, "output_tokens": args.output,
                "experts_in_ram": args.experts_in_ram}
        try:
            theirs = llama_bench_speeds(llama_bench_args(args.llama_bench, model, args.prompt, args.output,
                                                         args.repeats, args.experts_in_ram, args.threads),
                                        args.prompt, args.output)
        except (OSError, RuntimeError) as exc:
            print(json.dumps({**line, "error": str(exc)}), flush=True)
            failed = True
            continue
        ours = run(model, args.prompt, args.output, args.device, args.repeats, args.experts_in_ram)
        mine = (ours["prompt_tokens_per_s"], ours["output_tokens_per_s"])
        print(json.dumps({
            **line,
            "llamacpp_prompt_tokens_per_s": round(theirs[0], 1), "llamacpp_output_tokens_per_s": round(theirs[1], 1),
            "ours_prompt_tokens_per_s": mine[0], "ours_output_tokens_per_s": mine[1],
            "prompt_ratio": round(mine[0] / theirs[0], 3), "output_ratio": round(mine[1] / theirs[1], 3),
            "ours": ours,
        }), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
