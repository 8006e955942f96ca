"""What several tests share: running the pack's commands and Python in a child process, bounding a call in
time, pointing the host's model folders at test files (in this process and in a child's), GGUF files built
byte by byte or by gguf's writer, hard-linked copies of model trees, and the list of GGUF types the pack
dequantizes."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V

TESTS = Path(__file__).resolve().parent
PACK = TESTS.parent  # the pack's own folder (the repository)
DATA = TESTS / "data"

# The GGUF types the pack dequantizes itself, as docs/dequantization.md lists them. The kernel and format tests take
# their types from here, not from the table of types (gguf_types.TYPES), so that a row dropped from the table fails
# a test instead of silently leaving the tests.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
GGUF_QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                        "IQ4_XS")


# --- devices ------------------------------------------------------------------------------------------------

CUDA_MISSING = "torch sees no CUDA GPU here (devtools/gpu-check runs them on a GPU machine)"


def cuda_param(value):
    """A parameter value for CUDA: marked `cuda` (what the GPU check selects; conftest.py leaves these out where
    torch sees no GPU)."""
    return pytest.param(value, marks=pytest.mark.cuda)


# --- the one-pass CPU kernels (numba) -------------------------------------------------------------------------


@contextlib.contextmanager
def numba_unavailable():
    """numba made impossible to import, as on a machine without it, so the reference paths run (torch, the K
    quantizers' plain Python); afterwards the compiled kernels load again."""
    from comfyui_flux2dev.loaders.formats import kernels

    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "numba", None)
        for name in [name for name in sys.modules if name.startswith(kernels.MODULE_PREFIX)]:
            m.delitem(sys.modules, name)
        kernels.forget()
        try:
            yield
        finally:
            kernels.forget()


def quantizer_paths(without_numba: str, autouse: bool = False):
    """The fixture `quantizer_path` of a quantizer's tests (assign it to that name in the test module): each test runs
    with numba's compiled kernels ("numba"), then with numba made impossible to import, on the path that stands in
    (`without_numba`: "torch" for the legacy and float types, "python" for the K-quants' plain port)."""

    @pytest.fixture(autouse=autouse, params=["numba", without_numba])
    def quantizer_path(request):
        if request.param == "numba":
            yield request.param
            return
        with numba_unavailable():
            yield request.param

    return quantizer_path


# --- child processes ----------------------------------------------------------------------------------------


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (nothing of this process imported; its memory its own), with `args`."""
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def run_flux2dev(*args, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """The user's command, `flux2dev ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-P", "-m", "comfyui_flux2dev.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def flux2dev_here(*args) -> subprocess.CompletedProcess:
    """`flux2dev ARGS` in this process: run_flux2dev's main and its output, without a fresh interpreter's start (for
    commands whose checks do not depend on a fresh process)."""
    from comfyui_flux2dev.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(a) for a in args])
        except SystemExit as e:
            status = e.code
    return subprocess.CompletedProcess(list(args), status, out.getvalue(), err.getvalue())


def run_devtools(*args, env: dict | None = None, timeout: int = 1200) -> subprocess.CompletedProcess:
    """The developers' command, `python -m comfyui_flux2dev.devtools ARGS`."""
    return subprocess.run([sys.executable, "-P", "-m", "comfyui_flux2dev.devtools", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@contextlib.contextmanager
def out_of_open_files(free: int = 0):
    """Inside the block, this process may open `free` more files and no more: its soft limit of open files lowered
    to just above the files it has open, and all but `free` of the rest taken. Undone after (Linux)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    taken = []
    try:
        with contextlib.suppress(OSError):
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        for fd in taken[:free]:
            os.close(fd)
        del taken[:free]
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- watching a call ----------------------------------------------------------------------------------------


class Blocked(BaseException):
    """Raised into a call that did not return in time; a BaseException, so no `except Exception` hides it."""


@contextlib.contextmanager
def time_bound(seconds: float = 5.0):
    """Interrupt the block after `seconds` (SIGALRM: a blocking open() of a FIFO returns to Python for it)."""

    def alarm(signum, frame):
        raise Blocked(f"still running after {seconds} s (blocked on a FIFO?)")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- the host's model folders ------------------------------------------------------------------------------

# Each host model folder key -> the folders of the tiny models (as `devtools tiny DIR` writes them) it lists.
TINY_FOLDERS = {"text_encoders": ["text_encoders"], "diffusion_models": ["diffusion_models", "unet"],
                "diffusers": ["diffusers"], "vae": ["vae"]}


def point_model_folders(monkeypatch, folders: dict) -> None:
    """Make the host's model folder keys list only `folders` ({key: [paths]}) for this test."""
    import folder_paths

    for key, paths in folders.items():
        extensions = folder_paths.folder_names_and_paths[key][1]
        monkeypatch.setitem(folder_paths.folder_names_and_paths, key, ([str(p) for p in paths], extensions))


# The start of a child script (run_python) that loads the host and points its model folders at the tiny
# models under sys.argv[1], as point_model_folders does in this process.
CHILD_WITH_TINY_FOLDERS = f"""
import sys
from pathlib import Path

tiny = Path(sys.argv[1])
from comfyui_flux2dev.host import ensure_comfy
ensure_comfy()
import folder_paths
for key, folders in {TINY_FOLDERS!r}.items():
    folder_paths.folder_names_and_paths[key] = ([str(tiny / f) for f in folders],
                                                folder_paths.folder_names_and_paths[key][1])
"""


# --- GGUF files byte by byte, so that each field can be set to anything ---------------------------------------


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def gguf_u32(key: str, value: int) -> bytes:
    return gguf_kv(key, V.UINT32, struct.pack("<I", value))


def gguf_f32(key: str, value: float) -> bytes:
    return gguf_kv(key, V.FLOAT32, struct.pack("<f", value))


def gguf_array(key: str, itype: int, items: list[bytes]) -> bytes:
    return gguf_kv(key, V.ARRAY, struct.pack("<IQ", itype, len(items)) + b"".join(items))


def gguf_tensor_info(name: str, dims, qtype: int, offset: int) -> bytes:
    return gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) \
        + struct.pack("<IQ", qtype, offset)


def gguf_bytes(kvs=(), infos=(), data=b"", n_kv=None, n_tensors=None, magic=b"GGUF", version=3, alignment=32) -> bytes:
    """A GGUF file of these metadata entries and tensor infos (gguf_kv, gguf_tensor_info), padded to the
    alignment, then `data`; the counts, magic and version may be set to what the entries do not say."""
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


def write_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray]) -> Path:
    import gguf

    from comfyui_flux2dev.devtools.tiny.gguf_blocks import write_and_close

    writer = gguf.GGUFWriter(str(path), architecture)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    write_and_close(writer)
    return path


def host_flux2_tokenizer(tekken, skip_note: str = ""):
    """The running ComfyUI's own FLUX.2 tokenizer built from a tekken file (its bytes, or the uint8 tensor its single
    files embed), or a skip where that does not build under this transformers (it asks for a vocab_file there)."""
    import comfy.text_encoders.flux
    import transformers

    try:
        return comfy.text_encoders.flux.Flux2Tokenizer(tokenizer_data={"tekken_model": tekken})
    except TypeError as e:
        if "vocab_file" not in str(e):
            raise
        pytest.skip(f"this ComfyUI's own FLUX.2 tokenizer does not build under transformers "
                    f"{transformers.__version__} ({e}){skip_note}")


# --- FLUX.2 transformer GGUFs: the independent reference, and a LoRA over one ---------------------------------


def gguf_weights(path) -> dict:
    """Every tensor of a GGUF file as gguf-py's reader and numpy dequantizer see it, in float32."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = torch.from_numpy(values.reshape([int(d) for d in reversed(t.shape)]))
    return out


def dense_model(weights: dict):
    """The host model built from float32 BFL `weights` as they are."""
    from comfyui_flux2dev.host.model import build_model
    from comfyui_flux2dev.loaders.models.transformer import LoadedTransformer
    from comfyui_flux2dev.loaders.models.transformer_layout import geometry_from_shapes, variant_for_geometry

    geometry, layout = geometry_from_shapes({k: tuple(v.shape) for k, v in weights.items()})
    loaded = LoadedTransformer(dict(weights), variant_for_geometry(geometry, layout), geometry, layout.name)
    return build_model(loaded, dtype=torch.float32)


def reference_model(path):
    """The host model built from every tensor of the file as gguf-py's reader and numpy dequantizer see it."""
    return dense_model(gguf_weights(path))


def fp8_weights(path, spelling: str = "weight_scale") -> dict:
    """A tiny scaled-fp8 transformer file's weights in float32, each fp8 weight times its scale, read by safetensors:
    what the pack's fp8 MODEL computes with."""
    from safetensors.torch import load_file

    from comfyui_flux2dev.devtools.tiny.transformers import FP8_SPELLINGS

    stored, (weight_scale, input_scale) = load_file(str(path)), FP8_SPELLINGS[spelling]
    out = {}
    for key, t in stored.items():
        if key == "scaled_fp8" or key.endswith((f".{weight_scale}", f".{input_scale}")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = stored[key.removesuffix(".weight") + f".{weight_scale}"]
            t = t.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)
        out[key] = t.float()
    return out


def flux2_forward(patcher, device: torch.device) -> torch.Tensor:
    """One forward of a tiny host FLUX.2 model (patched onto `device` by the caller) on seeded inputs: the same
    values on every device (made on the CPU, then moved)."""
    variant = patcher.model.flux2_variant
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 128, 4, 4, generator=g)
    context = torch.randn(1, 5, variant.context_in_dim, generator=g)
    guidance = torch.tensor([4.0], device=device) if variant.guidance else None
    return patcher.model.diffusion_model(x.to(device), torch.tensor([0.7], device=device), context.to(device),
                                         guidance=guidance)


def on_device(patcher, device: torch.device):
    """Make the host load this patcher's model on `device`, as its own Select Device nodes set it, so that a test's
    CPU variant stays on the CPU where the host would pick a GPU."""
    patcher.load_device = device
    return patcher


def tiny_lora(patcher) -> dict:
    """A rank-4 LoRA over a quantized attention weight, a block-less F16 weight (txt_in) and a single block,
    in the two key spellings the host reads for Flux: generic BFL names and lora_unet_ names."""
    sd = patcher.model.diffusion_model.state_dict()
    g = torch.Generator().manual_seed(1)
    lora = {}
    for layer, spelling in (
        ("double_blocks.0.img_attn.qkv", "diffusion_model.{}"),
        ("txt_in", "diffusion_model.{}"),
        ("single_blocks.1.linear1", "lora_unet_{}"),
    ):
        name = spelling.format(layer if spelling.startswith("diffusion") else layer.replace(".", "_"))
        out_features = patcher.model.diffusion_model.get_submodule(layer).out_features
        in_features = patcher.model.diffusion_model.get_submodule(layer).in_features
        assert layer + ".weight" in sd
        lora[f"{name}.lora_up.weight"] = torch.randn(out_features, 4, generator=g) * 0.2
        lora[f"{name}.lora_down.weight"] = torch.randn(4, in_features, generator=g) * 0.2
        lora[f"{name}.alpha"] = torch.tensor(2.0)
    return lora


# --- folders that cannot be written -------------------------------------------------------------------------


def restricted(script: str, folder: Path, how: str, env: dict, room: int = 0) -> subprocess.CompletedProcess:
    """Run `script` (python) with `folder` made read-only ("read-only") or full ("full": `room` bytes left) for
    it alone: a mount namespace of its own where unprivileged ones exist, else (not root) the folder's
    permissions. Outside the namespace the folder is as it was."""
    import shlex
    import shutil

    import pytest

    python = f"{shlex.quote(sys.executable)} -P -c {shlex.quote(script)}"
    if how == "read-only":
        setup = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"
    else:  # a tmpfs of just the folder's size and `room`, holding a copy of it
        used = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) + (64 << 10)
        setup = (f"cp -a {folder} {folder}.copy && mount -t tmpfs -o size={used + room} tmpfs {folder} "
                 f"&& cp -a {folder}.copy/. {folder} && head -c {64 << 10} /dev/zero > {folder}/.filler 2>/dev/null; "
                 "true")
    if shutil.which("unshare") and subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                                                  capture_output=True).returncode == 0:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"{setup} && {python}"],
                              capture_output=True, text=True, env=env, timeout=600)
    if os.geteuid() == 0 or how == "full":
        pytest.skip("no mount namespace to make a folder read-only or full in (unshare --user --mount failed)")
    folder.chmod(0o555)
    try:
        return subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, env=env,
                              timeout=600)
    finally:
        folder.chmod(0o755)


# --- files ------------------------------------------------------------------------------------------------


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of a model file or folder made of hard links (the tiny weights are not copied)."""
    if src.is_file():
        os.link(src, dst)
        return dst
    dst.mkdir(parents=True)
    for item in sorted(src.iterdir()):
        if item.name not in skip:
            link_tree(item, dst / item.name)
    return dst
