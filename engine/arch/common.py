"""Helpers every architecture module shares: reading hyper-parameters, uploading weights with progress,
fusing matrices that read the same input, rotary frequencies, and the activation workspace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType

from engine import quants
from engine.backend import Backend, WeightHandle
from engine.errors import Cancelled, EngineError
from engine.gguf_file import GGUFFile, GGUFTensor


def hparam(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    """`{architecture}.{key}` from the metadata; EngineError if it is missing and has no default."""
    full = f"{gguf.architecture}.{key}"
    value = gguf.get(full, default)
    if value is None:
        raise EngineError(f"The model file {gguf.path.name} lacks {full!r}; it is incomplete or not a supported model.")
    return value


class WeightLoader:
    """Uploads tensors one by one, reporting (done, total, message) and stopping when asked to."""

    def __init__(
        self,
        backend: Backend,
        total: int,
        on_progress: Callable[[int, int, str], None] | None,
        should_cancel: Callable[[], bool] | None,
    ):
        self.backend = backend
        self.total = total
        self.done = 0
        self._on_progress = on_progress
        self._should_cancel = should_cancel

    def upload(self, tensor: GGUFTensor, counts_as: int = 1) -> WeightHandle:
        if self._should_cancel is not None and self._should_cancel():
            raise Cancelled("Loading the model was cancelled before it finished.")
        handle = self.backend.upload(tensor)
        self.done += counts_as
        if self._on_progress is not None:
            self._on_progress(self.done, self.total, f"uploaded {tensor.name}")
        return handle


def concat_rows(name: str, tensors: list[GGUFTensor]) -> GGUFTensor | None:
    """One matrix holding the rows of several (e.g. Q, K and V) so a single product computes them all, or
    None when their types or row lengths differ. Quantized blocks never straddle rows, so the rows' bytes
    can simply be stacked."""
    first = tensors[0]
    if any(t.qtype != first.qtype or len(t.shape) != 2 or t.shape[1] != first.shape[1] for t in tensors):
        return None
    elements, block_bytes = quants.block_layout(first.qtype)
    row_bytes = first.shape[1] // elements * block_bytes
    raw = np.concatenate([np.asarray(t.raw).reshape(t.shape[0], row_bytes) for t in tensors]).reshape(-1)
    return GGUFTensor(name, first.qtype, (sum(t.shape[0] for t in tensors), first.shape[1]), raw)


def rope_inv_freq(gguf: GGUFFile, rot_dim: int, base: float, scaled: bool = True) -> np.ndarray:
    """inv_freq[i] = base^(-2i/rot_dim), divided by the file's `rope_freqs.weight` factors (Llama 3.1 style)
    and by a linear rope scaling factor when the file declares one; with scaled=False neither (Gemma 3's
    sliding-window layers rotate unscaled)."""
    inv_freq = 1.0 / base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    if not scaled:
        return inv_freq.astype(np.float32)
    factors = gguf.tensors.get("rope_freqs.weight")
    if factors is not None:
        inv_freq = inv_freq / quants.dequantize(factors.raw, factors.qtype, factors.shape).astype(np.float64)
    scaling = gguf.get(f"{gguf.architecture}.rope.scaling.type", "none")
    if scaling == "linear":
        inv_freq = inv_freq / float(gguf.get(f"{gguf.architecture}.rope.scaling.factor", 1.0))
    elif scaling not in ("none", None):
        raise EngineError(
            f"The model {gguf.path.name} uses {scaling!r} rope scaling, which this engine does not support "
            "(supported: none, linear). Pick another model."
        )
    return inv_freq.astype(np.float32)


def concat_vectors(name: str, tensors: list[GGUFTensor]) -> GGUFTensor:
    """One vector holding several (e.g. the Q, K and V biases of a fused projection), as float32."""
    values = [quants.dequantize(t.raw, t.qtype, t.shape).reshape(-1).astype(np.float32) for t in tensors]
    joined = np.concatenate(values)
    return GGUFTensor(name, GGMLQuantizationType.F32, joined.shape, joined.view(np.uint8))


@dataclass(frozen=True)
class TransformerConfig:
    """The hyper-parameters every decoder-only architecture here shares; variants subclass it."""

    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def read_transformer_fields(gguf: GGUFFile, rope_base: float, rms_eps: float, ffn: int | None = None) -> dict[str, Any]:
    """TransformerConfig's fields from the metadata; the arguments are the defaults of the family for keys a
    file may leave out (`ffn` None: the file must give it)."""
    n_heads = int(hparam(gguf, "attention.head_count"))
    hidden = int(hparam(gguf, "embedding_length"))
    head_dim = int(hparam(gguf, "attention.key_length", hidden // n_heads))
    return dict(
        n_layers=int(hparam(gguf, "block_count")),
        hidden=hidden,
        ffn=int(hparam(gguf, "feed_forward_length", ffn)),
        n_heads=n_heads,
        n_kv_heads=int(hparam(gguf, "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rot_dim=int(hparam(gguf, "rope.dimension_count", head_dim)),
        rope_base=float(hparam(gguf, "rope.freq_base", rope_base)),
        rms_eps=float(hparam(gguf, "attention.layer_norm_rms_epsilon", rms_eps)),
        vocab_size=int(gguf.tensor("token_embd.weight").shape[0]),
        context_length=int(hparam(gguf, "context_length")),
    )


@dataclass
class Workspace:
    """Activation buffers for chunks of up to `max_chunk` tokens, allocated once."""

    ids: Any  # (1 + max_chunk,) int32: the chunk's first position, then its token ids; set by the caller in one copy
    tokens: Any  # ids[1:], the token ids
    start: Any  # ids[:1], the position of the chunk's first token
    x: Any  # (max_chunk, hidden) residual stream
    h: Any  # (max_chunk, hidden) normed input of the next projection
    qkv: Any  # (max_chunk, q_dim + 2 kv_dim)
    attn: Any  # (max_chunk, q_dim)
    delta: Any  # (max_chunk, hidden) output of a block, added to x by the next fused norm
    ffn: Any  # (max_chunk, ffn)
    ffn_scratch: Any  # (max_chunk, ffn)
    logits: Any  # (1, vocab) of the chunk's last token
    max_chunk: int
    extra: dict[str, Any]  # buffers a variant needs (qwen3moe's routing)


def new_workspace(config: Any, backend: Backend, max_chunk: int, ffn_width: int | None = None) -> Workspace:
    """Buffers for a transformer config with hidden, q_dim, kv_dim, ffn and vocab_size; `ffn_width` overrides ffn."""
    e = backend.empty
    ffn = config.ffn if ffn_width is None else ffn_width
    ids = e((1 + max_chunk,), np.int32)
    return Workspace(
        ids=ids,
        tokens=ids[1:],
        start=ids[:1],
        x=e((max_chunk, config.hidden)),
        h=e((max_chunk, config.hidden)),
        qkv=e((max_chunk, config.q_dim + 2 * config.kv_dim)),
        attn=e((max_chunk, config.q_dim)),
        delta=e((max_chunk, config.hidden)),
        ffn=e((max_chunk, ffn)),
        ffn_scratch=e((max_chunk, ffn)),
        logits=e((1, config.vocab_size)),
        max_chunk=max_chunk,
        extra={},
    )
