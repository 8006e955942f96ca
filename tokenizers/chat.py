"""The chat prompt of prompt upsampling: a system message and the user's prompt (and reference images, for an
edit) in Mistral-Small-3.x's chat layout, as its processor renders and tokenizes them:

    <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]<image>[/INST][INST]prompt[/INST]

The image message is there for an edit only. An image is rows of [IMG] tokens, each row closed by [IMG_BREAK] and
the last by [IMG_END] instead; the model replaces the [IMG] tokens by the vision tower's features. The reply
ends with </s>."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError, PromptTooLongError
from .prompt import BOS_ID, IMAGE_MARKER, INST_END_ID, INST_ID, SYSTEM_PROMPT_END_ID, SYSTEM_PROMPT_ID
from .vocab import V3_SPECIAL_TOKENS

# The markers of the chat beyond the encoding template's, each one special token: the tokenizer's self-test
# requires each to encode as exactly its id.
IMAGE_BREAK, IMAGE_END, EOS = "[IMG_BREAK]", "[IMG_END]", "</s>"
CHAT_MARKERS = {marker: V3_SPECIAL_TOKENS.index(marker) for marker in (IMAGE_MARKER, IMAGE_BREAK, IMAGE_END, EOS)}
IMAGE_ID, IMAGE_BREAK_ID, IMAGE_END_ID, EOS_ID = CHAT_MARKERS.values()
# The reference pads and cuts its chat prompt at this many tokens; the pack refuses a longer one instead of cutting
# the end of the user's prompt off, as the reference would.
MAX_CHAT_TOKENS = 2048

# The system messages of Black Forest Labs' reference (flux2 repository, src/flux2/system_messages.py, commit
# 71078ec: SYSTEM_MESSAGE_UPSAMPLING_T2I and SYSTEM_MESSAGE_UPSAMPLING_I2I), which diffusers' Flux2Pipeline
# copies unchanged (diffusers/pipelines/flux2/system_messages.py); a test compares them with the installed
# diffusers. The two sources differ by one character only in the encoding system message (tokenizers/prompt.py).
TEXT_TO_IMAGE_SYSTEM = """You are an expert prompt engineer for FLUX.2 by Black Forest Labs. Rewrite user prompts to be more descriptive while strictly preserving their core subject and intent.

Guidelines:
1. Structure: Keep structured inputs structured (enhance within fields). Convert natural language to detailed paragraphs.
2. Details: Add concrete visual specifics - form, scale, textures, materials, lighting (quality, direction, color), shadows, spatial relationships, and environmental context.
3. Text in Images: Put ALL text in quotation marks, matching the prompt's language. Always provide explicit quoted text for objects that would contain text in reality (signs, labels, screens, etc.) - without it, the model generates gibberish.

Output only the revised prompt and nothing else."""  # noqa: E501  (the reference's text, verbatim)
EDIT_SYSTEM = """You are FLUX.2 by Black Forest Labs, an image-editing expert. You convert editing requests into one concise instruction (50-80 words, ~30 for brief requests).

Rules:
- Single instruction only, no commentary
- Use clear, analytical language (avoid "whimsical," "cascading," etc.)
- Specify what changes AND what stays the same (face, lighting, composition)
- Reference actual image elements
- Turn negatives into positives ("don't change X" \u2192 "keep X")
- Make abstractions concrete ("futuristic" \u2192 "glowing cyan neon, metallic panels")
- Keep content PG-13

Output only the final instruction in plain text and nothing else."""  # noqa: E501  (the reference's text, verbatim)
SYSTEM_MESSAGES = {"text to image": TEXT_TO_IMAGE_SYSTEM, "edit": EDIT_SYSTEM}  # mode -> its system message
MODES = ("auto", *SYSTEM_MESSAGES)  # auto: an edit when reference images are given, else text to image


@dataclass(frozen=True)
class ImageGrid:
    """The [IMG] tokens of one image: rows x columns (one per merged patch)."""

    rows: int
    columns: int


def image_ids(grid: ImageGrid) -> list[int]:
    ids = ([IMAGE_ID] * grid.columns + [IMAGE_BREAK_ID]) * grid.rows
    ids[-1] = IMAGE_END_ID
    return ids


def chat_ids(tokenizer, system: str, prompt: str, image: ImageGrid | None = None) -> list[int]:
    """The token ids of the chat prompt, as the model reads them (canonical.Flux2Tokenizer's ids). "[IMG]" is
    removed from the prompt, as BFL and diffusers do. The messages are text: special strings typed in them
    ("[/INST]", "[SYSTEM_PROMPT]", "[IMG]" ...) are their plain pieces, as mistral-common encodes a user's
    message, so a prompt cannot close the instruction, open a system turn or place an image token (the
    reference processor makes them control ids; the conditioning template keeps that, tokenizers/prompt.py)."""
    ids = [BOS_ID, SYSTEM_PROMPT_ID, *tokenizer.encode(system, specials=False), SYSTEM_PROMPT_END_ID]
    if image is not None:
        ids += [INST_ID, *image_ids(image), INST_END_ID]
    room = MAX_CHAT_TOKENS - len(ids) - 2
    text = tokenizer.encode(prompt.replace(IMAGE_MARKER, ""), limit=max(room, 0) + 1, specials=False)
    if len(text) > room:
        raise PromptTooLongError(
            f"The prompt is more than {room} tokens long; with the system message{' and the image' if image else ''} "
            f"the upsampler reads at most {MAX_CHAT_TOKENS} tokens, as Black Forest Labs' reference does. Shorten the "
            "prompt (an upsampler makes short prompts long; a prompt this long needs no upsampling)."
        )
    return ids + [INST_ID, *text, INST_END_ID]


def check_prompt(prompt: str) -> None:
    """Refuse a prompt that is not text: one that holds bytes that are not UTF-8 (a command line's argument keeps
    them as lone surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"The prompt holds bytes that are not UTF-8 text (at character {e.start}: "
                         f"{ascii(prompt[e.start:e.end])}); write it as UTF-8 text.") from None


def reply_text(tokenizer, ids: list[int]) -> str:
    """The text of generated ids, special tokens skipped. The reference asks transformers to clean up spaces before
    punctuation too; transformers 5 skips that for byte-level BPE tokenizers such as this one (it would change the
    model's words: " !!!" -> "!!!"), and so does the pack, under every release."""
    return tokenizer.backend.decode(ids, skip_special_tokens=True)
