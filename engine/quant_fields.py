"""Reading the packed fields of GGML quantized blocks with NumPy, for all blocks at once.

Every function takes `blocks`-shaped uint8 arrays (one row per block, or a slice of those rows) and keeps
the block axis first, so a dequantizer is a handful of array expressions over the whole tensor.
"""

import numpy as np


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte `offset` of every block, as a float32 column of shape (n, 1)."""
    return blocks[:, offset:offset + 2].view("<f2").astype(np.float32)


def split_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Each byte cut into 8 // bits fields of `bits` bits, lowest first, on a new axis before the last.

    (..., m) -> (..., 8 // bits, m): ggml packs a byte's fields into elements that lie m apart.
    """
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]
    return (packed[..., None, :] >> shifts) & np.uint8((1 << bits) - 1)


def interleaved_nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., m) -> (..., 2 m) with each byte's low nibble followed by its high nibble (packed scales)."""
    pairs = np.stack((packed & np.uint8(0x0F), packed >> np.uint8(4)), axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def bits_little(packed: np.ndarray) -> np.ndarray:
    """(..., m) -> (..., 8 m): bit k of byte j is element 8 j + k (a little-endian bit mask)."""
    return np.unpackbits(packed, axis=-1, bitorder="little")
