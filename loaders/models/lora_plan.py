"""The one judge of a LoRA. From its header alone (tensor names, dtypes and shapes, its alphas, and the adapter
config PEFT writes into the metadata) and the weight shapes of the models it is given, it decides what each tensor
does, before a tensor is read or a weight patched: the layer it belongs to, the weight (and rows) that layer lands
on, the kind of adapter and the scale its trainer trained it at, or why it does not land. A LoRA that is damaged,
hostile or made for another model is refused here, naming the tensor. The LoRA node, the bake of `convert
transformer --lora` and the command line's early check all take this plan; host/lora.py turns it into the host's
patches and measures what they change. Torch-free, so the command line checks LoRAs before torch is imported."""

from __future__ import annotations

import math
import re
import struct
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ...errors import CorruptFileError, InputError, UnsupportedFormatError, WrongModelError
from ..formats.validate import NULL, Field, check_field, checked, parse_json
from . import lora_layouts
from .lora_layouts import ENCODER, TRANSFORMER, Target

Shape = tuple[int, ...]

STRENGTH_LIMIT = 100.0  # the LoRA node's strength inputs reach this far either way, as the host's LoRA loader's
FLOATS = ("F64", "F32", "F16", "BF16")  # what a LoRA's factors are stored as
# An alpha is read as one number of any numeric type (its struct format; bf16 is float32's upper half).
ALPHA_FORMATS = {"F64": "<d", "F32": "<f", "F16": "<e", "BF16": "<f", "I64": "<q", "I32": "<i", "I8": "<b", "U8": "<B"}
ALPHA = ".alpha"
MAGNITUDES = (".dora_scale", ".lora_magnitude_vector")  # DoRA's magnitudes: LyCORIS/kohya's, PEFT's
BIASES = (".diff_b", ".b_norm", ".lora_B.bias", ".lora_up.bias")  # differences of a bias
CONVOLUTION_FACTORS = (".lora_mid.weight", ".hada_t1", ".hada_t2", ".lokr_t2")  # only convolution layers have these


class ShapeFault(Exception):
    """What is wrong with the shapes of one layer's tensors (a kind's shape function raises it)."""


def _matrix(parts: Mapping[str, Shape], *roles: str) -> None:
    for role in roles:
        if len(parts[role]) != 2 or 0 in parts[role]:
            raise ShapeFault(f"its {role} is {list(parts[role])}, not a matrix")


def _product(parts: Mapping[str, Shape], left: str, right: str) -> Shape:
    """The shape of the product left @ right, both matrices of one inner size."""
    _matrix(parts, left, right)
    if parts[left][1] != parts[right][0]:
        raise ShapeFault(f"its {left} {list(parts[left])} and {right} {list(parts[right])} are not of one rank")
    return parts[left][0], parts[right][1]


def _lora(parts):
    return _product(parts, "up", "down"), parts["down"][0]


def _loha(parts):
    shape = _product(parts, "w1_a", "w1_b")
    if _product(parts, "w2_a", "w2_b") != shape:
        raise ShapeFault(f"its two products are {list(shape)} and {[parts['w2_a'][0], parts['w2_b'][1]]}")
    return shape, parts["w1_b"][0]


def _lokr(parts):
    """kron(w1, w2), each whole or a product of two factors; alpha divides by the rank of the factored one (w2's
    where both are), whole ones take no alpha."""
    factors, rank = [], None
    for w in ("w1", "w2"):
        if w in parts and (f"{w}_a" in parts or f"{w}_b" in parts):
            raise ShapeFault(f"it holds {w} both whole and as factors")
        if w in parts:
            _matrix(parts, w)
            factors.append(parts[w])
        elif f"{w}_a" in parts and f"{w}_b" in parts:
            factors.append(_product(parts, f"{w}_a", f"{w}_b"))
            rank = parts[f"{w}_b"][0]
        else:
            raise ShapeFault(f"it holds no {w} (whole, or as {w}_a and {w}_b)")
    (a, b), (c, d) = factors
    return (a * c, b * d), rank


def _full(parts):
    return parts["diff"], None


def _glora(parts):
    """W + W a1 a2 + b1 b2: a1 [in, r], a2 [r, in], b1 [out, r], b2 [r, in] (LyCORIS's current layout)."""
    inner = _product(parts, "a1", "a2")
    shape = _product(parts, "b1", "b2")
    if inner != (shape[1], shape[1]):
        raise ShapeFault(f"its a1 @ a2 is {list(inner)}, not [{shape[1]}, {shape[1]}]")
    return shape, parts["b1"][1]


def _oft(parts):
    """Rotations of the weight's rows in blocks: oft_blocks [n, b, b] (diagonal OFT) or [m, n, b, b] (butterfly
    OFT), n x b rows, with an optional rescale [rows, 1]; it keeps the weight's width, whatever that is."""
    found = parts["blocks"]
    if len(found) not in (3, 4) or found[-1] != found[-2] or 0 in found:
        raise ShapeFault(f"its oft_blocks is {list(found)}, not blocks of square rotations")
    rows = found[-3] * found[-1]
    if "rescale" in parts and tuple(parts["rescale"]) not in ((rows, 1), (rows,)):
        raise ShapeFault(f"its rescale is {list(parts['rescale'])}, not [{rows}, 1]")
    return (rows, None), None


def _set(parts):
    return parts["set_weight"], None


@dataclass(frozen=True)
class Kind:
    """One kind of layer the host's weight adapters apply: the endings of its tensors by role (one dict per way
    trainers spell them), what shape of difference its parts make and the rank its alpha divides by, whether what it
    does depends on the weight it patches, and whether DoRA may decompose it. `alpha` says what the layer's alpha is
    to the host: "rank" (scaled by alpha / rank, which PEFT's config may set), "constraint" (OFT's bound on its
    rotation, per row), or None (no alpha)."""

    name: str
    spellings: tuple[dict[str, str], ...]
    shape: Callable[[dict[str, Shape]], tuple[Shape, int | None]]
    optional: tuple[str, ...] = ()
    on_weight: bool = False
    decomposable: bool = False
    alpha: str | None = "rank"

    @property
    def endings(self) -> tuple[str, ...]:
        return tuple(end for spelling in self.spellings for end in spelling.values())


KINDS = (
    Kind("LoRA", tuple({"up": up, "down": down} for up, down in (
        (".lora_up.weight", ".lora_down.weight"),  # kohya, generic
        ("_lora.up.weight", "_lora.down.weight"),  # diffusers (old)
        (".lora_B.weight", ".lora_A.weight"),  # PEFT / diffusers
        (".lora.up.weight", ".lora.down.weight"),  # diffusers
        (".lora_B", ".lora_A"),  # mochi
        (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),  # transformers
        (".lora_B.default.weight", ".lora_A.default.weight"),  # PEFT adapters named "default"
    )), _lora, decomposable=True),
    Kind("LoHa", ({"w1_a": ".hada_w1_a", "w1_b": ".hada_w1_b", "w2_a": ".hada_w2_a", "w2_b": ".hada_w2_b"},),
         _loha, decomposable=True),
    Kind("LoKr", ({"w1": ".lokr_w1", "w2": ".lokr_w2", "w1_a": ".lokr_w1_a", "w1_b": ".lokr_w1_b",
                   "w2_a": ".lokr_w2_a", "w2_b": ".lokr_w2_b"},), _lokr,
         optional=("w1", "w2", "w1_a", "w1_b", "w2_a", "w2_b"), decomposable=True),
    Kind("full difference", ({"diff": ".diff"}, {"diff": ".w_norm"}), _full, alpha=None),
    Kind("GLoRA", ({"a1": ".a1.weight", "a2": ".a2.weight", "b1": ".b1.weight", "b2": ".b2.weight"},), _glora,
         on_weight=True),
    Kind("OFT", ({"blocks": ".oft_blocks", "rescale": ".rescale"},), _oft, optional=("rescale",), on_weight=True,
         alpha="constraint"),
    Kind("replacement", ({"set_weight": ".set_weight"},), _set, on_weight=True, alpha=None),
)

# Every ending the judge knows, longest first: what comes before a tensor's ending is its layer's name.
LORA = KINDS[0]
DOWNS = tuple(spelling["down"] for spelling in LORA.spellings)
ENDINGS = tuple(sorted({*(e for k in KINDS for e in k.endings), ALPHA, *MAGNITUDES, *BIASES, *CONVOLUTION_FACTORS},
                       key=len, reverse=True))

# Why tensors do not land, as the node says it.
UNPLACED = "naming no layer of the FLUX.2 transformer or its text encoder given"
NO_PART = "of no kind of adapter ComfyUI applies"
NO_BIAS = "bias differences, where FLUX.2 and its text encoder have no bias"
NO_PAIR = "an alpha or DoRA magnitude without the factors it scales"


@dataclass(frozen=True)
class PlannedLayer:
    """One layer of a LoRA as it will be applied: its name in the file, where it lands, its kind, its tensors (the
    kind's parts and its alpha, by the ending they are stored under), the alpha the host is to be given (scale x
    rank for a scaled kind, so that the host's alpha / rank is the trainer's scale), DoRA's magnitude (its tensor,
    and whether it is one per output row rather than per input column), and the shape of its difference."""

    name: str
    target: Target
    kind: Kind
    tensors: dict[str, str]
    alpha: float | None
    scale: float | None
    magnitude: str | None
    per_row: bool
    shape: Shape

    @property
    def names(self) -> list[str]:
        """Every tensor of the file this layer uses."""
        return [*self.tensors.values(), *([self.magnitude] if self.magnitude else [])]


@dataclass
class LoraPlan:
    """What a LoRA does to the models it was judged against: the layers that land, and every other tensor of it by
    the reason it does not."""

    path: str
    total: int
    layers: list[PlannedLayer] = field(default_factory=list)
    not_applied: dict[str, list[str]] = field(default_factory=dict)


def checked_strength(value, what: str) -> float:
    """A LoRA's strength as given on the node or the command line, refused unless it is a finite number within the
    node's range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or abs(value) > STRENGTH_LIMIT:
        raise InputError(
            f"{what} is {value!r}; a LoRA's strength is a number from {-STRENGTH_LIMIT:g} to {STRENGTH_LIMIT:g} (1 "
            "applies it as it was trained, 0 leaves the model as it is, negative values subtract it)."
        )
    return float(value)


# --- PEFT's adapter config (diffusers' save_lora_weights writes it into the metadata) ---------------------------

PEFT_METADATA = "lora_adapter_metadata"
PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8}  # LoraConfig's own defaults, which a config without the field means
_PATTERN = Field((dict, NULL), max_len=4096, required=False)
PEFT_FIELDS = {
    "peft_type": Field(str, max_len=32, required=False),
    "r": Field(int, lo=1, hi=1 << 20, required=False),
    "lora_alpha": Field((int, float), lo=-1e9, hi=1e9, required=False),
    "rank_pattern": _PATTERN,
    "alpha_pattern": _PATTERN,
    "use_rslora": Field(bool, required=False),
    "use_dora": Field(bool, required=False),
}
# Config fields with which PEFT computes something other than W + scale * B @ A (or its DoRA), at the value that
# means "not used": a LoRA with another value is refused rather than applied wrongly.
PEFT_UNUSED = {
    "fan_in_fan_out": False, "use_qalora": False, "use_bdlora": None, "alora_invocation_tokens": None,
    "target_parameters": None, "layer_replication": None,
}
_MODULE_PATTERN = re.compile(r"[\w.]+")  # the patterns PEFT and diffusers write: module names, matched as PEFT does


@dataclass(frozen=True)
class PeftConfig:
    rank: int
    alpha: float
    rank_pattern: dict
    alpha_pattern: dict
    rslora: bool
    dora: bool

    def scale(self, module: str, rank: int, where: str) -> float:
        """The scale PEFT gives the layer `module` (its name in the model PEFT wrapped), whose stored rank is `rank`."""
        expected = _by_pattern(self.rank_pattern, module, self.rank)
        if expected != rank:
            raise CorruptFileError(f"{where}: PEFT's config gives the layer rank {expected}, but its factors are of "
                                   f"rank {rank}; the file is damaged or was written wrongly.")
        alpha = _by_pattern(self.alpha_pattern, module, self.alpha)
        return alpha / (math.sqrt(rank) if self.rslora else rank)


def _by_pattern(patterns: dict, module: str, default):
    """PEFT's get_pattern_key: the first pattern that ends the module's name at a dot boundary, else the default."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _peft_configs(metadata: Mapping[str, str], path: str) -> dict[str, PeftConfig]:
    """The PEFT adapter config of each component ("transformer", "text_encoder", or "" for an unprefixed one) from
    the file's metadata, each field checked."""
    text = metadata.get(PEFT_METADATA)
    if text is None:
        return {}
    where = f"{path} (its {PEFT_METADATA}, PEFT's adapter config)"
    document = parse_json(text.encode("utf-8"), where, "config")
    if not isinstance(document, dict):
        raise CorruptFileError(f"{where} is not a JSON object; the file is damaged.")
    components: dict[str, dict] = {}
    for key, value in document.items():
        component, _, name = key.rpartition(".")
        components.setdefault(component, {})[name] = value
    configs = {}
    for component, raw in components.items():
        fields = checked(raw, PEFT_FIELDS, where, f"{component}." if component else "")
        if fields.get("peft_type", "LORA") != "LORA":
            raise UnsupportedFormatError(
                f"{where} says it is a PEFT {fields['peft_type']} adapter; the pack reads PEFT's LoRA adapters only.")
        for name, unused in PEFT_UNUSED.items():
            if fields.get(name, unused) not in (unused, None, False):
                raise UnsupportedFormatError(
                    f"{where} sets {name} to {fields[name]!r}: PEFT then computes something other than a LoRA's "
                    "difference added to the weight, which ComfyUI does not apply. Use a LoRA trained without it.")
        patterns = {}
        for name in ("rank_pattern", "alpha_pattern"):
            patterns[name] = fields.get(name) or {}
            for pattern, value in patterns[name].items():
                if not _MODULE_PATTERN.fullmatch(pattern) or len(pattern) > 256:
                    raise UnsupportedFormatError(
                        f"{where}: its {name} has the pattern {pattern[:60]!r}; the pack reads patterns that are "
                        "module names (letters, digits, '_' and '.').")
                check_field(value, PEFT_FIELDS["r" if name == "rank_pattern" else "lora_alpha"], where,
                            f"{component + '.' if component else ''}{name}[{pattern!r}]")
        configs[component] = PeftConfig(
            fields.get("r", PEFT_DEFAULTS["r"]), float(fields.get("lora_alpha", PEFT_DEFAULTS["lora_alpha"])),
            patterns["rank_pattern"], patterns["alpha_pattern"], bool(fields.get("use_rslora", False)),
            bool(fields.get("use_dora", False)))
    return configs


def _config_for(configs: dict[str, PeftConfig], layer: str) -> tuple[str, PeftConfig] | None:
    """(the component's prefix, its config) of the PEFT config that covers `layer`, if any."""
    for component, config in configs.items():
        if component and layer.startswith(component + "."):
            return component + ".", config
    return ("", configs[""]) if "" in configs else None


# --- the judge ---------------------------------------------------------------------------------------------------


def _split(name: str) -> tuple[str, str] | None:
    """(layer, ending) of a tensor's name, or None where its ending is nothing the judge knows."""
    for end in ENDINGS:
        if name.endswith(end) and len(name) > len(end):
            return name[: -len(end)], end
    return None


def _kind(layer: str, endings: set[str], path: str) -> tuple[Kind, dict[str, str]] | None:
    """The layer's kind and its parts (role -> ending), from the endings its tensors have; the pack's error for a
    layer holding parts of two kinds, or two spellings of one."""
    found = [(kind, spelling) for kind in KINDS for spelling in kind.spellings if endings & set(spelling.values())]
    if not found:
        return None
    if len(found) > 1:
        described = " and ".join(f"{kind.name} ({', '.join(sorted(endings & set(s.values())))})" for kind, s in found)
        raise CorruptFileError(f"{path}: the LoRA's layer {layer} holds {described}; a layer is one adapter, in one "
                               "spelling. The file is damaged or was merged wrongly.")
    kind, spelling = found[0]
    return kind, {role: end for role, end in spelling.items() if end in endings}


def _target_shape(shapes: Mapping[str, Mapping[str, Shape]], target: Target) -> Shape:
    shape = list(shapes[target.model][target.key])
    if target.rows is not None:
        shape[0] = target.rows[1]
    return tuple(shape)


def _fits(made: Shape, weight: Shape) -> bool:
    """Whether a difference of shape `made` is the weight's (a kind that keeps the weight's width says None)."""
    return len(made) == len(weight) and all(m is None or m == w for m, w in zip(made, weight))


class LoraHeader:
    """What the judge reads of a LoRA: its tensors' dtypes and shapes, its metadata, and a scalar's bytes."""

    def __init__(self, files):
        self.path = files.paths[0]
        self.infos = files.infos
        self.metadata = files.metadata
        self.files = files

    def number(self, name: str) -> float:
        """The one number tensor `name` holds (an alpha), refused unless it is one finite number."""
        info = self.infos[name]
        if info.dtype not in ALPHA_FORMATS or math.prod(info.shape) != 1:
            raise CorruptFileError(f"{self.path}: the LoRA's {name} is {info.dtype} {list(info.shape)}, not one "
                                   "number; the file is damaged or was written wrongly.")
        raw = self.files.read_bytes(name)
        (value,) = struct.unpack(ALPHA_FORMATS[info.dtype], b"\0\0" + raw if info.dtype == "BF16" else raw)
        if not math.isfinite(value):
            raise CorruptFileError(f"{self.path}: the LoRA's {name} is {value}, not a finite number; the file is "
                                   "damaged.")
        return float(value)


def plan_lora(header: LoraHeader, shapes: Mapping[str, Mapping[str, Shape]],
              targets: Mapping[str, Mapping[str, Target]]) -> LoraPlan:
    """What the LoRA `header` does to the models whose weights' shapes (model word -> key -> shape) and targets
    (model word -> lora_layouts.transformer_targets or encoder_targets) are given; a model not given is not looked
    in. Refused with the pack's error, naming the tensor: a damaged layer, factors that do not make the weight's
    shape, one weight given twice, a LoRA of which nothing lands."""
    path = header.path
    plan = LoraPlan(path, len(header.infos))
    configs = _peft_configs(header.metadata, path)
    layers: dict[str, dict[str, str]] = {}
    for name in sorted(header.infos):
        split = _split(name)
        if split is None:
            plan.not_applied.setdefault(NO_PART, []).append(name)
        else:
            layers.setdefault(split[0], {})[split[1]] = name
    found = lora_layouts.lookups(targets)
    misfits: list[tuple[str, str]] = []  # (a tensor of a layer shaped unlike its weight, what is wrong)
    for layer, tensors in layers.items():
        located = lora_layouts.locate(layer, found)
        if located is None:
            plan.not_applied.setdefault(UNPLACED, []).extend(tensors.values())
            continue
        prefix, target = located
        biases = [tensors.pop(end) for end in BIASES if end in tensors]
        if biases:
            plan.not_applied.setdefault(NO_BIAS, []).extend(biases)
        judged = _judge_layer(header, layer, prefix, target, tensors, shapes, configs)
        if judged is None:
            if tensors:
                plan.not_applied.setdefault(NO_PAIR, []).extend(tensors.values())
        elif isinstance(judged, str):
            misfits.extend((name, judged) for name in tensors.values())
        else:
            plan.layers.append(judged)
    for reason in plan.not_applied:
        plan.not_applied[reason].sort()
    if misfits and plan.layers:
        name, problem = misfits[0]
        raise WrongModelError(f"{path}: the LoRA's {name} {problem}. The LoRA was made for another model or written "
                              f"wrongly ({len(misfits)} of its tensors do not fit); pick one made for this model.")
    _refuse_doubles(plan)
    if not plan.layers:
        raise WrongModelError(
            f"{path} patches nothing here: none of its {plan.total} tensors lands on the "
            f"{' or the '.join(shapes) or 'nothing connected'} ({_what_it_is_for(header, plan, misfits, shapes)}). "
            "Pick a LoRA made for FLUX.2 [dev]."
        )
    return plan


def _judge_layer(header: LoraHeader, layer: str, prefix: str, target: Target, tensors: dict[str, str],
                 shapes, configs) -> PlannedLayer | str | None:
    """One layer planned; a string saying how its shape misses its weight's; None for a layer with no factors."""
    path = header.path
    where = f"{path}: the LoRA's layer {layer}"
    conv = [tensors[end] for end in CONVOLUTION_FACTORS if end in tensors]
    if conv:
        return f"is a factor of a convolution's adapter ({conv[0]}), and the layer it names is a linear one"
    found = _kind(layer, set(tensors), path)
    if found is None:
        return None
    kind, parts = found
    missing = [role for role in kind.spellings[0] if role not in parts and role not in kind.optional]
    if missing:
        present = ", ".join(tensors[end] for end in parts.values())
        raise CorruptFileError(f"{where} holds {present} but no {' or '.join(missing)} beside it; the file is damaged "
                               "or not a LoRA. Download it again.")
    infos = {role: header.infos[tensors[end]] for role, end in parts.items()}
    for role, info in infos.items():
        if info.dtype not in FLOATS:
            raise CorruptFileError(f"{where} has its {role} ({tensors[parts[role]]}) stored as {info.dtype}, not as "
                                   "floats; the file is damaged or not a LoRA.")
    try:
        made, rank = kind.shape({role: tuple(info.shape) for role, info in infos.items()})
    except ShapeFault as e:
        raise CorruptFileError(f"{where}: {e}; the file is damaged or not a LoRA.") from None
    weight = _target_shape(shapes, target)
    if not _fits(made, weight):
        return f"makes a difference of shape {[m if m else '*' for m in made]}, but the weight it names " \
               f"({target.key}{'' if target.rows is None else ', rows ' + str(target.rows)}) is {list(weight)}"
    made = weight
    alpha = header.number(tensors[ALPHA]) if ALPHA in tensors else None
    magnitudes = [tensors[end] for end in MAGNITUDES if end in tensors]
    peft = _config_for(configs, layer) if kind.name == "LoRA" else None
    scale = None
    if kind.alpha == "rank" and rank is not None:
        scale = (alpha if alpha is not None else rank) / rank
        if peft is not None:
            component, config = peft
            from_config = config.scale(layer[len(component or prefix):], rank, where)
            if alpha is not None and not math.isclose(from_config, scale, rel_tol=1e-6):
                raise CorruptFileError(f"{where} holds an alpha of {alpha:g} (scale {scale:g}), but PEFT's config "
                                       f"gives it scale {from_config:g}; the file is damaged or was merged wrongly.")
            scale = from_config
            if config.dora != bool(magnitudes):
                said = "DoRA" if config.dora else "no DoRA"
                raise CorruptFileError(f"{where}: PEFT's config says {said}, but the layer holds "
                                       f"{'no' if not magnitudes else 'a'} magnitude vector; the file is damaged.")
    host_alpha = alpha
    if scale is not None:
        host_alpha = scale * rank
    elif kind.alpha == "constraint" and alpha is not None:
        host_alpha = alpha * weight[0]  # LyCORIS bounds the rotation by constraint x rows; the host by alpha alone
    magnitude, per_row = _magnitude(header, where, kind, magnitudes, made)
    kept = {end: tensors[end] for end in parts.values()}
    if ALPHA in tensors:
        kept[ALPHA] = tensors[ALPHA]
    return PlannedLayer(layer, target, kind, kept, host_alpha, scale, magnitude, per_row, made)


def _magnitude(header: LoraHeader, where: str, kind: Kind, magnitudes: list[str], weight: Shape):
    """(DoRA's magnitude tensor, whether it has one value per output row) of a layer, checked against its weight."""
    if not magnitudes:
        return None, False
    if len(magnitudes) > 1 or not kind.decomposable:
        raise UnsupportedFormatError(f"{where} holds {', '.join(magnitudes)} on a {kind.name} layer; DoRA is read "
                                     "once per layer, on LoRA, LoHa and LoKr layers.")
    (name,) = magnitudes
    info = header.infos[name]
    shape = tuple(info.shape)
    if info.dtype not in FLOATS:
        raise CorruptFileError(f"{where} has its DoRA magnitude ({name}) stored as {info.dtype}, not as floats; the "
                               "file is damaged.")
    out, inputs = weight
    if name.endswith(".lora_magnitude_vector") and shape == (out,) or shape in ((out, 1), (out,)):
        return name, True
    if shape == (1, inputs):
        return name, False
    raise CorruptFileError(f"{where} has a DoRA magnitude ({name}) of shape {list(shape)}; its weight is [{out}, "
                           f"{inputs}], so it needs [{out}] or [{out}, 1] (per row) or [1, {inputs}] (per column). "
                           "The file is damaged or was made for another model.")


def _refuse_doubles(plan: LoraPlan) -> None:
    """One weight given twice (one layer in two spellings, or a fused weight beside its parts) is refused: which of
    them the trainer meant cannot be told."""
    seen: dict[str, list[tuple[int, int, str]]] = {}
    for layer in plan.layers:
        start, count = layer.target.rows or (0, 1 << 62)
        for other_start, other_count, other in seen.get(layer.target.key, ()):
            if start < other_start + other_count and other_start < start + count:
                raise CorruptFileError(
                    f"{plan.path}: the LoRA gives the weight {layer.target.key} twice, as {other} and as "
                    f"{layer.name}; which one its trainer meant cannot be told. Keep one of them in the file.")
        seen.setdefault(layer.target.key, []).append((start, count, layer.name))


def _what_it_is_for(header: LoraHeader, plan: LoraPlan, misfits: list, shapes) -> str:
    """A clause naming what a LoRA none of whose tensors landed was made for, as far as its names and the width of
    its layers' inputs tell."""
    family = lora_layouts.other_family(header.infos)
    if family is not None:
        return f"it is a LoRA of {family}"
    if ENCODER not in shapes and lora_layouts.names_encoder_layers(plan.not_applied.get(UNPLACED, ())):
        return "its layers are the text encoder's: connect the FLUX.2 [dev] CLIP to the node's clip input"
    if not misfits:
        return "its layers name no weight of a FLUX.2 transformer or of FLUX.2 [dev]'s Mistral text encoder"
    hidden_size = next((shape[0] for key, shape in shapes.get(TRANSFORMER, {}).items()
                        if key.endswith("img_in.weight")), None)
    widths = Counter(header.infos[name].shape[-1] for name, _ in misfits if name.endswith(DOWNS))
    width = widths.most_common(1)[0][0] if widths else None
    if width is None or width == hidden_size:
        name, problem = misfits[0]
        return f"its layers are shaped unlike the weights they name, {name} {problem}: a LoRA of another model, or " \
               "written wrongly"
    from .variants import known_variants

    models = [v.name for v in known_variants() if v.hidden_size == width]
    models += [family for family, _, family_width in lora_layouts.OTHER_FAMILIES if family_width == width]
    made_for = f": {' or '.join(models)}" if models else ""
    return f"its layers take inputs of width {width}, this transformer's are {hidden_size}; it is for another model" \
        + made_for


def check_loras(loras: list[tuple[str, float]], transformer: str) -> None:
    """Each LoRA (file, strength) judged against the transformer at `transformer` from headers alone, as the bake
    will judge it: `convert transformer --lora` refuses one before torch is imported."""
    from .transformer_layout import bfl_shapes

    _, shapes = bfl_shapes(transformer)
    targets = {TRANSFORMER: lora_layouts.transformer_targets(shapes)}
    for path, strength in loras:
        checked_strength(strength, f"The --strength of {path}")
        plan_lora(read_header(path), {TRANSFORMER: shapes}, targets)


def read_header(path: str) -> LoraHeader:
    """The LoRA file at `path`, its header read (a .safetensors file only: pickles are never opened)."""
    from ..formats.safetensors_file import SafetensorsFiles

    if not str(path).lower().endswith(".safetensors"):
        raise UnsupportedFormatError(
            f"{path}: LoRAs are read from .safetensors files only (GGUF files hold models, and pickled .pt/.ckpt/.bin "
            "files can run code when opened). Give the LoRA's .safetensors file."
        )
    return LoraHeader(SafetensorsFiles([str(path)]))
