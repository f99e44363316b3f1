"""Ctrl-C or SIGTERM (a job scheduler's) to python -m train.sweep outside its runs (while it
checks the grid, while it writes its report): one message saying what it was doing and the
command that goes on, no traceback, no file left half written. A rerun while a stopped sweep's
run still holds its folder waits for it, while its other runs go on."""

import contextlib
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from shared.fsio import is_atomic_tmp
from tests.cachegen import write_cache
from tests.held_file import ROOT, held_file, interrupted_at_open
from train.sweep.__main__ import main

TRAIN = [
    "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "512",
    "--workers", "0", "--shuffle-buffer", "4", "--steps", "2", "--log-every", "2",
    "--eval-parts", "1", "--checkpoint-every", "2",
]  # fmt: skip


def sweep_args(cache, out):
    return ["--data", str(cache), "--out", str(out), "--vary", "optimizer=adamw,muon", "--seeds",
            "1", "--gpus", "cpu", *TRAIN]  # fmt: skip


STOPS = [signal.SIGINT, signal.SIGTERM]
STOPPED = {signal.SIGINT: "stopped while ", signal.SIGTERM: "stopped by SIGTERM while "}


def stopped_while(done, sig) -> str:
    """What the sweep stopped by `sig` said it was doing; it said no more than that and how to
    go on, and exited with an error's status (not killed by the signal)."""
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    said = done.stderr.strip().splitlines()
    assert said[-1].startswith("resume: python -m train.sweep --data "), done.stderr
    assert said[-2].startswith(f"Error: {STOPPED[sig]}"), done.stderr
    return said[-2].removeprefix(f"Error: {STOPPED[sig]}")


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_stop_while_the_grid_is_checked(tmp_path, sig):
    """A stop signal while the sweep reads the cache's manifest to check each variant against
    it (the first time it opens it): stopped before any run, the sweep folder not made."""
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    manifest = cache / "manifest.json"
    done = interrupted_at_open("train.sweep", sweep_args(cache, out), manifest, sig=sig)
    assert stopped_while(done, sig) == "checking the grid, before any run started"
    assert not out.exists()


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: s.name)
def test_a_stop_while_the_report_is_written(tmp_path, monkeypatch, sig):
    """A stop signal while the sweep of finished runs writes its plots (where matplotlib,
    imported for them, reads its settings file): no file is left half written, and the same
    command writes the report."""
    pytest.importorskip("matplotlib")
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    result = CliRunner().invoke(main, sweep_args(cache, out))
    assert result.exit_code == 0, result.output
    settings = tmp_path / "matplotlibrc"
    settings.write_text("backend: Agg\n")
    monkeypatch.setenv("MATPLOTLIBRC", str(settings))
    done = interrupted_at_open("train.sweep", sweep_args(cache, out), settings, sig=sig)
    assert stopped_while(done, sig).startswith("writing the report"), done.stderr
    assert [n for n in os.listdir(out) if is_atomic_tmp(n)] == []
    assert "2 runs: 2 finished already, 0 to run" in done.stderr
    result = CliRunner().invoke(main, sweep_args(cache, out))
    assert result.exit_code == 0 and "| optimizer=muon | 1 |" in result.output, result.output


HOLDER = "python -m train --out (the test's holder)"  # the command its lock file names
HOLD_LOCK = """
import sys
from shared.lock import output_lock
with output_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes its end
"""


class Said:
    """A process's standard error, read line by line by a thread, so that a test waits for a
    line with a bound: a process that falls silent fails the test, with what it said, instead
    of hanging the suite."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.ended = False
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc.stderr,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)  # the end of its output

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def _next(self, deadline: float, waiting_for: str) -> str | None:
        """Its next line, None at the end of its output; AssertionError after `deadline`."""
        try:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{waiting_for}: timed out; it said:\n{self.text}") from None
        if line is None:
            self.ended = True
        else:
            self.lines.append(line)
        return line

    def until(self, *texts: str, timeout: float = 300) -> str:
        """The first line, from here on, that holds one of `texts`; AssertionError, with what
        the process said, where its output ends or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            line = self._next(deadline, f"waiting for a line saying {texts}")
            if line is not None and any(t in line for t in texts):
                return line
        raise AssertionError(f"it ended without a line saying {texts}; it said:\n{self.text}")

    def rest(self, timeout: float = 300) -> str:
        """All it said, once its output has ended (within `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            self._next(deadline, "waiting for the end of its output")
        return self.text


@contextlib.contextmanager
def waiting_sweep(tmp_path, optimizers="adamw"):
    """A sweep of a run for each of `optimizers`, on one slot, started while a child process
    holds the first run's folder lock (as an earlier sweep's run, still saving its checkpoint
    after that sweep was killed, does), read until it says that it waits for it: (the sweep,
    what it says, the run folder, a function that makes the child let the lock go). The block's
    end lets it go and ends the sweep."""
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    args = ["--data", str(cache), "--out", str(out), "--vary", f"optimizer={optimizers}"]
    folder = out / "runs" / "optimizer=adamw" / "seed-0"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    hold = [sys.executable, "-c", HOLD_LOCK, str(folder), HOLDER]
    earlier = subprocess.Popen(hold, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def release() -> None:
        earlier.stdin.close()
        earlier.wait()

    sweep = None
    try:
        assert earlier.stdout.readline() == b"held\n"
        cmd = [sys.executable, "-m", "train.sweep", *args, "--seeds", "1", "--gpus", "cpu", *TRAIN]
        sweep = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        said = Said(sweep)
        waiting = f"waiting for pid {earlier.pid} holding {folder}: optimizer=adamw seed 0 "
        line = said.until(waiting, "starting optimizer=adamw")
        assert waiting in line, f"it started the run while its folder was held:\n{said.text}"
        assert line.rstrip().endswith(f"once it has ended; its command: {HOLDER}"), line
        yield sweep, said, folder, release
    finally:
        if not earlier.stdin.closed:
            release()
        if sweep is not None and sweep.poll() is None:  # the block failed: end it
            sweep.kill()
            sweep.wait()


def test_a_rerun_waits_for_the_earlier_run_that_holds_its_folder(tmp_path):
    """The run is started once the earlier process has let its folder go, and finishes
    (train would have refused the folder)."""
    with waiting_sweep(tmp_path) as (sweep, said, folder, release):
        release()
        said.until("finished optimizer=adamw seed 0 (1 of 1 ended, 0 left)")
        assert sweep.wait(timeout=300) == 0, said.rest()
        assert (folder / "export" / "model.safetensors").is_file()


def test_the_other_runs_go_on_while_an_earlier_run_holds_a_folder(tmp_path):
    """Of two runs on one slot, the first one's folder held: the second is started meanwhile,
    and its end is counted; the first is started once its folder is let go. The wait is said
    once."""
    with waiting_sweep(tmp_path, "adamw,muon") as (sweep, said, folder, release):
        said.until("finished optimizer=muon seed 0 (1 of 2 ended, 1 left)")
        release()
        said.until("finished optimizer=adamw seed 0 (2 of 2 ended, 0 left)")
        assert sweep.wait(timeout=300) == 0, said.rest()
    started = [line for line in said.lines if "starting " in line]
    assert len(started) == 2, said.text
    assert "starting optimizer=muon seed 0 (1 of 2) on cpu" in started[0], said.text
    assert "starting optimizer=adamw seed 0 (2 of 2) on cpu" in started[1], said.text
    assert said.text.count("waiting for pid") == 1, said.text
    assert (folder / "export" / "model.safetensors").is_file()


def test_a_stop_signal_ends_the_wait_for_an_earlier_run(tmp_path):
    """SIGTERM while the sweep waits: it stops at once, the run not started, with the command
    that goes on, while the earlier process still holds the folder."""
    with waiting_sweep(tmp_path) as (sweep, said, folder, _):
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=300) == 1, said.rest()
        rest = said.rest()
        assert (folder / ".lock").is_file()
    assert "stopped by SIGTERM; not finished: optimizer=adamw seed 0" in rest
    assert "resume: python -m train.sweep --data" in rest and "starting" not in rest


def only_child(pid: int) -> int:
    """The pid of the one process whose parent is `pid` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # its ppid
                children.append(int(stat.parent.name))
    assert len(children) == 1, f"pid {pid} has the children {children}"
    return children[0]


def test_a_run_that_failed_on_its_own_before_a_stop_signal_is_not_said_stopped(tmp_path):
    """A run killed from outside (the out-of-memory killer, say) just before the sweep gets
    SIGTERM, its end not yet seen (the sweep is held by SIGSTOP meanwhile): the sweep never
    passed it the signal, so it is said to have ended with its status, not to have been
    stopped."""
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "train.sweep", *sweep_args(cache, out)]
    with held_file(
        cache / "part-000000" / "zarr.json"
    ) as opened:  # the runs read it, not the sweep
        sweep = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        said = Said(sweep)
        try:
            opened(timeout=300)  # the first run reads its data
            run = only_child(sweep.pid)
            os.kill(sweep.pid, signal.SIGSTOP)
            ended = os.pidfd_open(run)
            os.kill(run, signal.SIGKILL)
            assert select.select([ended], [], [], 60)[0], f"pid {run} still runs after SIGKILL"
            os.close(ended)
            os.kill(sweep.pid, signal.SIGTERM)
            os.kill(sweep.pid, signal.SIGCONT)
            assert sweep.wait(timeout=300) == 1, said.rest()
        finally:
            if sweep.poll() is None:
                sweep.kill()
                sweep.wait()
    rest = said.rest()
    assert "optimizer=adamw seed 0 ended with status -9 before its export" in rest, rest
    assert "stopped before its export" not in rest, rest
    assert "stopped by SIGTERM; not finished: optimizer=adamw seed 0, optimizer=muon" in rest
