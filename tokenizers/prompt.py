"""The FLUX.2 [dev] prompt template and its two padding modes."""

from __future__ import annotations

from .canonical import Flux2Tokenizer

SYSTEM_PROMPT = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
BOS_ID = 1
INST_ID = 3
INST_END_ID = 4
PAD_ID = 11
SYSTEM_PROMPT_ID = 17
SYSTEM_PROMPT_END_ID = 18
MAX_LENGTH = 512
IMAGE_MARKER = "[IMG]"  # removed from prompts before templating, as BFL and diffusers do

# "reference": as BFL and diffusers: truncate to 512, left-pad with <pad>, mask 0 on the pads.
# "comfy": as ComfyUI core: no padding (its model left-pads the conditioning with zeros instead).
PADDING_MODES = ("reference", "comfy")


def prompt_ids(tokenizer: Flux2Tokenizer, prompt: str, padding: str) -> tuple[list[int], list[int]]:
    """Token ids of <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]prompt[/INST] and their attention mask."""
    if padding not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    ids = [
        BOS_ID,
        SYSTEM_PROMPT_ID,
        *tokenizer.encode(SYSTEM_PROMPT),
        SYSTEM_PROMPT_END_ID,
        INST_ID,
        *tokenizer.encode(prompt.replace(IMAGE_MARKER, "")),
        INST_END_ID,
    ]
    if padding == "comfy":
        return ids, [1] * len(ids)
    ids = ids[:MAX_LENGTH]
    pads = MAX_LENGTH - len(ids)
    return [PAD_ID] * pads + ids, [0] * pads + [1] * len(ids)
