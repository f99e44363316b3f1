"""`bench/e2e_report.py` reads a GPU run's figures back from extraction's log. Here it reads the
log of a real `python -m extract` (CPU, tiny target), so a log line that the report no longer
finds fails here instead of leaving a GPU run's table without the figure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.fsio import filesystem_type
from shared.manifest import read_manifest
from tests.test_extract import data_file, qwen3  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from e2e_report import end_cell, extraction_figures  # noqa: E402


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_the_report_finds_an_extractions_figures_in_its_log(
    tmp_path,
    qwen3,  # noqa: F811
    data_file,  # noqa: F811
    fmt,
):
    args = ["--target", str(qwen3), "--data", str(data_file), "--out", str(tmp_path / "c")]
    args += ["--gpus", "cpu", "--format", fmt, "--max-rows", "14", "--rows-per-part", "6"]
    args += ["--layers", "0,2", "--writer-threads", "2"]  # 3 parts: 6, 6 and 2 rows
    done = subprocess.run(
        [sys.executable, "-m", "extract", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "extract.log"
    log.write_text(done.stderr)
    manifest = read_manifest(tmp_path / "c")
    x = extraction_figures(log, plain_tok_s=1.0)
    assert x["tokens"] == sum(p.tokens for p in manifest.parts)
    assert 0 < x["forwards_s"] <= x["seconds"]
    staging = x["staging"]
    assert staging["writers"] == 2
    # Their time on a core is part of their time in tasks (each thread's clock within its wall).
    assert 0 <= staging["writers_cpu_s"] <= staging["writers_busy_s"]
    assert x["filesystem"] == filesystem_type(tmp_path / "c")
    end = x["end"]
    assert end is not None and end["committed_s"] >= end["writers_s"]
    # The last part's own commit by step, named as the manifest names it.
    assert len(manifest.parts) == 3
    assert end["last_commit"].startswith(f"{manifest.parts[-1].name}'s commit took ")
    assert end["last_commit"] in end_cell(end)


def test_the_disk_measured_first_leaves_nothing_and_bounds_extraction_by_the_bytes_per_token(
    tmp_path,
):
    from e2e_report import disk_bound, disk_cell
    from shard_write import disk_rate

    assert disk_rate(tmp_path, 0) is None
    disk = disk_rate(tmp_path, 0.02)
    assert list(tmp_path.iterdir()) == []  # its files are gone once measured
    assert disk is not None and disk["gb"] == pytest.approx(0.02, rel=0.1) and disk["gb_s"] > 0
    bound = disk_bound(disk, bytes_per_token=2e4, plain_tok_s=1e4)
    # Twice the bytes per token halve the extraction rate the disk allows.
    assert disk_bound(disk, 4e4, 1e4)["bound_tok_s"] == pytest.approx(bound["bound_tok_s"] / 2)
    assert bound["bound_ratio"] == pytest.approx(bound["bound_tok_s"] / 1e4)
    assert f"{bound['bound_ratio']:.3f} x eager" in disk_cell(bound)
