"""How the quantizers (gguf_quant, kquants) and dequantizers (gguf_dequant, packed_dequant) step through a weight:
chunks of rows worked on in a cache-sized float32 scratch, on a bounded number of CPU threads.

Threads: every torch op on the CPU is one parallel step over the intra-op threads, and a step ends when
its slowest thread does. A dequantization is a few hundred short steps. When other jobs share the cores,
the scheduler parks one of the threads for a time slice now and then and the whole step waits for it: on
2 cores beside 2 busy processes, a 3072x12288 GGUF dequantization's median call took 1.7-20x its fastest
on 2 threads, 1.2-1.5x on one, and one thread was 3-40x faster. So the quantizers and dequantizers leave half the
cores to other work (one thread on a 2-core machine); matmuls keep every thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

# Values per chunk, for every quantizer and dequantizer: every op of a torch kernel runs on a whole chunk. On the
# CPU, large chunks keep the number of ops small, while their scratch still fits the L3 cache; on a GPU they only
# bound the temporary memory. Which rows share a chunk changes no byte: every block is worked on alone.
CHUNK_VALUES = {"cpu": 1 << 20, "cuda": 1 << 24}


def cpu_threads() -> int:
    """How many threads a CPU quantization or dequantization may use: half the cores, at least one."""
    return max(1, (os.cpu_count() or 1) // 2)


@contextlib.contextmanager
def few_threads(device: torch.device):
    """Torch's intra-op threads bounded to half the cores (at least one) inside the block, on the CPU."""
    threads = torch.get_num_threads()
    bounded = min(threads, cpu_threads())
    if device.type != "cpu" or bounded == threads:
        yield
        return
    torch.set_num_threads(bounded)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def output(out: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`out` checked to be a contiguous tensor of this shape, dtype and device, or a new one."""
    shape = tuple(int(s) for s in shape)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {list(shape)} on {device}, "
            f"not {out.dtype} {list(out.shape)} on {out.device}"
        )
    return out


def fill_by_rows(values: torch.Tensor, fill: Callable[[slice, torch.Tensor], None]) -> None:
    """Writes `values` ([rows, width], contiguous) chunk by chunk: fill(rows, v) puts the float32 values of
    those rows into v ([n, width] float32, contiguous), which is `values` itself when it is float32 and
    otherwise a scratch reused for every chunk and cast into place."""
    rows, width = values.shape
    step = max(1, CHUNK_VALUES.get(values.device.type, CHUNK_VALUES["cuda"]) // width)
    direct = values.dtype == torch.float32
    scratch = None if direct else torch.empty((min(step, rows), width), device=values.device)
    for start in range(0, rows, step):
        chunk = slice(start, min(start + step, rows))
        v = values[chunk] if direct else scratch[: chunk.stop - start]
        fill(chunk, v)
        if not direct:
            values[chunk].copy_(v)
