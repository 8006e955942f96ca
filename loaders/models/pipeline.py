"""diffusers FLUX.2 pipeline folders: finding them, telling [dev] from Klein, and refusing a Klein pipeline
as the source of a [dev] text encoder before any weight is read.

A pipeline's variant is read three ways, which must agree: the class model_index.json names, the
transformer's config.json, and the transformer's tensor shapes (safetensors headers only). The text
encoder's config, when present, must have the width of that variant's encoder."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import UnknownModelError, VariantMismatchError, WrongModelError
from ..formats.files import ENCODER_CONFIG, MODEL_INDEX, PIPELINE_INDEX, TRANSFORMER_CONFIG, read_json
from ..formats.safetensors_file import SafetensorsFiles
from .node_titles import title
from .transformer_layout import geometry_from_shapes, transformer_files, variant_for_geometry
from .variants import Flux2Variant, variant_by_key, variant_for_transformer

# diffusers' FLUX.2 pipeline classes (0.42) and the variants each may hold.
PIPELINE_CLASSES = {
    "Flux2Pipeline": ("dev",),
    "Flux2KleinPipeline": ("klein-4b", "klein-9b"),
    "Flux2KleinInpaintPipeline": ("klein-4b", "klein-9b"),
    "Flux2KleinKVPipeline": ("klein-4b", "klein-9b"),
}


@dataclass(frozen=True)
class PipelineInfo:
    path: Path
    class_name: str
    variant: Flux2Variant


def holds_variant(folder: str | Path, key: str) -> bool:
    """Whether the pipeline folder's model_index.json names a class that may hold the variant (cheap: one
    small file read, for menus)."""
    return key in PIPELINE_CLASSES.get(pipeline_class(folder), ())


def pipeline_class(folder: str | Path) -> str | None:
    """The FLUX.2 pipeline class model_index.json names, or None when the folder is not a FLUX.2 pipeline."""
    index = Path(folder) / MODEL_INDEX
    if not index.is_file():
        return None
    name = read_json(index, PIPELINE_INDEX).get("_class_name")
    return name if name in PIPELINE_CLASSES else None


def _config_variant(config: Mapping) -> tuple[Flux2Variant | None, str]:
    """The variant a diffusers transformer config.json describes, and the description in its words (its
    numbers are those files.TRANSFORMER_CONFIG bounds)."""
    hidden = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
    context, guidance = config.get("joint_attention_dim"), bool(config.get("guidance_embeds"))
    said = (
        f"joint_attention_dim {context}, {config.get('num_attention_heads')} heads x "
        f"{config.get('attention_head_dim')}, guidance_embeds {guidance}"
    )
    return variant_for_transformer(context, hidden, guidance), said


def _encoder_width(config: Mapping) -> int | None:
    return config.get("text_config", config).get("hidden_size")


def _allowed_variants(name: str, class_name: str) -> tuple[str, ...]:
    if class_name not in PIPELINE_CLASSES:
        raise WrongModelError(
            f"{name} is a diffusers {class_name or 'unnamed'} pipeline, not a FLUX.2 one "
            f"({', '.join(PIPELINE_CLASSES)}). Choose a FLUX.2 pipeline folder."
        )
    return PIPELINE_CLASSES[class_name]


def pipeline_variant(
    name: str,
    class_name: str,
    transformer_config: Mapping,
    transformer_shapes: Mapping[str, tuple[int, ...]],
    encoder_config: Mapping | None,
) -> Flux2Variant:
    """The one variant all parts of a pipeline agree on; each disagreement is named with what each part says."""
    allowed = _allowed_variants(name, class_name)
    geometry, layout = geometry_from_shapes(transformer_shapes)
    weights = variant_for_geometry(geometry, layout)
    config_variant, config_said = _config_variant(transformer_config)
    if config_variant is None:
        raise UnknownModelError(f"{name}: transformer/config.json describes no known FLUX.2 transformer "
                                f"({config_said}).")
    says = {
        f"model_index.json names {class_name}": allowed,
        f"transformer/config.json ({config_said}) describes {config_variant.name}": (config_variant.key,),
        f"the transformer weights (hidden {geometry.hidden_size}, context {geometry.context_in_dim}) "
        f"are {weights.name}": (weights.key,),
    }
    width = _encoder_width(encoder_config) if encoder_config is not None else None
    if width is not None:
        matching = variant_by_key(weights.key, tiny=weights.tiny)
        says[f"text_encoder/config.json is {width} wide"] = (matching.key,) if width == matching.encoder_width else ()
    if not all(weights.key in keys for keys in says.values()):
        parts = "; ".join(says)
        raise VariantMismatchError(
            f"The pipeline folder {name} contradicts itself: {parts}. A {weights.name} text encoder is "
            f"{weights.encoder_width} wide ({weights.encoder_name}). Parts of different FLUX.2 variants were mixed "
            "in one folder; download the pipeline again."
        )
    return weights


def describe_pipeline(path: str | Path) -> PipelineInfo:
    """A pipeline folder's class and variant, from its JSON files and safetensors headers (no weights read)."""
    path = Path(path)
    if not os.path.lexists(path / MODEL_INDEX):
        raise WrongModelError(f"{path} is not a diffusers pipeline folder (it has no {MODEL_INDEX}).")
    class_name = read_json(path / MODEL_INDEX, PIPELINE_INDEX).get("_class_name", "")
    _allowed_variants(path.name, class_name)
    config_path = path / "transformer" / "config.json"
    if not os.path.lexists(config_path):
        raise UnknownModelError(f"{path} has no transformer/config.json; download the pipeline again.")
    files = SafetensorsFiles([str(p) for p in transformer_files(path)])
    encoder_config = path / "text_encoder" / "config.json"
    variant = pipeline_variant(
        path.name,
        class_name,
        read_json(config_path, TRANSFORMER_CONFIG),
        {k: i.shape for k, i in files.infos.items()},
        read_json(encoder_config, ENCODER_CONFIG) if os.path.lexists(encoder_config) else None,
    )
    return PipelineInfo(path, class_name, variant)


def dev_encoder_folder(pipeline_path: str | Path) -> Path:
    """The pipeline folder, once it is known to hold a FLUX.2 [dev] text encoder; a Klein pipeline is
    refused here, before any weight is read, rather than failing in the first sampling step."""
    info = describe_pipeline(pipeline_path)
    found = info.variant
    if found.key == "dev":
        return info.path
    raise klein_encoder_error(info.path.name, info.class_name, found)


def klein_encoder_error(name: str, class_name: str, found: Flux2Variant) -> VariantMismatchError:
    """What a user reads who picked a Klein pipeline as the [dev] text encoder source."""
    dev = variant_by_key("dev", tiny=found.tiny)
    return VariantMismatchError(
        f"{name} is a {found.name} pipeline ({class_name}). Its {found.encoder_name} text encoder gives "
        f"{found.context_in_dim}-wide conditioning, but {dev.name} needs {dev.context_in_dim} (the {dev.encoder_name} "
        f"encoder). Use this pipeline only for its VAE (with {title('Flux2DevVAESource')}: the VAE is shared); for "
        f"the text encoder choose a {dev.name} pipeline folder, or a {dev.encoder_name} encoder file or folder in "
        "models/text_encoders."
    )
