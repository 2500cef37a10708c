"""The Llama architecture (Llama 2/3, SmolLM2, TinyLlama, Mistral without sliding window): the plain decoder,
attention with adjacent-pair ('normal') rotary and a SwiGLU FFN in every layer."""

from __future__ import annotations

from engine.arch.decoder import forward, load_weights, new_cache, new_workspace
from engine.arch.parts import DecoderConfig, read_decoder_config
from engine.gguf_file import GGUFFile

__all__ = ["read_config", "load_weights", "new_workspace", "new_cache", "forward"]


def read_config(gguf: GGUFFile) -> DecoderConfig:
    return read_decoder_config(gguf, rope_base=10000.0, rms_eps=1e-5)
