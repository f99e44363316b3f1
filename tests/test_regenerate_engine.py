"""`python -m extract.regen --engine vllm`: vLLM in the regenerating process (its CPU build, in
the Python DFLASH_VLLM_PYTHON names, as `.ci/run` sets it) on the tiny demo target. The rows equal
our own greedy run's, token for token; sampled rows do not depend on the concurrency; a killed
run and a Ctrl-C'd one resume without losing a row or generating a finished one again. Without
vLLM, the option is a message.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from extract.regen.config import RegenConfig, RegenError
from extract.regen.regenerate import run
from extract.regen.state import parts_dir, read_state
from tests.test_regenerate_server import _finished_rows

ROOT = Path(__file__).resolve().parents[1]
ROWS, ROWS_PER_CHUNK, MAX_NEW = 48, 4, 32
VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")


def needs_vllm(test):
    marks = (pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON, reason="no DFLASH_VLLM_PYTHON"))
    for mark in marks:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def demo():
    from extract.data import demo_dataset
    from extract.tiny import tiny_target

    return tiny_target(), demo_dataset()


@pytest.fixture(scope="module")
def local(demo, tmp_path_factory) -> Path:
    """Our own greedy run (Hugging Face `generate`) of the same rows: its output."""
    target, data = demo
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    cfg = dict(target=str(target), data=(data,), out=out, max_rows=ROWS, gpus="cpu")
    run(RegenConfig(**cfg, rows_per_chunk=ROWS_PER_CHUNK, max_new_tokens=MAX_NEW))
    return out


def _engine(out: Path, demo, *more: str) -> subprocess.Popen:
    target, data = demo
    args = ["--engine", "vllm", "--target", str(target), "--data", str(data), "--out", str(out)]
    args += ["--max-rows", str(ROWS), "--rows-per-chunk", str(ROWS_PER_CHUNK)]
    args += ["--max-new-tokens", str(MAX_NEW), *more]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [VLLM_PYTHON, "-m", "extract.regen", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    stdout, stderr = proc.communicate(timeout=600)
    return proc.returncode, stdout + stderr


def _until_commit(proc: subprocess.Popen) -> None:
    for line in proc.stderr:
        if "committed chunk-" in line:
            return
    raise AssertionError("the run ended before committing a chunk")


def _asked(log: str) -> int:
    """The rows a run handed to the engine: its progress line's total."""
    totals = re.findall(r"regenerate: of ([\d,]+) rows", log)
    assert totals, log[-3000:]
    return int(totals[-1].replace(",", ""))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_option_is_a_message(demo, tmp_path):
    target, data = demo
    cfg = RegenConfig(target=str(target), data=(data,), out=tmp_path / "o.jsonl", engine="vllm")
    with pytest.raises(RegenError, match="vLLM is not importable in this Python"):
        run(cfg)


def test_an_engine_with_a_server_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--engine vllm: the server generates"):
        RegenConfig(out=tmp_path / "o.jsonl", engine="vllm", server="http://localhost:1")


@needs_vllm
def test_rows_equal_our_greedy_run_token_for_token(demo, local, tmp_path):
    out = tmp_path / "engine.jsonl"
    code, log = _finish(_engine(out, demo, "--concurrency", "16"))
    assert code == 0, log[-3000:]
    assert out.read_bytes() == local.read_bytes()
    assert read_state(parts_dir(out)).settings["engine"] == "vllm"


@needs_vllm
def test_sampled_rows_do_not_depend_on_the_concurrency(demo, tmp_path):
    """Each turn draws from its own seed (the run's, the row's and the turn's)."""
    outs = []
    for concurrency in ("1", "12"):
        outs.append(tmp_path / f"sampled-{concurrency}.jsonl")
        proc = _engine(outs[-1], demo, "--concurrency", concurrency, "--temperature", "0.8")
        code, log = _finish(proc)
        assert code == 0, log[-3000:]
    assert outs[0].read_bytes() == outs[1].read_bytes()


@needs_vllm
@pytest.mark.parametrize("stop", ["kill", "ctrl-c"])
def test_a_stopped_run_resumes_losing_nothing_generating_nothing_twice(demo, local, tmp_path, stop):
    """SIGKILL: the journals keep what was finished; SIGINT: the conversations in flight are
    finished first, then a message. Either way the rerun asks only for the rest."""
    out = tmp_path / f"{stop}.jsonl"
    proc = _engine(out, demo, "--concurrency", "1")
    _until_commit(proc)
    proc.send_signal(signal.SIGKILL if stop == "kill" else signal.SIGINT)
    code, log = _finish(proc)
    finished = _finished_rows(out)
    assert finished and finished != set(range(ROWS)), log[-3000:]
    assert read_state(parts_dir(out)).merged_rows is None
    if stop == "ctrl-c":
        assert code == 1 and "Traceback" not in log, log[-3000:]
        message = log.strip().splitlines()[-1]
        assert "stopped by a signal" in message and "run the same command to resume" in message
    code, log = _finish(_engine(out, demo, "--concurrency", "4"))
    assert code == 0, log[-3000:]
    assert out.read_bytes() == local.read_bytes()
    assert _asked(log) == ROWS - len(finished)
