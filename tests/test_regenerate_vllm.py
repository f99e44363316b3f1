"""`python -m extract.regen --server` against a real vLLM server (its CPU build, started with the
Python DFLASH_VLLM_PYTHON names, as `.ci/run` sets it) serving the tiny demo target: the rows
equal our own greedy run's, token for token; a killed run resumes without losing a row or asking
for a finished one again (vLLM's own request counter); and the server stopping mid-run is a
message and a resumable state, not a traceback. Few rows, short turns: one server start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from extract.regen.config import RegenConfig, RegenError
from extract.regen.regenerate import run
from extract.regen.state import parts_dir, read_state
from tests.test_regenerate_server import _finished_rows, _turns
from tests.vllm_server import vllm_server

ROOT = Path(__file__).resolve().parents[1]
ROWS, ROWS_PER_CHUNK, MAX_NEW = 16, 4, 32

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.environ.get("DFLASH_VLLM_PYTHON"), reason="DFLASH_VLLM_PYTHON unset"),
]


@pytest.fixture(scope="module")
def demo():
    from extract.data import demo_dataset
    from extract.tiny import tiny_target

    return tiny_target(), demo_dataset()


@pytest.fixture(scope="module")
def server(demo):
    with vllm_server(os.environ["DFLASH_VLLM_PYTHON"], demo[0]) as served:
        yield served


@pytest.fixture(scope="module")
def local_run(demo, tmp_path_factory) -> tuple[Path, dict]:
    """Our own greedy run (Hugging Face `generate`) of the same rows: its output and totals."""
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    state = _regen(out, demo, gpus="cpu")
    return out, state.totals(range(len(state.chunks)))


@pytest.fixture(scope="module")
def local(local_run) -> Path:
    return local_run[0]


def _args(demo) -> list[str]:
    target, data = demo
    args = ["--target", str(target), "--data", str(data), "--max-rows", str(ROWS)]
    return args + ["--rows-per-chunk", str(ROWS_PER_CHUNK), "--max-new-tokens", str(MAX_NEW)]


def _regen(out: Path, demo, **over):
    target, data = demo
    cfg = dict(target=str(target), data=(data,), out=out, max_rows=ROWS)
    cfg.update(rows_per_chunk=ROWS_PER_CHUNK, max_new_tokens=MAX_NEW, **over)
    return run(RegenConfig(**cfg))


def _cli(out: Path, demo, url: str) -> subprocess.Popen:
    args = [*_args(demo), "--out", str(out), "--server", url, "--concurrency", "1"]
    args += ["--retries", "1", "--retry-wait", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "extract.regen", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_commit(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "committed chunk-" in line:
            break
    return lines


def _requests(url: str) -> float:
    """Requests vLLM has finished, by its own counter."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_rows_equal_our_greedy_run_token_for_token(server, demo, local_run, tmp_path):
    local, local_totals = local_run
    out = tmp_path / "served.jsonl"
    before = _requests(server.url)
    state = _regen(out, demo, server=server.url)
    assert out.read_bytes() == local.read_bytes()
    totals = state.totals(range(len(state.chunks)))
    # The same generated ids: the same turns whose ids extraction reads otherwise (a greedy
    # random model may emit a token sequence its tokenizer would not make of the text).
    assert totals["turns_retokenized"] == local_totals["turns_retokenized"]
    assert _requests(server.url) - before == sum(_turns(local).values())


def test_a_killed_run_resumes_losing_nothing_asking_nothing_twice(server, demo, local, tmp_path):
    out = tmp_path / "killed.jsonl"
    proc = _cli(out, demo, server.url)
    _wait_for_commit(proc)
    proc.kill()
    proc.communicate()
    finished = _finished_rows(out)
    assert finished and read_state(parts_dir(out)).merged_rows is None
    before = _requests(server.url)
    _regen(out, demo, server=server.url)
    assert out.read_bytes() == local.read_bytes()
    rest = sum(n for row, n in _turns(local).items() if row not in finished)
    assert _requests(server.url) - before == rest


def test_the_server_stopping_mid_run_is_a_message_and_a_resumable_state(server, demo, tmp_path):
    """Last in this module: it kills the server (SIGKILL: a crash, and no graceful drain that
    would keep answering for a while)."""
    out = tmp_path / "stopped.jsonl"
    proc = _cli(out, demo, server.url)
    _wait_for_commit(proc)
    server.stop(signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stdout + stderr
    message = stderr.strip().splitlines()[-1]
    assert "the run stopped (" in message and "run the same command to resume" in message
    finished = _finished_rows(out)
    assert finished and finished != set(range(ROWS))
    with pytest.raises(RegenError, match="no OpenAI-compatible server answers there"):
        _regen(out, demo, server=server.url)
