"""The FLUX.2 [dev] prompt template and its two padding modes."""

from __future__ import annotations

import re
from collections.abc import Callable

from .vocab import V3_SPECIAL_TOKENS

SYSTEM_PROMPT = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
# The template's markers, each one special token, and their ids (their place among the special tokens of every
# Mistral-Small-3.x vocabulary): the tokenizer's self-test requires each to encode as exactly its id.
BOS, SYSTEM_OPEN, SYSTEM_CLOSE, INST_OPEN, INST_CLOSE, PAD = (
    "<s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]", "<pad>")
TEMPLATE_MARKERS = {marker: V3_SPECIAL_TOKENS.index(marker)
                    for marker in (BOS, SYSTEM_OPEN, SYSTEM_CLOSE, INST_OPEN, INST_CLOSE, PAD)}
BOS_ID, SYSTEM_PROMPT_ID, SYSTEM_PROMPT_END_ID, INST_ID, INST_END_ID, PAD_ID = TEMPLATE_MARKERS.values()
MAX_LENGTH = 512
IMAGE_MARKER = "[IMG]"  # removed from prompts before templating, as BFL and diffusers do

# "reference": as BFL and diffusers: [IMG] removed, truncate to 512, left-pad with <pad>, mask 0 on the pads.
# "comfy": the ids ComfyUI's own FLUX.2 tokenizer gives: no padding (its model left-pads the conditioning
# with zeros instead), [IMG] kept as its id, and the host's prompt syntax applied (below).
PADDING_MODES = ("reference", "comfy")

# ComfyUI tokenizes the template as text (markers become their ids) through its generic prompt tokenizer,
# in pieces its prompt syntax decides. Inside ComfyUI the host adapter hands over the running release's own
# pieces; without a host, these are those of current releases (0.33): "\(" and "\)" lose the backslash that
# escapes the weight syntax, and a new piece starts at each "embedding:" that follows whitespace.
COMFY_TEMPLATE = SYSTEM_OPEN + SYSTEM_PROMPT + SYSTEM_CLOSE + INST_OPEN + "{}" + INST_CLOSE
COMFY_EMBEDDING_MARK = "embedding:"
Pieces = Callable[[str], list[str]]  # prompt -> the texts ComfyUI tokenizes, the template included


def comfy_pieces(prompt: str) -> list[str]:
    text = COMFY_TEMPLATE.format(prompt)
    # The host's escape and unescape, in its order: placeholders keep the two replacements apart.
    text = text.replace("\\)", "\0\1").replace("\\(", "\0\2").replace("\0\1", ")").replace("\0\2", "(")
    first, *rest = re.split(r"(?<=\s)" + re.escape(COMFY_EMBEDDING_MARK), text)
    return [p for p in (first, *(COMFY_EMBEDDING_MARK + r for r in rest)) if p]


def prompt_ids(tokenizer, prompt: str, padding: str, pieces: Pieces = comfy_pieces) -> tuple[list[int], list[int]]:
    """Token ids of <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]prompt[/INST] and their attention mask, by the
    canonical tokenizer (canonical.Flux2Tokenizer); in comfy mode, of the pieces `pieces` gives."""
    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    if padding == "comfy":
        ids = [BOS_ID, *(i for piece in pieces(prompt) for i in tokenizer.encode(piece))]
        return ids, [1] * len(ids)
    system = tokenizer.encode(SYSTEM_PROMPT)
    room = MAX_LENGTH - len(system) - 4  # what the cut at MAX_LENGTH leaves of the prompt: no more is tokenized
    ids = [
        BOS_ID,
        SYSTEM_PROMPT_ID,
        *system,
        SYSTEM_PROMPT_END_ID,
        INST_ID,
        *tokenizer.encode(prompt.replace(IMAGE_MARKER, ""), limit=max(room, 0)),
        INST_END_ID,
    ][:MAX_LENGTH]
    ids = [PAD_ID] * (MAX_LENGTH - len(ids)) + ids
    return ids, left_padding_mask(ids)


def left_padding_mask(ids, pad_id: int = PAD_ID) -> list[int]:
    """1 for real tokens, 0 for the run of pad ids a sequence starts with (left padding): prompt_ids's mask,
    found again from the ids alone (the host hands its encoder the ids without the mask)."""
    ids = [int(t) for t in ids]
    pads = next((i for i, t in enumerate(ids) if t != pad_id), len(ids))
    return [0] * pads + [1] * (len(ids) - pads)
