"""`flux2dev convert encoder SRC OUT.gguf --type T`: a FLUX.2 [dev] text encoder from any layout the encoder loader
reads, written as a llama.cpp GGUF of the layers FLUX.2 reads (the embeddings and layers 0-29: about a quarter
smaller than a 40-layer file), which this pack and ComfyUI-GGUF's CLIPLoaderGGUF both load.

Reading is convert/encoder.py's: the loader's plan, one weight at a time, packed weights dequantized exactly to
float32. What is written is what llama.cpp's converter and llama-quantize write for Mistral-Small-3.x:

- general.architecture "llama": what llama.cpp names Mistral-Small's text model, and the one Mistral architecture
  ComfyUI-GGUF's text-encoder loader takes; its settings (block_count 30, head counts, key/value length 128, rope
  freq base, RMS epsilon ...) in gguf-py's key names;
- tensors in gguf-py's llama.cpp names (token_embd, blk.N.attn_q ...), Q and K rows in llama.cpp's rotary order
  (convert_hf_to_gguf.py's LlamaModel.permute: the inverse of the loader's undo_rotary_permute);
- output_norm.weight as ones (F32): llama.cpp's llama graph requires it (create_tensor without TENSOR_NOT_REQUIRED),
  though the pruned encoder never applies a final norm (the pack and ComfyUI's pruned FLUX.2 model read none);
- the tokenizer as llama.cpp writes a Tekken one: model "gpt2", pre "tekken", byte-level token strings, control
  types for the special tokens, merges derived from the ranks, bos 1 / eos 2 / unk 0 / pad 11: the vocabulary the
  tokenizer ladder found for the source;
- each tensor's type by llama.cpp's own rules for LLMs (presets.RAISES, and its types' fallbacks: the rows').
"""

from __future__ import annotations

import os

import torch
from gguf import GGML_QUANT_VERSION, MODEL_ARCH, GGUFValueType, Keys, TokenType
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as Q
from gguf.tensor_mapping import get_tensor_name_map

from ...errors import CorruptFileError, UnsupportedFormatError, WrongModelError
from ..formats import packed_dequant
from ..formats.gguf_row import NotQuantizable
from ..formats.gguf_types import type_of
from ..models import progress
from ..models.encoder import plan_encoder, planned_weights, read_weight, resolve_plan_tokenizer, undo_rotary_permute
from ..models.encoder_identify import FINAL_NORM, LAYER_SHAPES
from ..models.variants import MistralEncoderGeometry, layers_kept
from .output import check_not_source, check_output, output_file
from .presets import RAISES, At
from .tensor_files import gguf_file, write_quantized
from .transformer import TYPES

ARCHITECTURE = "llama"
CONTEXT_LENGTH = 131072  # Mistral-Small-3.x's max_position_embeddings
FLOATS = (Q.F32, Q.F16, Q.BF16)
# Token ids llama.cpp's converter states for Tekken (tokenizer_config.json's): bos <s>, eos </s>, unk <unk>, pad <pad>
SPECIAL_IDS = {Keys.Tokenizer.BOS_ID: 1, Keys.Tokenizer.EOS_ID: 2, Keys.Tokenizer.UNK_ID: 0, Keys.Tokenizer.PAD_ID: 11}
# The modules whose rows llama.cpp permutes -> their head count
ROTARY = {"self_attn.q_proj": lambda g: g.heads, "self_attn.k_proj": lambda g: g.kv_heads}
PARTS = list(LAYER_SHAPES)


def tensor_type(kind: T, layer: int, shape: tuple[int, ...], preset: str, gqa: int, layers: int) -> Q:
    """The GGUF type llama-quantize gives tensor `kind` of `layer` (shape in torch order) in a file of `layers`
    layers for `preset` (a TYPES name)."""
    if len(shape) < 2:  # tensor_allows_quantization: matrices only; the converter writes 1-D tensors in F32
        return Q.F32
    base = TYPES[preset].weights
    if base in FLOATS:  # ggml_is_quantized(default_type) is false: every matrix takes it
        return base
    row = type_of(base)
    at = At(preset, row.name, row.fits(shape), layer, layers, gqa)
    for r in RAISES:
        if r.kind == kind.name and (r.presets is None or preset in r.presets) and r.applies(at):
            row = type_of(Q[r.qtype])
            break
    if not row.fits(shape) and row.fallback:  # llama.cpp's tensor_type_fallback, then F16
        row = type_of(Q[row.fallback])
    return row.qtype if row.fits(shape) else Q.F16


def _layer(host: str) -> int:
    return int(host.split(".")[2]) if host.startswith("model.layers.") else 0


def _order(host: str) -> tuple[int, int]:
    """llama.cpp's order: the embeddings, then layer by layer."""
    if not host.startswith("model.layers."):
        return -1, 0
    return _layer(host), PARTS.index(host.split(".", 3)[3].removesuffix(".weight"))


def rotary_interleave(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF half-split rows -> llama.cpp's interleaved rows: the inverse of the loader's undo_rotary_permute."""
    moved = undo_rotary_permute(torch.arange(weight.shape[0]), heads)  # row i of the undone weight is row moved[i]
    return weight[torch.argsort(moved)]


def encoder_settings(arch: str, g: MistralEncoderGeometry, layers: int,
                     rope_theta: float) -> list[tuple[str, GGUFValueType, object]]:
    """The {arch}.* settings llama.cpp writes for a Mistral text model of geometry `g` with `layers` layers."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    return [(key.format(arch=arch), vtype, value) for key, vtype, value in (
        (Keys.LLM.BLOCK_COUNT, u32, layers),
        (Keys.LLM.CONTEXT_LENGTH, u32, CONTEXT_LENGTH),
        (Keys.LLM.EMBEDDING_LENGTH, u32, g.width),
        (Keys.LLM.FEED_FORWARD_LENGTH, u32, g.mlp),
        (Keys.Attention.HEAD_COUNT, u32, g.heads),
        (Keys.Attention.HEAD_COUNT_KV, u32, g.kv_heads),
        # Mistral-Small's heads are 128 wide, not width / heads (160): llama.cpp states both lengths then
        (Keys.Attention.KEY_LENGTH, u32, g.head_dim),
        (Keys.Attention.VALUE_LENGTH, u32, g.head_dim),
        (Keys.Rope.DIMENSION_COUNT, u32, g.head_dim),
        (Keys.Rope.FREQ_BASE, f32, rope_theta),
        (Keys.Attention.LAYERNORM_RMS_EPS, f32, g.rms_norm_eps),
        (Keys.LLM.VOCAB_SIZE, u32, g.vocab),
    )]


def _tokenizer(plan) -> list[tuple[str, GGUFValueType, object]]:
    """llama.cpp's tokenizer.ggml.* of the vocabulary the encoder loads with, as its converter writes a Tekken one."""
    from ...tokenizers.canonical import vocab_and_merges
    from ...tokenizers.vocab import byte_level_string

    vocab = resolve_plan_tokenizer(plan).tokenizer.vocab
    tokens = [*vocab.specials, *map(byte_level_string, vocab.ranks)]
    if len(tokens) != plan.geometry.vocab:
        raise WrongModelError(
            f"{plan.path}: the vocabulary its tokenizer was found in has {len(tokens)} tokens, but its embedding table "
            f"has {plan.geometry.vocab} rows; they are not of one model. Put the encoder's own tekken.json beside it."
        )
    types = [int(TokenType.CONTROL)] * len(vocab.specials) + [int(TokenType.NORMAL)] * len(vocab.ranks)
    merges = [f"{left} {right}" for left, right in vocab_and_merges(vocab)[1]]
    S, A, I32, U32 = GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.INT32, GGUFValueType.UINT32
    return [
        (Keys.Tokenizer.MODEL, S, "gpt2"),
        (Keys.Tokenizer.PRE, S, "tekken"),
        (Keys.Tokenizer.LIST, A, (S, tokens)),
        (Keys.Tokenizer.TOKEN_TYPE, A, (I32, types)),
        (Keys.Tokenizer.MERGES, A, (S, merges)),
        *((key, U32, value) for key, value in SPECIAL_IDS.items()),
        (Keys.Tokenizer.ADD_BOS, GGUFValueType.BOOL, True),
        (Keys.Tokenizer.ADD_EOS, GGUFValueType.BOOL, False),
    ]


def convert_encoder_gguf(src: str, out: str, *, qtype: str, force: bool = False) -> dict:
    """Write the encoder at `src` to `out` (a .gguf file) with `qtype` (a TYPES name) as llama.cpp's rules give it
    to each tensor; returns what was written. Nothing is written when the source is refused or `out` is taken
    (unless `force`)."""
    if qtype not in TYPES:
        raise UnsupportedFormatError(f"GGUF encoders are written as {', '.join(TYPES)}, not {qtype!r}.")
    target = check_output(out, force=force, suffix=".gguf")
    plan = plan_encoder(src)
    check_not_source(target, src)
    g = plan.geometry
    layers = layers_kept(g)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, layers)
    hosts = sorted(planned_weights(plan), key=_order)
    # host name -> (GGUF name, type, shape); the final norm (never read) last
    written = {}
    for host in [*hosts, FINAL_NORM]:
        kind, name = names.get_type_and_name(host, try_suffixes=(".weight",))
        shape = (g.width,) if host == FINAL_NORM else plan.source.entries[plan.mapping[host]][1]
        written[host] = name, tensor_type(kind, _layer(host), shape, qtype, g.heads // g.kv_heads, layers), shape
    layout = {name: (t, shape, type_of(t).nbytes(shape)) for name, t, shape in written.values()}
    metadata = [
        (Keys.General.ARCHITECTURE, GGUFValueType.STRING, ARCHITECTURE),
        *encoder_settings(ARCHITECTURE, g, layers, plan.rope_theta),
        (Keys.General.FILE_TYPE, GGUFValueType.UINT32, int(TYPES[qtype].file_type)),
        (Keys.General.QUANTIZATION_VERSION, GGUFValueType.UINT32, GGML_QUANT_VERSION),
        *_tokenizer(plan),
    ]
    with output_file(target, force=force) as f:
        file = gguf_file(f, metadata, layout)
        for host in progress.tracked(hosts):
            weight, companions = packed_dequant.split_entries(read_weight(plan, host), host)
            name, t, shape = written[host]
            # a plain weight goes to the quantizer as stored (it widens each chunk exactly), so only packed ones are
            # held whole in float32
            values = packed_dequant.dequantize(weight, companions, torch.float32, shape) if companions else weight
            del weight, companions
            module = ".".join(host.split(".")[3:5])
            if module in ROTARY:
                values = rotary_interleave(values, ROTARY[module](g))
            try:
                write_quantized(file, name, values, t)
            except NotQuantizable as e:
                raise CorruptFileError(f"The encoder's {name} cannot be written as {t.name}: {e}. A weight like that "
                                       "is damaged; check the source.") from None
            del values
        name, t, shape = written[FINAL_NORM]
        file.write(name, torch.ones(shape, dtype=torch.float32))
        file.finish()
    counts: dict[str, int] = {}
    for _, t, _ in written.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    return {"path": str(target), "layout": plan.layout, "type": qtype, "layers": layers, "tensors": len(written),
            "types": counts, "bytes": os.path.getsize(target)}

