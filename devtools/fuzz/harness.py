"""The fuzzing harness: one input applied and run (the oracle: a normal return or the pack's own error, in
bounded CPU and memory, without blocking or quoting a file outside the model folder), the forked workers that
run the inputs, and the command line."""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from .files import FILE_KINDS, FileSpec, Gguf, JsonDoc, JsonLines, RawFile, Safetensors, write_kind
from .mutations import mutate_bytes, mutate_gguf, mutate_json, mutate_lines, mutate_safetensors
from .targets import LADDER_TARGETS, TARGETS, Fixtures, Tree, target_trees

QUICK_INPUTS = 100  # per target in the quick run (the tests run it with seed 0)
LONG_INPUTS = 20000  # per target in the long campaign (`fuzz --long`), a developer's run
# The regression corpus: by target, the seed-0 indices of inputs that once failed. Every run with seed 0 runs them
# besides its own; an input the long campaign finds is fixed, then its index joins here.
REGRESSIONS: dict[str, tuple[int, ...]] = {}
CPU_LIMIT_S = 5.0  # refusing a damaged file should take well under a second
WALL_LIMIT_S = 120.0  # even on a loaded machine
BLOCKED_S = 3.0  # this long asleep without using CPU is a hang (a FIFO opened, a lock never released)
MEMORY_SLACK = 256 << 20  # allowed peak growth: this plus MEMORY_PER_BYTE x the input's size
MEMORY_PER_BYTE = 4
ADDRESS_SPACE_MARGIN = 3 << 30  # RLIMIT_AS over a worker's start: a hard stop before the machine runs out
OUT_ENV = "FLUX2DEV_FUZZ_OUT"
CANARY = b"CANARY!!"  # the first bytes of a file beside each tree, outside every model folder
# What an error text may never hold: the canary's or /etc/passwd's first bytes, as text or as a number.
LEAKS = ("CANARY!!", str(int.from_bytes(CANARY, "little")), "root:x:", str(int.from_bytes(b"root:x:0", "little")))


@dataclass
class Case:
    tree: Tree
    rel: str  # the file changed
    notes: list[str]
    spec: FileSpec | None = None  # its new content, or
    kind: str | None = None  # its new kind (FILE_KINDS)


def make_case(target: str, trees: list[Tree], seed: int, index: int) -> Case:
    """Input `index` of `seed`: index < 0 is tree -1-index unchanged (the seed itself)."""
    if index < 0:
        tree = trees[-1 - index]
        return Case(tree, tree.mutable[0], ["unchanged"], tree.spec(tree.mutable[0]))
    rng = random.Random(f"{target}/{seed}/{index}")
    tree = rng.choice(trees)
    rel = rng.choice(tree.mutable)
    model = tree.files[rel]
    notes: list[str] = []
    if rng.random() < 0.01:
        kind = rng.choice(FILE_KINDS)
        return Case(tree, rel, [f"file kind: {kind}"], kind=kind)
    structured = not isinstance(model, RawFile) and rng.random() < 0.65
    if structured:
        value, text = getattr(model, "value", None), None
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            if isinstance(model, Gguf):
                model = mutate_gguf(model, rng, notes)
            elif isinstance(model, Safetensors) and model.text is None:
                model = mutate_safetensors(model, rng, notes)
            elif isinstance(model, JsonDoc):
                value, text = mutate_json(value, rng, notes)
            elif isinstance(model, JsonLines):
                model = mutate_lines(model, rng, notes)
        if text is not None:
            model = RawFile(text.encode("utf-8", "surrogatepass"))
    spec = model.spec()
    if not structured or rng.random() < 0.15:
        for _ in range(rng.choice((1, 1, 2, 4))):
            spec = mutate_bytes(spec, rng, notes)
    return Case(tree, rel, notes, spec)


def _memory() -> tuple[int, int]:
    """(current, peak) resident memory of this process, bytes."""
    status = Path("/proc/self/status").read_text()
    rss, hwm = (int(re.search(rf"{k}:\s+(\d+)", status)[1]) << 10 for k in ("VmRSS", "VmHWM"))
    return rss, hwm


def _site(exc: BaseException) -> str:
    """Where the exception was raised: the pack's innermost frame, and the innermost frame if elsewhere."""
    pack = str(Path(__file__).resolve().parents[2])
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if os.path.realpath(f.filename).startswith(pack) and "devtools" not in f.filename]
    parts = []
    if own:
        f = own[-1]
        parts.append(f"{os.path.relpath(os.path.realpath(f.filename), pack)}:{f.lineno} ({f.name})")
    if frames and (not own or frames[-1] is not own[-1]):
        f = frames[-1]
        name = f.filename.split("site-packages/")[-1] if "site-packages/" in f.filename \
            else os.path.basename(f.filename)
        parts.append(f"{name}:{f.lineno} ({f.name})")
    return " > ".join(parts) or "?"


def run_case(case: Case, root: Path, stamp: int, started: Callable[[], None] = lambda: None) -> dict:
    """Apply the case under `root` (the tree's copy), call the target, restore; the verdict as a dict."""
    from ...errors import Flux2DevError

    tree_root = root / case.tree.name
    path = tree_root / case.rel
    if case.kind is not None:
        write_kind(path, case.kind)
    else:
        case.spec.write(path)
        # A distinct mtime per input: caches keyed on (path, mtime, size) never mistake one input for another.
        os.utime(path, ns=(stamp, stamp))
    size = case.spec.written if case.spec is not None else 0
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
    except OSError:
        pass  # a kernel without it: the peak is the worker's, still bounded by RLIMIT_AS
    before, _ = _memory()
    cpu = time.process_time()
    verdict: dict = {"ok": True}
    started()
    try:
        problem = case.tree.run(tree_root / case.tree.entry)
        if problem:
            verdict = {"ok": False, "kind": "wrong result", "type": "-", "message": problem, "site": case.tree.name}
    except Flux2DevError as e:
        text = str(e)
        leak = next((m for m in LEAKS if m in text), None)
        if leak:
            verdict = {"ok": False, "kind": "leak", "type": type(e).__name__, "message": text[:400],
                       "site": f"the error text quotes a file outside the model folder ({leak!r})"}
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the tokenizers library's PanicException is a BaseException
        verdict = {"ok": False, "kind": "exception",
                   "type": f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins."),
                   "message": " ".join(str(e).split())[:400], "site": _site(e)}
    _, peak = _memory()
    growth = peak - before
    verdict["cpu_s"] = time.process_time() - cpu
    verdict["peak_mib"] = growth >> 20
    if verdict["ok"] and growth > MEMORY_SLACK + MEMORY_PER_BYTE * size:
        verdict = {**verdict, "ok": False, "kind": "memory", "type": "-", "site": case.tree.name,
                   "message": f"peak memory grew by {growth >> 20} MiB for a {size >> 20} MiB input"}
    # Back to the seed for the next input.
    case.tree.spec(case.rel).write(path)
    os.utime(path, ns=(1, 1))
    return verdict


def _write_tree(tree: Tree, root: Path) -> None:
    for rel in tree.files:
        path = root / tree.name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tree.spec(rel).write(path)
        os.utime(path, ns=(1, 1))


def _worker(conn, target: str, trees: list[Tree], seed: int, root: Path) -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the worker dies with the harness
        if "torch" in sys.modules:  # imported by prepare(), before the fork
            sys.modules["torch"].set_num_threads(1)
        root.mkdir(parents=True, exist_ok=True)
        (root / "canary").write_bytes(CANARY + b" a file outside every model folder\n")
        for tree in trees:
            _write_tree(tree, root)
        if target in LADDER_TARGETS:
            # Fixed costs of the worker, not of the input that first reaches them: the bundled vocabulary (the
            # ladder's last local rung, built once per process) and transformers' tokenizer modules.
            import transformers

            from ...tokenizers import resolve_tokenizer

            resolve_tokenizer()
            for probe in ("AutoProcessor", "AutoTokenizer", "PreTrainedTokenizerFast"):
                getattr(transformers, probe)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        size = int(re.search(r"VmSize:\s+(\d+)", Path("/proc/self/status").read_text())[1]) << 10
        limit = size + ADDRESS_SPACE_MARGIN
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        conn.send("ready")
        while True:
            index = conn.recv()
            if index is None:
                break
            try:
                case = make_case(target, trees, seed, index)
            except Exception as e:  # a bug of the harness: reported, never mistaken for the pack's
                conn.send({"ok": False, "kind": "harness error", "type": type(e).__name__, "message": str(e)[:300],
                           "site": _site(e)})
                continue
            conn.send(run_case(case, root, 10**9 + index + 2, lambda: conn.send("started")))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        os._exit(0)


def _cpu_seconds(pid: int) -> tuple[float, str]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, "?"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]


@dataclass
class Worker:
    process: Any
    conn: Any
    index: int | None = None
    running: bool = False  # the input is written and the entry point runs: the limits apply from here
    started: float = 0.0
    cpu0: float = 0.0
    idle_since: float = 0.0
    idle_cpu: float = 0.0


@dataclass
class Report:
    target: str
    seed: int
    inputs: int
    seconds: float = 0.0
    failures: list[dict] = field(default_factory=list)

    def groups(self) -> dict[tuple[str, str, str], list[dict]]:
        out: dict = {}
        for f in self.failures:
            out.setdefault((f["kind"], f["type"], f["site"]), []).append(f)
        return out

    def summary(self) -> str:
        lines = [f"{self.target}: {self.inputs} inputs (seed {self.seed}) in {self.seconds:.0f} s, "
                 f"{len(self.failures)} failure(s)"]
        for (kind, exc, site), found in sorted(self.groups().items(), key=lambda kv: -len(kv[1])):
            first = found[0]
            lines.append(f"  {len(found):5d} x {kind}: {exc} at {site}: {first['message'][:200]}")
            lines.append(f"          e.g. index {first['index']} ({first['tree']}/{first['file']}: "
                         f"{'; '.join(first['notes'])[:200]}) input: {first.get('saved', '-')}")
        return "\n".join(lines)


class Fuzzer:
    def __init__(self, target: str, trees: list[Tree], seed: int, out: Path, jobs: int, cpu_limit: float,
                 log: Callable[[str], None] = print):
        self.target, self.seed, self.out, self.jobs, self.cpu_limit, self.log = target, seed, out, jobs, cpu_limit, log
        self.trees = trees
        self.scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-"))
        self.workers: list[Worker | None] = [None] * jobs
        self.context = multiprocessing.get_context("fork")

    def _start(self, slot: int) -> Worker:
        parent, child = self.context.Pipe()
        root = self.scratch / f"w{slot}-{time.monotonic_ns()}"
        process = self.context.Process(target=_worker, args=(child, self.target, self.trees, self.seed, root),
                                       daemon=True)
        process.start()
        child.close()
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError(f"fuzz worker for {self.target} did not start")
        worker = Worker(process, parent)
        self.workers[slot] = worker
        return worker

    def _stop(self, slot: int) -> None:
        worker = self.workers[slot]
        if worker is not None:
            worker.process.kill()
            worker.process.join()
            worker.conn.close()
            self.workers[slot] = None

    def _record(self, report: Report, index: int, verdict: dict) -> None:
        failure = {"target": self.target, "seed": self.seed, "index": index, "tree": "?", "file": "?", "notes": [],
                   "saved": "", **verdict}
        if verdict["kind"] != "harness error":
            case = make_case(self.target, self.trees, self.seed, index)
            failure.update(tree=case.tree.name, file=case.rel, notes=case.notes)
            folder = self.out / (f"{self.target}-seed{self.seed}-"
                                 f"{index if index >= 0 else 'unchanged' + str(-1 - index)}")
            failure["saved"] = str(save_input(case, folder, failure))
        report.failures.append(failure)
        self.log(f"FAIL {self.target} seed {self.seed} index {index}: {verdict['kind']} {verdict['type']}: "
                 f"{verdict['message'][:300]} [{verdict['site']}] input: {failure['saved']}")

    def run(self, indices) -> Report:
        indices = list(indices)
        report = Report(self.target, self.seed, sum(1 for i in indices if i >= 0))
        start = time.monotonic()
        pending = list(reversed(indices))
        try:
            while pending or any(w is not None and w.index is not None for w in self.workers):
                for slot in range(self.jobs):
                    worker = self.workers[slot]
                    if pending and (worker is None or worker.index is None):
                        worker = worker or self._start(slot)
                        worker.index, worker.running = pending.pop(), False
                        worker.started = worker.idle_since = time.monotonic()
                        worker.cpu0 = worker.idle_cpu = _cpu_seconds(worker.process.pid)[0]
                        worker.conn.send(worker.index)
                busy = [w.conn for w in self.workers if w is not None and w.index is not None]
                ready = wait(busy, timeout=0.25)
                now = time.monotonic()
                for slot in range(self.jobs):
                    worker = self.workers[slot]
                    if worker is None or worker.index is None:
                        continue
                    if worker.conn in ready:
                        try:
                            verdict = worker.conn.recv()
                            if verdict == "started":  # the input is written: its time starts now
                                worker.running = True
                                worker.started = worker.idle_since = now
                                worker.cpu0 = worker.idle_cpu = _cpu_seconds(worker.process.pid)[0]
                                continue
                        except (EOFError, OSError):
                            code = worker.process.join(1) or worker.process.exitcode
                            verdict = {"ok": False, "kind": "crash", "type": f"exit {code}", "site": "worker",
                                       "message": "the worker process died (a signal such as SIGBUS/SIGSEGV, "
                                                  "or the OOM killer)"}
                        index, worker.index = worker.index, None
                        if not verdict["ok"]:
                            self._stop(slot)
                            self._record(report, index, verdict)
                        continue
                    cpu, state = _cpu_seconds(worker.process.pid)
                    if cpu - worker.idle_cpu > 0.05:
                        worker.idle_since, worker.idle_cpu = now, cpu
                    problem = None
                    # Writing a huge input costs the harness, not the entry point: only the wall clock bounds it.
                    if worker.running and cpu - worker.cpu0 > self.cpu_limit:
                        problem = ("slow", f"more than {self.cpu_limit:g} s of CPU")
                    elif now - worker.started > WALL_LIMIT_S:
                        problem = ("hang", f"no answer after {WALL_LIMIT_S:g} s")
                    # Asleep (S), not waiting on the disk or for memory (D): a loaded machine makes those
                    # waits last seconds, and the wall clock bounds them.
                    elif worker.running and state == "S" and now - worker.idle_since > BLOCKED_S:
                        problem = ("hang", f"blocked for {BLOCKED_S:g} s without using CPU")
                    if problem:
                        index = worker.index
                        self._stop(slot)
                        self._record(report, index, {"ok": False, "kind": problem[0], "type": "-", "site": "-",
                                                     "message": problem[1]})
        finally:
            for slot in range(self.jobs):
                if self.workers[slot] is not None:
                    self.workers[slot].conn.send(None)
                self._stop(slot)
            shutil.rmtree(self.scratch, ignore_errors=True)
        report.seconds = time.monotonic() - start
        return report


def save_input(case: Case, folder: Path, verdict: dict) -> Path:
    """The input as a file (the changed file at its place in the tree) and what happened, under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / case.tree.name / case.rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if case.kind is None:
        case.spec.write(path)
    (folder / "failure.json").write_text(json.dumps({**verdict, "rebuild": "the other files of the tree are the "
                                                     "tiny fixture's, rebuilt by devtools/fuzz/"},
                                                    indent=1, default=str))
    return path


def fuzz_target(target: str, fixtures: Fixtures | list[Tree], *, inputs: int, seed: int, out: Path, jobs: int = 2,
                cpu_limit: float = CPU_LIMIT_S, log: Callable[[str], None] = print) -> Report:
    """Every seed tree unchanged (each must pass), then `inputs` mutated inputs, and with seed 0 the target's
    REGRESSIONS beyond them. `fixtures` may also be the trees themselves (the tests' own)."""
    trees = target_trees(target, fixtures) if isinstance(fixtures, Fixtures) else fixtures
    fuzzer = Fuzzer(target, trees, seed, out, jobs, cpu_limit, log)
    again = sorted(i for i in REGRESSIONS.get(target, ()) if i >= inputs) if seed == 0 else []
    return fuzzer.run([-1 - k for k in range(len(trees))] + list(range(inputs)) + again)


def reproduce(target: str, fixtures: Fixtures, seed: int, index: int, out: Path) -> int:
    """One input in this process, its traceback shown; the input is written under `out`."""
    trees = target_trees(target, fixtures)
    case = make_case(target, trees, seed, index)
    root = Path(tempfile.mkdtemp(prefix="fuzz-one-"))
    (root / "canary").write_bytes(CANARY + b"\n")
    for tree in trees:
        _write_tree(tree, root)
    print(f"{target} seed {seed} index {index}: {case.tree.name}/{case.rel}: {'; '.join(case.notes)}")
    from ...errors import Flux2DevError

    tree_root = root / case.tree.name
    if case.kind:
        write_kind(tree_root / case.rel, case.kind)
    else:
        case.spec.write(tree_root / case.rel)
    try:
        problem = case.tree.run(tree_root / case.tree.entry)
        print(f"returned normally{': ' + problem if problem else ''}")
    except Flux2DevError as e:
        print(f"refused with {type(e).__name__}: {e}")
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    print("input:", save_input(case, out / f"{target}-seed{seed}-{index}", {"notes": case.notes}))
    shutil.rmtree(root, ignore_errors=True)
    return 0


def prepare(fixtures: str | None) -> Fixtures:
    """The process's setup before any worker forks: tiny models known, tokenizers single-threaded, the
    bundled tokenizer built once (every worker inherits it), the loaders imported."""
    from ..tiny.geometry import test_models_env

    os.environ.update(test_models_env())
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    if fixtures is None:
        from .. import tiny

        fixtures = tempfile.mkdtemp(prefix="fuzz-tiny-")
        print(f"writing the tiny fixtures to {fixtures} (pass --fixtures to reuse them)")
        tiny.write_all(fixtures)
    from ...loaders.models import encoder, gguf_transformer, inspect, pipeline, transformer  # noqa: F401
    from ...tokenizers import resolve_tokenizer

    resolve_tokenizer()
    return Fixtures(Path(fixtures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comfyui_flux2dev.devtools fuzz",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="repeatable; default: all")
    parser.add_argument("--inputs", type=int, default=QUICK_INPUTS, help=f"per target (default {QUICK_INPUTS})")
    parser.add_argument("--long", action="store_true", help=f"{LONG_INPUTS} inputs per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index", type=int, help="run this one input in this process and show its traceback")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--cpu", type=float, default=CPU_LIMIT_S, help="CPU seconds one input may take")
    parser.add_argument("--fixtures",
                        help="a folder written by the dev tools' `tiny` (default: write one to a temp dir)")
    parser.add_argument("--out", help=f"where failing inputs go (default ${OUT_ENV} or a temp dir)")
    parser.add_argument("--json", help="write the reports here as JSON")
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get(OUT_ENV) or tempfile.mkdtemp(prefix="flux2dev-fuzz-"))
    fixtures = prepare(args.fixtures)
    targets = args.target or list(TARGETS)
    if args.index is not None:
        return reproduce(targets[0], fixtures, args.seed, args.index, out)
    inputs = LONG_INPUTS if args.long else args.inputs
    reports = []
    for target in targets:
        report = fuzz_target(target, fixtures, inputs=inputs, seed=args.seed, out=out, jobs=args.jobs,
                             cpu_limit=args.cpu)
        print(report.summary(), flush=True)
        reports.append(report)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in reports], indent=1, default=str))
    total = sum(len(r.failures) for r in reports)
    print(f"{len(reports)} target(s), {sum(r.inputs for r in reports)} inputs, {total} failure(s); inputs under {out}")
    return 1 if total else 0
