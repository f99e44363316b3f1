"""Ctrl-C to python -m train.sweep outside its runs (while it checks the grid, while it writes
its report): one message saying what it was doing and the command that goes on, no traceback,
no file left half written. A rerun while a stopped sweep's run still holds its folder waits
for it."""

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from shared.fsio import is_atomic_tmp
from tests.cachegen import write_cache
from tests.held_file import ROOT, interrupted_at_open
from train.sweep.__main__ import main

TRAIN = [
    "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "512",
    "--workers", "0", "--shuffle-buffer", "4", "--steps", "2", "--log-every", "2",
    "--eval-parts", "1", "--checkpoint-every", "2",
]  # fmt: skip


def sweep_args(cache, out):
    return ["--data", str(cache), "--out", str(out), "--vary", "optimizer=adamw,muon", "--seeds",
            "1", "--gpus", "cpu", *TRAIN]  # fmt: skip


def stopped_while(done) -> str:
    """What the interrupted sweep said it was doing; it said no more than that and how to go
    on."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    said = done.stderr.strip().splitlines()
    assert said[-1].startswith("resume: python -m train.sweep --data "), done.stderr
    assert said[-2].startswith("Error: stopped while "), done.stderr
    return said[-2].removeprefix("Error: stopped while ")


def test_ctrl_c_while_the_grid_is_checked(tmp_path):
    """SIGINT while the sweep reads the cache's manifest to check each variant against it (the
    first time it opens it): stopped before any run, the sweep folder not made."""
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    done = interrupted_at_open("train.sweep", sweep_args(cache, out), cache / "manifest.json")
    assert stopped_while(done) == "checking the grid, before any run started"
    assert not out.exists()


def test_ctrl_c_while_the_report_is_written(tmp_path, monkeypatch):
    """SIGINT while the sweep of finished runs writes its plots (where matplotlib, imported
    for them, reads its settings file): no file is left half written, and the same command
    writes the report."""
    pytest.importorskip("matplotlib")
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    result = CliRunner().invoke(main, sweep_args(cache, out))
    assert result.exit_code == 0, result.output
    settings = tmp_path / "matplotlibrc"
    settings.write_text("backend: Agg\n")
    monkeypatch.setenv("MATPLOTLIBRC", str(settings))
    done = interrupted_at_open("train.sweep", sweep_args(cache, out), settings)
    assert stopped_while(done).startswith("writing the report"), done.stderr
    assert [n for n in os.listdir(out) if is_atomic_tmp(n)] == []
    assert "2 runs: 2 finished already, 0 to run" in done.stderr
    result = CliRunner().invoke(main, sweep_args(cache, out))
    assert result.exit_code == 0 and "| optimizer=muon | 1 |" in result.output, result.output


HOLD_LOCK = """
import sys
from shared.lock import output_lock
with output_lock(sys.argv[1], "python -m train"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes its end
"""


@contextlib.contextmanager
def waiting_sweep(tmp_path):
    """A sweep of one run started while a child process holds that run's folder lock (as an
    earlier sweep's run, still saving its checkpoint after that sweep was killed, does), read
    until it says that it waits for it (or starts the run): (the sweep, its standard error so
    far, the run folder). The child lets the lock go when the block ends."""
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "sweep"
    args = ["--data", str(cache), "--out", str(out), "--vary", "optimizer=adamw", "--seeds", "1"]
    folder = out / "runs" / "optimizer=adamw" / "seed-0"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    hold = [sys.executable, "-c", HOLD_LOCK, str(folder)]
    earlier = subprocess.Popen(hold, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert earlier.stdout.readline() == b"held\n"
        cmd = [sys.executable, "-m", "train.sweep", *args, "--gpus", "cpu", *TRAIN]
        sweep = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        waiting = f"waiting for the earlier run of optimizer=adamw seed 0 (pid {earlier.pid})"
        said = []
        for line in sweep.stderr:  # blocks until it says more: no sleeping
            said.append(line)
            if waiting in line or "starting optimizer=adamw" in line:
                break
        assert waiting in said[-1], "".join(said)
        yield sweep, said, folder
    finally:
        earlier.stdin.close()
        earlier.wait()


def test_a_rerun_waits_for_the_earlier_run_that_holds_its_folder(tmp_path):
    """The run is started once the earlier process has let its folder go, and finishes
    (train would have refused the folder)."""
    with waiting_sweep(tmp_path) as (sweep, said, folder):
        pass
    rest = sweep.stderr.read()
    assert sweep.wait() == 0, "".join(said) + rest
    assert "finished optimizer=adamw seed 0 (1 of 1 ended, 0 left)" in rest
    assert (folder / "export" / "model.safetensors").is_file()


def test_a_stop_signal_ends_the_wait_for_an_earlier_run(tmp_path):
    """SIGTERM while the sweep waits: it stops at once, the run not started, with the command
    that goes on, while the earlier process still holds the folder."""
    with waiting_sweep(tmp_path) as (sweep, said, folder):
        sweep.send_signal(signal.SIGTERM)
        rest = sweep.stderr.read()
        assert sweep.wait() == 1, "".join(said) + rest
        assert (folder / ".lock").is_file()
    assert "stopped by SIGTERM; not finished: optimizer=adamw seed 0" in rest
    assert "resume: python -m train.sweep --data" in rest and "starting" not in rest
