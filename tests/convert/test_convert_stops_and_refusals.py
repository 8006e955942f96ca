"""`flux2dev convert` and `compare` stopped midway or given what cannot work: Ctrl-C and SIGTERM end in one line
and no partial file; a partial file a killed conversion left is removed by the next conversion into that name,
and nothing else is, not even a finished one being published; OUT naming the source is refused; a LoRA that is
malformed, no safetensors file or shaped for another model, and a [dev] compared with a Klein, are refused from
headers alone, before ComfyUI is imported."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_flux2dev

TRANSFORMER = "diffusion_models/flux2-dev-tiny.safetensors"
KLEIN = "diffusion_models/flux2-klein-4b-tiny.safetensors"
ENCODER = "text_encoders/mistral_3_small_flux2_bf16.safetensors"
HIDDEN = 256  # the tiny [dev]'s width
PARTIAL_END = ".0123456789abcdef.partial"  # a name of new_file's own pattern, with a fixed hex part

# The command line, with the writer paused after its first tensor (a line on stdout says so) so that a signal
# lands while the partial file is being written.
PAUSED = """
import sys, time
from comfyui_flux2dev.loaders.convert import tensor_files
from comfyui_flux2dev.cli import main
write = tensor_files.TensorFile.write
def paused(self, *args, **kwargs):
    write(self, *args, **kwargs)
    print("writing", flush=True)
    time.sleep(60)
tensor_files.TensorFile.write = paused
sys.exit(main({argv!r}))
"""

# The command line, with the writer paused as it renames its finished file into place (a line on stdout says so)
# until a line comes on stdin.
PUBLISHING = """
import os, sys
from comfyui_flux2dev.cli import main
replace = os.replace
def paused(src, dst, **kwargs):
    if str(src).endswith(".partial"):
        print("publishing", flush=True)
        sys.stdin.readline()
    return replace(src, dst, **kwargs)
os.replace = paused
sys.exit(main({argv!r}))
"""

# The command line, then whether ComfyUI was imported (the last line of stdout).
COMFY_IMPORTED = """
import sys
from comfyui_flux2dev.cli import main
status = main({argv!r})
print("torch" in sys.modules, "comfy" in sys.modules, [m for m in sys.modules if m.startswith("comfy.")][:3])
sys.exit(status)
"""


STOPS = (signal.SIGINT, signal.SIGTERM)


def _default_stops() -> None:
    """In the child before it runs: Ctrl-C and SIGTERM as a terminal's command gets them. A suite started in the
    background (nohup, `&` in a script, some CI runners) passes SIGINT on ignored, and the child would not stop."""
    for stop in STOPS:
        signal.signal(stop, signal.SIG_DFL)


def _python(script: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def _paused_convert(tiny_root, out: Path) -> subprocess.Popen:
    argv = ["convert", "transformer", str(tiny_root / TRANSFORMER), str(out), "--type", "Q8_0"]
    # Started as from a background job, whatever started the suite: the signals the test sends ignored here.
    ignored = {stop: signal.signal(stop, signal.SIG_IGN) for stop in STOPS}
    try:
        process = _python(PAUSED.format(argv=argv), preexec_fn=_default_stops)
    finally:
        for stop, handler in ignored.items():
            signal.signal(stop, handler)
    assert process.stdout.readline() == "writing\n", process.communicate(timeout=60)[1][-3000:]
    return process


def _partials(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".partial"))


@pytest.mark.parametrize("stop, status, said", [(signal.SIGINT, 130, "Ctrl-C (SIGINT)"),
                                               (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stopped_conversion_ends_in_one_line_and_leaves_no_partial_file(tiny_root, tmp_path, stop, status, said):
    out = tmp_path / "out.gguf"
    process = _paused_convert(tiny_root, out)
    assert len(_partials(tmp_path)) == 1
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == status, stderr[-3000:]
    assert stderr == f"flux2dev convert transformer: stopped by {said}; nothing was written under {out}.\n"
    assert os.listdir(tmp_path) == []


def test_the_next_conversion_removes_the_partial_file_a_killed_one_left_and_nothing_else(tiny_root, tmp_path):
    out = tmp_path / "out.gguf"
    process = _paused_convert(tiny_root, out)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    left = _partials(tmp_path)
    assert len(left) == 1 and left[0].startswith(".out.gguf.")
    # beside it: another name's partial file, names almost of the pattern, and one a live writer holds locked
    foreign = [".other.gguf" + PARTIAL_END, ".out.gguf.0123.partial", ".out.gguf.0123456789abcdeg.partial",
               "out.gguf" + PARTIAL_END, ".out.gguf" + PARTIAL_END + ".txt"]
    for name in foreign:
        (tmp_path / name).write_bytes(b"not the pack's to remove")
    victim = tmp_path / "victim.txt"  # and a link at a name of the pattern, to a file of the user's
    victim.write_bytes(b"not the pack's to remove")
    link = tmp_path / ".out.gguf.00112233aabbccdd.partial"
    link.symlink_to(victim)
    live = tmp_path / (".out.gguf.fedcba9876543210.partial")
    live.write_bytes(b"a conversion in progress")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        done = run_flux2dev("convert", "transformer", tiny_root / TRANSFORMER, out, "--type", "Q8_0")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["out.gguf", live.name, *foreign, victim.name, link.name])
    assert all((tmp_path / name).read_bytes() == b"not the pack's to remove" for name in [*foreign, victim.name])
    assert link.is_symlink()


def test_a_finished_file_being_published_is_left_to_its_writer_by_another_conversion(tiny_root, tmp_path):
    """The first conversion is paused as it renames its finished file into place; a second into the same name
    runs meanwhile, sweeping stale partial files first. It leaves the first's (its writer still holds the lock),
    both finish, and the name holds the first's file (it came last, with --force)."""
    out = tmp_path / "out.gguf"
    argv = ["convert", "transformer", str(tiny_root / TRANSFORMER), str(out), "--type", "Q8_0", "--force"]
    first = _python(PUBLISHING.format(argv=argv), stdin=subprocess.PIPE)
    try:
        assert first.stdout.readline() == "publishing\n", first.communicate(timeout=60)[1][-3000:]
        (partial,) = _partials(tmp_path)
        finished = (tmp_path / partial).read_bytes()
        second = run_flux2dev("convert", "transformer", tiny_root / TRANSFORMER, out, "--type", "Q4_0")
        assert second.returncode == 0, second.stderr
        assert _partials(tmp_path) == [partial], "the second conversion swept a file its writer is publishing"
        _, stderr = first.communicate("\n", timeout=60)
        assert first.returncode == 0, stderr[-3000:]
    finally:
        first.kill()
        first.communicate()
    assert out.read_bytes() == finished and os.listdir(tmp_path) == ["out.gguf"]


def test_force_with_out_naming_the_source_is_refused_and_the_source_kept(encoder, tmp_path):
    before = encoder.read_bytes()
    (tmp_path / "other-name.safetensors").hardlink_to(encoder)
    (tmp_path / "link.safetensors").symlink_to(encoder)
    for out in (encoder, tmp_path / "other-name.safetensors", tmp_path / "link.safetensors"):
        done = run_flux2dev("convert", "encoder", encoder, out, "--dtype", "fp8", "--force")
        assert done.returncode == 2 and "is the source being converted" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
    assert encoder.read_bytes() == before and (tmp_path / "link.safetensors").is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["encoder.safetensors", "link.safetensors", "other-name.safetensors"]


# --- refused from headers, before ComfyUI is imported ----------------------------------------------------------


def _pair(prefix: str, out_features: int, in_features: int, up: str = "lora_up", down: str = "lora_down") -> dict:
    g = torch.Generator().manual_seed(out_features + in_features)
    return {f"{prefix}.{up}.weight": torch.randn(out_features, 4, generator=g),
            f"{prefix}.{down}.weight": torch.randn(4, in_features, generator=g)}


def _loras(folder: Path) -> dict[str, tuple[Path, str]]:
    """Bad LoRAs for the tiny [dev] -> (file, what the refusal says)."""
    from safetensors.torch import save_file

    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"
    # a tiny Klein 4B's layers (width 128, MLP 384): no [dev] weight takes inputs of 384 or 512
    klein = {**_pair(qkv, 3 * 128, 128), **_pair("diffusion_model.single_blocks.0.linear2", 128, 512),
             **_pair("diffusion_model.double_blocks.0.img_mlp.2", 128, 384)}
    diffusers = _pair("transformer.transformer_blocks.0.attn.to_k", HIDDEN, 100, "lora_B", "lora_A")
    alpha = {**_pair(qkv, 3 * HIDDEN, HIDDEN), f"{qkv}.alpha": torch.tensor(list(b"16.0"), dtype=torch.uint8)}
    up_alone = {f"{qkv}.lora_up.weight": torch.zeros(3 * HIDDEN, 4)}
    down_alone = {f"{qkv}.lora_down.weight": torch.zeros(4, HIDDEN)}
    ranks = {f"{qkv}.lora_up.weight": torch.zeros(3 * HIDDEN, 4), f"{qkv}.lora_down.weight": torch.zeros(8, HIDDEN)}
    # shaped like the transformer's qkv weights, named after a text encoder's layers
    names = _pair("lora_te_text_model_encoder_layers_0_self_attn_qkv", 3 * HIDDEN, HIDDEN)
    cases = {
        "klein": (klein, "patches nothing here: none of its 6 tensors lands on the transformer (its layers take "
                         "inputs of width 128, this transformer's are 256; it is for another model: FLUX.2 Klein 4B"),
        "diffusers-shapes": (diffusers, "patches nothing here: none of its 2 tensors lands on the transformer (its "
                                        "layers take inputs of width 100"),
        "alpha-string": (alpha, f"the LoRA's {qkv}.alpha is U8 [4], not one number"),
        "up-alone": (up_alone, f"layer {qkv} holds {qkv}.lora_up.weight but no down beside it"),
        "down-alone": (down_alone, f"layer {qkv} holds {qkv}.lora_down.weight but no up beside it"),
        "ranks": (ranks, "its up [768, 4] and down [8, 256] are not of one rank"),
        "names": (names, "none of its 2 tensors lands on the transformer (it is a LoRA of Stable Diffusion or SDXL)"),
        "strength": (_pair(qkv, 3 * HIDDEN, HIDDEN), "is nan; a LoRA's strength is a number from -100 to 100"),
    }
    out = {}
    for name, (tensors, said) in cases.items():
        save_file(tensors, str(folder / f"{name}.safetensors"))
        out[name] = (folder / f"{name}.safetensors", said)
    (folder / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    out["gguf"] = (folder / "model.gguf", "LoRAs are read from .safetensors files only")
    return out


def test_bad_loras_are_refused_in_one_line_before_torch_is_imported(tiny_root, tmp_path):
    out = tmp_path / "out.gguf"
    for name, (lora, said) in _loras(tmp_path).items():
        argv = ["convert", "transformer", str(tiny_root / TRANSFORMER), str(out), "--type", "Q8_0", "--lora", str(lora),
                *(["--strength", "nan"] if name == "strength" else [])]
        stdout, stderr = _python(COMFY_IMPORTED.format(argv=argv)).communicate(timeout=120)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("flux2dev convert transformer: "), (name, stderr)
        assert said in lines[0], (name, stderr)
        assert "unexpectedly" not in stderr
        assert stdout.splitlines()[-1] == "False False []", (name, stdout)
        assert not out.exists() and not _partials(tmp_path)


def test_output_and_argument_refusals_are_one_line_before_torch_is_imported(tiny_root, tmp_path):
    src, encoder = tiny_root / TRANSFORMER, tiny_root / ENCODER
    gguf = tiny_root / "text_encoders" / "mistral3-q4_0.gguf"
    (tmp_path / "taken.gguf").write_bytes(b"a user's file")
    (tmp_path / "folder.gguf").mkdir()
    os.link(src, tmp_path / "same.gguf")
    transformer = ["convert", "transformer", str(src)]
    cases = {
        "a wrong suffix": ([*transformer, str(tmp_path / "out.bin"), "--type", "Q8_0"],
                           "the output of this conversion is a .gguf file"),
        "OUT taken": ([*transformer, str(tmp_path / "taken.gguf"), "--type", "Q8_0"], "already exists and was left"),
        "OUT a folder": ([*transformer, str(tmp_path / "folder.gguf"), "--type", "Q8_0", "--force"], "is a folder"),
        "OUT the source": ([*transformer, str(tmp_path / "same.gguf"), "--type", "Q8_0", "--force"],
                           "is the source being converted"),
        "a GGUF source": (["convert", "transformer", str(gguf), str(tmp_path / "out.gguf"), "--type", "Q8_0"],
                          "is not a .safetensors file"),
        "an encoder's OUT taken": (["convert", "encoder", str(encoder), str(tmp_path / "taken.gguf"), "--type", "Q8_0"],
                                   "already exists and was left"),
        "an encoder's wrong suffix": (["convert", "encoder", str(encoder), str(tmp_path / "out.bin")],
                                      "the output of this conversion is a .safetensors file"),
        "an unknown type": ([*transformer, str(tmp_path / "out.gguf"), "--type", "Q9"],
                            "--type Q9 is not a type convert writes; use one of Q8_0, "),
    }
    for name, (argv, said) in cases.items():
        stdout, stderr = _python(COMFY_IMPORTED.format(argv=argv)).communicate(timeout=120)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"flux2dev {' '.join(argv[:2])}: "), (name, stderr)
        assert said in lines[0], (name, stderr)
        # every refusal but the type's is made before torch is imported; the types come from the table of GGUF
        # types, which imports torch, so a --type is checked after the others (and before the host is imported)
        imported = "True False []" if "--type" in said else "False False []"
        assert stdout.splitlines()[-1:] == [imported], (name, stdout)
    assert (tmp_path / "taken.gguf").read_bytes() == b"a user's file"
    assert sorted(os.listdir(tmp_path)) == ["folder.gguf", "same.gguf", "taken.gguf"]


def _header_refusals(tiny_root, folder: Path) -> dict[str, tuple[list[str], str]]:
    """Sources whose headers alone refuse them, for each converter -> (the command line, what the refusal says)."""
    from safetensors.torch import load_file, save_file

    def changed(start: str, name: str, change) -> str:
        tensors = load_file(str(tiny_root / start))
        change(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
        return str(folder / name)

    def zeros(key: str, dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] | None = None):
        return lambda t: t.__setitem__(key, torch.zeros(shape or t[key].shape, dtype=dtype))

    def first_layers(count: int):
        return lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.") and int(k.split(".")[2]) >= count]

    up, norm = "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"
    qkv, scale = "double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.norm.query_norm.scale"
    linear2 = "single_blocks.0.linear2.weight"
    encoder = ["convert", "encoder"]
    transformer = ["convert", "transformer"]
    to_st, to_gguf = str(folder / "out.safetensors"), [str(folder / "out.gguf"), "--type", "Q8_0"]
    return {
        "an encoder's int8 weight": ([*encoder, changed(ENCODER, "int8.safetensors", zeros(up, torch.int8)), to_st],
                                     f"{up} is stored as I8 with no comfy_quant tensor"),
        "an encoder's bool norm": ([*encoder, changed(ENCODER, "bool.safetensors", zeros(norm, torch.bool)), to_st],
                                   f"{norm} is stored as BOOL with no comfy_quant tensor"),
        "a 20-layer encoder": ([*encoder, changed(ENCODER, "20.safetensors", first_layers(20)), *to_gguf],
                               "matches no FLUX.2 [dev] encoder: found vocab 131072, width 64, q rows 256, k rows "
                               "128, MLP 128, 20 layers"),
        "a Klein encoder": ([*encoder, str(tiny_root / "diffusers/flux2-klein-4b-tiny-pipeline/text_encoder"), to_st],
                            "text encoder of FLUX.2 Klein 4B (tiny test model) (hidden size 32, attention q_norm "
                            "present), not the Mistral-Small 24B encoder"),
        "a GGUF transformer as the encoder": ([*encoder, str(tiny_root / "unet/flux2-dev-tiny-Q8_0.gguf"), *to_gguf],
                                              "is a FLUX transformer GGUF, not a text encoder"),
        "a transformer's int8 weight": ([*transformer, changed(TRANSFORMER, "t-int8.safetensors",
                                                               zeros(qkv, torch.int8)), *to_gguf],
                                        f"{qkv} is stored as I8 with no comfy_quant tensor"),
        "a transformer's bool norm": ([*transformer, changed(TRANSFORMER, "t-bool.safetensors",
                                                             zeros(scale, torch.bool)), *to_gguf],
                                      f"holds integer tensors (e.g. {scale}, torch.bool)"),
        "a transformer's wrong shape": ([*transformer, changed(TRANSFORMER, "t-shape.safetensors",
                                                               zeros(linear2, shape=(250, 1024))), *to_gguf],
                                        f"{linear2} [250, 1024] (expected [256, 1024])"),
    }


def test_header_refusals_are_one_line_before_torch_is_imported(tiny_root, tmp_path):
    for name, (argv, said) in _header_refusals(tiny_root, tmp_path).items():
        process = _python(COMFY_IMPORTED.format(argv=argv))
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (name, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"flux2dev {' '.join(argv[:2])}: "), (name, stderr)
        assert said in lines[0], (name, stderr)
        assert stdout.splitlines()[-1:] == ["False False []"], (name, stdout)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("out.", ".out."))]


def test_compare_of_dev_and_klein_or_of_two_kinds_is_refused_before_torch_is_imported(tiny_root):
    argv = ["compare", str(tiny_root / TRANSFORMER), str(tiny_root / KLEIN)]
    stdout, stderr = _python(COMFY_IMPORTED.format(argv=argv)).communicate(timeout=120)
    assert stderr.splitlines() == [f"flux2dev compare: {tiny_root / TRANSFORMER} is a FLUX.2 dev transformer and "
                                   f"{tiny_root / KLEIN} a klein-4b one; their outputs cannot be compared (they take "
                                   "conditioning of different widths)."], stderr
    assert stdout.splitlines()[-1] == "False False []"
    vae = tiny_root / "vae" / "flux2-ae.safetensors"
    stdout, stderr = _python(
        COMFY_IMPORTED.format(argv=["compare", str(tiny_root / TRANSFORMER), str(vae)])).communicate(timeout=120)
    assert stderr.splitlines() == [f"flux2dev compare: {tiny_root / TRANSFORMER} is a transformer and {vae} a vae; "
                                   "compare two models of one kind."], stderr
    assert stdout.splitlines()[-1] == "False False []"
