"""`python -m comfyui_flux2dev.devtools VERB`: what only developers run, beside the pack's own `flux2dev`
command and under the same contract (one sentence and exit status 2 on failure, --debug for the traceback).
The dev tools are in a clone (and an editable install) only; a wheel of the pack leaves them out."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from ..cli import Parser, UsageError, run

PROG = "python -m comfyui_flux2dev.devtools"
# Verbs that are programs of their own, with their own options: VERB -> module (whose main takes argv).
PROGRAMS = {
    "fuzz": ("fuzz.harness", "mutation fuzzing of every parser and loader entry point"),
    "workflows": ("example_workflows", "write the example workflows (UI and API form) from their definitions"),
    "screenshot": ("frontend", "the pictures in docs/ of the frontend and the templates' thumbnails"),
    "gpu-check": ("gpu_check", "the GPU check's steps (measure, sample, report); devtools/gpu-check runs them all"),
}


def _tiny(args) -> None:
    from . import tiny
    from .tiny.geometry import DECLARATION

    if not args.comfyui:
        entries = tiny.write_all(args.dir)
        print(f"wrote {len(entries)} tiny models to {args.dir}, with {Path(args.dir) / tiny.MANIFEST}")
        return
    if not (Path(args.comfyui) / "main.py").is_file():
        raise UsageError(f"{args.comfyui} is not a ComfyUI folder (it has no main.py); give the folder that holds "
                         "main.py.")
    written = tiny.write_into_comfyui(args.comfyui)
    declaration = next(p for p in written if p.name == DECLARATION)
    print("wrote the tiny models into a folder of their own in each model folder:")
    print("\n".join(f"  {p}" for p in written if p.is_dir()))
    print("and the pack's example workflows in their tiny form (256x256, 2 steps) into the user's workflows:")
    print("\n".join(f"  {p.name}" for p in written if p.suffix == ".json" and p != declaration))
    print(f"ComfyUI lists them in the pack's nodes, and loads them only when started with FLUX2DEV_TINY_MODELS naming "
          f"their declaration: FLUX2DEV_TINY_MODELS={declaration.resolve()} python main.py")


def _bench(args) -> None:
    import json

    if args.real:
        from .bench.real_size import bench_real, format_real

        result = bench_real(args.real)
        print(json.dumps(result) if args.json else format_real(result))
        return
    from . import bench

    results = bench.run_all(quick=args.quick)
    print(json.dumps(results) if args.json else bench.format_report(results))


def _demo(args) -> None:
    from .demo import run_demo

    print(f"wrote {run_demo(Path(args.out), prompt=args.prompt)}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny", help="write tiny FLUX.2 weights in every layout, with DIR/manifest.json")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("dir", nargs="?", help="a folder: one subfolder per part, and manifest.json")
    where.add_argument("--comfyui", metavar="COMFYUI_DIR", help="into that ComfyUI's models folders, to try the nodes")
    p.set_defaults(run=_tiny)

    p = sub.add_parser("bench", help="dequantization (alone; in a CPU forward pass against the copy ceiling, gguf's "
                       "numpy and ComfyUI-GGUF, as the machine is and beside a memory-bound process; under load), GGUF "
                       "header, tokenizer, load, conditioning cache, refusal and long-prompt figures, GGUF "
                       "quantization, a conversion's memory, and prompt upsampling beside transformers' generate")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--quick", action="store_true", help="small sizes, for CI")
    where.add_argument("--real", metavar="DIR", help="the text encoder and the transformer at FLUX.2 [dev]'s real size "
                       "beside the host's and ComfyUI-GGUF's loaders, their files written once into DIR (about 120 GB; "
                       "takes hours)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench)

    p = sub.add_parser("demo", help="run the official [dev] graph with the pack's nodes in a headless ComfyUI")
    p.add_argument("--out", default="demo-out")
    p.add_argument("--prompt", default="a red fox in the snow")
    p.set_defaults(run=_demo)

    for verb, (_, what) in PROGRAMS.items():  # listed here; main hands their options to them
        sub.add_parser(verb, help=f"{what} (its own options: {verb} --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PROGRAMS:
        return importlib.import_module(f".{PROGRAMS[argv[0]][0]}", __package__).main(argv[1:]) or 0
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
