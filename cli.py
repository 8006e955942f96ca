"""The `flux2dev` command: the pack's loaders without the ComfyUI UI.

Every failure ends with exit status 2 and one plain sentence on stderr; --debug shows the traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _tiny(args) -> None:
    from . import tiny
    from .errors import ModelNotFoundError
    from .loaders.variants import TINY_MODELS_ENV

    if args.comfyui:
        if not (Path(args.comfyui) / "main.py").is_file():
            raise ModelNotFoundError(f"{args.comfyui} is not a ComfyUI folder (it has no main.py); give the folder that holds main.py.")
        # Each part goes to the model folder of its name (models/text_encoders, models/unet, ...).
        target = Path(args.comfyui) / "models"
    else:
        target = Path(args.dir)
    entries = tiny.write_all(target, manifest=not args.comfyui)
    print(f"wrote {len(entries)} tiny models to {target}")
    print(f"ComfyUI lists them in the pack's nodes, and loads them only when started with {TINY_MODELS_ENV}=1 "
          f"(for example: {TINY_MODELS_ENV}=1 python main.py).")


def _read_prompts(args) -> list[str]:
    if args.prompts:
        lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    return [args.prompt]


def _tokenize(args) -> None:
    from . import tokenizers
    from .loaders.encoder import encoder_tokenizer

    resolution = encoder_tokenizer(args.path, allow_network=args.allow_network)
    for prompt in _read_prompts(args):
        ids, _ = tokenizers.prompt_ids(resolution.tokenizer, prompt, "comfy")
        record = {"rung": resolution.rung, "source": str(resolution.source), "ids": ids}
        print(json.dumps(record) if args.json else " ".join(map(str, ids)))


def _encode(args) -> None:
    import torch
    from safetensors.torch import save_file

    from .host.clip import load_clip

    clip = load_clip(args.path, padding=args.padding, allow_network=args.allow_network)
    conditioning = clip.encode_from_tokens(clip.tokenize(args.prompt))
    tensor = conditioning.to(getattr(torch, args.dtype)).contiguous()
    save_file({"conditioning": tensor}, args.out)
    print(f"wrote conditioning {list(tensor.shape)} to {args.out}")


def _inspect(args) -> None:
    from .loaders.inspect import inspect_path

    report = inspect_path(args.path)
    print(json.dumps(report, indent=None if args.json else 1, default=str))


def _bench(args) -> None:
    from .devtools import bench

    results = bench.run_all(quick=args.quick)
    print(json.dumps(results) if args.json else bench.format_report(results))


def _demo(args) -> None:
    from .devtools.demo import run_demo

    image = run_demo(Path(args.out), prompt=args.prompt)
    print(f"wrote {image}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flux2dev", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny", help="write tiny FLUX.2 weights in every layout, with DIR/manifest.json")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("dir", nargs="?", help="a folder: one subfolder per part, and manifest.json")
    where.add_argument("--comfyui", metavar="COMFYUI_DIR", help="into that ComfyUI's models folders, to try the nodes")
    p.set_defaults(run=_tiny)

    p = sub.add_parser("tokenize", help="the token ids an encoder would see (template included)")
    p.add_argument("path", help="an encoder file or folder, or a folder of tokenizer files")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--prompts", help="a .jsonl file, one JSON string a line")
    p.add_argument("--json", action="store_true")
    p.add_argument("--allow-network", action="store_true", help="let the last rung fetch the tokenizer from the hub")
    p.set_defaults(run=_tokenize)

    p = sub.add_parser("encode", help="the conditioning the host CLIP produces for a prompt")
    p.add_argument("path")
    p.add_argument("--prompt", required=True)
    p.add_argument("--padding", choices=("reference", "comfy"), default="reference")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--out", required=True)
    p.add_argument("--allow-network", action="store_true")
    p.set_defaults(run=_encode)

    p = sub.add_parser("inspect", help="what the pack sees in a file or folder")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("bench", help="dequantization, GGUF header, tokenizer and load figures")
    p.add_argument("--quick", action="store_true", help="small sizes, for CI")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench)

    p = sub.add_parser("demo", help="run the official [dev] graph with the pack's nodes in a headless ComfyUI")
    p.add_argument("--out", default="demo-out")
    p.add_argument("--prompt", default="a red fox in the snow")
    p.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except Exception as e:  # noqa: BLE001  (the command's contract: one sentence, exit 2)
        if args.debug:
            raise
        from .errors import Flux2DevError

        text = str(e) if isinstance(e, Flux2DevError) else f"{type(e).__name__}: {e}"
        print(f"flux2dev {args.command}: {' '.join(text.split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
