"""The lazy encoder through the real host: the CLIP is built from headers and the tokenizer, the weights are
read on the first prompt the cache does not hold, never when every prompt is cached, and freed after each
encode with keep_loaded off. Reads are the bytes read() returned, counted by the kernel (/proc/self/io rchar, page
cache included), plus the bytes of the weights the pack maps (SafetensorsFiles.view: pages of a map are read as
the model touches them, which no kernel counter tells apart); memory by /proc/self/status."""

from __future__ import annotations

import pytest
import torch

from comfyui_flux2dev.loaders.cache.store import ConditioningCache
from helpers import on_device

PROMPTS = ("a red fox in the snow", "a lighthouse at night", "three cats on a sofa")
BF16 = "text_encoders/mistral_3_small_flux2_bf16.safetensors"


def _proc(path: str, field: str) -> int:
    with open(path) as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


_mapped = [0]  # bytes of the tensors SafetensorsFiles.view handed out in this process


@pytest.fixture(autouse=True)
def count_mapped(monkeypatch):
    from comfyui_flux2dev.loaders.formats.safetensors_file import SafetensorsFiles

    view = SafetensorsFiles.view

    def counted(self, name):
        _mapped[0] += self.infos[name].nbytes
        return view(self, name)

    monkeypatch.setattr(SafetensorsFiles, "view", counted)


def _read_bytes() -> int:
    return _proc("/proc/self/io", "rchar") + _mapped[0]


def _rss() -> int:
    return _proc("/proc/self/status", "VmRSS") * 1024


def _encode(clip, prompt):
    return clip.encode_from_tokens(clip.tokenize(prompt), return_dict=True)["cond"]


def _lazy(path, device, **options):
    """The lazy CLIP, run on `device` by the host."""
    from comfyui_flux2dev.host.clip import lazy_clip

    clip = lazy_clip(path, dtype=torch.float32, **options)
    on_device(clip.patcher, device)
    return clip


def _weights_in_memory(clip) -> int:
    """Bytes of storage behind the encoder's packed layers (placeholders hold one element each)."""
    from comfyui_flux2dev.host.ops import PackedLayer

    return sum(p.untyped_storage().nbytes() for m in clip.cond_stage_model.modules() if isinstance(m, PackedLayer)
               for p in m.parameters(recurse=False))


@pytest.fixture
def weights_bytes(encoder):
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder

    return plan_encoder(encoder).memory_bytes


@pytest.fixture(scope="module")
def fresh_on(comfy_host, tiny_root):
    """device -> each prompt's conditioning from an eager load without a cache, run there."""
    from comfyui_flux2dev.host.clip import load_clip

    made = {}

    def fresh(device):
        if device not in made:
            clip = load_clip(str(tiny_root / BF16), dtype=torch.float32)
            on_device(clip.patcher, device)
            made[device] = {p: _encode(clip, p) for p in PROMPTS}
        return made[device]

    return fresh


@pytest.fixture
def fresh(fresh_on, device):
    return fresh_on(device)


def test_the_clip_reads_headers_and_tokenizer_only(comfy_host, encoder, weights_bytes, tmp_path):
    """This file embeds its tokenizer (tekken.json as a tensor, about as large as the tiny weights): the CLIP
    reads the header and that tensor, nothing else."""
    from comfyui_flux2dev.host.clip import lazy_clip
    from comfyui_flux2dev.loaders.models.encoder import plan_encoder

    plan = plan_encoder(encoder)
    header = 8 + int.from_bytes(open(encoder, "rb").read(8), "little")
    tokenizer = plan.source.nbytes(plan.embedded_tekken_key)
    lazy_clip(encoder, cache=str(tmp_path / "warm-up"))  # one-time costs: imports, the tokenizer cache
    before = _read_bytes()
    clip = lazy_clip(encoder, cache=str(tmp_path / "cache"), dtype=torch.float32)
    assert _read_bytes() - before < 2 * header + tokenizer + 2**20
    assert _weights_in_memory(clip) < weights_bytes / 100
    assert not clip.flux2dev_source.loaded


def test_a_workflow_whose_prompts_are_all_cached_never_reads_the_weights(comfy_host, encoder, weights_bytes, fresh,
                                                                          device, tmp_path):
    cache = str(tmp_path / "cache")
    filler = _lazy(encoder, device, cache=cache)
    reads = _read_bytes()
    for p in PROMPTS:
        assert torch.equal(_encode(filler, p), fresh[p])
    assert _read_bytes() - reads >= weights_bytes, "the fill read the weights (the counter sees reads)"
    del filler

    clip = _lazy(encoder, device, cache=cache)
    _encode(clip, PROMPTS[0])  # one-time costs of a hit
    reads, rss = _read_bytes(), _rss()
    for _ in range(3):
        for p in PROMPTS:
            assert torch.equal(_encode(clip, p), fresh[p])
    entry = max(e.bytes for e in ConditioningCache(cache).entries())
    assert _read_bytes() - reads < 3 * len(PROMPTS) * entry + 2**20  # the entries themselves, and no weights
    assert _rss() - rss < weights_bytes / 2
    assert _weights_in_memory(clip) < weights_bytes / 100 and not clip.flux2dev_source.loaded


def test_keep_loaded_off_frees_the_weights_after_each_encode(comfy_host, encoder, weights_bytes, fresh, device,
                                                             tmp_path):
    import comfy.model_management

    clip = _lazy(encoder, device, cache=str(tmp_path / "cache"), keep_loaded=False)
    for p in PROMPTS[:2]:  # two misses: each reads the weights again
        reads = _read_bytes()
        assert torch.equal(_encode(clip, p), fresh[p])
        assert _read_bytes() - reads >= weights_bytes
        assert _weights_in_memory(clip) < weights_bytes / 100
        assert not any(m.model is not None and m.model.model is clip.cond_stage_model
                       for m in comfy.model_management.current_loaded_models)
    reads = _read_bytes()
    assert torch.equal(_encode(clip, PROMPTS[0]), fresh[PROMPTS[0]])  # a hit
    assert _read_bytes() - reads < weights_bytes / 10


def test_keep_loaded_on_reads_the_weights_once(comfy_host, encoder, weights_bytes, fresh, device, tmp_path):
    clip = _lazy(encoder, device, cache=str(tmp_path / "cache"))
    _encode(clip, PROMPTS[0])
    assert _weights_in_memory(clip) >= weights_bytes / 2
    reads = _read_bytes()
    for p in PROMPTS[1:]:
        assert torch.equal(_encode(clip, p), fresh[p])
    assert _read_bytes() - reads < weights_bytes / 10


def test_clones_share_the_lazy_weights_and_the_reload_factory_loads(comfy_host, encoder, weights_bytes, fresh, fresh_on,
                                                                    device, tmp_path):
    clip = _lazy(encoder, device, cache=str(tmp_path / "cache"))
    clone = clip.clone()
    assert type(clone) is type(clip) and clone.flux2dev_source is clip.flux2dev_source
    assert torch.equal(_encode(clone, PROMPTS[1]), fresh[PROMPTS[1]])
    assert clip.flux2dev_source.loaded
    factory, args = clip.patcher.cached_patcher_init
    patcher = factory(*args)
    tokens = clip.tokenize(PROMPTS[1])
    with torch.no_grad():  # the factory's model, not loaded by the host, runs where its weights are read: the CPU
        assert torch.equal(patcher.model.encode_token_weights(tokens)[0], fresh_on(torch.device("cpu"))[PROMPTS[1]])
