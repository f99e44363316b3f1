"""The output folder lock: one holder, named in the refusal by its pid and its command line,
stale locks taken over."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shared.lock import COMMAND_CHARS, LOCK_FILE, LockHeld, acquire, output_lock, release
from tests.cachegen import write_cache
from tests.held_file import held_file

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
    assert "its command: holder test" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    release(tmp_path, fd)
    assert not (tmp_path / LOCK_FILE).exists()
    assert sorted(os.listdir(tmp_path)) == []


def test_lock_from_another_host_is_refused_with_what_to_do(tmp_path):
    record = {"pid": 1, "host": "elsewhere", "started": 0, "command": "python -m train"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(LockHeld, match="(?s)elsewhere.*python -m train.*delete"):
        acquire(tmp_path)


def test_a_long_command_line_is_kept_shortened(tmp_path):
    """A holder's command line of 100,000 characters (a long list of files, say) is kept cut
    to its first words: the lock file stays one a refusal reads in full, naming the holder."""
    command = "python -m extract --data " + " ".join(f"/data/file-{i}.jsonl" for i in range(5000))
    fd = acquire(tmp_path, command)
    try:
        with pytest.raises(LockHeld) as e:
            acquire(tmp_path)
    finally:
        release(tmp_path, fd)
    said = str(e.value)
    assert f"pid {os.getpid()}" in said, said
    cut = said.split("running:\n  ")[1].split("\n")[0]
    assert cut.startswith("python -m extract --data /data/file-0.jsonl /data/file-1.jsonl"), cut
    assert cut.endswith(" more characters)") and len(cut) < COMMAND_CHARS + 40, cut


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
        assert "running:\n  holder test\n" in r.output, r.output
        cache = write_cache(tmp_path / "cache", num_parts=2)
        args = ["--data", str(cache), "--out", str(out), "--gpus", "cpu", "--workers", "0"]
        r = CliRunner().invoke(train_main, args)
        assert r.exit_code == 1 and f"pid {proc.pid}" in r.output, r.output
        assert "running:\n  holder test\n" in r.output, r.output
        assert sorted(os.listdir(out)) == [LOCK_FILE]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_folder_held_by_a_train_run_is_refused_with_its_command_line(tmp_path, tiny_qwen3):
    """`python -m train` holds its --out while it reads the cache (held at its first read of a
    hidden-state chunk, after it took the lock): a second train or an extraction on that
    folder is refused naming that run's command line, its options too, as it was typed."""
    from extract.__main__ import main as extract_main
    from train.__main__ import main as train_main

    cache = write_cache(tmp_path / "cache", num_parts=2)
    out = tmp_path / "run"
    args = ["--data", str(cache), "--out", str(out), "--gpus", "cpu", "--workers", "0"]
    args += ["--steps", "2", "--log-every", "2"]
    chunk = min((cache / "part-000000" / "hidden").glob("c.*"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with held_file(chunk) as opened:
        run = subprocess.Popen(
            [sys.executable, "-m", "train", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE
        )
        try:
            opened(timeout=120)
            again = CliRunner().invoke(train_main, args)
            extract = CliRunner().invoke(
                extract_main, ["--out", str(out), "--target", str(tiny_qwen3)]
            )
        finally:
            run.kill()
            run.wait(timeout=30)
    typed = shlex.join(["python", "-m", "train", *args])
    for r in (again, extract):
        assert r.exit_code == 1 and f"{out} is in use by pid {run.pid} on host " in r.output
        assert f"running:\n  {typed}\nWait for it to finish" in r.output, r.output


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


@pytest.mark.parametrize(
    ("command", "state"),
    [
        ("python -m extract --out /c --data d.jsonl", "an extraction is writing it (pid"),
        ("python -m extract.verify /c --repair", "no extraction is running on it"),
        ("python -m train --data /c --follow", "no extraction is running on it"),
    ],
)
def test_a_follower_tells_an_extraction_from_other_holders_of_the_cache(tmp_path, command, state):
    """A run following the cache names an extraction only where the lock's holder is one:
    `extract.verify --repair` holding it for a moment is not an extraction writing it."""
    from train.data.follow import extraction_state

    fd = acquire(tmp_path, command)
    try:
        assert extraction_state(tmp_path).startswith(state)
    finally:
        release(tmp_path, fd)
