"""The machine's speed limits an encode or a prompt upsampling is measured against, measured in the same run: the best
rate torch's matmul reaches here on the encoder's own shapes in the dtype the encoder multiplies in, and the rates
its weights can be read at (from the page cache, from the disk for a file larger than the memory, and from memory for
a model kept loaded). A run's roofline is the time its matmuls take at that rate or the time its weights take to be
read, whichever is longer; its ratio is the measured time over it (1.0: at the machine's limit)."""

from __future__ import annotations

import math
import os
import time

import torch

from ...loaders.models.variants import MistralEncoderGeometry
from .meters import best, evict, read_through

_READ_LIMIT = 2 << 30  # bytes of a file read to measure a read rate


def linear_shapes(g: MistralEncoderGeometry) -> dict[str, tuple[int, int]]:
    """Each linear layer of one Mistral layer -> (outputs, inputs)."""
    attention, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    return {"q_proj": (attention, g.width), "k_proj": (kv, g.width), "v_proj": (kv, g.width),
            "o_proj": (g.width, attention), "gate_proj": (g.mlp, g.width), "up_proj": (g.mlp, g.width),
            "down_proj": (g.width, g.mlp)}


def matmul_rate(g: MistralEncoderGeometry, dtype: torch.dtype, rows: int = 512, repeats: int = 3) -> float:
    """The best FLOP/s torch's linear reaches here in `dtype` on the layer's own shapes, `rows` tokens at a time."""
    best = 0.0
    for outputs, inputs in set(linear_shapes(g).values()):
        x, w = torch.randn(rows, inputs).to(dtype), torch.randn(outputs, inputs).to(dtype)
        torch.nn.functional.linear(x, w)  # the kernel chosen and its buffers made
        start = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(x, w)
        best = max(best, 2 * rows * inputs * outputs * repeats / (time.perf_counter() - start))
    return best


def _read_rate(path: str) -> float:
    start = time.perf_counter()
    return read_through(path, _READ_LIMIT) / (time.perf_counter() - start)


def memory_rate(size: int = 1 << 30, repeats: int = 3) -> float:
    """The best bytes per second torch reads memory at here (a sum over `size` bytes on its threads): the rate a loaded
    model's weights, already in memory, are read at."""
    values = torch.ones(size // 4)
    values.sum()
    return size / best(values.sum, repeats)


def read_rates(path: str) -> dict[str, float]:
    """Bytes per second a file is read at: from the disk (its pages evicted first) and from the page cache."""
    evict([path])
    disk = _read_rate(path)
    return {"disk": disk, "cache": _read_rate(path)}


def encode_flops(g: MistralEncoderGeometry, layers: int, tokens: int, pads: int) -> float:
    """The matmul work of an encode through `layers` layers: `tokens` real tokens through attention and MLP, and,
    where there are pads, the one row the encoder computes for all of them (they see no key: the MLP alone)."""
    params = sum(o * i for o, i in linear_shapes(g).values())
    mlp = sum(o * i for name, (o, i) in linear_shapes(g).items() if name in ("gate_proj", "up_proj", "down_proj"))
    attention = 2 * tokens * tokens * g.heads * g.head_dim  # scores and their sum of values
    return layers * (2 * tokens * params + 2 * attention + (2 * mlp if pads else 0))


def layer_bytes(path: str, head: bool = False) -> int:
    """The bytes of a weight file's layers (what an encode reads whole; of the embeddings it reads the prompt's
    rows alone), and of its lm_head where `head` (what writing a token reads)."""
    if path.endswith(".gguf"):
        from ...loaders.formats.gguf_file import open_gguf

        with open_gguf(path) as f:
            return sum(t.nbytes for t in f.tensors.values()
                       if t.name.startswith("blk.") or head and t.name == "output.weight")
    from ...loaders.formats.safetensors_file import SafetensorsFiles

    return sum(info.nbytes for name, info in SafetensorsFiles([path]).infos.items()
               if ".layers." in name or head and name == "lm_head.weight")


def token_flops(g: MistralEncoderGeometry, layers: int, tokens: int, context: int) -> float:
    """The matmul work of running `tokens` new tokens through a whole model of `layers` layers, each seeing
    `context` tokens, and its lm_head for the last of them (what a prefill or one written token costs)."""
    params = sum(o * i for o, i in linear_shapes(g).values())
    return layers * (2 * tokens * params + 4 * tokens * context * g.heads * g.head_dim) + 2 * g.width * g.vocab


def roofline_s(flops: float, weight_bytes: int, rate: float, read_rate: float) -> float:
    """The seconds the work takes at the machine's limit: its matmuls at `rate` or its weights read at `read_rate`,
    whichever takes longer."""
    return max(flops / rate, weight_bytes / read_rate)


def machine_rates(g: MistralEncoderGeometry, dtype: torch.dtype, path: str) -> dict:
    """The rates of this machine a run is measured against: the matmul rate in `dtype` and the read rates of the
    file at `path`, with the memory a file must fit in to be read from the page cache."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return {"matmul_flops": matmul_rate(g, dtype), "dtype": str(dtype).removeprefix("torch."),
            **{f"{where}_bytes_s": rate for where, rate in read_rates(path).items()},
            "memory_available_bytes": available, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}


def read_from(rates: dict, file_bytes: int) -> str:
    """Where a run reads a file's weights: the page cache where the file fits in the memory left (as a running ComfyUI
    finds a model file it has read before), else the disk."""
    return "disk" if file_bytes > rates["memory_available_bytes"] else "page cache"


def measured_against(rates: dict, flops: float, weight_bytes: int, file_bytes: int, seconds: float) -> dict:
    """A run's roofline and ratio, its weights read from where read_from says."""
    where = read_from(rates, file_bytes)
    roof = roofline_s(flops, weight_bytes, rates["matmul_flops"],
                      rates["disk_bytes_s" if where == "disk" else "cache_bytes_s"])
    return {"flops": flops, "weight_bytes": weight_bytes, "read_from": where,
            "roofline_s": roof, "ratio": seconds / roof if roof else math.inf}
