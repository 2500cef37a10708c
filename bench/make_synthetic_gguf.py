"""Writes a Llama-shaped GGUF of random quantized blocks, for speed tests of geometries no embedded model has
(decode speed does not depend on the weight values). Every matrix gets the one type asked for, norms are F32,
and a minimal byte-level tokenizer makes the file loadable by engine.load_model.

Usage: python bench/make_synthetic_gguf.py OUT.gguf --shape 1.2b|8b --type Q4_0|Q4_K|...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import quants  # noqa: E402
from engine.kernels.gpu_layout import random_blocks  # noqa: E402
from engine.tokenizer import byte_alphabet  # noqa: E402

# hidden, layers, ffn, heads, kv heads, vocab, tied embeddings (Llama 3.2 1B ties them, Llama 3 8B does not)
SHAPES = {
    "1.2b": dict(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, vocab=128256, tied=True),
    "8b": dict(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, vocab=128256, tied=False),
}


def random_matrix(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A (rows, cols) weight of type qtype with values of about 0.02, as the writer takes it (bytes per row
    for quantized types)."""
    floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    if qtype in floats:
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(floats[qtype])
    if qtype == GGMLQuantizationType.BF16:
        values = (rng.standard_normal((rows, cols), np.float32) * 0.02).view(np.uint32) >> 16
        return values.astype(np.uint16).view(np.uint8).reshape(rows, 2 * cols)
    elements, block_bytes = quants.block_layout(qtype)
    return random_blocks(qtype, rows * cols // elements, rng).reshape(rows, cols // elements * block_bytes)


def add_matrix(w: GGUFWriter, name: str, qtype: GGMLQuantizationType, rows: int, cols: int, rng) -> None:
    data = random_matrix(qtype, rows, cols, rng)
    if data.dtype == np.uint8:
        w.add_tensor(name, data, raw_dtype=qtype)
    else:
        w.add_tensor(name, data)


def write_model(path: Path, s: dict, qtype: GGMLQuantizationType, name: str, seed: int = 0) -> None:
    """Write the model of geometry s (a SHAPES entry) with every matrix of type qtype."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_vocab_size(s["vocab"])
    # A byte-level BPE vocabulary: the 256 byte symbols, one merge, then filler tokens up to the vocab size.
    symbols = list(byte_alphabet().values())
    tokens = symbols + ["ab"] + [f"<filler{i}>" for i in range(s["vocab"] - len(symbols) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    hidden, ffn, kv = s["hidden"], s["ffn"], s["kv_heads"] * (s["hidden"] // s["heads"])
    norm = np.ones(hidden, np.float32)
    add_matrix(w, "token_embd.weight", qtype, s["vocab"], hidden, rng)
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        add_matrix(w, f"blk.{i}.attn_q.weight", qtype, hidden, hidden, rng)
        add_matrix(w, f"blk.{i}.attn_k.weight", qtype, kv, hidden, rng)
        add_matrix(w, f"blk.{i}.attn_v.weight", qtype, kv, hidden, rng)
        add_matrix(w, f"blk.{i}.attn_output.weight", qtype, hidden, hidden, rng)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        add_matrix(w, f"blk.{i}.ffn_gate.weight", qtype, ffn, hidden, rng)
        add_matrix(w, f"blk.{i}.ffn_up.weight", qtype, ffn, hidden, rng)
        add_matrix(w, f"blk.{i}.ffn_down.weight", qtype, hidden, ffn, rng)
    w.add_tensor("output_norm.weight", norm)
    if not s["tied"]:
        add_matrix(w, "output.weight", qtype, s["vocab"], hidden, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", default="Q4_0", help="GGML type of every matrix, e.g. Q4_0, Q4_K, Q8_0")
    args = parser.parse_args()
    write_model(args.out, SHAPES[args.shape], GGMLQuantizationType[args.type], f"synthetic-llama-{args.shape}-{args.type}")


if __name__ == "__main__":
    main()
