"""A stand-in for a real GGUF that is too large to carry to the GPU machine: the same metadata (tokenizer
included) and the same tensors (names, types, shapes, so the same bytes on the GPU), with random values.

`skeleton` writes a small GGUF of the real file's metadata plus the list of its tensors; `expand` turns that
skeleton into the replica on the other machine. Memory use and speed do not depend on the weight values.

Usage: python bench/replica_gguf.py skeleton REAL.gguf SKELETON.gguf
       python bench/replica_gguf.py expand SKELETON.gguf REPLICA.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.make_synthetic_gguf import add_matrix  # noqa: E402

TENSORS_KEY = "strata.replica.tensors"  # one "name|TYPE|dim0,dim1,..." string per tensor, row-major shape
# Written by GGUFWriter itself, so never copied.
_OWN_KEYS = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def _copy_fields(writer: GGUFWriter, reader: GGUFReader, skip: set[str]) -> None:
    for name, field in reader.fields.items():
        if name in skip:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)


def _architecture(reader: GGUFReader) -> str:
    return reader.fields["general.architecture"].contents()


def write_skeleton(real: Path, out: Path) -> None:
    reader = GGUFReader(real)
    writer = GGUFWriter(str(out), _architecture(reader))
    _copy_fields(writer, reader, _OWN_KEYS)
    # GGUF lists dims fastest first; the engine and the writer take row-major shapes.
    specs = [f"{t.name}|{t.tensor_type.name}|{','.join(str(int(d)) for d in reversed(t.shape))}" for t in reader.tensors]
    writer.add_array(TENSORS_KEY, specs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def expand(skeleton: Path, out: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    reader = GGUFReader(skeleton)
    writer = GGUFWriter(str(out), _architecture(reader))
    _copy_fields(writer, reader, _OWN_KEYS | {TENSORS_KEY})
    for spec in reader.fields[TENSORS_KEY].contents():
        name, type_name, dims = spec.split("|")
        qtype = GGMLQuantizationType[type_name]
        shape = tuple(int(d) for d in dims.split(","))
        if len(shape) == 1:
            # Norm weights and biases: ones keep the activations of a random network in range.
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            add_matrix(writer, name, qtype, int(np.prod(shape[:-1])), shape[-1], rng, shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("skeleton", "expand"))
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    (write_skeleton if args.command == "skeleton" else expand)(args.source, args.out)


if __name__ == "__main__":
    main()
