"""What `flux2dev convert ... --type` writes: one GGUF type for every weight (each type the pack quantizes, from the
table of GGUF types) or one of llama.cpp's K presets, and the rules by which llama.cpp gives a preset's tensors their
types. Torch-free (the command line reads it before importing torch); the table of types is imported where the list
is asked for."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

# llama.cpp's K presets for image models (ComfyUI-GGUF's tools/lcpp.patch, img_tensor_get_type) -> the GGUF type of
# their weights, and of the fused attention qkv tensors where the patch's rule raises it. Of its rules only that one
# names FLUX.2 tensors (double_blocks.N.img_attn.qkv and txt_attn.qkv): FLUX.2 has no attention v tensor of its own,
# and its feed-forward down tensors (img_mlp.2, txt_mlp.2, linear2) match none of the rule's ffn_down spellings.
K_PRESETS = {
    "Q6_K": ("Q6_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K"),
    "Q5_K_S": ("Q5_K", "Q5_K"),
    "Q4_K_M": ("Q4_K", "Q5_K"),
    "Q4_K_S": ("Q4_K", "Q4_K"),
    "Q3_K_L": ("Q3_K", "Q4_K"),
    "Q3_K_M": ("Q3_K", "Q4_K"),
    "Q3_K_S": ("Q3_K", "Q3_K"),
    "Q2_K": ("Q2_K", "Q2_K"),
}
SMALL_TENSORS = "F32"  # the type small tensors keep in every file, offered as no --type of its own


@functools.cache
def written_types() -> tuple[str, ...]:
    """Every --type: the quantized types the pack writes that no preset names, the presets, then the float types;
    each group from the most bytes a value to the fewest (then by name)."""
    from ..formats.gguf_types import TYPES

    in_presets = {t for pair in K_PRESETS.values() for t in pair}
    written = sorted((row for row in TYPES if row.writer and row.name not in in_presets | {SMALL_TENSORS}),
                     key=lambda row: (-row.block_bytes / row.block_values, row.name))
    return (*(r.name for r in written if not r.float_dtype), *K_PRESETS, *(r.name for r in written if r.float_dtype))


@dataclass(frozen=True)
class At:
    """Where a tensor is, as llama.cpp's rules see it."""

    preset: str
    base: str  # the preset's default type
    base_fits: bool  # whether the tensor's rows hold whole blocks of it
    layer: int  # i_attention_wv / i_ffn_down: the layer, each layer having one of each
    layers: int  # n_attention_wv / n_ffn_down: the file's block count (30)
    gqa: int  # n_gqa(): heads / kv heads


def _more_bits(at: At) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    n = at.layers
    return at.layer < n // 8 or at.layer >= 7 * n // 8 or (at.layer - n // 8) % 3 == 2


@dataclass(frozen=True)
class Raise:
    """A rule of llama.cpp's llama_tensor_get_type_impl: in `presets` (every quantized one where None), a tensor of
    `kind` (gguf's MODEL_TENSOR name) takes `qtype` where `applies`."""

    presets: tuple[str, ...] | None
    kind: str
    qtype: str
    applies: Callable[[At], bool]


def _always(at: At) -> bool:
    return True


# llama.cpp's per-tensor rules for a llama-architecture LLM without experts (Mistral-Small), line numbers of
# src/llama-quant.cpp as vendored by llama-cpp-python 0.3.36; the first row that applies wins, else the preset's type
# (K_PRESETS' weights type). Rules for other architectures, experts, 70B models or an importance matrix never apply.
RAISES = (
    # 490-511: with no output.weight, token_embd is quantized as the output tensor (tied embeddings): Q8_0 where its
    # rows do not hold the preset type's blocks, else Q6_K (Q8_0 stays Q8_0)
    Raise(None, "TOKEN_EMBD", "Q8_0", lambda at: not at.base_fits),
    Raise(None, "TOKEN_EMBD", "Q6_K", lambda at: at.preset != "Q8_0"),
    # 567-604: attn_v
    Raise(("Q2_K",), "ATTN_V", "Q4_K", lambda at: at.gqa >= 4),  # 568-569
    Raise(("Q2_K",), "ATTN_V", "Q3_K", _always),
    Raise(("Q3_K_M",), "ATTN_V", "Q5_K", lambda at: at.layer < 2),  # 583-584
    Raise(("Q3_K_M",), "ATTN_V", "Q4_K", _always),
    Raise(("Q3_K_L",), "ATTN_V", "Q5_K", _always),  # 586
    Raise(("Q4_K_M", "Q5_K_M"), "ATTN_V", "Q6_K", _more_bits),  # 590-591
    Raise(("Q4_K_S",), "ATTN_V", "Q5_K", lambda at: at.layer < 4),  # 592
    # 624-668: ffn_down
    Raise(("Q2_K",), "FFN_DOWN", "Q3_K", _always),  # 627
    Raise(("Q3_K_M",), "FFN_DOWN", "Q5_K", lambda at: at.layer < at.layers // 16),  # 634-637
    Raise(("Q3_K_M",), "FFN_DOWN", "Q4_K", _always),
    Raise(("Q3_K_L",), "FFN_DOWN", "Q5_K", _always),  # 643-644
    Raise(("Q4_K_M", "Q5_K_M"), "FFN_DOWN", "Q6_K", _more_bits),  # 646-651, 657
    Raise(("Q4_K_S",), "FFN_DOWN", "Q5_K", lambda at: at.layer < at.layers // 8),  # 658
    # 669-684: attn_output
    Raise(("Q2_K",), "ATTN_OUT", "Q3_K", _always),  # 679
    Raise(("Q3_K_M",), "ATTN_OUT", "Q4_K", _always),  # 681
    Raise(("Q3_K_L",), "ATTN_OUT", "Q5_K", _always),  # 682
)
