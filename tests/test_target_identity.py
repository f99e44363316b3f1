"""Which checkpoint a cache was extracted from: a checkpoint of the same shape (another
fine-tune) is told apart by sampled weight bytes, refused on resume and named by verify."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from extract.target import content_hash, weights_sample
from shared.manifest import read_manifest
from shared.manifest_checks import identity_mismatches
from tests.test_extract import data_file, extract  # noqa: F401


def _checkpoint(folder: Path, seed: int) -> Path:
    """A folder with config.json and a weight file over 64 MiB (its header alone is hashed by
    `content_hash`) of the same shape for every seed."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(4096, 4200, generator=g)}, str(folder / "model.safetensors"))
    return folder


def test_weights_sample_tells_apart_what_the_header_hash_cannot(tmp_path):
    a, b = _checkpoint(tmp_path / "a", 0), _checkpoint(tmp_path / "b", 1)
    assert (a / "model.safetensors").stat().st_size > 64 << 20
    assert content_hash(a) == content_hash(b)  # same names, shapes, dtypes
    assert weights_sample(a) != weights_sample(b)
    shutil.copytree(a, tmp_path / "a2")
    assert weights_sample(tmp_path / "a2") == weights_sample(a)


def test_resuming_with_another_checkpoint_of_the_same_shape_is_refused(
    tmp_path,
    tiny_qwen3,
    data_file,  # noqa: F811
):
    old = extract(tmp_path / "c", tiny_qwen3, data_file, max_rows=4)
    assert old.target.weights_sample is not None
    other = dataclasses.replace(old.target, weights_sample="sha256:other")
    (line,) = identity_mismatches(old, dataclasses.replace(old, target=other))
    assert "same shapes but other weights" in line and str(tiny_qwen3) in line
    cache_written_before = dataclasses.replace(old.target, weights_sample=None)
    assert identity_mismatches(dataclasses.replace(old, target=cache_written_before), old) == []


def test_verify_names_a_target_whose_weights_changed(tmp_path, tiny_qwen3, data_file):  # noqa: F811
    from click.testing import CliRunner

    from extract.verify import main

    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    extract(tmp_path / "c", target, data_file, max_rows=4)
    verify = lambda: CliRunner().invoke(main, [str(tmp_path / "c"), "--samples", "1"])  # noqa: E731
    assert verify().exit_code == 0
    weights = next(target.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 1.5  # another checkpoint: same shapes, other values
    save_file(tensors, str(weights), metadata={"format": "pt"})
    r = verify()
    assert r.exit_code == 1 and "is not the one this cache was extracted from" in r.output
    assert read_manifest(tmp_path / "c").complete  # nothing about the cache itself changed


def test_verify_names_a_target_it_cannot_load(tmp_path, tiny_qwen3, data_file):  # noqa: F811
    from click.testing import CliRunner

    from extract.verify import main

    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    extract(tmp_path / "c", target, data_file, max_rows=4)
    weights = next(target.glob("*.safetensors"))
    whole = weights.read_bytes()
    verify = lambda: CliRunner().invoke(main, [str(tmp_path / "c"), "--samples", "1"])  # noqa: E731
    weights.write_bytes(whole[:-1000])  # its header intact, its data cut short
    r = verify()
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert f"MISMATCH the target {target} cannot be re-run: {weights} cannot be read (" in r.output
    assert "1 part checked, 1 problem\n" in r.output
    weights.write_bytes(whole)
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.down_proj.weight"]  # a layer the cache's states pass through
    save_file(tensors, str(weights), metadata={"format": "pt"})
    r = verify()
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert f"MISMATCH the target {target} cannot be re-run: " in r.output, r.output
    assert "model.layers.1.mlp.down_proj.weight" in r.output
    assert "1 part checked, 2 problems\n" in r.output  # that, and its weights' changed bytes
