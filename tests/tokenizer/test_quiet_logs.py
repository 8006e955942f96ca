"""Warnings a user cannot act on stay out of the log: transformers' complaint about a published tokenizer
folder's class name is dropped while the pack probes the folder (and only then), and the pack's own lines stay."""

from __future__ import annotations

import logging

from helpers import run_python

WARNING = "but `tokenizer.json` is ByteLevel; loading `TokenizersBackend`"


def _probe(folder, through_the_pack: bool):
    return run_python(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO)
        folder = sys.argv[1]
        if sys.argv[2] == "pack":
            from comfyui_flux2dev.tokenizers import resolve_tokenizer
            print(resolve_tokenizer([folder]).rung)
        else:
            import transformers
            transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        """,
        folder, "pack" if through_the_pack else "transformers",
    )


def test_the_tokenizer_class_warning_is_dropped_during_the_packs_probe_only(tiny_root):
    folder = tiny_root / "diffusers" / "flux2-dev-tiny-pipeline" / "tokenizer"
    plain = _probe(folder, through_the_pack=False)
    assert plain.returncode == 0, plain.stderr
    assert WARNING in plain.stderr  # the folder does make transformers warn
    pack = _probe(folder, through_the_pack=True)
    assert pack.returncode == 0, pack.stderr
    assert WARNING not in pack.stderr
    assert pack.stdout.strip() == "transformers"


def test_the_filter_is_gone_after_the_probe(tiny_root):
    from comfyui_flux2dev.tokenizers import resolve_tokenizer

    resolve_tokenizer([tiny_root / "diffusers" / "flux2-dev-tiny-pipeline" / "tokenizer"])
    assert logging.getLogger("transformers.models.auto.tokenization_auto").filters == []
