"""GGUF helpers for the tiny models and the tests: random quantized blocks, data for the types gguf-py can
dequantize but not quantize (K and IQ types; gguf's numpy dequantizer is their reference), and the one
way a gguf.GGUFWriter is finished."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...loaders.formats.gguf_types import TYPES

Q = GGMLQuantizationType

# Byte offsets of the fp16 scale fields (d, dmin) in each type's block, as ggml's block_* structs lay them out.
FP16_FIELDS = {row.qtype: row.scale_fields for row in TYPES if row.scale_fields}


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator,
                  magnitude: float | None = None) -> np.ndarray:
    """uint8 rows of random whole blocks for a tensor of `shape` ([..., bytes per row]). The fp16 scale
    fields are finite: random bit patterns when magnitude is None (every value the format can hold, for
    bit-exactness tests), else within 0.5-1.5 x magnitude (weights of a plausible size, for models)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block_size, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        if magnitude is None:
            bits = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent is inf/NaN: clear one of its bits
        else:
            bits = (rng.uniform(0.5, 1.5, blocks.shape[0]) * magnitude).astype(np.float16).view(np.uint16)
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def write_and_close(writer) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors to its file, in the order the format needs."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
