"""Hugging Face transformers on CPU PyTorch, loading the same GGUF as the engine: the independent reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_reference_model(gguf: Path):
    """The transformers model of a GGUF file, dequantized to float32 by transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """float32 logits (positions, vocab) for one sequence of token ids."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
