"""`--store int4` through the command lines: extract writes it (both formats), verify checks it
with its tolerance, train reads it; a target it cannot code is refused up front."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from extract.layer_check import TOLERANCE, layer_errors
from shared.cache import open_part
from shared.int4 import Int4Scheme
from shared.manifest import read_manifest
from tests.test_extract import chat

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(chat(i, turns=1 + i % 2)) + "\n" for i in range(12)))
    return path


def extract_cli(out: Path, target: Path, data: Path, *args: str):
    from extract.__main__ import main

    argv = ["--out", str(out), "--target", str(target), "--data", str(data), "--gpus", "cpu"]
    argv += ["--rows-per-part", "6", "--batch-tokens", "512", "--layers", "0,2,3", *args]
    return CliRunner().invoke(main, argv)


def hidden_bytes(cache: Path) -> int:
    """Bytes of the stored states: zarr shard files, or tar members."""
    total = 0
    for rec in read_manifest(cache).parts:
        path = cache / rec.name
        if path.is_dir():
            total += sum(f.stat().st_size for f in (path / "hidden").glob("c.*") if f.is_file())
        else:
            with tarfile.open(path) as tar:
                total += sum(i.size for i in tar if i.name.endswith(".hidden.blosc"))
    return total


def states(cache: Path) -> dict[int, torch.Tensor]:
    out = {}
    for rec in read_manifest(cache).parts:
        for s in open_part(cache / rec.name).iter_samples():
            out[s.sample_index] = s.hidden_tensor("cpu").float()
    return out


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_extract_int4_then_verify_and_train_read_it(tmp_path, tiny_qwen3, data_file, fmt):
    int4, bf16 = tmp_path / "int4", tmp_path / "bf16"
    r = extract_cli(int4, tiny_qwen3, data_file, "--store", "int4", "--format", fmt)
    assert r.exit_code == 0, r.output
    assert extract_cli(bf16, tiny_qwen3, data_file, "--format", fmt).exit_code == 0
    m = read_manifest(int4)
    assert m.complete and m.store == "int4" and m.codec["compressor"]["id"] == "int4"
    recorded = {k: v for k, v in Int4Scheme(hidden=64).to_dict().items() if k != "hidden"}
    assert m.codec["int4"] == recorded
    for rec in m.parts:  # each part records its scheme, with the hidden size
        assert open_part(int4 / rec.name).scheme == Int4Scheme(hidden=64)
    # On disk: a 4-bit code of the states (the tiny target's hidden 64 pays more per value for
    # its scales and exact values than a real target does: 45 of 128 bytes before zstd).
    raw = m.totals()["tokens"] * 3 * 64 * 2
    assert hidden_bytes(int4) < 0.4 * raw and hidden_bytes(int4) < 0.6 * hidden_bytes(bf16)

    # The states decode within the int4 code's error, which needs verify's int4 tolerance:
    # more than bf16's, less than int4's.
    a, b = states(int4), states(bf16)
    assert a.keys() == b.keys()
    errors = [e for row in a for e in layer_errors(a[row], b[row])]
    assert TOLERANCE["bf16"] < max(errors) < TOLERANCE["int4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    verify = [sys.executable, "-m", "extract.verify", str(int4), "--samples", "2"]
    ok = subprocess.run(verify, cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr

    from train.__main__ import main as train_main

    run = tmp_path / "run"
    argv = ["--data", str(int4), "--out", str(run), "--gpus", "cpu", "--steps", "3"]
    argv += ["--drafter-layers", "1", "--num-anchors", "8", "--batch-tokens", "512"]
    argv += ["--workers", "1", "--eval-parts", "1", "--log-every", "1"]
    r = CliRunner().invoke(train_main, argv)
    assert r.exit_code == 0, r.output
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in logged if "loss" in x]
    assert losses and all(0 < loss < 20 for loss in losses)


def test_a_target_the_code_cannot_tile_is_refused_naming_the_option(tmp_path, tiny_qwen3):
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    config = json.loads((target / "config.json").read_text())
    config["hidden_size"] = 96  # not a multiple of the code's groups of 64
    (target / "config.json").write_text(json.dumps(config))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat(0)) + "\n")
    out = tmp_path / "out"
    r = extract_cli(out, target, data, "--store", "int4")
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit)
    assert "--store int4 needs a hidden size that is a multiple of 64" in r.output
    assert not out.exists()
