"""The `flux2dev` command: the pack's loaders without the ComfyUI UI (the dev tools have their own,
`python -m comfyui_flux2dev.devtools`).

Every failure ends with exit status 2 and one plain sentence on stderr; --debug shows the traceback."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from pathlib import Path

from .errors import Flux2DevError, InputError


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

    with torch.inference_mode():  # as ComfyUI runs a node: each layer's weight then goes into one scratch buffer
        conditioning = clip.encode_from_tokens(clip.tokenize(args.prompt))
    tensor = conditioning.to(getattr(torch, args.dtype)).contiguous()
    save_file({"conditioning": tensor}, args.out)
    print(f"wrote conditioning {list(tensor.shape)} to {args.out}")


def _fill_cache(clip, prompts: list[str], folder: str) -> None:
    import torch

    from .loaders.cache.store import ConditioningCache

    cache = ConditioningCache(folder)
    before = {e.path for e in cache.entries()}
    for done, prompt in enumerate(prompts, 1):
        with torch.inference_mode():  # as in _encode
            clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)
        print(f"\rencoding: {done}/{len(prompts)} prompts", end="" if done < len(prompts) else "\n", file=sys.stderr,
              flush=True)
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
        print(f"{r['file'][:16]}  {r['bytes'] / 2**20:8.1f} MiB  {used}  {r['tokens'] or '?':>5} tokens  "
              f"{r['padding']}  {r['dtype']}  {r['device']}  {r['layout']}  weights {r['weights']}")
    total = sum(r["bytes"] for r in rows)
    print(f"{len(rows)} entries, {total / 2**20:.1f} MiB" + (f"; removed {len(removed)}" if removed else ""))
    if others:
        print(f"{len(others)} other name(s) in the folder, not the cache's, left alone: {', '.join(others[:5])}"
              + (" ..." if len(others) > 5 else ""))


def _upsample(args) -> None:
    from .loaders.upsampler.generation_settings import check_settings
    from .tokenizers.chat import check_prompt

    # a bad setting, prompt or image file is refused at once, before torch and the host are imported (upsample
    # checks the settings again); the images are decoded once, joined at the size the model sees
    check_settings(seed=args.seed, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    check_prompt(args.prompt)
    images = args.image or []
    if images and args.mode != "text to image":
        from .loaders.upsampler.images import reference_image

        images = [reference_image(images)]
    from .host.upsampler import upsample

    def progress(count: int, total: int) -> None:
        print(f"\rwriting: {count}/{total} tokens", end="", file=sys.stderr, flush=True)

    result = upsample(args.path, args.prompt, images=images, mode=args.mode, seed=args.seed,
                      temperature=args.temperature, max_new_tokens=args.max_new_tokens, cache=args.cache,
                      on_token=None if args.json else progress)
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


def _progress(what: str):
    """A progress listener printing "what: done/total" on one line of stderr."""
    from .loaders.models import progress

    def show(done: int, total: int) -> None:
        print(f"\r{what}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return progress.listening(show)


def _check_output(args, suffix: str) -> None:
    """OUT refused here, before torch is imported, where a conversion could not write it (the converter checks
    it again for its library callers)."""
    from .loaders.convert.output import check_not_source, check_output

    check_not_source(check_output(args.out, force=args.force, suffix=suffix), args.path)


def _convert_encoder(args) -> None:
    suffix = Path(args.out).suffix.lower()
    other = "dtype" if suffix == ".gguf" else "type"  # --dtype chooses a .safetensors file's weights, --type a .gguf's
    if getattr(args, other) is not None:
        raise InputError(f"--{other} does not apply to a {suffix or 'extensionless'} OUT: a .safetensors encoder takes "
                         "--dtype bf16|fp8, a .gguf one --type (Q8_0, Q4_K_M ...).")
    _check_output(args, ".gguf" if suffix == ".gguf" else ".safetensors")
    if suffix == ".gguf" and args.type is None:
        raise InputError("a .gguf encoder needs --type (Q8_0, Q6_K, Q5_K_M, Q4_K_M, ... BF16 or F16).")
    from .loaders.models.encoder import plan_encoder

    plan_encoder(args.path)  # the source refused from its headers, before torch is imported (planned again)
    _check_type(args)
    if suffix == ".gguf":
        from .loaders.convert.encoder_gguf import convert_encoder_gguf

        with _progress("writing the encoder, weights"):
            done = convert_encoder_gguf(args.path, args.out, qtype=args.type, force=args.force)
        types = ", ".join(f"{n} {t}" for t, n in done["types"].items())
        print(f"wrote {done['path']}: {done['tensors']} tensors ({types}), {done['bytes'] / 2**20:.1f} MiB, "
              f"from a {done['layout']} encoder")
        return
    from .loaders.convert.encoder import convert_encoder

    with _progress("writing the encoder, weights"):
        done = convert_encoder(args.path, args.out, dtype=args.dtype or "bf16", force=args.force)
    print(f"wrote {done['path']}: {done['tensors']} tensors ({done['fp8_layers']} fp8 layers), "
          f"{done['bytes'] / 2**20:.1f} MiB, from a {done['layout']} encoder")


class _Lora(argparse.Action):
    """--lora FILE appends (FILE, 1.0); --strength S sets the strength of the --lora before it."""

    def __call__(self, parser, namespace, value, option_string=None):
        loras = getattr(namespace, "loras", None) or []
        if option_string == "--lora":
            loras.append((value, 1.0))
        elif not loras:
            raise argparse.ArgumentError(self, "sets the strength of the --lora before it; give --lora FILE first")
        else:
            try:
                loras[-1] = (loras[-1][0], float(value))
            except ValueError:
                raise argparse.ArgumentError(self, f"{value!r} is not a number") from None
        namespace.loras = loras


def _convert_transformer(args) -> None:
    from .loaders.models.transformer import plan_transformer

    _check_output(args, ".gguf")
    plan_transformer(args.path)  # the source refused from its headers, before torch is imported (planned again)
    bake = None
    if args.loras:  # each LoRA is judged against the transformer's headers here, before torch is imported
        from .loaders.models.lora_plan import check_loras

        check_loras(args.loras, args.path)
        from .host.lora_bake import LoraBake

        bake = LoraBake(args.loras)
    _check_type(args)
    from .loaders.convert.transformer import convert_transformer

    with _progress("writing the transformer, tensors"):
        done = convert_transformer(args.path, args.out, qtype=args.type, force=args.force, patch=bake)
    types = ", ".join(f"{n} {t}" for t, n in done["types"].items())
    baked = f", {len(args.loras)} LoRA(s) baked in" if args.loras else ""
    print(f"wrote {done['path']}: {done['tensors']} tensors ({types}){baked}, {done['bytes'] / 2**20:.1f} MiB, "
          f"from a {done['layout']} FLUX.2 {done['variant']} transformer")
    if bake is not None:
        from .host.lora_bake import summary

        for one in bake.baked:
            print(summary(one))


def _compare(args) -> None:
    from .loaders.formats.files import first_look
    from .loaders.models.inspect import check_comparable

    first_look(args.other)
    check_comparable(args.path, args.other)  # from the headers, before torch is imported and any weight compared
    from .loaders.convert.identity import compare_weights, weights_at

    a, b = weights_at(args.path), weights_at(args.other)
    prompts = _read_prompts(args) if args.prompts else None
    if a.kind in ("encoder", "transformer"):  # the figures run the models: the host is needed, so it is found first
        from .host import ensure_comfy

        ensure_comfy()
    with _progress("comparing weights"):
        identity = compare_weights(a, b)
    report = {"kind": a.kind, "a": {"path": a.path, **a.description, "digest": a.digest},
              "b": {"path": b.path, **b.description, "digest": b.digest}, "identity": identity}
    if a.kind == "encoder":
        from .host.parity import PROMPTS, encoder_parity

        with _progress("encoding the prompts"):
            report["parity"] = encoder_parity(a.path, b.path, prompts or list(PROMPTS))
    elif a.kind == "transformer":
        from .host.parity import transformer_parity

        with _progress("running the transformers"):
            report["parity"] = transformer_parity(a.path, b.path)
    if args.json:
        print(json.dumps(report, allow_nan=False))  # strict JSON: an undefined figure is null
    else:
        print(_compare_text(report))


def _figure(value: float | None, spec: str) -> str:
    return "undefined" if value is None else format(value, spec)


def _compare_text(report: dict) -> str:
    lines = []
    for side in ("a", "b"):
        r = report[side]
        details = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("path", "digest"))
        lines.append(f"{side.upper()}: {r['path']} ({report['kind']}, {details}); weights digest {r['digest'][:16]}")
    identity = report["identity"]
    lines.append("identity: " + ", ".join(f"{n} {v}" for v, n in identity["counts"].items()))
    lines.append(f"  {identity['summary']}")
    differ = [t for t in identity["tensors"] if t["verdict"] not in ("identical", "equal after dequantization",
                                                                    "B is a cast of A", "A is a cast of B")]
    for t in differ[:10]:
        extra = f" (max abs {_figure(t['max_abs'], '.3g')}, rel L2 {_figure(t['rel_l2'], '.3g')})" \
            if "max_abs" in t else ""
        lines.append(f"  {t['verdict']}: {t['name']}{extra}")
    if len(differ) > 10:
        lines.append(f"  ... and {len(differ) - 10} more (--json lists every tensor)")
    parity = report.get("parity")
    if parity:
        lines.append(f"{parity['what']}:")
        first = "prompt" if "prompt" in parity["rows"][0] else "timestep"
        lines.append(f"  {first:<42} {'cosine':>12} {'rel L2':>10} {'max abs':>10}")
        for r in parity["rows"]:
            label = r[first] if first == "timestep" else json.dumps(r[first], ensure_ascii=False)
            label = str(label)[:40] + ("..." if len(str(label)) > 40 else "")
            if "cosine" in r:
                lines.append(f"  {label:<42} {_figure(r['cosine'], '.8f'):>12} {_figure(r['rel_l2'], '.3g'):>10} "
                             f"{_figure(r['max_abs'], '.3g'):>10}")
            else:
                lines.append(f"  {label:<42} token counts differ: {r['shapes']}")
        worst = parity["worst"]
        if worst is not None:
            label = worst[first] if first == "timestep" else json.dumps(worst[first], ensure_ascii=False)
            lines.append(f"  worst: {label} (cosine {_figure(worst['cosine'], '.8f')})")
    shown = differ[:10] + (parity["rows"] if parity else [])
    if any(r.get(k, 0) is None for r in shown for k in ("cosine", "rel_l2", "max_abs")):
        lines.append("undefined: the figure has no value (a cosine where an output is all zeros, a rel L2 where A's "
                     "values are, any figure where values are NaN or infinite)")
    return "\n".join(lines)


class UsageError(Flux2DevError):
    """A command line that cannot work as given."""


def _padding_option(parser) -> None:
    from .tokenizers import PADDING_MODES

    parser.add_argument("--padding", choices=PADDING_MODES, default=PADDING_MODES[0],
                        help="how the prompt's tokens are laid out, as the encoder node's input (default "
                        f"{PADDING_MODES[0]})")


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one sentence on stderr and exit status 2 as every other refusal of the
    command line, pointing at --help instead of printing the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flux2dev", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tokenize", help="the token ids an encoder would see (template included)")
    p.add_argument("path", help="an encoder file or folder, or a folder of tokenizer files")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--prompts", help="a .jsonl file, one JSON string a line")
    _padding_option(p)
    p.add_argument("--json", action="store_true", help="one object a prompt: rung, source, padding, the ids without "
                   "the left pads, and the attention mask (0 for each pad)")
    p.add_argument("--allow-network", action="store_true", help="let the last rung fetch the tokenizer from the hub")
    p.set_defaults(run=_tokenize)

    p = sub.add_parser("encode", help="the conditioning the host CLIP produces for a prompt, or a cache filled for "
                       "many")
    p.add_argument("path")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="one prompt, written to --out")
    group.add_argument("--prompts", help="a .jsonl file, one JSON string a line: each encoded into --cache")
    p.add_argument("--cache", help="a conditioning cache folder (as the encoder node's cache input); needed with "
                   "--prompts")
    _padding_option(p)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="of the --out file")
    p.add_argument("--out")
    p.add_argument("--allow-network", action="store_true")
    p.set_defaults(run=_encode)

    from .tokenizers.chat import MODES as UPSAMPLE_MODES

    p = sub.add_parser("upsample", help="rewrite a prompt with the encoder's own Mistral-Small weights, as Black "
                       "Forest Labs recommends for FLUX.2 [dev] (a whole model: all 40 layers and lm_head)")
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
    p.add_argument("--max-size", help="delete least recently used entries until they take at most this: a positive "
                   "number of bytes, or one followed by K, M, G or T (powers of 1024), e.g. 20G")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_cache)

    p = sub.add_parser("inspect", help="what the pack sees in a file or folder")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_inspect)

    _convert_commands(sub)
    return parser


class _WrittenTypes:
    """convert's --type names (presets.written_types()): they come from the table of GGUF types, which imports torch,
    so the help lists them when shown and _check_type checks a --type after the torch-free refusals."""

    def __str__(self) -> str:
        from .loaders.convert.presets import written_types

        return ", ".join(written_types())


def _check_type(args) -> None:
    from .loaders.convert.presets import written_types

    if args.type is not None and args.type not in written_types():
        raise InputError(f"--type {args.type} is not a type convert writes; use one of {_WrittenTypes()}.")


def _convert_commands(sub) -> None:
    convert = sub.add_parser("convert", help="write an encoder or a transformer in another form")
    kinds = convert.add_subparsers(dest="kind", required=True)
    p = kinds.add_parser("encoder", help="a text encoder as ComfyUI's single file (bf16 or scaled fp8) or as a "
                         "llama.cpp GGUF of the 30 layers FLUX.2 reads")
    p.add_argument("path", help="the encoder: any layout the encoder loader reads")
    p.add_argument("out", help="the .safetensors or .gguf file to write")
    p.add_argument("--dtype", choices=("bf16", "fp8"), help="of a .safetensors OUT (default bf16)")
    p.add_argument("--type", metavar="TYPE", help="of a .gguf OUT: %(written)s; the llama.cpp preset "
                   "(docs/convert.md lists each tensor's type)").written = _WrittenTypes()
    p.add_argument("--force", action="store_true", help="replace what is at OUT (never written through a link)")
    p.set_defaults(run=_convert_encoder, command="convert encoder")
    p = kinds.add_parser("transformer", help="a transformer as GGUF, optionally with LoRAs baked in")
    p.add_argument("path", help="the transformer: a BFL file (bf16 or scaled fp8), a diffusers transformer folder or a "
                   "pipeline")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", metavar="TYPE", required=True, help="the type of the weights: %(written)s (the README "
                   "lists what stays unquantized)").written = _WrittenTypes()
    p.add_argument("--lora", action=_Lora, dest="loras", metavar="FILE",
                   help="a LoRA (.safetensors, in any layout the Load FLUX.2 LoRA node reads) baked in; repeat for "
                   "more (needs ComfyUI)")
    p.add_argument("--strength", action=_Lora, dest="loras", metavar="S",
                   help="the strength of the --lora before it (default 1)")
    p.add_argument("--force", action="store_true", help="replace what is at OUT (never written through a link)")
    p.set_defaults(run=_convert_transformer, command="convert transformer", loras=[])

    p = sub.add_parser("compare", help="what two encoders, transformers or VAEs are to each other, tensor by tensor "
                       "and by output")
    p.add_argument("path", help="A")
    p.add_argument("other", help="B")
    p.add_argument("--prompts", help="encoders: a .jsonl file, one JSON string a line (default: a few built in)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_compare)


class Terminated(BaseException):
    """SIGTERM, raised where the command is, so that its cleanup runs as on Ctrl-C."""


def _terminated(signum, frame):
    raise Terminated


# how a command was stopped -> (what the message calls it, the exit status: 128 + the signal's number)
STOPPED = {KeyboardInterrupt: ("Ctrl-C (SIGINT)", 130), Terminated: ("SIGTERM", 143)}


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse and run one command under the command line's contract: a model path is looked at first, and any
    failure is one sentence on stderr and exit status 2 (--debug: the traceback)."""
    args = parser.parse_args(argv)
    before = signal.signal(signal.SIGTERM, _terminated)  # so SIGTERM removes what a command was writing, as Ctrl-C does
    try:
        if getattr(args, "path", None):  # a bad file is refused here, before torch and the host are imported
            from .loaders.formats.files import first_look

            first_look(args.path)
        args.run(args)
    except SystemExit:
        raise
    except tuple(STOPPED) as e:
        how, status = STOPPED[type(e)]
        written = f"; nothing was written under {args.out}" if args.command.startswith("convert") else ""
        print(f"{parser.prog} {args.command}: stopped by {how}{written}.", file=sys.stderr)
        return status
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
    finally:
        signal.signal(signal.SIGTERM, before)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
