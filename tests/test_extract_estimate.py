"""Before extracting: the size estimate, the free-space refusal and its override, the time
estimate; after: the summary's figures and the commands to run next."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from extract.data import demo_dataset, index_rows
from extract.estimate import estimate_cache
from shared.manifest import read_manifest
from shared.progress import RankCounters, SummedBar
from tests.test_extract import chat

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str):
    from extract.__main__ import main

    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(chat(i, 1 + i % 3)) + "\n" for i in range(600)))
    return path


@pytest.mark.parametrize("fmt,store", [("zarr", "bf16"), ("wds", "fp8"), ("zarr", "int4")])
def test_the_estimate_is_near_what_the_cache_takes(tmp_path, tiny_qwen3, data, fmt, store):
    """At the tiny target's hidden size 64 too, where fp8's scales, int4's records and a tar's
    headers weigh most."""
    from transformers import AutoTokenizer

    files = [data]
    est = estimate_cache(
        files,
        index_rows(files, every=64),  # many seek points: the sample is spread over them
        AutoTokenizer.from_pretrained(tiny_qwen3),
        total=600,
        max_length=3072,
        layers=2,
        hidden=64,
        store=store,
        fmt=fmt,
    )
    assert est.sampled == 256
    out = tmp_path / "c"
    args = ["--out", str(out), "--target", str(tiny_qwen3), "--data", str(data), "--gpus", "cpu"]
    args += ["--format", fmt, "--store", store]
    r = cli(*args, "--layers", "0,2", "--rows-per-part", "200", "--writer-threads", "1")
    assert r.exit_code == 0, r.output
    t = read_manifest(out).totals()
    assert abs(est.tokens / t["tokens"] - 1) < 0.10
    assert t["nbytes"] <= est.nbytes < 1.3 * t["nbytes"]  # the free-space check errs large


def test_a_disk_too_small_is_refused_before_any_write(tmp_path, tiny_qwen3, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    out = tmp_path / "c"
    base = ["--out", str(out), "--target", str(tiny_qwen3), "--data", str(demo_dataset())]
    base += ["--gpus", "cpu", "--max-rows", "64", "--writer-threads", "1"]
    r = cli(*base)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"--out {out}: the cache needs about" in r.output and "0.1 MB free" in r.output
    assert "--no-space-check" in r.output and "--store fp8" in r.output
    assert not out.exists()
    r = cli(*base, "--no-space-check")  # goes on: this disk has the room the figure hid
    assert r.exit_code == 0 and read_manifest(out).complete, r.output
    # An --overwrite deletes the old cache first: its bytes count as free
    r = cli(*base, "--overwrite", "--layers", "1")
    assert r.exit_code == 0 and read_manifest(out).layer_ids == (1,), r.output


def test_the_time_estimate_comes_from_the_measured_rate(tmp_path, monkeypatch, caplog):
    clock = [100.0]
    monkeypatch.setattr("shared.progress.time.monotonic", lambda: clock[0])
    counters = RankCounters(tmp_path, 0)
    bar = SummedBar(tmp_path, total=10, unit_key="done_rows", desc="x", expected_tokens=50_000)
    with caplog.at_level(logging.INFO, logger="shared.progress"):
        for now, tokens in [(101.0, 0), (102.0, 1_000), (107.0, 5_000), (112.0, 11_000)]:
            clock[0] = now
            counters.add(tokens=tokens - counters.counts["tokens"])
            counters.flush()
            bar.refresh()
    counters.close()
    (line,) = [r.getMessage() for r in caplog.records if "time estimate" in r.getMessage()]
    # 10,000 tokens in the 10 s after the first 1,000: 1,000 tok/s, 39,000 left.
    assert "1,000 tok/s over the first 10 s" in line and "take about 39 s more" in line


def test_the_summary_speaks_of_raw_bf16_and_says_what_to_run_next(tmp_path, tiny_qwen3):
    out = tmp_path / "c"
    base = ["--out", str(out), "--target", str(tiny_qwen3), "--gpus", "cpu", "--max-rows", "24"]
    r = cli(*base, "--layers", "0,2", "--writer-threads", "1")
    assert r.exit_code == 0, r.output
    assert "ratio" not in r.output and " of raw bf16)" in r.output
    assert "s planning, " in r.output and "s extracting (" in r.output
    lines = r.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("next"))
    verify = lines[at].split(None, 1)[1].split("   (")[0]
    assert verify == f"python -m extract.verify {out}"
    assert lines[at + 1].strip() == f"python -m train --data {out} --out runs/NAME"
    done = subprocess.run(  # the command it names runs as printed
        [sys.executable, *verify.split()[1:], "--samples", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    again = cli(*base, "--layers", "0,2", "--writer-threads", "1")  # complete: names verify
    assert again.exit_code == 0 and f"python -m extract.verify {out}` checks them" in again.output
