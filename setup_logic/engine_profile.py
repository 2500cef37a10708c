"""What the engine can run and how it stores things, as setup_logic receives it.

setup_logic never imports the engine: the MCP layer fills this from `engine.capabilities.profile()`, so the facts
are written once, in the engine, and every field here must be given.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# The engine's KV cache types (engine.backend.KV_CACHE_TYPES): "full" (fp16 on the GPU, float32 on the CPU) or "q8_0".
KvCacheType = Literal["full", "q8_0"]


class EngineProfile(BaseModel):
    supported_architectures: set[str] = Field(description="GGUF architectures the engine runs on the CPU")
    supported_tensor_types: set[str] = Field(description="tensor types the CPU path reads")
    gpu_tensor_types: set[str] = Field(description="tensor types the GPU kernels compute on")
    gpu_architectures: set[str] = Field(description="architectures the GPU path runs")
    min_compute_capability: tuple[int, int] = Field(description="oldest NVIDIA compute capability the GPU kernels run on")
    cpu_weights_dequantized_to_f32: bool = Field(
        description="the CPU path keeps float32 weights (4 bytes each); else the GGUF's bytes"
    )
    cpu_bytes_per_file_byte: dict[str, float] = Field(
        description="RAM the CPU path's layout of quantized weights takes per byte of the file's, for each tensor "
        "type it repacks; other types keep their file's bytes"
    )
    cpu_kernel_types: set[str] = Field(
        description="tensor types the CPU computes one token on at about its memory's speed (its kernels' types and the "
        "float ones); it dequantizes the others a few rows at a time, far slower"
    )
    kv_bytes_per_element_gpu: int = Field(gt=0, description="the full KV cache on the GPU")
    kv_bytes_per_element_cpu: int = Field(gt=0, description="the full KV cache on the CPU")
    kv_bytes_per_element_q8_0: float = Field(gt=0, description="a q8_0 KV cache, on either device")
    prefill_chunk: int = Field(gt=0, description="tokens per prompt chunk on the CPU, which sizes the workspace")
    gpu_prefill_chunk: int = Field(gt=0, description="tokens per prompt chunk on the GPU")
    default_context: int = Field(gt=0, description="context the engine uses when none is asked for")
    dequant_scratch_elements: int = Field(ge=0, description="fp16 scratch of the GPU prompt path, in values")
    gpu_delta_chunk: int = Field(
        gt=0, description="tokens a chunk of the GPU's chunked delta rule (hybrids' prompts), which sizes its scratch"
    )
    experts_in_ram: bool = Field(description="the engine can keep some MoE experts in RAM and compute them on the CPU")
    hot_expert_cache: bool = Field(
        False, description="the GPU can also hold the most picked experts of the layers whose experts are in RAM"
    )

    def kv_bytes_per_element(self, kv_cache: KvCacheType, on_gpu: bool) -> float:
        if kv_cache == "q8_0":
            return self.kv_bytes_per_element_q8_0
        return self.kv_bytes_per_element_gpu if on_gpu else self.kv_bytes_per_element_cpu

    def gpu_usable(self, compute_capability: str | None) -> bool:
        """Whether an NVIDIA GPU of this compute capability ("8.9") runs the engine's kernels."""
        if compute_capability is None:
            return False
        major, minor = (int(x) for x in compute_capability.split("."))
        return (major, minor) >= tuple(self.min_compute_capability)

    def prompt_chunk(self, on_gpu: bool, asked: int | None = None) -> int:
        """The engine's rule: `asked`, else the device's default; the CPU path never more than its own."""
        return (asked or self.gpu_prefill_chunk) if on_gpu else min(asked or self.prefill_chunk, self.prefill_chunk)

    @property
    def min_compute_capability_text(self) -> str:
        return ".".join(map(str, self.min_compute_capability))
