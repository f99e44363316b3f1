"""Ctrl-C to python -m train.sweep outside its runs (while it checks the grid, while it writes
its report): one message saying what it was doing and the command that goes on, no traceback,
no file left half written."""

import os

import pytest
from click.testing import CliRunner

from shared.fsio import is_atomic_tmp
from tests.cachegen import write_cache
from tests.held_file import interrupted_at_open
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
