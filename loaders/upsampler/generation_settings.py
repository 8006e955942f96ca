"""Prompt upsampling's generation settings and their bounds, checked before anything heavy is imported (the
command line refuses a bad setting before torch loads)."""

from __future__ import annotations

import math

from ...errors import InputError
from ...tokenizers.chat import MAX_CHAT_TOKENS

# The generation settings' bounds (inclusive), stated in the errors and in the node's inputs: torch.Generator's
# seeds, the node's temperature range, and the chat's own length for the tokens written (the KV cache holds them).
LIMITS = {"seed": (0, 2**64 - 1), "temperature": (0.0, 2.0), "max_new_tokens": (1, MAX_CHAT_TOKENS)}
WHOLE_NUMBERS = ("seed", "max_new_tokens")  # the others take any number


def check_settings(**settings) -> None:
    """Refuse a generation setting outside LIMITS (nan and infinity among them), naming its bounds."""
    for name, value in settings.items():
        lo, hi = LIMITS[name]
        whole = name in WHOLE_NUMBERS
        number = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and lo <= value <= hi):
            kind = "a whole number" if whole else "a number"
            raise InputError(f"{name} is {value!r}; it must be {kind} from {lo} to {hi}.")
