"""The `flux2dev` command: the pack's loaders without the ComfyUI UI (the dev tools have their own,
`python -m comfyui_flux2dev.devtools`).

Every failure ends with exit status 2 and one plain sentence on stderr; --debug shows the traceback."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .errors import Flux2DevError


def _read_prompts(args) -> list[str]:
    from .loaders.formats.files import read_prompts

    return read_prompts(args.prompts) if args.prompts else [args.prompt]


def _tokenize(args) -> None:
    from . import tokenizers
    from .loaders.models.encoder import encoder_tokenizer

    resolution = encoder_tokenizer(args.path, allow_network=args.allow_network)
    for prompt in _read_prompts(args):
        ids, mask = tokenizers.prompt_ids(resolution.tokenizer, prompt, args.padding)
        if args.json:  # the ids the encoder attends to; the left pads are what the mask's zeros stand for
            pads = mask.index(1) if 1 in mask else len(mask)
            print(json.dumps({"rung": resolution.rung, "source": str(resolution.source), "padding": args.padding,
                              "ids": ids[pads:], "mask": mask}))
        else:
            print(" ".join(map(str, ids)))


def _encode(args) -> None:
    if args.prompts and not args.cache:
        raise UsageError("--prompts fills a conditioning cache: give its folder with --cache DIR.")
    if args.prompt is not None and not args.out:
        raise UsageError("--prompt writes one conditioning file: give its name with --out FILE.")
    from .host.clip import lazy_clip

    # The weights are read on the first prompt the cache lacks, once: prompts already cached are skipped.
    clip = lazy_clip(args.path, padding=args.padding, allow_network=args.allow_network, cache=args.cache)
    if args.prompts:
        _fill_cache(clip, _read_prompts(args), args.cache)
        return
    import torch
    from safetensors.torch import save_file

    conditioning = clip.encode_from_tokens(clip.tokenize(args.prompt))
    tensor = conditioning.to(getattr(torch, args.dtype)).contiguous()
    save_file({"conditioning": tensor}, args.out)
    print(f"wrote conditioning {list(tensor.shape)} to {args.out}")


def _fill_cache(clip, prompts: list[str], folder: str) -> None:
    from .loaders.cache.store import ConditioningCache

    cache = ConditioningCache(folder)
    before = {e.path for e in cache.entries()}
    for done, prompt in enumerate(prompts, 1):
        clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)
        print(f"\rencoding: {done}/{len(prompts)} prompts", end="" if done < len(prompts) else "\n", file=sys.stderr, flush=True)
    new = len({e.path for e in cache.entries()} - before)
    print(f"{len(prompts)} prompts: {new} encoded into {folder}, the others were already cached")


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT]?)", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    """Bytes from a positive size: a number, or one followed by K, M, G or T (powers of 1024): 500M, 20G, 1.5T."""
    match = _SIZE.fullmatch(text.strip())
    size = int(float(match[1]) * _UNITS[match[2].upper()]) if match else 0
    if size <= 0:
        raise UsageError(f"{text!r} is not a size; write a positive number of bytes, or one followed by K, M, G or "
                         "T (powers of 1024), for example 500M or 20G.")
    return size


def _cache(args) -> None:
    from .loaders.cache.keys import stored_key
    from .loaders.cache.store import ConditioningCache

    limit = _size(args.max_size) if args.max_size is not None else None
    if not Path(args.dir).is_dir():
        raise UsageError(f"{args.dir} is not a folder; give a conditioning cache folder.")
    cache = ConditioningCache(args.dir)  # refused when it holds files the cache did not write
    removed = cache.prune() if args.prune else []  # entries that fail their own check: damaged or truncated
    if limit is not None:
        removed += cache.evict(limit)
    rows = []
    for entry in cache.entries():
        key = stored_key(entry.key_json, str(entry.path)) or {}
        rows.append({"file": entry.path.name, "bytes": entry.bytes, "last_used": entry.last_used,
                     "tokens": key.get("tokens"), "padding": key.get("padding"), "dtype": key.get("dtype"),
                     "device": key.get("device"), "layout": key.get("layout"),
                     "weights": (key.get("weights") or "?")[:12]})
    others = cache.others()
    if args.json:
        print(json.dumps({"entries": rows, "removed": [p.name for p in removed], "left_alone": others}))
        return
    import datetime

    for r in rows:
        used = datetime.datetime.fromtimestamp(r["last_used"]).isoformat(sep=" ", timespec="seconds")
        print(f"{r['file'][:16]}  {r['bytes'] / 2**20:8.1f} MiB  {used}  {r['tokens'] or '?':>5} tokens  {r['padding']}  "
              f"{r['dtype']}  {r['device']}  {r['layout']}  weights {r['weights']}")
    total = sum(r["bytes"] for r in rows)
    print(f"{len(rows)} entries, {total / 2**20:.1f} MiB" + (f"; removed {len(removed)}" if removed else ""))
    if others:
        print(f"{len(others)} other name(s) in the folder, not the cache's, left alone: {', '.join(others[:5])}"
              + (" ..." if len(others) > 5 else ""))


def _upsample(args) -> None:
    from .host.upsampler import upsample
    from .loaders.formats.validate import regular_file

    images = []
    if args.image:
        from PIL import Image

        for name in args.image:
            with Image.open(regular_file(name, "image")) as image:
                images.append(image.convert("RGB"))

    def progress(count: int, total: int) -> None:
        print(f"\rwriting: {count}/{total} tokens", end="", file=sys.stderr, flush=True)

    result = upsample(args.path, args.prompt, images=images, mode=args.mode, seed=args.seed, temperature=args.temperature,
                      max_new_tokens=args.max_new_tokens, cache=args.cache, on_token=None if args.json else progress)
    if not args.json:
        print(file=sys.stderr)
        print(result.text)
        return
    print(json.dumps({"text": result.text, "system_message": result.system_message, "input_ids": result.input_ids,
                      "output_ids": result.output_ids}))


def _inspect(args) -> None:
    from .loaders.models.inspect import inspect_path

    report = inspect_path(args.path)
    print(json.dumps(report, indent=None if args.json else 1, default=str))


class UsageError(Flux2DevError):
    """A command line that cannot work as given."""


def _padding_option(parser) -> None:
    from .tokenizers import PADDING_MODES

    parser.add_argument("--padding", choices=PADDING_MODES, default=PADDING_MODES[0],
                        help=f"how the prompt's tokens are laid out, as the encoder node's input (default {PADDING_MODES[0]})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flux2dev", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tokenize", help="the token ids an encoder would see (template included)")
    p.add_argument("path", help="an encoder file or folder, or a folder of tokenizer files")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--prompts", help="a .jsonl file, one JSON string a line")
    _padding_option(p)
    p.add_argument("--json", action="store_true", help="one object a prompt: rung, source, padding, the ids without the "
                   "left pads, and the attention mask (0 for each pad)")
    p.add_argument("--allow-network", action="store_true", help="let the last rung fetch the tokenizer from the hub")
    p.set_defaults(run=_tokenize)

    p = sub.add_parser("encode", help="the conditioning the host CLIP produces for a prompt, or a cache filled for many")
    p.add_argument("path")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="one prompt, written to --out")
    group.add_argument("--prompts", help="a .jsonl file, one JSON string a line: each encoded into --cache")
    p.add_argument("--cache", help="a conditioning cache folder (as the encoder node's cache input); needed with --prompts")
    _padding_option(p)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="of the --out file")
    p.add_argument("--out")
    p.add_argument("--allow-network", action="store_true")
    p.set_defaults(run=_encode)

    from .tokenizers.chat import MODES as UPSAMPLE_MODES

    p = sub.add_parser("upsample", help="rewrite a prompt with the encoder's own Mistral-Small weights, as Black Forest Labs "
                       "recommends for FLUX.2 [dev] (a whole model: all 40 layers and lm_head)")
    p.add_argument("path", help="a whole Mistral-Small-3.x checkpoint: a Hugging Face folder, a [dev] pipeline or its "
                   "text_encoder/, consolidated.safetensors, or a llama.cpp .gguf")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", help="a reference image for an edit (repeat for several; they are "
                   "joined side by side, as the reference does)")
    p.add_argument("--mode", choices=UPSAMPLE_MODES, default=UPSAMPLE_MODES[0], help="auto (the default): an edit when "
                   "images are given, else text to image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.15, help="0 for greedy (default 0.15, the reference's)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--cache", help="a conditioning cache folder: a prompt upsampled before is served from it")
    p.add_argument("--json", action="store_true", help="one object: text, system_message, input_ids (the whole chat "
                   "prompt as fed to the model) and output_ids (what the model wrote)")
    p.set_defaults(run=_upsample)

    p = sub.add_parser("cache", help="list a conditioning cache folder, and prune it")
    p.add_argument("dir")
    p.add_argument("--prune", action="store_true", help="delete entries that fail their check (damaged or truncated)")
    p.add_argument("--max-size", help="delete least recently used entries until they take at most this: a positive number of "
                   "bytes, or one followed by K, M, G or T (powers of 1024), e.g. 20G")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_cache)

    p = sub.add_parser("inspect", help="what the pack sees in a file or folder")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_inspect)

    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and run one command under the command line's contract: a model path is looked at first, and any
    failure is one sentence on stderr and exit status 2 (--debug: the traceback)."""
    args = parser.parse_args(argv)
    try:
        if getattr(args, "path", None):  # a bad file is refused here, before torch and the host are imported
            from .loaders.formats.files import first_look

            first_look(args.path)
        args.run(args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001  (the command's contract: one sentence, exit 2; a Rust panic too)
        if args.debug:
            raise
        if isinstance(e, Flux2DevError):
            text = str(e)
        else:  # a fault of the pack, not of the user's file: no Python type or traceback, but how to report it
            text = (f"the pack failed unexpectedly ({e}); this is a bug of the pack, not of your file. Run the same "
                    "command with --debug and report what it prints.")
        print(f"{parser.prog} {args.command}: {' '.join(text.split())}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
