"""`llama_server(binary, gguf)`: llama.cpp's `llama-server` on a GGUF file, on a free local
port, yielding once its `/health` answers 200; stopped on exit.

`slots` parallel slots (`-np`: the conversations it decodes at once), each with `slot_tokens` of
context (`-c` is their product), `threads` CPU threads (`-t`, default: llama.cpp's own), no web
UI; `extra`: more of its arguments.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.vllm_server import Served, free_port, launch


@contextmanager
def llama_server(
    binary: Path,
    gguf: Path,
    *,
    slots: int,
    slot_tokens: int = 1024,
    threads: int | None = None,
    extra: tuple[str, ...] = (),
) -> Iterator[Served]:
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", str(slots), "-c", str(slots * slot_tokens), "--no-webui"]
    if threads:
        command += ["-t", str(threads)]
    command += list(extra)
    served = launch(command, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 300
        while not _healthy(served.url):
            if served.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start:\n" + "".join(served.lines[-40:]))
            time.sleep(0.2)
        yield served
    finally:
        served.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
