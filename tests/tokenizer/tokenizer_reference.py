"""The independent reference for the tokenizer tests, run as a script under transformers 4.57
(PYTHONPATH=.venv/oldest): the HF tokenizer transformers 4.57's convert_tekken_tokenizer makes from a tekken
file (how Mistral-Small-3.1's tokenizer.json, the one BFL and diffusers load, was made), with the special
tokens passed as strings (mistral-common 1.13 hands out dicts, which that function cannot key on).

    python -P tests/tokenizer/tokenizer_reference.py TEKKEN_JSON CORPUS_JSONL OUT_DIR

writes OUT_DIR/hf/ (the tokenizer saved by transformers) and OUT_DIR/reference.json (the ids)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SYSTEM_PROMPT = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
TEMPLATE = "<s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt}[/INST]"
# Text that spells special tokens, beyond the corpus: each is checked against the reference too.
EXTRA_TEXTS = [
    "[INST]", "[/INST]", "[SYSTEM_PROMPT]x[/SYSTEM_PROMPT]", "<s>", "</s>", "<pad>", "<unk>", "[IMG]",
    "a<s>b</s>c", "[TOOL_CALLS] [AVAILABLE_TOOLS] <SPECIAL_42> <SPECIAL_999> <SPECIAL_1000>",
    "[inst] lower case [Inst]", "[ INST ]", "<<s>>", "[[INST]]", "नमस्ते दुनिया", " 12345 ", "\n\n", "  ",
]


def main(tekken: str, corpus: str, out: str) -> None:
    import transformers
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import LlamaTokenizerFast
    from transformers.integrations.mistral import MistralConverter

    if not transformers.__version__.startswith("4.57."):
        raise SystemExit(f"the reference needs transformers 4.57, this is {transformers.__version__}")
    tekkenizer = MistralTokenizer.from_file(tekken).instruct_tokenizer.tokenizer
    specials = [getattr(t["token_str"], "value", t["token_str"]) for t in tekkenizer._all_special_tokens]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update(tekkenizer._tekken_token2id_nospecial)
    converted = MistralConverter(vocab=vocab, additional_special_tokens=specials).converted()
    tokenizer = LlamaTokenizerFast(tokenizer_object=converted)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompts = [json.loads(line) for line in Path(corpus).read_text(encoding="utf-8").splitlines() if line.strip()]
    result = {
        "transformers": transformers.__version__,
        "prompts": prompts,
        "prompt_ids": [ids(p) for p in prompts],
        "template_ids": [ids(TEMPLATE.format(system=SYSTEM_PROMPT, prompt=p.replace("[IMG]", ""))) for p in prompts],
        "extra_texts": EXTRA_TEXTS,
        "extra_ids": [ids(t) for t in EXTRA_TEXTS],
    }
    tokenizer.save_pretrained(str(Path(out) / "hf"))
    (Path(out) / "reference.json").write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:])
