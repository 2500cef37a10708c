# One device call: install the carried wheels, run the GPU tests, then the speed benchmarks.
# Usage (on the GPU machine, repo root): bash bench/device_run.sh [warm] [tests] [kernels] [shapes] [prompt] [synthetic] [smol]
#                                        [archs] [memory] [issue5] [flash] [ram] [cache] [moe] [hybrid] [hybridbench] [kvq8]
#                                        [ring] [moeab] [peer] [s13] [s13b] [s13c] [phases] [ab] [files] [gputests]
#                                        [profile] [winners] [kcache] [bus] [peerbuild] [bench]
# The GPU machine has no network: .whl/ holds the wheels it lacks (gguf; pydantic and its dependencies, which
# tests/conftest.py's catalog lookup imports; bench/device_carry.sh downloads them for Python 3.12, and makes the
# .carry/ items below that a fresh checkout lacks), and the SmolLM2 GGUF
# (98 MB, over one call's 64 MB) travels in two parts, .carry/smol.part00 (copied to /tmp/strata by a first call) and
# .carry/smol.part01 (joined to it by the `smol` step of a second call while the machine is still warm).
# SYNTHETIC="8b:Q4_K ..." limits the synthetic step to those shape:type pairs. archs, memory and issue5 need no
# model file: .carry/smollm2-tokenizer.gguf (tests/gguf_convert.py
# write_tokenizer_gguf) and the skeletons .carry/smollm2-skeleton.gguf, .carry/gemma3-skeleton.gguf
# (bench/replica_gguf.py) travel instead, a few MB each. flash: the attention tests, the attention kernels alone
# (bench/bench_attention.py) and the Qwen3-8B Q4_K_M shape, FLASH_RUNS="prompt:attention[:decode-attention] ..." (the
# bench_gpu.py options; by default 512 and 8192 tokens, today's kernels against the older ones). moe: the mixture
# tests, one layer's experts both ways (gpu_kernels.py moe) and the synthetic Qwen3-30B-A3B's prompts of
# MOE_PROMPTS="512 4096" tokens. hybrid: the hybrid families' GPU tests, on the tiny models carried in .carry/hybrid
# (tests/test_gpu_hybrid.py tiny_hybrid, for a machine whose transformers lacks these families). hybridbench: the
# synthetic HYBRID_SHAPES="qwen3.6-35b-a3b qwen3.8-27b" (Q4_K_M mix) at prompts of HYBRID_PROMPTS="512 4096". kvq8:
# the q8_0 KV cache's GPU tests beside the fp16 cache's attention tests, the attention kernels alone on each cache,
# and the synthetic Qwen3-8B (Q4_K_M mix) with each cache at prompts of KVQ8_PROMPTS="512 8192 32768" tokens. ring:
# the KV cache tests (q8_0 and sliding-window rings) and the GPU's Gemma 3 ring against the CPU path, the older
# attention tests, then the kvq8 step's model runs at RING_PROMPTS="512 32768". moeab: the mixture and prompt-product
# tests, then the moe step's kernels (gpu_kernels.py moe prompt) and model runs (MOE_PROMPTS) for the code in
# .carry/old (an earlier tree's engine/ and bench/, `git archive <commit> engine bench`) and for this one, in one call.
# peer (not yet run on a device): builds llama.cpp's llama-bench from .carry/llama.cpp.tar.xz
# (shared/reference/peer-llamacpp.md says how the tarball is cut) and writes PEER_SHAPES="qwen3-8b qwen3-30b-a3b
# qwen3.6-35b-a3b" (Q4_K_M mix, SmolLM2's tokenizer, so llama.cpp loads them), then bench/peer_llamacpp.py for
# PEER_RUNS="shape:prompt:output[:layers of experts in RAM] ..." (on a warm machine whose /tmp still holds the build
# and the files, it reuses them), then bench_gpu.py for AB_RUNS="shape:prompt ..." with .carry/old's code and this
# tree's. s13, s13b, s13c: session 13's three calls (below). phases: decode attention's kernels on caches out of L2 and
# the deep kernel's timeline (ATTN_RUNS); ab: synthetic files (AB_RUNS) through bench_gpu.py for .carry/old and this tree. warm: bench/compile_kernels.py for this tree and
# .carry/old at once, first in a call whose steps run under time limits. files, gputests, profile: see their lines.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 STRATA_TEST_CACHE=/tmp/strata
OUT=${OUT:-/tmp/out}; mkdir -p /tmp/strata "$OUT"
# CuPy's compiled kernels (keyed by source, GPU and NVRTC version): seeded from .carry/kcache.part* where an earlier
# call's kcache step sent them back, so a fresh machine skips NVRTC for sources it has already built.
export CUPY_CACHE_DIR=/tmp/kcache
[ -d $CUPY_CACHE_DIR ] || { mkdir -p $CUPY_CACHE_DIR; ls .carry/kcache.part* >/dev/null 2>&1 && cat .carry/kcache.part* | tar xJ -C $CUPY_CACHE_DIR; }
LLAMA_BENCH=/tmp/llama.cpp/build/bin/llama-bench
# Unpack and build llama-bench in the background (`wait` joins it).
llama_build() {
  [ -d /tmp/llama.cpp ] && return  # built, or being built by an earlier step of this call
  tar xJf .carry/llama.cpp.tar.xz -C /tmp || return 1
  gen=Ninja; command -v ninja >/dev/null || gen="Unix Makefiles"
  (cd /tmp/llama.cpp && cmake -S . -B build -G "$gen" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build --target llama-bench -j 16) > "$OUT/llama_build.log" 2>&1 &
}
peer_files() {
  for shape in ${PEER_SHAPES:-qwen3-8b qwen3-30b-a3b qwen3.6-35b-a3b}; do
    f=/tmp/strata/peer-$shape.gguf
    [ -f "$f" ] || { python3 bench/make_synthetic_gguf.py "$f.tmp" --shape $shape --type Q4_K_M \
      --tokenizer .carry/smollm2-tokenizer.gguf >> "$OUT/make.log" 2>&1 && mv "$f.tmp" "$f"; }
  done
}
for part in "$@"; do
  echo "== $part $(date +%T)"
  case $part in
    warm)  # compile this tree's kernels and those of AB_TREES (.carry/old by default) at once (with the sweep copies
           # unless WARM_OPTIONS is set, e.g. to ""), so timed steps do not pay NVRTC inside their limits
      for tree in $(printf '%s\n' . ${AB_TREES:-.carry/old} | sort -u); do
        [ -d $tree/engine ] && timeout 300 python3 bench/compile_kernels.py ${WARM_OPTIONS---sweep} --tree $tree 2>&1 | tee -a "$OUT/compile.jsonl" &
      done
      wait ;;
    tests) python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_gpu_layout.py tests/test_gpu_kernels.py tests/test_gpu_backend.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    kernels) python3 bench/gpu_kernels.py matvec 2>&1 | tee "$OUT/kernels.jsonl" ;;
    shapes) python3 bench/gpu_kernels.py matvec_shapes 2>&1 | tee "$OUT/shapes.jsonl" ;;
    prompt) python3 bench/gpu_kernels.py prompt 2>&1 | tee "$OUT/prompt.jsonl" ;;
    synthetic)
      for spec in ${SYNTHETIC:-1.2b:Q4_0 8b:Q4_0 8b:Q4_K}; do
        f=/tmp/strata/synthetic-${spec/:/-}.gguf
        python3 bench/make_synthetic_gguf.py "$f" --shape "${spec%:*}" --type "${spec#*:}" && python3 bench/bench_gpu.py "$f" 2>&1 | tee -a "$OUT/bench.jsonl"
        rm -f "$f"
      done ;;
    smol)
      [ -f /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /tmp/strata/smol.part00 .carry/smol.part01 > /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
      sha256sum /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf
      python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_model.py 2>&1 | tee "$OUT/model_tests.log" | tail -25
      python3 bench/bench_gpu.py /tmp/strata/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1 | tee -a "$OUT/bench.jsonl" ;;
    archs)
      cp .carry/smollm2-tokenizer.gguf /tmp/strata/
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_moe.py tests/test_gpu_arch.py tests/test_gpu_backend.py 2>&1 | tee "$OUT/arch_tests.log" | grep -E "relative error|logit range|differ|passed|failed|Error" ;;
    memory)
      python3 bench/replica_gguf.py expand .carry/smollm2-skeleton.gguf /tmp/strata/smollm2-replica.gguf
      python3 bench/replica_gguf.py expand .carry/gemma3-skeleton.gguf /tmp/strata/gemma3-replica.gguf
      python3 bench/make_synthetic_gguf.py /tmp/strata/synthetic-8b.gguf --shape 8b --type Q4_K
      timeout 200 python3 bench/gpu_memory_fit.py measure smollm2-135m-instruct=/tmp/strata/smollm2-replica.gguf \
        gemma-3-270m=/tmp/strata/gemma3-replica.gguf synthetic-8b=/tmp/strata/synthetic-8b.gguf 2>&1 | tee "$OUT/memory.jsonl"
      rm -f /tmp/strata/synthetic-8b.gguf ;;
    issue5)
      [ -f /tmp/strata/gemma3-replica.gguf ] || python3 bench/replica_gguf.py expand .carry/gemma3-skeleton.gguf /tmp/strata/gemma3-replica.gguf
      timeout 60 python3 bench/bench_gpu.py /tmp/strata/gemma3-replica.gguf 2>&1 | tee -a "$OUT/issue5.jsonl"
      for spec in qwen3-8b qwen3-30b-a3b; do
        f=/tmp/strata/synthetic-$spec.gguf
        python3 bench/make_synthetic_gguf.py "$f" --shape $spec --type Q4_K_M && timeout 150 python3 bench/bench_gpu.py "$f" 2>&1 | tee -a "$OUT/issue5.jsonl"
        rm -f "$f"
      done ;;
    flash)
      timeout 300 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_flash.py tests/test_gpu_backend.py \
        tests/test_gpu_kernels.py -k "flash or attention or long_prompt or backend" 2>&1 | tee "$OUT/flash_tests.log" | grep -E "logit difference|passed|failed|Error"
      timeout 200 python3 bench/bench_attention.py 2>&1 | tee "$OUT/attention.jsonl"
      f=/tmp/strata/synthetic-qwen3-8b.gguf
      python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-8b --type Q4_K_M
      for run in ${FLASH_RUNS:-512:flash 512:chunk 8192:flash 8192:chunk}; do
        IFS=: read -r p a d <<< "$run"
        timeout 200 python3 bench/bench_gpu.py "$f" --prompt $p --output 64 --repeats 2 --attention $a ${d:+--decode-attention $d} 2>&1 | tee -a "$OUT/flash_bench.jsonl"
      done
      rm -f "$f" ;;
    ram)
      # Experts in RAM (issue 18): GPU tests of the split model, then the synthetic Qwen3-30B-A3B (Q4_K_M mix) with the
      # experts of RAM_LAYERS="0 21 32 48" layers in RAM, prompts of RAM_PROMPT=512 tokens.
      timeout 300 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_moe.py 2>&1 | tee "$OUT/ram_tests.log" | grep -E "in RAM|passed|failed|Error"
      f=/tmp/strata/synthetic-qwen3-30b-a3b.gguf
      [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-30b-a3b --type Q4_K_M
      for n in ${RAM_LAYERS:-0 21 32 48}; do
        timeout 240 python3 bench/bench_gpu.py "$f" --prompt ${RAM_PROMPT:-512} --repeats 2 --experts-in-ram $n 2>&1 | tee -a "$OUT/ram_bench.jsonl"
      done ;;
    cache)
      # The hot-expert cache (issue 18 item 4): the mixture tests, then the synthetic Qwen3-30B-A3B (Q4_K_M mix) with
      # routers skewed by CACHE_SKEW=2 (make_synthetic_gguf.py router_rows), for CACHE_RUNS="layers:slots ..." (the
      # experts of that many layers in RAM, GPU slots for each such layer's hottest experts), prompt 512, 256 out.
      cp .carry/smollm2-tokenizer.gguf /tmp/strata/
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_moe.py 2>&1 | tee "$OUT/cache_tests.log" | grep -E "in RAM|slots|passed|failed|Error"
      f=/tmp/strata/synthetic-qwen3-30b-a3b-skew.gguf
      [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-30b-a3b --type Q4_K_M --router-skew ${CACHE_SKEW:-2}
      for run in ${CACHE_RUNS:-21:0 24:16}; do
        IFS=: read -r layers slots <<< "$run"
        timeout 240 python3 bench/bench_gpu.py "$f" --output 256 --repeats 2 --experts-in-ram $layers \
          --expert-cache-slots $slots 2>&1 | tee -a "$OUT/cache_bench.jsonl"
      done ;;
    moe)
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_moe.py tests/test_gpu_kernels.py \
        -k "moe or matmul or prompt" 2>&1 | tee "$OUT/moe_tests.log" | grep -E "relative error|in RAM|passed|failed|Error"
      timeout 200 python3 bench/gpu_kernels.py moe 2>&1 | tee "$OUT/moe_kernels.jsonl"
      f=/tmp/strata/synthetic-qwen3-30b-a3b.gguf
      [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-30b-a3b --type Q4_K_M
      for p in ${MOE_PROMPTS:-512 4096}; do
        timeout 200 python3 bench/bench_gpu.py "$f" --prompt $p --output 64 --repeats 2 2>&1 | tee -a "$OUT/moe_bench.jsonl"
      done ;;
    hybrid)
      cp .carry/smollm2-tokenizer.gguf .carry/hybrid/*.gguf /tmp/strata/
      timeout 300 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_hybrid.py 2>&1 | tee "$OUT/hybrid_tests.log" | grep -E "relative error|logit range|passed|failed|Error" ;;
    hybridbench)
      for shape in ${HYBRID_SHAPES:-qwen3.6-35b-a3b qwen3.8-27b}; do
        f=/tmp/strata/synthetic-$shape.gguf
        [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape $shape --type Q4_K_M
        for p in ${HYBRID_PROMPTS:-512 4096}; do
          timeout 240 python3 bench/bench_gpu.py "$f" --prompt $p --output 64 --repeats 2 2>&1 | tee -a "$OUT/hybrid_bench.jsonl"
        done
        rm -f "$f"
      done ;;
    kvq8)
      cp .carry/smollm2-tokenizer.gguf /tmp/strata/
      timeout 420 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_kv_cache.py tests/test_gpu_flash.py \
        tests/test_gpu_kernels.py -k "q8_0 or attention or rope or flash" 2>&1 | tee "$OUT/kvq8_tests.log" | grep -E "logit difference|passed|failed|Error"
      for kv in full q8_0; do
        timeout 120 python3 bench/bench_attention.py --depths 0,1023,7680,32256 --kv-cache $kv 2>&1 | tee -a "$OUT/kvq8_attention.jsonl"
      done
      f=/tmp/strata/synthetic-qwen3-8b.gguf
      [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-8b --type Q4_K_M
      for p in ${KVQ8_PROMPTS:-512 8192 32768}; do
        for kv in full q8_0; do
          timeout 200 python3 bench/bench_gpu.py "$f" --prompt $p --output 64 --repeats 2 --kv-cache $kv 2>&1 | tee -a "$OUT/kvq8_bench.jsonl"
        done
      done ;;
    ring)
      cp .carry/smollm2-tokenizer.gguf /tmp/strata/
      timeout 360 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_kv_cache.py tests/test_gpu_flash.py \
        tests/test_gpu_arch.py tests/test_gpu_kernels.py -k "q8_0 or ring or attention or rope or flash" 2>&1 | tee "$OUT/ring_tests.log" | grep -E "logit|passed|failed|Error"
      f=/tmp/strata/synthetic-qwen3-8b.gguf
      [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-8b --type Q4_K_M
      for p in ${RING_PROMPTS:-512 32768}; do
        for kv in full q8_0; do
          timeout 200 python3 bench/bench_gpu.py "$f" --prompt $p --output 64 --repeats 2 --kv-cache $kv 2>&1 | tee -a "$OUT/ring_bench.jsonl"
        done
      done ;;
    moeab)
      timeout 240 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_moe.py tests/test_gpu_kernels.py \
        -k "moe or matmul or prompt" 2>&1 | tee "$OUT/moeab_tests.log" | grep -E "relative error|passed|failed|Error"
      f=/tmp/strata/synthetic-qwen3-30b-a3b.gguf
      [ -f "$f" ] || python3 bench/make_synthetic_gguf.py "$f" --shape qwen3-30b-a3b --type Q4_K_M
      for tree in .carry/old .; do
        echo "{\"tree\": \"$tree\"}" >> "$OUT/moeab_kernels.jsonl"
        (cd $tree && timeout 150 python3 bench/gpu_kernels.py moe prompt) 2>&1 | tee -a "$OUT/moeab_kernels.jsonl"
      done
      for p in ${MOE_PROMPTS:-512 4096}; do
        for tree in . .carry/old; do
          echo "{\"tree\": \"$tree\"}" >> "$OUT/moeab_bench.jsonl"
          (cd $tree && timeout 150 python3 bench/bench_gpu.py "$f" --prompt $p --output 64 --repeats 2) 2>&1 | tee -a "$OUT/moeab_bench.jsonl"
        done
      done ;;
    s13)
      # Session 13's first call: the synthetic files written in the background, the hybrid families' GPU tests (session
      # 12's refactor and test edits had not run on a GPU), then where a decode step's time goes (bench/profile_decode.py)
      # for PROFILE_RUNS="shape:depth ..." (Q4_K_M mix).
      runs=${PROFILE_RUNS:-qwen3.6-35b-a3b:512 qwen3-30b-a3b:4096 qwen3-8b:8192 qwen3.8-27b:512}
      # At most two files on the disk at once (64 GB; the MoE files are about 20 GB each): each is deleted once profiled.
      (for run in $runs; do f=/tmp/strata/synthetic-${run%%:*}.gguf
         while [ $(ls /tmp/strata/synthetic-*.gguf 2>/dev/null | wc -l) -ge 2 ]; do sleep 2; done
         [ -f $f ] || python3 bench/make_synthetic_gguf.py $f --shape ${run%%:*} --type Q4_K_M >> "$OUT/make.log" 2>&1
         touch $f.done; done) &
      cp .carry/smollm2-tokenizer.gguf .carry/hybrid/*.gguf /tmp/strata/
      timeout 200 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_hybrid.py 2>&1 | tee "$OUT/hybrid_tests.log" | grep -E "delta rule|relative error|logit range|passed|failed|Error"
      for run in $runs; do
        f=/tmp/strata/synthetic-${run%%:*}.gguf
        while [ ! -f $f.done ]; do sleep 2; done; date +%T
        timeout 120 python3 bench/profile_decode.py $f --prompt ${run#*:} 2>&1 | tee -a "$OUT/profile.jsonl"
        rm -f $f $f.done
      done ;;
    s13b)
      # Session 13's second call: llama-bench built and the peer files written in the background; decode attention
      # alone for .carry/old and this tree (4 and 8 KV heads); profile_decode.py on each peer file as it lands
      # (PROFILE_RUNS="shape:depth ..."); then peer_llamacpp.py for PEER_RUNS (as the peer step).
      llama_build
      (peer_files; touch /tmp/strata/peer.done) &
      for tree in .carry/old .; do
        for kvh in 4 8; do
          echo "{\"tree\": \"$tree\"}" >> "$OUT/attention.jsonl"
          (cd $tree && timeout 60 python3 bench/bench_attention.py --kv-heads $kvh --depths 8191 --reps 10) 2>&1 | grep decode | tee -a "$OUT/attention.jsonl"
        done
      done
      for run in ${PROFILE_RUNS:-qwen3.6-35b-a3b:512 qwen3-8b:8192 qwen3-30b-a3b:4096}; do
        f=/tmp/strata/peer-${run%%:*}.gguf
        while [ ! -f $f ] || pgrep -f "make_synthetic_gguf.py $f" >/dev/null; do sleep 2; done
        date +%T
        timeout 100 python3 bench/profile_decode.py $f --prompt ${run#*:} 2>&1 | grep -v Warn | tee -a "$OUT/profile.jsonl"
      done
      wait; date +%T
      for run in ${PEER_RUNS:-qwen3-8b:512:128}; do
        IFS=: read -r shape p n ram <<< "$run"
        timeout 200 python3 bench/peer_llamacpp.py /tmp/strata/peer-$shape.gguf --llama-bench $LLAMA_BENCH --prompt $p \
          --output $n --repeats ${PEER_REPEATS:-2} --experts-in-ram ${ram:-0} 2>&1 | tee -a "$OUT/peer.jsonl"
      done ;;
    s13c)
      # Session 13's third call: the attention kernels' tests (decode, flash, rings, q8_0), then decode at depth for
      # this tree and .carry/old: the Qwen3-8B shape at 8,192 and the Qwen3-30B-A3B shape at 4,096 (Q4_K_M mix), then
      # profile_decode.py on the 8B at 8,192.
      f8=/tmp/strata/synthetic-qwen3-8b.gguf f30=/tmp/strata/synthetic-qwen3-30b-a3b.gguf
      (python3 bench/make_synthetic_gguf.py $f8 --shape qwen3-8b --type Q4_K_M > "$OUT/make.log" 2>&1; touch $f8.done
       python3 bench/make_synthetic_gguf.py $f30 --shape qwen3-30b-a3b --type Q4_K_M >> "$OUT/make.log" 2>&1; touch $f30.done) &
      cp .carry/smollm2-tokenizer.gguf /tmp/strata/
      timeout 170 python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf tests/test_gpu_kv_cache.py tests/test_gpu_flash.py \
        tests/test_gpu_kernels.py -k "ring or q8_0 or flash or attention_decode" 2>&1 | tee "$OUT/attention_tests.log" | grep -E "logit|passed|failed|Error"
      for run in $f8:8192 $f30:4096; do
        f=${run%:*}
        while [ ! -f $f.done ]; do sleep 2; done; date +%T
        for tree in . .carry/old; do
          echo "{\"tree\": \"$tree\"}" >> "$OUT/ab.jsonl"
          (cd $tree && timeout 80 python3 bench/bench_gpu.py $f --prompt ${run#*:} --output 64 --repeats 2) 2>&1 | tee -a "$OUT/ab.jsonl"
        done
      done
      timeout 60 python3 bench/profile_decode.py $f8 --prompt 8192 2>&1 | grep -v Warn | tee -a "$OUT/profile.jsonl" ;;
    phases)
      # Decode attention alone on caches read from memory (bench_attention.py --layers), with the deep kernel's
      # timeline (--phases, this tree's), for ATTN_RUNS="kv_heads:depth:layers ..." (32 query heads of 128) and the trees
      # of ATTN_TREES (". .carry/old" for an A/B; give .carry/old this tree's bench_attention.py).
      for run in ${ATTN_RUNS:-4:4095:16 8:8191:8}; do
        IFS=: read -r kvh depth layers <<< "$run"
        for tree in ${ATTN_TREES:-.}; do
          echo "{\"tree\": \"$tree\"}" >> "$OUT/attention.jsonl"
          (cd $tree && timeout 150 python3 bench/bench_attention.py --kv-heads $kvh --depths 0,$depth --layers $layers \
            --reps 10 $([ $tree = . ] && echo --phases)) 2>&1 | grep -E "decode|Error" | tee -a "$OUT/attention.jsonl"
        done
      done ;;
    ab)
      # AB_RUNS="shape:prompt ..." (synthetic, Q4_K_M mix, written here unless /tmp still holds them) through
      # bench_gpu.py, for each tree of AB_TREES (".carry/old ." by default: an earlier tree's code, then this one's).
      for run in ${AB_RUNS}; do
        f=/tmp/strata/synthetic-${run%%:*}.gguf
        # The files step may still be writing files: wait for all of them, so no write competes with a timed run for
        # the host (session 16's prompts, timed during one, were 19-25% below session 15's on another H100).
        while pgrep -f make_synthetic_gguf.py >/dev/null; do sleep 2; done
        [ -f $f ] || python3 bench/make_synthetic_gguf.py $f --shape ${run%%:*} --type Q4_K_M > "$OUT/make.log" 2>&1
        for tree in ${AB_TREES:-.carry/old .}; do
          echo "{\"tree\": \"$tree\"}" >> "$OUT/ab.jsonl"
          (cd $tree && timeout 150 python3 bench/bench_gpu.py $f --prompt ${run#*:} --output 64 --repeats 2) 2>&1 | tee -a "$OUT/ab.jsonl"
        done
      done ;;
    files)  # FILES="shape ..." (synthetic, Q4_K_M mix) written in the background, each to .tmp first: later steps wait
      (for shape in $FILES; do f=/tmp/strata/synthetic-$shape.gguf
         [ -f $f ] || { python3 bench/make_synthetic_gguf.py $f.tmp --shape $shape --type Q4_K_M >> "$OUT/make.log" 2>&1 && mv $f.tmp $f; }
       done) & ;;
    gputests)  # pytest on TESTS (files and options), within TESTS_LIMIT seconds
      cp .carry/smollm2-tokenizer.gguf /tmp/strata/; [ -d .carry/hybrid ] && cp .carry/hybrid/*.gguf /tmp/strata/
      eval timeout ${TESTS_LIMIT:-240} python3 -m pytest -q -s -p no:cacheprovider --tb=short -rf "$TESTS" 2>&1 | tee "$OUT/tests.log" \
        | grep -E "relative error|logit range|passed|failed|Error" ;;
    profile)  # bench/profile_decode.py for PROFILE_RUNS="shape:depth[:options joined by commas] ..." (synthetic files;
              # e.g. qwen3.8-27b:4096:--prefill), PROFILE_LIMIT seconds each (on a fresh machine the first compiles);
              # PROFILE_PREFIX=peer: the peerbuild step's files, each as it lands. Its lines are also kept in
              # /tmp/strata/profile.jsonl for a later call's winners step on the same warm machine.
      for run in $PROFILE_RUNS; do
        IFS=: read -r shape depth opts <<< "$run"
        f=/tmp/strata/${PROFILE_PREFIX:-synthetic}-$shape.gguf
        while [ ! -f $f ] || { [ -z "$PROFILE_PREFIX" ] && pgrep -f make_synthetic_gguf.py >/dev/null; }; do sleep 2; done
        timeout ${PROFILE_LIMIT:-120} python3 bench/profile_decode.py $f --prompt $depth ${opts//,/ } 2>&1 | grep -v Warn \
          | tee -a "$OUT/profile.jsonl" /tmp/strata/profile.jsonl
      done ;;
    winners)  # bench_gpu.py --variant V (64 tokens out, 2 repeats) on each file and depth the profile steps of this
              # machine timed with --variants, V the variant of the shortest step there, unless it is the default
      python3 - /tmp/strata/profile.jsonl > /tmp/strata/winners <<'EOF'
import json, sys
best = {}
for line in open(sys.argv[1]):
    row = json.loads(line) if line.startswith("{") else {}
    if row.get("variant") and row.get("gpu_ms_per_decode_step"):
        key = (row["file"], row["depth"])
        best[key] = min(best.get(key, (float("inf"), "")), (row["gpu_ms_per_decode_step"], row["variant"]))
print(" ".join(f"{f}:{d}:{v}" for (f, d), (_, v) in best.items() if v != "default"))
EOF
      for run in $(cat /tmp/strata/winners); do
        IFS=: read -r file depth variant <<< "$run"
        timeout 200 python3 bench/bench_gpu.py /tmp/strata/$file --prompt $depth --output 64 --repeats 2 --variant $variant \
          2>&1 | tee -a "$OUT/winners.jsonl"
      done ;;
    bus)  # experts in RAM partly read over the bus (issue 18): the synthetic Qwen3-30B-A3B (Q4_K_M mix, the files step's)
          # for BUS_RUNS="layers in RAM:experts over the bus ...", prompt 512, 128 tokens out
      f=/tmp/strata/synthetic-qwen3-30b-a3b.gguf
      for run in ${BUS_RUNS:-21:0 21:3}; do
        IFS=: read -r layers bus <<< "$run"
        while [ ! -f $f ] || pgrep -f make_synthetic_gguf.py >/dev/null; do sleep 2; done
        timeout 240 python3 bench/bench_gpu.py $f --output 128 --repeats 2 --experts-in-ram $layers \
          --experts-over-bus $bus 2>&1 | tee -a "$OUT/bus_bench.jsonl"
      done ;;
    bench)  # bench_gpu.py on synthetic files (Q4_K_M mix, the files step's) for BENCH_RUNS="shape:prompt[:options joined
            # by commas] ...", 64 tokens out, 2 repeats; BENCH_PREFIX=peer: the peerbuild step's files, each as it lands
            # (others may still be written meanwhile, so compare decode steps' GPU times, not prompts)
      for run in $BENCH_RUNS; do
        IFS=: read -r shape p opts <<< "$run"
        f=/tmp/strata/${BENCH_PREFIX:-synthetic}-$shape.gguf
        while [ ! -f $f ] || { [ -z "$BENCH_PREFIX" ] && pgrep -f make_synthetic_gguf.py >/dev/null; }; do sleep 2; done
        timeout 200 python3 bench/bench_gpu.py $f --prompt $p --output 64 --repeats 2 ${opts//,/ } 2>&1 | tee -a "$OUT/bench.jsonl"
      done ;;
    kcache)  # the kernel cache back to $OUT in parts of 15 MB (kcache.part*), for .carry/ in the next call
      tar cC $CUPY_CACHE_DIR . | xz -T0 -6 | split -b 15M - "$OUT/kcache.part"; ls -l "$OUT"/kcache.part* ;;
    peerbuild)  # the peer step's build and files started in the background, for steps between to overlap them
      llama_build; peer_files & ;;
    peer)
      llama_build
      wait  # for a peerbuild step's build and files
      peer_files
      for run in ${PEER_RUNS:-qwen3-8b:512:128}; do
        IFS=: read -r shape p n ram <<< "$run"
        timeout 400 python3 bench/peer_llamacpp.py /tmp/strata/peer-$shape.gguf --llama-bench $LLAMA_BENCH --prompt $p \
          --output $n --repeats ${PEER_REPEATS:-2} --experts-in-ram ${ram:-0} 2>&1 | tee -a "$OUT/peer.jsonl"
      done
      for run in ${AB_RUNS}; do
        IFS=: read -r shape p <<< "$run"
        for tree in .carry/old .; do
          echo "{\"tree\": \"$tree\"}" >> "$OUT/peer_ab.jsonl"
          (cd $tree && timeout 200 python3 bench/bench_gpu.py /tmp/strata/peer-$shape.gguf --prompt $p --output 64 --repeats 2) 2>&1 | tee -a "$OUT/peer_ab.jsonl"
        done
      done ;;
  esac
done
