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


def test_an_out_of_other_files_is_refused_before_the_wait_for_the_cache(tmp_path, monkeypatch):
    """A --out that holds files no sweep writes is refused first: not after the wait for an
    extraction to start writing --data (up to 10 minutes), and not with that wait's end."""
    monkeypatch.setattr("train.follow_start.START_WAIT_S", 0.0)  # the wait's end, now
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("x")
    args = ["--data", str(tmp_path / "shards"), "--out", str(out), "--vary", "lr=1e-3,3e-3"]
    result = CliRunner().invoke(main, [*args, "--seeds", "1", "--gpus", "cpu", *TRAIN])
    assert result.exit_code == 1, result.output
    assert f"--out {out}: holds files but no sweep (todo.txt)" in result.output
    assert "waiting for an extraction" not in result.output, result.output
    assert sorted(p.name for p in out.iterdir()) == ["todo.txt"]
