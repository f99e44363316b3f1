"""The sweep folder's record (sweep.json): one that cannot be read is named, not a traceback."""

import pytest

from train.sweep.grid import SWEEP_FILE, GridError, read_record


@pytest.mark.parametrize("text", ['{"command": "python -m tr', "[1, 2]", "\udcff"])
def test_a_damaged_record_is_named(tmp_path, text):
    (tmp_path / SWEEP_FILE).write_text(text, errors="surrogateescape")
    with pytest.raises(GridError, match=r"sweep.json cannot be read \(.*Restore it, or delete"):
        read_record(tmp_path)


def test_a_new_folder_has_no_record(tmp_path):
    assert read_record(tmp_path) is None
    (tmp_path / SWEEP_FILE).write_text('{"train_args": []}')
    assert read_record(tmp_path) == {"train_args": []}


def test_the_sweep_names_a_damaged_record(tmp_path):
    from click.testing import CliRunner

    from tests.cachegen import write_cache
    from train.sweep.__main__ import main

    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=2)
    out = tmp_path / "s"
    out.mkdir()
    (out / SWEEP_FILE).write_text('{"train_args": ["--st')
    args = ["--data", str(cache), "--out", str(out), "--vary", "lr=1e-3", "--seeds", "1"]
    result = CliRunner().invoke(main, [*args, "--gpus", "cpu", "--drafter-layers", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "sweep.json cannot be read" in result.output and not (out / "runs").exists()
