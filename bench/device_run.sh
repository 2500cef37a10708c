# One device call: install the carried gguf wheel, run the GPU tests, then the speed benchmarks.
# Usage (on the GPU machine, repo root): bash bench/device_run.sh [tests] [kernels] [synthetic] [profile] [smol]
# The GPU machine has no network: .whl/ holds the gguf wheel, and the SmolLM2 GGUF (98 MB, over one call's
# 64 MB) travels in two parts, .carry/smol.part00 (copied to /tmp/strata by a first call) and
# .carry/smol.part01 (joined to it by the `smol` step of a second call while the machine is still warm).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STRATA_TEST_CACHE=/tmp/strata
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/strata "$OUT"
for part in "$@"; do
  case $part in
    tests) python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_gpu_layout.py tests/test_gpu_kernels.py tests/test_gpu_backend.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    kernels) python3 bench/gpu_kernels.py matvec 2>&1 | tee "$OUT/kernels.jsonl" ;;
    synthetic)
      for spec in 1.2b:Q4_0 8b:Q4_0 8b:Q4_K; do
        f=/tmp/strata/synthetic-${spec/:/-}.gguf
        python3 bench/make_synthetic_gguf.py "$f" --shape "${spec%:*}" --type "${spec#*:}" && python3 bench/bench_gpu.py "$f" 2>&1 | tee -a "$OUT/bench.jsonl"
        rm -f "$f"
      done ;;
    profile)
      f=/tmp/strata/synthetic-1.2b-Q4_0.gguf
      python3 bench/make_synthetic_gguf.py "$f" --shape 1.2b --type Q4_0
      python3 bench/bench_gpu.py "$f" 2>&1 | tee -a "$OUT/bench.jsonl"
      rm -f "$f" ;;
    smol)
      [ -f /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /tmp/strata/smol.part00 .carry/smol.part01 > /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
      sha256sum /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
      python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_model.py 2>&1 | tee "$OUT/model_tests.log" | tail -25
      python3 bench/bench_gpu.py /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1 | tee -a "$OUT/bench.jsonl" ;;
  esac
done
