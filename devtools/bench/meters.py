"""What the benchmarks measure with: timings, a competing load, and a block's peak RSS, disk reads and
seconds (Linux /proc), with the page cache and the C heap cleared before, so that figures are the measured
code's own."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

from ...host.clip_weights import return_freed_memory


def timings(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def best(fn, repeats: int) -> float:
    return min(timings(fn, repeats))


# A memory-bound process: copies 256 MiB back and forth, far beyond any cache, as fast as one core can.
_MEMORY_BOUND = ("import numpy as np\na = np.ones(1 << 25); b = np.empty_like(a)\n"
                 "while True: np.copyto(b, a); np.copyto(a, b)")


@contextlib.contextmanager
def one_thread():
    """Torch's intra-op threads set to one inside the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def competing_load(processes: int, memory: bool = False):
    """`processes` busy Python processes (one core's worth of work each) running beside the block, as the
    other jobs on a user's machine do; memory: each copying memory instead of spinning on the CPU."""
    code = _MEMORY_BOUND if memory else "while True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    try:
        time.sleep(1.0 if memory and processes else 0.5)  # started and running
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


def _status_kib(pid: int | str, *fields: str) -> list[int]:
    """The named fields of /proc/PID/status in KiB, in the order asked (OSError once the process is gone)."""
    with open(f"/proc/{pid}/status") as f:
        found = dict(line.split(":", 1) for line in f if line.split(":", 1)[0] in fields)
    return [int(found[name].split()[0]) for name in fields]


def proc_kib(field: str) -> int:
    """A field of this process's /proc status in KiB (VmRSS, VmHWM, RssAnon, ...)."""
    return _status_kib("self", field)[0]


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def evict(paths: list[str]) -> None:
    """Drop the files from the page cache, so that reading them counts as disk reads."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(path: str, limit: int | None = None) -> int:
    """Reads the file from its start in 64 MiB pieces, to its end or past `limit` bytes; returns the bytes read."""
    buffer = memoryview(bytearray(64 << 20))
    done = 0
    with open(path, "rb", buffering=0) as f:
        while (limit is None or done < limit) and (n := f.readinto(buffer)):
            done += n
    return done


def cache(paths: list[str]) -> None:
    """Read the files through once, so that their pages are in the page cache where the memory holds them, once
    written back (a file just written is still being flushed to the disk, which a measured step would wait on)."""
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        read_through(path)


class Measured:
    """Peak RSS above the RSS at entry (the high-water mark is reset where the kernel allows it), bytes
    read from disk and seconds, of the code inside the with-block."""

    def __enter__(self) -> Measured:
        gc.collect()
        # what the measured code allocates shows as RSS growth, not as reuse of memory an earlier step freed
        return_freed_memory()
        self.base_rss = proc_kib("VmRSS") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        self.read0 = _read_bytes()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        self.read_bytes = _read_bytes() - self.read0
        self.peak_rss_bytes = proc_kib("VmHWM") * 1024 - self.base_rss


def _status_bytes(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssFile) of process `pid` in bytes: its own memory and the file pages it maps; None once gone."""
    try:
        anon, mapped = _status_kib(pid, "RssAnon", "RssFile")
    except (OSError, KeyError, ValueError):
        return None
    return anon * 1024, mapped * 1024


def _open_files(pid: int) -> int:
    """How many files process `pid` holds open (its descriptors: files, maps' own, pipes, sockets); 0 once gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


_SAMPLE_S = 0.02


def sampled_child(code: str, *, what: str, anon_limit: int | None = None) -> dict:
    """Run `code` in a fresh interpreter that knows the test models, sampling its memory and open files every 20 ms:
    {"seconds", "peak_anon_bytes", "peak_mapped_bytes", "peak_open_files"} and "result" (the JSON its last line
    printed), or
    "failed" (its error's last line), or "over_limit" (it was stopped when its own memory passed `anon_limit`,
    before the machine would run out). `what` names the row in a failure."""
    from ..tiny.geometry import test_models_env

    peak_anon = peak_mapped = peak_files = 0
    over = False
    # files, not pipes: a child that logs more than a pipe holds would wait for a reader that is sampling
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-P", "-c", code], env={**os.environ, **test_models_env()},
                                 stdout=out_file, stderr=err_file, text=True)
        while child.poll() is None:
            sizes = _status_bytes(child.pid)
            peak_files = max(peak_files, _open_files(child.pid))
            if sizes:
                peak_anon, peak_mapped = max(peak_anon, sizes[0]), max(peak_mapped, sizes[1])
                if anon_limit is not None and sizes[0] > anon_limit:
                    child.kill()
                    over = True
            time.sleep(_SAMPLE_S)
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    figures = {"seconds": time.perf_counter() - start, "peak_anon_bytes": peak_anon, "peak_mapped_bytes": peak_mapped,
               "peak_open_files": peak_files}
    if over:
        return {**figures, "over_limit": anon_limit}
    if child.returncode:
        lines = err.strip().splitlines() or [f"exit status {child.returncode}"]
        return {**figures, "failed": lines[-1][:400], "stderr": err[-4000:], "what": what}
    return {**figures, "result": json.loads(out.strip().splitlines()[-1])}


def sampled_call(module: str, function: str, *args, what: str, anon_limit: int | None = None) -> dict:
    """sampled_child's figures for `function(*args)` of a bench module (its "result" what the function returns)."""
    code = (f"import json; from comfyui_flux2dev.devtools.bench import {module} as s; "
            f"print(json.dumps(s.{function}(*{args!r})))")
    return sampled_child(code, what=what, anon_limit=anon_limit)


def in_child(module: str, function: str, *args, what: str) -> dict:
    """What `function(*args)` of a bench module returns (JSON), run in a fresh process that knows the test models:
    its memory and page faults are its own. `what` names the row in a failure."""
    return in_child_sampled(module, function, *args, what=what)[0]


def in_child_sampled(module: str, function: str, *args, what: str) -> tuple[dict, dict]:
    """in_child's result, and sampled_child's figures of the child."""
    done = sampled_call(module, function, *args, what=what)
    if "failed" in done:
        raise RuntimeError(f"bench child ({what}) failed:\n{done['stderr']}")
    return done.pop("result"), done


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": os.getloadavg()[0],  # other work on the machine makes every figure here noisy
    }


