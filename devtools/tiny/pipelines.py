"""Tiny diffusers FLUX.2 pipeline folders, one per TINY_VARIANTS row: model_index.json, transformer/
(sharded), vae/ (the shared FLUX.2 VAE), text_encoder/, tokenizer/ and scheduler/, laid out as on the hub.

[dev] gets the tiny Mistral-Small encoder of tiny/encoders.py; Klein gets a tiny Qwen3 causal LM whose width is
the variant's encoder width and a byte-level Qwen2 tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ...loaders.models.variants import Flux2Variant
from . import encoders
from .geometry import TINY_VARIANTS
from .transformers import SHARD_SIZE, make_transformer
from .vae import write_vae_folder

QWEN3_LAYERS = 28  # enough for hidden_states[27], the deepest layer Klein reads
QWEN3_SEED = 3
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# What model_index.json names for each family, as in the published pipelines.
MODEL_INDEX = {
    "dev": {
        "_class_name": "Flux2Pipeline",
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
        "tokenizer": ["transformers", "PixtralProcessor"],
    },
    "klein": {
        "_class_name": "Flux2KleinPipeline",
        "is_distilled": True,
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    },
}
COMMON_INDEX = {
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}


def family(variant: Flux2Variant) -> str:
    return "dev" if variant.key == "dev" else "klein"


def _write_qwen3(folder: Path, variant: Flux2Variant) -> None:
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

    byte_vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = Qwen2TokenizerFast(tokenizer_object=backend, pad_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2],
                                   unk_token=None, bos_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": [SPECIAL_TOKENS[1]]})
    tokenizer.save_pretrained(str(folder / "tokenizer"))

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=variant.encoder_width, intermediate_size=2 * variant.encoder_width,
        num_hidden_layers=QWEN3_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(QWEN3_SEED)
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(folder / "text_encoder"))


def _write_mistral3(folder: Path) -> None:
    encoders.write_hf_mistral3(str(folder / "text_encoder"))
    encoders.write_tokenizer_folder(str(folder / "tokenizer"))


def _link_or_copy_tree(src: Path, dst: Path) -> None:
    """The VAE is the same in every pipeline: hard links save disk where the file system allows them."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copyfile(f, dst / f.name)


def write_pipeline(folder: Path, variant: Flux2Variant, vae_from: Path | None = None) -> None:
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    folder.mkdir(parents=True, exist_ok=True)
    index = {**MODEL_INDEX[family(variant)], "_diffusers_version": diffusers.__version__, **COMMON_INDEX}
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    make_transformer(variant).bfloat16().save_pretrained(str(folder / "transformer"), max_shard_size=SHARD_SIZE)
    if vae_from is None:
        write_vae_folder(folder / "vae")
    else:
        _link_or_copy_tree(vae_from, folder / "vae")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(str(folder / "scheduler"))
    if family(variant) == "dev":
        _write_mistral3(folder)
    else:
        _write_qwen3(folder, variant)


def write_pipelines(root: str | Path) -> list[dict]:
    root = Path(root)
    entries, vae = [], None
    for variant in TINY_VARIANTS:
        name = f"flux2-{variant.key}-tiny-pipeline"
        write_pipeline(root / name, variant, vae_from=vae)
        vae = vae or root / name / "vae"
        entries.append({"path": name, "kind": "pipeline", "layout": "diffusers", "variant": variant.key,
                        "format": "bf16"})
    return entries
