"""A sweep on a --data that holds no cache yet waits once, as each of its runs would, for an
extraction to start there, and starts no run when none did."""

from __future__ import annotations

from click.testing import CliRunner

from train.sweep.__main__ import main

TRAIN = ["--drafter-layers", "1", "--batch-tokens", "256", "--steps", "2"]


def test_a_data_folder_no_extraction_writes_stops_the_sweep_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr("train.follow_start.START_WAIT_S", 0.0)  # the wait's end, now
    out = tmp_path / "sweep"
    args = ["--data", str(tmp_path / "shrads"), "--out", str(out), "--vary", "lr=1e-3,3e-3"]
    result = CliRunner().invoke(main, [*args, "--seeds", "2", "--gpus", "cpu", *TRAIN])
    assert result.exit_code == 1, result.output
    assert "shrads" in result.output and "no run was started" in result.output
    assert "waiting for an extraction to start writing" in result.output
    assert not (out / "runs").exists() and not (out / "logs").exists()
    # without following, at once
    result = CliRunner().invoke(
        main, [*args, "--seeds", "1", "--gpus", "cpu", *TRAIN, "--no-follow"]
    )
    assert result.exit_code == 1 and "no run was started" in result.output, result.output
