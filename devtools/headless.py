"""A real ComfyUI server run headless on this machine, with the pack loaded, and a small client for it.
The tests and `flux2dev demo` use it; it starts ComfyUI as a child process and never imports comfy."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from ..errors import GraphError, HostError

PACK_ROOT = Path(__file__).resolve().parents[1]
# Any folder name works for the pack; the tests use one that differs from the repository's on purpose, the pictures
# in docs/ the one a user's clone has (README: Install).
PACK_FOLDER = "flux2dev-pack-under-test"
INSTALLED_FOLDER = "ComfyUI-Flux2Dev"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HeadlessComfy:
    """ComfyUI at `comfyui_root`, serving 127.0.0.1 with only this pack among the custom nodes.

    `models` maps a host model folder name (text_encoders, diffusion_models, vae, diffusers ...) to the
    folders whose entries are linked into the temporary base directory's models/<name>/. It runs on the CPU
    (--cpu), or with `gpu` on the GPU the host finds, with the host's own choices there (0.33: dynamic VRAM).
    `open_files`: the soft limit of open files it starts under (a macOS shell gives 256; Unix only)."""

    def __init__(self, comfyui_root: str | os.PathLike, models: dict[str, list[str | os.PathLike]] | None = None,
                 base_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None, gpu: bool = False,
                 pack_folder: str = PACK_FOLDER, open_files: int | None = None):
        self.comfyui_root = Path(comfyui_root)
        self._tmp = None if base_dir else tempfile.TemporaryDirectory(prefix="flux2dev-comfy-")
        self.base_dir = Path(base_dir or self._tmp.name)
        self.models = {k: [Path(f) for f in folders] for k, folders in (models or {}).items()}
        self.env = env or {}
        self.gpu = gpu
        self.pack_folder = pack_folder
        self.open_files = open_files
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.log_path = self.base_dir / "server.log"

    def __enter__(self) -> HeadlessComfy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _lay_out_base_dir(self) -> None:
        nodes = self.base_dir / "custom_nodes"
        nodes.mkdir(parents=True, exist_ok=True)
        link = nodes / self.pack_folder
        if not link.exists():
            link.symlink_to(PACK_ROOT, target_is_directory=True)
        for folder, sources in self.models.items():
            dest = self.base_dir / "models" / folder
            dest.mkdir(parents=True, exist_ok=True)
            for source in sources:
                for entry in source.iterdir():
                    if not (dest / entry.name).exists():
                        (dest / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())

    def start(self, timeout: float = 120.0) -> None:
        self._lay_out_base_dir()
        self.port = _free_port()
        cmd = [
            sys.executable, "main.py", *([] if self.gpu else ["--cpu"]),
            "--listen", "127.0.0.1", "--port", str(self.port),
            "--base-directory", str(self.base_dir), "--disable-auto-launch", "--disable-api-nodes",
            "--database-url", "sqlite:///:memory:",
            "--disable-all-custom-nodes", "--whitelist-custom-nodes", self.pack_folder,
        ]
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "wb")
        limit = None if self.open_files is None else functools.partial(_limit_open_files, self.open_files)
        self.process = subprocess.Popen(cmd, cwd=self.comfyui_root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        preexec_fn=limit)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise HostError(f"ComfyUI exited with status {self.process.returncode} while starting:\n{self.log()}")
            try:
                self.get("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.25)
        self.stop()
        raise HostError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"

    def get(self, path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return json.loads(r.read())

    def submit(self, graph: dict, client_id: str | None = None) -> str:
        body = json.dumps({"prompt": graph, "client_id": client_id or uuid.uuid4().hex}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/prompt", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())["prompt_id"]
        except urllib.error.HTTPError as e:
            raise GraphError(_refusal_text(json.loads(e.read() or b"{}"))) from None

    def wait(self, prompt_id: str, timeout: float = 600.0) -> dict:
        """The node outputs of a finished graph; GraphError with the host's text when a node failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            status = (entry or {}).get("status", {})
            if status.get("status_str") == "error":
                raise GraphError(_execution_error_text(status))
            if status.get("completed"):
                return entry["outputs"]
            if self.process is None or self.process.poll() is not None:
                raise HostError(f"ComfyUI stopped while running the graph:\n{self.log()}")
            time.sleep(0.2)
        raise HostError(f"the graph did not finish within {timeout:.0f} s")

    def run(self, graph: dict, timeout: float = 600.0) -> dict:
        return self.wait(self.submit(graph), timeout)

    def run_watched(self, graph: dict, timeout: float = 600.0) -> tuple[dict, list[dict]]:
        """Run a graph as the web UI does, listening on the server's websocket: its outputs, and every message
        the server sent about it (progress, executing, ...) in order."""
        prompt_id, messages = self.watch(graph, timeout)
        return self.wait(prompt_id, timeout), messages

    def watch(self, graph: dict, timeout: float = 600.0, on_message=None) -> tuple[str, list[dict]]:
        """Queue a graph as the web UI does and listen on the server's websocket until it ends (done, failed or
        interrupted): its prompt id and every message the server sent, in order. on_message(message) sees each
        as it comes (it may call interrupt())."""
        import asyncio

        import aiohttp

        client_id = uuid.uuid4().hex
        ends = ("execution_error", "execution_interrupted")

        async def watch() -> tuple[str, list[dict]]:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"http://127.0.0.1:{self.port}/ws?clientId={client_id}") as ws:
                    prompt_id = await asyncio.to_thread(self.submit, graph, client_id)
                    messages = []
                    async for message in ws:
                        if message.type != aiohttp.WSMsgType.TEXT:
                            continue
                        messages.append(json.loads(message.data))
                        if on_message is not None:
                            await asyncio.to_thread(on_message, messages[-1])
                        kind, data = messages[-1]["type"], messages[-1].get("data") or {}
                        if data.get("prompt_id") == prompt_id and (
                            kind in ends or (kind == "executing" and data.get("node") is None)
                        ):
                            return prompt_id, messages
                    return prompt_id, messages

        return asyncio.run(asyncio.wait_for(watch(), timeout))

    def _post(self, path: str, body: dict) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30):
            pass

    def interrupt(self) -> None:
        """Stop the graph that runs now, as the UI's cancel button does."""
        self._post("/interrupt", {})

    def free(self) -> None:
        """Unload the models and drop the node cache, as the UI's "Free model and node cache" does: the server does
        it when it next looks at its queue (after the graph it runs, or at once when idle)."""
        self._post("/free", {"unload_models": True, "free_memory": True})

    def output_file(self, saved: dict) -> Path:
        """Where a file an output node reported (SaveImage's images, SaveLatent's latents) lies on disk."""
        return self.base_dir / "output" / saved.get("subfolder", "") / saved["filename"]


def _limit_open_files(soft: int) -> None:
    """In the server's process before it starts: its soft limit of open files lowered to `soft`, as a shell's."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _refusal_text(body: dict) -> str:
    lines = [body.get("error", {}).get("message", "the server refused the graph")]
    for node_id, node in (body.get("node_errors") or {}).items():
        for err in node.get("errors", []):
            lines.append(f"node {node_id} ({node.get('class_type')}): {err.get('details') or err.get('message')}")
    return "\n".join(lines)


def _execution_error_text(status: dict) -> str:
    for kind, data in status.get("messages", []):
        if kind == "execution_error":
            return data.get("exception_message", "").strip()
    return "the graph failed without an error message"
