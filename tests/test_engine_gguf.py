"""GGUF files: the summary, damaged and truncated files, split sets, unsupported architectures."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine import EngineError, load_model, read_gguf_summary
from engine.arch import llama
from engine.backend_numpy import NumpyBackend
from engine.gguf_file import GGUFFile, GGUFTensor


def write_gguf(path, arch="llama", tensors=None, **metadata):
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        writer.add_uint32(key.replace("__", "."), value)
    for name, array in (tensors or {"a.weight": np.ones((2, 32), np.float32)}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_summary_reads_metadata_without_weights(smollm2_gguf):
    summary = read_gguf_summary(smollm2_gguf)
    assert summary.architecture == "llama"
    assert summary.context_length == 8192
    assert summary.tensor_count == 272
    assert summary.tensor_types == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert summary.file_size == smollm2_gguf.stat().st_size
    assert 130e6 < summary.parameter_count < 140e6


@pytest.mark.parametrize("keep", [1_000, 50_000_000])
def test_truncated_file_is_named_in_the_error(smollm2_gguf, tmp_path, keep):
    broken = tmp_path / "cut-short.gguf"
    with open(smollm2_gguf, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(EngineError, match="cut-short.gguf") as excinfo:
        read_gguf_summary(broken)
    assert "truncated" in str(excinfo.value)
    with pytest.raises(EngineError, match="cut-short.gguf"):
        load_model(broken, device="cpu")


def test_bad_magic_and_missing_file(tmp_path):
    junk = tmp_path / "not-a-model.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(EngineError, match="not-a-model.gguf.*corrupt"):
        read_gguf_summary(junk)
    with pytest.raises(EngineError, match="does not exist"):
        read_gguf_summary(tmp_path / "nowhere.gguf")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "other.gguf", arch="mamba")
    with pytest.raises(EngineError, match=r"'mamba' architecture.*Supported architectures: .*llama"):
        load_model(path, device="cpu")


def test_split_files_are_found_and_a_missing_part_is_named(tmp_path):
    first = write_gguf(
        tmp_path / "tiny-00001-of-00002.gguf",
        tensors={"a.weight": np.full((2, 32), 1.0, np.float32)},
        split__no=0, split__count=2, split__tensors__count=2,
    )
    second = write_gguf(
        tmp_path / "tiny-00002-of-00002.gguf",
        tensors={"b.weight": np.full((3, 32), 2.0, np.float32)},
        split__no=1, split__count=2, split__tensors__count=2,
    )
    model = GGUFFile(first)
    assert sorted(model.tensors) == ["a.weight", "b.weight"]
    assert model.tensor("b.weight").shape == (3, 32)
    assert np.all(model.tensor("b.weight").raw.view(np.float32) == 2.0)
    assert model.file_size == first.stat().st_size + second.stat().st_size

    with pytest.raises(EngineError, match="open its first part"):
        GGUFFile(second)
    second.unlink()
    with pytest.raises(EngineError, match="tiny-00002-of-00002.gguf is missing"):
        read_gguf_summary(first)


def test_missing_tensor_and_tokenizer_are_explained(tmp_path):
    path = write_gguf(tmp_path / "hollow.gguf", tensors={"token_embd.weight": np.ones((4, 32), np.float32)},
                      llama__block_count=1, llama__context_length=64, llama__embedding_length=32,
                      llama__feed_forward_length=64, llama__attention__head_count=2)
    model = GGUFFile(path)
    config = llama.read_config(model)
    with pytest.raises(EngineError, match="hollow.gguf has no tensor 'blk.0.attn_q.weight'"):
        llama.load_weights(model, config, NumpyBackend(), 64)
    with pytest.raises(EngineError, match="hollow.gguf has no tokenizer"):
        load_model(path, device="cpu")


def test_unsupported_tensor_type_names_tensor_and_type():
    tensor = GGUFTensor("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.TQ1_0, (4, 256), np.zeros(4 * 54, np.uint8))
    with pytest.raises(EngineError, match=r"blk\.0\.ffn_up\.weight.*TQ1_0.*Q4_1"):
        NumpyBackend().upload(tensor)
