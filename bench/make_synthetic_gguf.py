"""Writes a GGUF of random quantized blocks in the geometry of a real model, for speed and memory tests of
geometries no embedded model has (decode speed does not depend on the weight values): Llama 1.2B/8B, a
Qwen3-8B (QK-norm), a Qwen3-30B-A3B mixture of experts, and the hybrid Gated DeltaNet Qwen3.8-27B (qwen35) and
Qwen3.6-35B-A3B (qwen35moe), every fourth layer gated attention. Norms are F32 ones, and a minimal byte-level
tokenizer makes the file loadable by engine.load_model; --tokenizer copies a real model's instead (padded to the
shape's vocabulary), so llama.cpp loads the very file our bench runs.

--type names one GGML type for every matrix, or Q4_K_M for llama.cpp's usual mix in that file type: Q4_K for
most matrices, Q6_K for ffn_down, attn_v and the output head (llama.cpp gives Q6_K to only some ffn_down and
attn_v layers; all of them here, so the speed figures are a little pessimistic).

Large tensors repeat a 32 MiB pool of random blocks from a random block offset: the bytes a kernel reads still
lie at their own addresses, and writing a 20 GB file stays a memory copy instead of 20 GB of random numbers.

Usage: python bench/make_synthetic_gguf.py OUT.gguf --shape 1.2b|8b|qwen3-8b|qwen3-30b-a3b|qwen3.8-27b|qwen3.6-35b-a3b
       --type Q4_0|Q4_K|Q4_K_M|...
       [--tokenizer OTHER.gguf] [--router-skew S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import quants  # noqa: E402
from engine.kernels.gpu_layout import PLANES, random_blocks  # noqa: E402
from engine.tokenizer import byte_alphabet  # noqa: E402

T = GGMLQuantizationType
# hidden, layers, ffn, heads, kv heads, vocab, tied embeddings (Llama 3.2 1B ties them, Llama 3 8B does not);
# Qwen3 adds head_dim, QK-norm and its context length, the MoE its experts (ffn is then one expert's); the hybrids
# their DeltaNet heads (linear: key heads, value heads, head size), rotary dims and shared expert (model-catalog.md).
SHAPES = {
    "1.2b": dict(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, vocab=128256, tied=True),
    "8b": dict(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, vocab=128256, tied=False),
    "qwen3-8b": dict(arch="qwen3", hidden=4096, layers=36, ffn=12288, heads=32, kv_heads=8, head_dim=128,
                     vocab=151936, tied=False, context=40960),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, layers=48, ffn=768, heads=32, kv_heads=4, head_dim=128,
                          vocab=151936, tied=False, experts=128, experts_used=8, context=40960),
    "qwen3.8-27b": dict(arch="qwen35", hidden=5120, layers=64, ffn=17408, heads=24, kv_heads=4, head_dim=256,
                        rope_dims=64, linear=(16, 48, 128), vocab=248320, tied=False, context=262144),
    "qwen3.6-35b-a3b": dict(arch="qwen35moe", hidden=2048, layers=40, ffn=512, heads=16, kv_heads=2, head_dim=256,
                            rope_dims=64, linear=(16, 32, 128), vocab=248320, tied=False, experts=256, experts_used=8,
                            shared=512, context=262144),
}
HYBRIDS = ("qwen35", "qwen35moe")
ROLES = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
Q4_K_M = {role: (T.Q6_K if role in ("attn_v", "ffn_down", "output") else T.Q4_K) for role in ROLES}
POOL_BYTES = 32 << 20


def type_mix(name: str) -> dict[str, T]:
    """GGML type per matrix role for a --type argument."""
    return dict(Q4_K_M) if name == "Q4_K_M" else {role: T[name] for role in ROLES}


def _quantized_bytes(qtype: T, n_blocks: int, rng: np.random.Generator, pools: dict) -> np.ndarray:
    if qtype not in PLANES:
        # Types the GPU path refuses (K-quants below 4 bits, IQ types): random bytes, only ever loaded to be refused.
        return rng.integers(0, 256, size=n_blocks * quants.block_layout(qtype)[1], dtype=np.uint8)
    block_bytes = quants.block_layout(qtype)[1]
    pool_blocks = POOL_BYTES // block_bytes
    if n_blocks <= pool_blocks:
        return random_blocks(qtype, n_blocks, rng)
    if qtype not in pools:
        pools[qtype] = random_blocks(qtype, pool_blocks, rng)
    start = int(rng.integers(pool_blocks)) * block_bytes
    return np.resize(np.roll(pools[qtype], -start), n_blocks * block_bytes)


def random_matrix(qtype: T, rows: int, cols: int, rng: np.random.Generator, pools: dict | None = None) -> np.ndarray:
    """A (rows, cols) weight of type qtype with values of about 0.02, as the writer takes it (bytes per row
    for quantized types)."""
    floats = {T.F32: np.float32, T.F16: np.float16}
    if qtype in floats:
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(floats[qtype])
    if qtype == T.BF16:
        values = (rng.standard_normal((rows, cols), np.float32) * 0.02).view(np.uint32) >> 16
        return values.astype(np.uint16).view(np.uint8).reshape(rows, 2 * cols)
    elements, block_bytes = quants.block_layout(qtype)
    data = _quantized_bytes(qtype, rows * cols // elements, rng, {} if pools is None else pools)
    return data.reshape(rows, cols // elements * block_bytes)


def add_matrix(w: GGUFWriter, name: str, qtype: T, rows: int, cols: int, rng, shape: tuple[int, ...] | None = None,
               pools: dict | None = None) -> None:
    """Add a random (rows, cols) weight; shape (row-major, last dim cols) stacks it, e.g. (experts, f, cols)."""
    data = random_matrix(qtype, rows, cols, rng, pools)
    if shape is not None:
        data = data.reshape(*shape[:-1], data.shape[-1])
    if data.dtype == np.uint8:
        w.add_tensor(name, data, raw_dtype=qtype)
    else:
        w.add_tensor(name, data)


def _metadata(w: GGUFWriter, s: dict, head_dim: int, tokenizer: Path | None) -> None:
    w.add_context_length(s.get("context", 8192))  # the trained length (Qwen3: 40,960), for long-prompt runs
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(500000.0 if s.get("arch", "llama") == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-5 if s.get("arch", "llama") == "llama" else 1e-6)
    w.add_rope_dimension_count(s.get("rope_dims", head_dim))
    w.add_vocab_size(s["vocab"])
    if "experts" in s:
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["experts_used"])
        w.add_expert_feed_forward_length(s["ffn"])
    if "shared" in s:
        w.add_expert_shared_feed_forward_length(s["shared"])
    if "linear" in s:
        n_k, n_v, d = s["linear"]
        arch = s["arch"]
        for key, value in (("ssm.conv_kernel", 4), ("ssm.state_size", d), ("ssm.group_count", n_k),
                           ("ssm.time_step_rank", n_v), ("ssm.inner_size", n_v * d), ("full_attention_interval", 4)):
            w.add_uint32(f"{arch}.{key}", value)
        # Rotary sections as the real files have them (11, 11, 10, 0 for 64 rotary dims): llama.cpp's loader requires
        # the key; with text positions the sections rotate alike, so their split does not change the model.
        base, extra = divmod(s.get("rope_dims", head_dim) // 2, 3)
        w.add_array(f"{arch}.rope.dimension_sections", [base + (i < extra) for i in range(3)] + [0])
    if tokenizer is not None:
        _copied_tokenizer(w, s, tokenizer)
    else:
        _minimal_tokenizer(w, s)


def _minimal_tokenizer(w: GGUFWriter, s: dict) -> None:
    """A byte-level BPE vocabulary: the 256 byte symbols, one merge, then filler tokens up to the vocab size."""
    symbols = list(byte_alphabet().values())
    tokens = symbols + ["ab"] + [f"<filler{i}>" for i in range(s["vocab"] - len(symbols) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


PER_TOKEN = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
TOKEN_CONTROL = 3


def _copied_tokenizer(w: GGUFWriter, s: dict, source: Path) -> None:
    """Every tokenizer.* key of another GGUF (llama.cpp then tokenizes as it does for that model), the vocabulary
    padded with control tokens up to the shape's vocab size so the geometry stays the shape's."""
    fields = {name: f for name, f in GGUFReader(source).fields.items() if name.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens: give the GGUF of a complete model.")
    n = len(fields["tokenizer.ggml.tokens"].contents())
    pad = s["vocab"] - n
    if pad < 0:
        raise ValueError(f"{source}'s vocabulary ({n} tokens) is larger than this shape's ({s['vocab']}): "
                         "copy the tokenizer of a model with a smaller one.")
    for name, field in fields.items():
        value, kind = field.contents(), field.types[0]
        if kind != GGUFValueType.ARRAY:
            w.add_key_value(name, value, kind)
            continue
        if name in PER_TOKEN:
            filler = {"tokenizer.ggml.tokens": [f"<|synthetic_pad_{i}|>" for i in range(pad)],
                      "tokenizer.ggml.token_type": [TOKEN_CONTROL] * pad, "tokenizer.ggml.scores": [0.0] * pad}
            value = list(value) + filler[name]
        w.add_key_value(name, value, kind, sub_type=field.types[-1])


def write_model(path: Path, s: dict, qtype: T | dict[str, T], name: str, seed: int = 0,
                tokenizer: Path | None = None, router_skew: float = 0.0) -> None:
    """Write the model of geometry s (a SHAPES entry) with every matrix of type qtype, or per role from a
    type_mix dict; with the tokenizer of the GGUF `tokenizer` (see _copied_tokenizer), else a minimal one.
    router_skew: see router_rows."""
    types = qtype if isinstance(qtype, dict) else {role: qtype for role in ROLES}
    rng = np.random.default_rng(seed)
    pools: dict = {}
    arch = s.get("arch", "llama")
    head_dim = s.get("head_dim", s["hidden"] // s["heads"])
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    _metadata(w, s, head_dim, tokenizer)

    def matrix(tensor: str, role: str, rows: int, cols: int, shape=None) -> None:
        add_matrix(w, tensor, types[role], rows, cols, rng, shape, pools)

    hidden, ffn = s["hidden"], s["ffn"]
    q_dim, kv = s["heads"] * head_dim, s["kv_heads"] * head_dim
    norm = np.ones(hidden, np.float32)
    matrix("token_embd.weight", "token_embd", s["vocab"], hidden)
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        if arch in HYBRIDS and (i + 1) % 4:
            _deltanet(w, matrix, s, i, rng)
        else:
            # A hybrid's gated attention: each head's query rows, then its output gate's, in attn_q.
            matrix(f"blk.{i}.attn_q.weight", "attn_q", q_dim * (2 if arch in HYBRIDS else 1), hidden)
            matrix(f"blk.{i}.attn_k.weight", "attn_k", kv, hidden)
            matrix(f"blk.{i}.attn_v.weight", "attn_v", kv, hidden)
            matrix(f"blk.{i}.attn_output.weight", "attn_output", hidden, q_dim)
            if arch != "llama":
                w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
                w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        w.add_tensor(f"blk.{i}.{'post_attention_norm' if arch in HYBRIDS else 'ffn_norm'}.weight", norm)
        if "experts" in s:
            e = s["experts"]
            # The routers stay F32, as llama.cpp keeps them.
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router_rows(e, hidden, router_skew, rng))
            matrix(f"blk.{i}.ffn_gate_exps.weight", "ffn_gate", e * ffn, hidden, (e, ffn, hidden))
            matrix(f"blk.{i}.ffn_up_exps.weight", "ffn_up", e * ffn, hidden, (e, ffn, hidden))
            matrix(f"blk.{i}.ffn_down_exps.weight", "ffn_down", e * hidden, ffn, (e, hidden, ffn))
        if "shared" in s:
            matrix(f"blk.{i}.ffn_gate_shexp.weight", "ffn_gate", s["shared"], hidden)
            matrix(f"blk.{i}.ffn_up_shexp.weight", "ffn_up", s["shared"], hidden)
            matrix(f"blk.{i}.ffn_down_shexp.weight", "ffn_down", hidden, s["shared"])
            w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", rng.standard_normal((1, hidden), np.float32) * 0.02)
        if "experts" not in s:
            matrix(f"blk.{i}.ffn_gate.weight", "ffn_gate", ffn, hidden)
            matrix(f"blk.{i}.ffn_up.weight", "ffn_up", ffn, hidden)
            matrix(f"blk.{i}.ffn_down.weight", "ffn_down", hidden, ffn)
    w.add_tensor("output_norm.weight", norm)
    if not s["tied"]:
        matrix("output.weight", "output", s["vocab"], hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def router_rows(experts: int, hidden: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """A router's random rows, the row of the expert of rank r (a random order per layer) scaled by
    exp(-skew * r / experts): a wider spread of logits wins the top-k more often, so skew > 0 makes some experts
    hot, as trained routers do (random rows route nearly uniformly). A synthetic skew, not a real model's: on
    independent random activations, with 128 experts and 8 picked, skew 2 gives the 16 hottest about 40% of the
    picks (0 gives them 13%); a random model's activations are alike from token to token, so its picks gather far
    more (the synthetic Qwen3-30B-A3B at skew 2: 81% of picks within 16 experts a layer, bench/RESULTS.md)."""
    rows = rng.standard_normal((experts, hidden), np.float32) * np.float32(0.02)
    if not skew:  # the draws of files made before the option
        return rows
    return rows * np.exp(-skew * rng.permutation(experts) / experts).astype(np.float32)[:, None]


def _deltanet(w: GGUFWriter, matrix, s: dict, i: int, rng: np.random.Generator) -> None:
    """A Gated DeltaNet layer's tensors as llama.cpp's converter names them for qwen35 files: the q/k/v projection,
    the output gate z, beta and alpha (projections typed as the attention's), the F32 convolution, dt_bias, A stored
    as -exp(A_log), the head norm and the output projection."""
    hidden = s["hidden"]
    n_k, n_v, d = s["linear"]
    conv_dim = 2 * n_k * d + n_v * d
    matrix(f"blk.{i}.attn_qkv.weight", "attn_q", conv_dim, hidden)
    matrix(f"blk.{i}.attn_gate.weight", "attn_q", n_v * d, hidden)
    matrix(f"blk.{i}.ssm_beta.weight", "attn_q", n_v, hidden)
    matrix(f"blk.{i}.ssm_alpha.weight", "attn_q", n_v, hidden)
    w.add_tensor(f"blk.{i}.ssm_conv1d.weight", rng.standard_normal((conv_dim, 4), np.float32) * 0.3)
    w.add_tensor(f"blk.{i}.ssm_dt.bias", rng.standard_normal(n_v, np.float32))
    w.add_tensor(f"blk.{i}.ssm_a", -np.exp(rng.standard_normal(n_v, np.float32)))
    w.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones(d, np.float32))
    matrix(f"blk.{i}.ssm_out.weight", "attn_output", hidden, n_v * d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", default="Q4_0", help="GGML type of every matrix (Q4_0, Q4_K, Q8_0, ...) or Q4_K_M")
    parser.add_argument("--tokenizer", type=Path, help="a GGUF whose tokenizer to copy (e.g. the SmolLM2 file), so "
                        "llama.cpp can load the result too")
    parser.add_argument("--router-skew", type=float, default=0.0,
                        help="make some experts of each layer hot (router_rows); 0: random routing, nearly uniform")
    args = parser.parse_args()
    write_model(args.out, SHAPES[args.shape], type_mix(args.type), f"synthetic-{args.shape}-{args.type}",
                tokenizer=args.tokenizer, router_skew=args.router_skew)


if __name__ == "__main__":
    main()
