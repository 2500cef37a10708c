"""The entry names the launchers in cuda.py build for the kernels that the macros of engine/kernels/*.cu
instantiate, and the data they are built from: weight types (FOR_EACH_QUANT and FOR_EACH_FLOAT in
quant_blocks.cuh, suffixes from gpu_layout), decode product shapes and forms, head sizes. Plain Python, so
tests/test_kernel_sources.py checks every name the launchers can build against the entries NVRTC compiles.

Kernels the backend never chooses but that are kept to be measured (SWEEP_SHAPES, which bench/gpu_kernels.py
sweeps, and the 32-register streamed form of the types outside LEAN_STREAM_TYPES) compile only under SWEEP_OPTION:
a launch of one builds that copy of its module (cuda.module), and the modules the backend launches from lack them.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from engine.kernels.gpu_layout import FLOAT_TYPES, KERNEL_SUFFIX, PLANES

QUANT_TYPES = tuple(PLANES)
FLOAT_WEIGHTS = tuple(FLOAT_TYPES)
ALL_TYPES = QUANT_TYPES + FLOAT_WEIGHTS
# Kernels built once per weight type: kind -> (module, the types).
PER_TYPE = {
    "matvec": ("matvec", FLOAT_WEIGHTS),  # quantized weights have shaped() and stream() products
    "matvec_glu": ("matvec", FLOAT_WEIGHTS),
    "matvec_glu_q8": ("matvec", QUANT_TYPES),
    "matmul": ("matmul", QUANT_TYPES),
    "matmul_glu": ("matmul", QUANT_TYPES),
    "router_route": ("sampling", FLOAT_WEIGHTS),  # a decode step's router product and routing (sampling.cu)
}
# A mixture's grouped prompt products (matmul.cu GROUPED_Q), built per weight type and for the CPU kernels' layouts
# of experts streamed from RAM (engine/cpu/layout.py families; "5": nibbles with a fifth bit, "_k": the K-quants'
# 8-bit group scales under float32 super-block ones).
GROUPED_KINDS = ("grouped_matmul", "grouped_matmul_glu")
HOST_LAYOUTS = ("cpu_nibble", "cpu_nibble5", "cpu_nibble_k", "cpu_nibble5_k", "cpu_q6k", "cpu_q3k", "cpu_q8")
_GROUPED_SUFFIXES = (*(KERNEL_SUFFIX[t] for t in QUANT_TYPES), *HOST_LAYOUTS)
# A decode step's expert products (matvec.cu MOE_Q, MOE_F), built per weight type and for the layouts of experts
# read over the bus from RAM.
MOE_KINDS = ("moe_gate_up", "moe_down")
_MOE_SUFFIXES = (*(KERNEL_SUFFIX[t] for t in ALL_TYPES), *HOST_LAYOUTS)
# Quantized decode products of matvec.cu by kernel shape: kind -> (warps per row set, rows per set).
SHAPES = {"matvec": ((1, 1), (2, 1), (1, 2), (2, 2)), "matvec_glu": ((1, 1), (2, 1), (1, 2))}
SWEEP_SHAPES = {"matvec": ((4, 1),), "matvec_glu": ((4, 1), (2, 2))}  # matvec.cu, #ifdef SWEEP_KERNELS
# Two products of one input in one launch (matvec.cu MATVEC_PAIR), for the type pairs of a joined projection's runs
# in K-quant files (Q and K, then V; Q4_K_M and Q5_K_M keep V in Q6_K on some layers, Q3_K_M in Q5_K), each part in
# the shape cuda.matvec_shape gives it there: (first's, second's).
PAIR_TYPES = ((T.Q4_K, T.Q6_K), (T.Q5_K, T.Q6_K), (T.Q3_K, T.Q5_K))
PAIR_SHAPES = tuple((a, b) for a in ((1, 1), (2, 1), (2, 2)) for b in ((1, 1), (2, 1)))
SWEEP_OPTION = "-DSWEEP_KERNELS"
STREAM_FORMS = ("", "_lean")  # matvec_stream: plain, and at 32 registers
LEAN_STREAM_TYPES = (T.Q4_0,)  # where the 32-register form paid on an H200 (8B Q4_0); the others' are sweep-only
HEAD_DIMS = (64, 128, 256)  # head sizes the attention kernels are built for
# Attention kernels built per head size: kind -> (module, the oldest compute capability, major * 10 + minor, they
# are built for).
# attention.cu builds the cluster form (attention_decode) under __CUDA_ARCH__ >= 900.
PER_HEAD_DIM = {"attention_partial": ("attention", 75), "attention_decode": ("attention", 90),
                "attention_decode_deep": ("attention", 80), "flash_attention": ("flash_attention", 75)}
# attention_decode_deep's (keys a warp's tile, pipeline stages) per head size, and the others only
# bench/bench_attention.py launches (attention.cu, #ifdef SWEEP_KERNELS).
DEEP_TILES = {64: (64, 2), 128: (16, 4), 256: (16, 2)}
DEEP_SWEEP = {128: ((16, 2), (16, 3), (16, 6), (32, 2), (32, 3))}
# Sweep-only copies of DEEP_TILES[128]'s fp16 kernel (attention.cu DeepForm): "phases" records its timeline
# (deep_phases), "bulk" fetches its tiles by bulk copies (sm_90+), "short" only where a split's keys are few.
DEEP_FORMS = {form: f"attention_decode_deep_128_{form}" for form in ("phases", "bulk", "short")}
# The gated delta rule (hybrid.cu) is built per key head size, which sets the registers its state takes.
DELTA_KEY_DIMS = (16, 32, 64, 128)
# Its chunked prompt form (delta_chunk_prep, delta_chunk_state; tensor cores, sm_80+) per key head size.
DELTA_CHUNK_KEY_DIMS = (64, 128)
DELTA_CHUNK_OLDEST = 80
DELTA_CHUNK = 64  # tokens a chunk of the delta rule's prompt form (hybrid.cu DC)
DELTA_CHUNK_SCRATCH_TYPES = ("float32", "uint16", "uint16", "float32")  # of delta_chunk_scratch's arrays, in order


def delta_chunk_scratch(n: int, n_v: int, dk: int, dv: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of cuda.gated_delta_net_chunked's scratch for n tokens: u float32, wqk and p uint16 (fp16 bits), last
    float32 (here, CuPy-free, so the fit can count them)."""
    chunks = -(-n // DELTA_CHUNK) * n_v
    return (chunks, DELTA_CHUNK, dv), (chunks, 3, DELTA_CHUNK, dk), (chunks, DELTA_CHUNK, DELTA_CHUNK), (chunks,)


# The attention kernels and rope_store_kv are built for each form of the KV cache (engine.backend.KV_CACHE_TYPES):
# the name's suffix.
KV_SUFFIX = {"full": "", "q8_0": "_q8"}
# Decode attention built per head size and query slots a block (the GQA group, rounded up to 4 or 8): kind ->
# (module, oldest capability, head size -> slots).
PER_GROUP = {"attention_decode_split": ("attention", 75, {hd: (4, 8) for hd in HEAD_DIMS})}


def typed(kind: str, qtype: T) -> str:
    if qtype not in PER_TYPE[kind][1]:
        raise ValueError(f"{kind} has no kernel for {qtype.name} weights")
    return f"{kind}_{KERNEL_SUFFIX[qtype]}"


def grouped(kind: str, suffix: str) -> str:
    """suffix: a quantized type's (gpu_layout.KERNEL_SUFFIX) or one of HOST_LAYOUTS."""
    if kind not in GROUPED_KINDS or suffix not in _GROUPED_SUFFIXES:
        raise ValueError(f"{kind} has no grouped kernel for {suffix} weights")
    return f"{kind}_{suffix}"


def moe(kind: str, suffix: str) -> str:
    """suffix: a weight type's (gpu_layout.KERNEL_SUFFIX) or one of HOST_LAYOUTS."""
    if kind not in MOE_KINDS or suffix not in _MOE_SUFFIXES:
        raise ValueError(f"{kind} has no kernel for {suffix} weights")
    return f"{kind}_{suffix}"


def shaped(kind: str, qtype: T, shape: tuple[int, int]) -> str:
    if qtype not in QUANT_TYPES or shape not in SHAPES[kind] + SWEEP_SHAPES[kind]:
        raise ValueError(f"{kind} has no kernel of shape {shape} for {qtype.name} weights")
    wpr, rows = shape
    return f"{kind}_{KERNEL_SUFFIX[qtype]}_w{wpr}" + ("_r2" if rows == 2 else "")


def pair(types: tuple[T, T], shapes: tuple[tuple[int, int], tuple[int, int]]) -> str:
    if types not in PAIR_TYPES or shapes not in PAIR_SHAPES:
        raise ValueError(f"matvec_pair has no kernel for {types[0].name} then {types[1].name} in shapes {shapes}")
    return "matvec_pair" + "".join(f"_{KERNEL_SUFFIX[t]}_w{wpr}_r{rows}" for t, (wpr, rows) in zip(types, shapes))


def stream_forms(qtype: T) -> tuple[str, ...]:
    """The streamed product's forms the backend chooses from for this type (cuda._stream_grid)."""
    return STREAM_FORMS if qtype in LEAN_STREAM_TYPES else STREAM_FORMS[:1]


def stream(qtype: T, form: str) -> str:
    if qtype not in QUANT_TYPES or form not in STREAM_FORMS:
        raise ValueError(f"matvec_stream has no form {form!r} for {qtype.name} weights")
    return f"matvec_stream{form}_{KERNEL_SUFFIX[qtype]}"


def dequant(qtype: T, half: bool) -> str:
    return f"dequant_{KERNEL_SUFFIX[qtype]}_{'f16' if half else 'f32'}"


def delta_rule(key_dim: int) -> str:
    if key_dim not in DELTA_KEY_DIMS:
        raise ValueError(f"the gated delta rule has no kernel for key heads of {key_dim}")
    return f"gated_delta_net_{key_dim}"


def delta_step(key_dim: int) -> str:
    """The mixer's one-token core in one launch (convolution, delta rule, gated norm)."""
    if key_dim not in DELTA_KEY_DIMS:
        raise ValueError(f"the one-token delta mixer has no kernel for key heads of {key_dim}")
    return f"delta_step_{key_dim}"


def delta_chunk(kind: str, key_dim: int) -> str:
    """kind: prep or state."""
    if kind not in ("prep", "state") or key_dim not in DELTA_CHUNK_KEY_DIMS:
        raise ValueError(f"the chunked delta rule has no {kind} kernel for key heads of {key_dim}")
    return f"delta_chunk_{kind}_{key_dim}"


def _kv(kv: str) -> str:
    if kv not in KV_SUFFIX:
        raise ValueError(f"no attention kernels for a {kv!r} KV cache")
    return KV_SUFFIX[kv]


def rope_store(kv: str = "full") -> str:
    return f"rope_store_kv{_kv(kv)}"


def per_head_dim(kind: str, head_dim: int, kv: str = "full") -> str:
    if kind not in PER_HEAD_DIM or head_dim not in HEAD_DIMS:
        raise ValueError(f"{kind} has no kernel for heads of {head_dim}")
    return f"{kind}_{head_dim}{_kv(kv)}"


def deep_decode(head_dim: int, tiles: tuple[int, int] | None = None, kv: str = "full") -> str:
    """attention_decode_deep's name for this head size with DEEP_TILES' tiles or, for a sweep (fp16 only), other
    ones."""
    if tiles is None or tiles == DEEP_TILES[head_dim]:
        return per_head_dim("attention_decode_deep", head_dim, kv)
    if tiles not in DEEP_SWEEP.get(head_dim, ()) or kv != "full":
        raise ValueError(f"attention_decode_deep has no kernel for heads of {head_dim} with tiles {tiles} ({kv})")
    return f"{per_head_dim('attention_decode_deep', head_dim)}_kt{tiles[0]}_s{tiles[1]}"


def per_group(kind: str, head_dim: int, slots: int, kv: str = "full") -> str:
    if kind not in PER_GROUP or slots not in PER_GROUP[kind][2].get(head_dim, ()):
        raise ValueError(f"{kind} has no kernel for heads of {head_dim} with {slots} query slots")
    return f"{kind}_{head_dim}_g{slots}{_kv(kv)}"


def built(capability: int, sweep: bool = False) -> dict[str, set[str]]:
    """Per module, every name the functions above build from their data for a GPU of this compute capability:
    the kernels of the modules the backend launches from, or (sweep) the ones only their sweep copies add."""
    names: dict[str, set[str]] = {}

    def add(module: str, new: set[str]) -> None:
        names[module] = names.get(module, set()) | new

    for kind, shapes in (SWEEP_SHAPES if sweep else SHAPES).items():
        add("matvec", {shaped(kind, t, s) for s in shapes for t in QUANT_TYPES})
    streams = {stream(t, form) for t in QUANT_TYPES for form in stream_forms(t)}
    if sweep:
        add("matvec", {stream(t, form) for t in QUANT_TYPES for form in STREAM_FORMS} - streams)
        add("attention", {deep_decode(hd, tiles) for hd, sweep_tiles in DEEP_SWEEP.items() for tiles in sweep_tiles}
            | set(DEEP_FORMS.values()))
        return names
    add("matvec", streams | {pair(types, shapes) for types in PAIR_TYPES for shapes in PAIR_SHAPES})
    for kind, (module, types) in PER_TYPE.items():
        add(module, {typed(kind, t) for t in types})
    add("matmul", {grouped(kind, suffix) for kind in GROUPED_KINDS for suffix in _GROUPED_SUFFIXES})
    add("matvec", {moe(kind, suffix) for kind in MOE_KINDS for suffix in _MOE_SUFFIXES})
    add("dequant", {dequant(t, half) for t in ALL_TYPES for half in (False, True)})
    add("hybrid", {delta_rule(dk) for dk in DELTA_KEY_DIMS} | {delta_step(dk) for dk in DELTA_KEY_DIMS})
    if capability >= DELTA_CHUNK_OLDEST:
        add("hybrid", {delta_chunk(kind, dk) for kind in ("prep", "state") for dk in DELTA_CHUNK_KEY_DIMS})
    add("rope", {rope_store(kv) for kv in KV_SUFFIX})
    for kind, (module, oldest) in PER_HEAD_DIM.items():
        if capability >= oldest:
            add(module, {per_head_dim(kind, hd, kv) for hd in HEAD_DIMS for kv in KV_SUFFIX})
    for kind, (module, oldest, slots) in PER_GROUP.items():
        if capability >= oldest:
            add(module, {per_group(kind, hd, g, kv) for hd, gs in slots.items() for g in gs for kv in KV_SUFFIX})
    return names


SWEEP_ONLY = frozenset(set().union(*built(75, sweep=True).values()))
