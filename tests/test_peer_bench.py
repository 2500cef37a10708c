"""bench/peer_llamacpp.py (issue 19 item 6) runs llama-bench with the documented arguments and divides our speeds by
its own: here against a stand-in llama-bench (a script that records its arguments and prints llama-bench's JSONL
rows for several prompt/output/depth cases), our side on the CPU with a tiny synthetic model."""

import json
import subprocess
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.make_synthetic_gguf import write_model  # noqa: E402

ROWS = [  # the two the script must pick, and two it must not (the stand-in prints all four for each run)
    {"n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ts": 800.0},
    {"n_prompt": 8, "n_gen": 0, "n_depth": 8, "avg_ts": 1.0},
    {"n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ts": 2.0},
    {"n_prompt": 0, "n_gen": 4, "n_depth": 8, "avg_ts": 40.0},
]


def _stand_in(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-bench"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"open({str(tmp_path / 'args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n{body}\n")
    script.chmod(0o755)
    return script


def _run(tmp_path: Path, script: Path, *extra: str) -> subprocess.CompletedProcess:
    model = tmp_path / "tiny.gguf"
    write_model(model, dict(hidden=64, layers=2, ffn=128, heads=2, kv_heads=1, vocab=300, tied=True), T.Q8_0, "tiny")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "peer_llamacpp.py"), str(model), "--llama-bench",
                           str(script), "--prompt", "8", "--output", "4", "--repeats", "1", "--device", "cpu", *extra],
                          capture_output=True, text=True, timeout=600)


def test_ratios_are_ours_over_llama_benchs_at_the_same_lengths(tmp_path):
    script = _stand_in(tmp_path, "\n".join(f"print(json.dumps({row!r}))" for row in ROWS))
    done = _run(tmp_path, script)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert (line["llamacpp_prompt_tokens_per_s"], line["llamacpp_output_tokens_per_s"]) == (800.0, 40.0)
    assert line["ours"]["backend"] == "numpy" and line["ours"]["prompt_tokens"] == 8
    assert line["prompt_ratio"] == round(line["ours_prompt_tokens_per_s"] / 800.0, 3)
    assert line["output_ratio"] == round(line["ours_output_tokens_per_s"] / 40.0, 3)
    args = json.loads((tmp_path / "args.json").read_text())  # the second run's: the output at the prompt's depth
    assert args == ["-m", str(tmp_path / "tiny.gguf"), "-ngl", "99", "-fa", "1", "-r", "1", "-o", "jsonl", "-p", "0",
                    "-n", "4", "-d", "8"]


def test_a_failing_llama_bench_is_reported_with_its_words(tmp_path):
    script = _stand_in(tmp_path, "sys.stderr.write('error: unknown argument: -ncmoe\\n'); sys.exit(1)")
    done = _run(tmp_path, script, "--experts-in-ram", "2", "--threads", "3")
    assert done.returncode == 1
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert "exited with 1" in line["error"] and "unknown argument: -ncmoe" in line["error"]
    assert json.loads((tmp_path / "args.json").read_text())[10:14] == ["-ncmoe", "2", "-t", "3"]
