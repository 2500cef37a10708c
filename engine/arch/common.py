"""GGUF-reading helpers the decoder and its parts share: hyper-parameters, uploading weights with progress,
fusing matrices that read the same input, rotary frequencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType

from engine import quants
from engine.backend import Array, Backend, WeightHandle
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

    def upload(self, tensor: GGUFTensor, counts_as: int = 1, host: bool = False) -> WeightHandle:
        if self._should_cancel is not None and self._should_cancel():
            raise Cancelled("Loading the model was cancelled before it finished.")
        handle = self.backend.upload(tensor, host=host)
        self.done += counts_as
        if self._on_progress is not None:
            self._on_progress(self.done, self.total, f"uploaded {tensor.name}")
        return handle


def joinable(tensors: list[GGUFTensor]) -> bool:
    """Whether concat_rows can join these matrices: one type, one row length."""
    first = tensors[0]
    return all(t.qtype == first.qtype and len(t.shape) == 2 and t.shape[1] == first.shape[1] for t in tensors)


def concat_rows(name: str, tensors: list[GGUFTensor]) -> GGUFTensor | None:
    """One matrix holding the rows of several (e.g. Q, K and V) so a single product computes them all, or
    None when their types or row lengths differ. Quantized blocks never straddle rows, so the rows' bytes
    can simply be stacked."""
    if not joinable(tensors):
        return None
    first = tensors[0]
    elements, block_bytes = quants.block_layout(first.qtype)
    row_bytes = first.shape[1] // elements * block_bytes
    raw = np.concatenate([np.asarray(t.raw).reshape(t.shape[0], row_bytes) for t in tensors]).reshape(-1)
    return GGUFTensor(name, first.qtype, (sum(t.shape[0] for t in tensors), first.shape[1]), raw)


@dataclass
class JoinedProjection:
    """Matrices that read the same input (Q, K and V; a mixer's input projections), each run of consecutive ones
    that concat_rows can join uploaded as one matrix: one product a run (Q4_K_M files keep Q and K in Q4_K and V
    in Q6_K on some layers: two products there, not three). bounds: where each run's output starts in the joined
    output, then its end."""

    weights: list[WeightHandle]
    biases: list[WeightHandle] | None
    bounds: list[int]

    @classmethod
    def load(cls, loader: WeightLoader, name: str, parts: list[GGUFTensor], counts: list[int] | None = None,
             biases: list[GGUFTensor] | None = None) -> JoinedProjection:
        """counts: the file tensors each part stands for (one each by default), for the loader's progress."""
        counts = counts or [1] * len(parts)
        runs: list[list[int]] = []
        for i, part in enumerate(parts):
            if runs and joinable([parts[runs[-1][0]], part]):
                runs[-1].append(i)
            else:
                runs.append([i])
        weights, joined_biases, bounds = [], [], [0]
        for run in runs:
            tensors = [parts[i] for i in run]
            matrix = tensors[0] if len(run) == 1 else concat_rows(name, tensors)
            weights.append(loader.upload(matrix, counts_as=sum(counts[i] for i in run)))
            if biases is not None:
                joined_biases.append(loader.upload(concat_vectors(f"{name}.bias", [biases[i] for i in run]),
                                                   counts_as=len(run)))
            bounds.append(bounds[-1] + matrix.shape[0])
        return cls(weights, joined_biases if biases is not None else None, bounds)

    def run(self, backend: Backend, x: Array, out: Array) -> None:
        """out[:, : bounds[-1]] = x times every part's rows."""
        backend.linears(x, self.weights, out[:, : self.bounds[-1]], self.biases)


def stack_rows(name: str, tensors: list[GGUFTensor]) -> GGUFTensor:
    """concat_rows' matrix, or where the types differ every row as float32; a vector counts as one row."""
    tensors = [GGUFTensor(t.name, t.qtype, (1, t.shape[0]), t.raw) if len(t.shape) == 1 else t for t in tensors]
    joined = concat_rows(name, tensors)
    if joined is not None:
        return joined
    rows = np.concatenate([quants.dequantize(t.raw, t.qtype, t.shape).astype(np.float32) for t in tensors])
    return GGUFTensor(name, GGMLQuantizationType.F32, rows.shape, rows.reshape(-1).view(np.uint8))


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
