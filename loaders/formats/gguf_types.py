"""The GGUF types the pack reads and writes, one row each (TYPES); every list of types is derived from it. Their
blocks' sizes are gguf's (GGML_QUANT_SIZES).

A row names its type's kernels, which live beside their reference, each table of them keyed by the type:
- read, every type: gguf_dequant.py (a view and a cast for plain floats, else its torch steps in _KERNELS, on every
  device, against gguf-py's numpy dequantizer), and on the CPU the one-pass kernel in numba_kernels.GGUF where
  `one_pass_read`;
- written, where `writer` is set: "gguf-py" types by gguf_quant.py (its torch _KERNELS, and numba_kernels.QUANTIZE
  where `one_pass_write`), against gguf-py's quantizer; "ggml" types by kquants.py (kquant_kernels.KERNELS), against
  ggml's reference quantizers.
tests/formats/test_gguf_types.py checks that each kernel table holds exactly the kernels the rows name.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class GGUFType:
    qtype: Q
    scale_fields: tuple[int, ...] = ()  # byte offsets of its blocks' fp16 scales (d, then dmin where it has one)
    float_dtype: str | None = None  # a plain float type: read as this torch dtype
    one_pass_read: bool = False
    writer: str | None = None  # whose quantizer its bytes equal: "gguf-py" (gguf_quant.py) or "ggml" (kquants.py)
    one_pass_write: bool = False


# In the order the docs and the errors list them
TYPES = (
    GGUFType(Q.F32, float_dtype="float32", writer="gguf-py"),
    GGUFType(Q.F16, float_dtype="float16", writer="gguf-py", one_pass_write=True),
    GGUFType(Q.BF16, float_dtype="bfloat16", writer="gguf-py", one_pass_write=True),
    GGUFType(Q.Q8_0, (0,), one_pass_read=True, writer="gguf-py", one_pass_write=True),
    GGUFType(Q.Q4_0, (0,), one_pass_read=True, writer="gguf-py", one_pass_write=True),
    GGUFType(Q.Q4_1, (0, 2), one_pass_read=True, writer="gguf-py", one_pass_write=True),
    GGUFType(Q.Q5_0, (0,), one_pass_read=True, writer="gguf-py", one_pass_write=True),
    GGUFType(Q.Q5_1, (0, 2), one_pass_read=True, writer="gguf-py", one_pass_write=True),
    GGUFType(Q.Q2_K, (80, 82), one_pass_read=True, writer="ggml"),
    GGUFType(Q.Q3_K, (108,), one_pass_read=True, writer="ggml"),
    GGUFType(Q.Q4_K, (0, 2), one_pass_read=True, writer="ggml"),
    GGUFType(Q.Q5_K, (0, 2), one_pass_read=True, writer="ggml"),
    GGUFType(Q.Q6_K, (208,), one_pass_read=True, writer="ggml"),
    GGUFType(Q.IQ4_NL, (0,), one_pass_read=True),
    GGUFType(Q.IQ4_XS, (0,), one_pass_read=True),
)
BY_TYPE = {row.qtype: row for row in TYPES}

READ_TYPES = tuple(BY_TYPE)
FLOAT_TYPES = tuple(row.qtype for row in TYPES if row.float_dtype)
QUANTIZED_TYPES = tuple(row.qtype for row in TYPES if not row.float_dtype)
LEGACY_TYPES = tuple(row.qtype for row in TYPES if row.writer == "gguf-py")
K_TYPES = tuple(row.qtype for row in TYPES if row.writer == "ggml")
WRITE_TYPES = (*LEGACY_TYPES, *K_TYPES)
