"""An export names the target its training cache was extracted from; `train.proof.speculate`
warns, naming both targets, when it is given another target of the same shape (a fine-tune of
it), and says nothing for the right target or for an export that names none."""

import dataclasses
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from extract.target import read_config, target_info
from shared.manifest import read_manifest, write_manifest
from tests.cachegen import write_cache
from tests.test_train_loop import tiny
from train.checkpoint import list_checkpoints
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.export import export_drafter
from train.export import main as export_main
from train.export_hf import TARGET_KEY, target_record
from train.proof.speculate import main as speculate_main
from train.proof.target_check import other_target, short
from train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")
WARNING = "its figures measure this drafter against another target than the one it was trained for"


def named_target(config_file):
    return json.loads(config_file.read_text()).get(TARGET_KEY)


def test_an_export_names_its_caches_target_and_so_does_the_export_command(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=4)
    manifest = read_manifest(cache)
    base = dataclasses.replace(manifest.target, path="/models/base", weights_sample="sha256:ab")
    write_manifest(cache, dataclasses.replace(manifest, target=base))
    out = tmp_path / "run"
    export = run(tiny(cache, out, epochs=1))
    fields = {k: getattr(base, k) for k in ("path", "revision", "weights_sample", "model_type")}
    assert named_target(export / "config.json") == fields
    step = list_checkpoints(out)[-1][1]
    result = CliRunner().invoke(export_main, [str(step), str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert named_target(tmp_path / "again" / "config.json") == fields


@pytest.fixture(scope="module")
def finetune(tmp_path_factory, tiny_qwen3):
    """The tiny target with one weight matrix changed: another checkpoint of the same shape and
    config, as a fine-tune of it is."""
    folder = shutil.copytree(tiny_qwen3, tmp_path_factory.mktemp("finetune") / "target")
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


def drafter_export(folder, tiny_qwen3, target):
    config = read_config(str(tiny_qwen3))
    cfg = DrafterConfig.from_target_config(
        config, num_layers=1, target_layer_ids=(1, 3), block_size=4, tokenizer_vocab_size=500
    )
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    return export_drafter(drafter, cfg, folder, target=target)


@pytest.fixture(scope="module")
def trained_for_tiny(tmp_path_factory, tiny_qwen3):
    """An export whose cache was extracted from the tiny target (its record as extraction's)."""
    record = target_record(target_info(str(tiny_qwen3), read_config(str(tiny_qwen3)), 500))
    return drafter_export(tmp_path_factory.mktemp("named") / "export", tiny_qwen3, record)


def speculate(target, drafter, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 5, 9]]))
    args = ["--target", target, "--drafter", drafter, "--prompts", prompts, "--device", "cpu"]
    args += ["--max-new-tokens", 3, "--warmup", 0]
    result = CliRunner().invoke(speculate_main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_speculate_warns_once_of_another_target_of_the_same_shape(
    tmp_path, tiny_qwen3, finetune, trained_for_tiny
):
    output = speculate(finetune, trained_for_tiny, tmp_path)
    assert output.count(WARNING) == 1, output
    recorded = named_target(trained_for_tiny / "config.json")
    assert f"was trained on the cache of {tiny_qwen3} (weights " in output
    assert short(recorded["weights_sample"]) in output and f"not of --target {finetune}" in output
    assert "tau " in output  # the figures are still measured


def test_speculate_says_nothing_for_its_own_target_or_an_export_naming_none(
    tmp_path, tiny_qwen3, finetune, trained_for_tiny
):
    assert WARNING not in speculate(tiny_qwen3, trained_for_tiny, tmp_path)
    unnamed = drafter_export(tmp_path / "unnamed", tiny_qwen3, None)
    assert named_target(unnamed / "config.json") is None
    assert WARNING not in speculate(finetune, unnamed, tmp_path)


def test_a_record_without_a_weights_sample_is_compared_by_its_content_hash(
    tiny_qwen3, finetune, trained_for_tiny
):
    """Caches extracted before weights samples were kept record the content hash alone."""
    recorded = {**named_target(trained_for_tiny / "config.json"), "weights_sample": None}
    assert other_target(recorded, tiny_qwen3) is None
    what, was, now = other_target(recorded, finetune)
    assert what == "content hash" and was == recorded["revision"] and now != was


def test_a_target_without_safetensors_files_is_not_called_another_target(
    tmp_path, tiny_qwen3, trained_for_tiny
):
    """The tiny target's own weights saved as pytorch_model.bin: no safetensors file to sample
    (extraction reads only those), so no hash to compare, and no warning that it is another."""
    folder = shutil.copytree(tiny_qwen3, tmp_path / "as_bin")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    recorded = named_target(trained_for_tiny / "config.json")
    assert other_target(recorded, folder) is None
    assert other_target({**recorded, "weights_sample": None}, folder) is None
