"""The output folder lock: one holder, its name in the refusal, stale locks taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shared.lock import LOCK_FILE, LockHeld, acquire, output_lock, release
from tests.cachegen import write_cache

ROOT = Path(__file__).resolve().parents[1]
HOLD = (
    "import sys; from shared.lock import acquire; acquire(sys.argv[1], 'holder test'); "
    "print('held', flush=True); sys.stdin.read()"
)


def holder(folder: Path) -> subprocess.Popen:
    """A process holding `folder`'s lock until its stdin closes; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"  # blocks until then (pytest's timeout)
    return proc


def test_second_holder_is_refused_naming_the_first(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(LockHeld) as e:
            acquire(tmp_path)
        assert f"pid {proc.pid}" in str(e.value) and socket.gethostname() in str(e.value)
        assert "holder test" in str(e.value)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_lock_of_a_killed_holder_is_taken_over(tmp_path, caplog):
    proc = holder(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid
    fd = acquire(tmp_path)
    assert "stale lock" in caplog.text and str(proc.pid) in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    release(tmp_path, fd)
    assert not (tmp_path / LOCK_FILE).exists()
    assert sorted(os.listdir(tmp_path)) == []


def test_lock_from_another_host_is_refused_with_what_to_do(tmp_path):
    record = {"pid": 1, "host": "elsewhere", "started": 0, "command": "python -m train"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(LockHeld, match="elsewhere.*delete"):
        acquire(tmp_path)


def test_a_new_folder_left_empty_is_removed(tmp_path):
    with output_lock(tmp_path / "new"):
        assert (tmp_path / "new" / LOCK_FILE).is_file()
    assert not (tmp_path / "new").exists()


def test_extract_and_train_refuse_a_locked_output(tmp_path, tiny_qwen3):
    from extract.__main__ import main as extract_main
    from train.__main__ import main as train_main

    out = tmp_path / "busy"
    proc = holder(out)
    try:
        r = CliRunner().invoke(
            extract_main, ["--out", str(out), "--target", str(tiny_qwen3), "--gpus", "cpu"]
        )
        assert r.exit_code == 1 and f"pid {proc.pid}" in r.output, r.output
        cache = write_cache(tmp_path / "cache", num_parts=2)
        args = ["--data", str(cache), "--out", str(out), "--gpus", "cpu", "--workers", "0"]
        r = CliRunner().invoke(train_main, args)
        assert r.exit_code == 1 and f"pid {proc.pid}" in r.output, r.output
        assert sorted(os.listdir(out)) == [LOCK_FILE]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


# Runs a command line's main in a fresh interpreter, then says whether the slow stacks were
# imported: `--help` and a refusal must come before them.
CLI_RUN = """
import runpy, sys
module, args = sys.argv[1], sys.argv[2:]
sys.argv = [module, *args]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("exit", code, "imported", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI_RUN, module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("module", ["extract", "train", "extract.regen", "extract.verify"])
def test_help_answers_without_torch_or_transformers(module):
    done = run_cli(module, "-h")
    assert "Usage:" in done.stdout and "exit 0 imported []" in done.stdout, done.stdout


def test_a_locked_folder_is_refused_before_torch_is_imported(tmp_path):
    out = tmp_path / "busy"
    proc = holder(out)
    try:
        for module, args in [
            ("extract", ["--out", str(out)]),
            ("train", ["--data", str(tmp_path / "no-cache"), "--out", str(out)]),
        ]:
            done = run_cli(module, *args)
            assert f"pid {proc.pid}" in done.stderr, done.stderr
            assert "exit 1 imported []" in done.stdout, (module, done.stdout)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_export_takes_h_for_help():
    from train.export import main as export_main

    r = CliRunner().invoke(export_main, ["-h"])
    assert r.exit_code == 0 and "Usage:" in r.output


def test_a_lock_that_cannot_be_written_leaves_no_file(tmp_path):
    """A full disk (here: a file size limit of 0) fails taking the lock with OSError and
    leaves the folder as it was."""
    code = (
        "import resource, signal, sys\n"
        "from shared.lock import acquire\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        "try:\n"
        "    acquire(sys.argv[1])\n"
        "except OSError as e:\n"
        "    sys.exit(f'OSError {e.errno}')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True)
    assert done.stderr.decode().startswith("OSError"), done.stderr.decode()
    assert os.listdir(tmp_path) == []
