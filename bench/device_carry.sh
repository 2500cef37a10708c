#!/usr/bin/env bash
# What bench/device_run.sh reads beside the tree on the GPU machine, made anew here (a fresh checkout has none of it;
# needs PyPI and the README's .venv). Each item goes into a folder .git/info/exclude hides from git; name them in
# the device call's `carry`. Usage: bash bench/device_carry.sh [wheels] [tokenizer] [old] [llama] (the first three by
# default)
#   wheels     .whl/: the packages the GPU machine lacks (gguf; pydantic and what it needs, for tests/conftest.py)
#   tokenizer  .carry/smollm2-tokenizer.gguf: SmolLM2's tokenizer alone (1.8 MB), for tests and synthetic files
#   old        .carry/old: OLD's engine/ and bench/ (default HEAD), the "before" of the A/B steps
#   llama      .carry/llama.cpp.tar.xz: llama.cpp as llama-cpp-python's sdist vendors it, trimmed to the CUDA and
#              CPU backends (shared/reference/peer-llamacpp.md), for the peer steps
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
for path in .whl/ .carry/; do grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
mkdir -p .whl .carry
items=("$@")
[ $# -gt 0 ] || items=(wheels tokenizer old)
for item in "${items[@]}"; do
  case $item in
    wheels)
      $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        gguf pydantic pydantic_core annotated_types typing_inspection typing_extensions ;;
    tokenizer)
      $py - <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, "tests")
import conftest
from gguf_convert import write_tokenizer_gguf

write_tokenizer_gguf(conftest.packaged_gguf("smollm2-135m-instruct"), Path(".carry/smollm2-tokenizer.gguf"))
EOF
      ;;
    old)
      rm -rf .carry/old && mkdir -p .carry/old
      git archive "${OLD:-HEAD}" engine bench | tar x -C .carry/old ;;
    llama)
      work=$(mktemp -d)
      $py -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work"
      tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
      src="$work"/llama_cpp_python-0.3.36/vendor/llama.cpp
      (cd "$src" && rm -rf models docs media benches tests gguf-py conversion scripts \
        && find ggml/src -maxdepth 1 -type d -name 'ggml-*' ! -name ggml-cuda ! -name ggml-cpu -exec rm -rf {} +)
      tar cC "$src"/.. llama.cpp | xz -T0 -6 > .carry/llama.cpp.tar.xz
      rm -rf "$work" ;;
    *) echo "unknown item $item (wheels, tokenizer, old, llama)" >&2; exit 2 ;;
  esac
  echo "$item: done"
done
