"""bench/make_synthetic_gguf.py with another model's tokenizer (issue 19 item 6: llama.cpp can then load the very
file our bench runs): the tokenizer is the source's, the vocabulary padded to the shape's, and the file loads."""

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from engine import load_model
from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.make_synthetic_gguf import write_model  # noqa: E402

SMOLLM2_VOCAB = 49152


def test_synthetic_model_takes_another_models_tokenizer(tmp_path, smollm2_gguf):
    shape = dict(hidden=128, layers=1, ffn=256, heads=2, kv_heads=1, vocab=SMOLLM2_VOCAB + 100, tied=True)
    path = tmp_path / "synthetic.gguf"
    write_model(path, shape, T.Q8_0, "synthetic", tokenizer=smollm2_gguf)
    text = "Hello, world! The café's 3 tokens:\n  def f(x): return x ** 2"
    ours, theirs = Tokenizer(GGUFFile(path)), Tokenizer(GGUFFile(smollm2_gguf))
    assert ours.encode(text) == theirs.encode(text)
    tokens = GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == shape["vocab"] and tokens[-1] == "<|synthetic_pad_99|>"
    model = load_model(path, device="cpu", context_length=64)
    logits, _ = model.prompt_logits(ours.encode(text))
    model.close()
    assert logits.shape == (shape["vocab"],) and np.isfinite(logits).all()


def test_a_tokenizer_larger_than_the_shape_is_refused(tmp_path, smollm2_gguf):
    shape = dict(hidden=128, layers=1, ffn=256, heads=2, kv_heads=1, vocab=1000, tied=True)
    with pytest.raises(ValueError, match="larger than this shape's"):
        write_model(tmp_path / "synthetic.gguf", shape, T.Q8_0, "synthetic", tokenizer=smollm2_gguf)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_hybrid_shapes_load_and_run(tmp_path, arch):
    """The hybrid shapes' tensors and metadata are what the engine reads from llama.cpp's files: a small one of each
    family loads (three DeltaNet layers, then gated attention) and gives finite logits."""
    from bench.make_synthetic_gguf import type_mix

    shape = dict(arch=arch, hidden=256, layers=4, ffn=256, heads=4, kv_heads=1, head_dim=64, rope_dims=16,
                 linear=(2, 4, 64), vocab=300, tied=False, context=512)
    if arch == "qwen35moe":
        shape.update(experts=8, experts_used=2, shared=256)
    path = tmp_path / f"synthetic-{arch}.gguf"
    write_model(path, shape, type_mix("Q4_K_M"), "synthetic")
    # llama.cpp's loader requires the rotary sections; they cover the 8 rotary pairs.
    assert list(GGUFReader(path).fields[f"{arch}.rope.dimension_sections"].contents()) == [3, 3, 2, 0]
    model = load_model(path, device="cpu", context_length=64)
    kinds = model._state.config.mixer_kinds
    logits, _ = model.prompt_logits(list(range(2, 40)))
    model.close()
    assert kinds == ("deltanet", "deltanet", "deltanet", "gated_attention")
    assert logits.shape == (300,) and np.isfinite(logits).all()
