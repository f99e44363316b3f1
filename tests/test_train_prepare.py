"""What stage two resolves before training: ascending target layers (the order in which SGLang
and vLLM feed a drafter its target states), the last-layer warning, the default drafter shape;
and the export of a checkpoint trained in another layer order."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from shared.manifest import CacheMismatch, read_manifest, write_manifest
from shared.target_files import target_checksums
from tests.cachegen import write_cache
from tests.drafters import tiny_drafter, tiny_drafter_config
from train.checkpoint import save_checkpoint
from train.config import TrainConfig
from train.export import main as export_main
from train.run import prepare, prepare_run_dir
from train.run_dir import RunError


def test_training_resolves_target_layers_to_ascending(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=2, layer_ids=(3, 0, 1))
    cfg = TrainConfig(
        data=cache, out=tmp_path / "run", gpus="cpu", drafter_layers=1, target_layers="3,0"
    )
    resolved, prep = prepare(cfg, read_manifest(cache), device_kind="cpu")
    assert prep.drafter.target_layer_ids == (0, 3) and resolved.target_layers == "0,3"
    assert prep.layers == (1, 0)  # where layers 0 and 3 lie in the cache's layer axis


def test_export_cli_sorts_an_older_checkpoint(tmp_path):
    """A checkpoint trained on layers (6, 1, 4) before training sorted them exports ascending."""
    cfg = tiny_drafter_config(target_layer_ids=(6, 1, 4))
    drafter = tiny_drafter(cfg)
    ckpt = save_checkpoint(tmp_path / "run", 3, {"model": drafter.state_dict()}, cfg, keep=1)
    result = CliRunner().invoke(export_main, [str(ckpt), str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 4, 6]
    fc = load_file(str(tmp_path / "export" / "model.safetensors"))["fc.weight"]
    blocks = drafter.fc.weight.detach().bfloat16().split(64, dim=1)  # layers 6, 1, 4
    assert torch.equal(fc, torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))


def test_training_warns_when_the_last_target_layer_is_used(tmp_path, caplog):
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=2)  # layers 0, 1, 3 of 4
    for layers, warned in (("0,1", False), ("0,3", True)):
        caplog.clear()
        cfg = TrainConfig(data=cache, out=tmp_path / "run", gpus="cpu", target_layers=layers)
        prepare(cfg, read_manifest(cache), device_kind="cpu")
        assert ("SGLang and vLLM cannot serve" in caplog.text) == warned


def _rewrite_config(cache, text):
    """A new target config.json, recorded in the manifest as extraction would have."""
    (cache / "target" / "config.json").write_text(json.dumps(text))
    manifest = read_manifest(cache)
    write_manifest(cache, dataclasses.replace(manifest, target_files=target_checksums(cache)))


def test_moe_target_gets_the_published_shape_recorded_in_the_run_config(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=2)
    path = cache / "target" / "config.json"
    text = json.loads(path.read_text())
    del text["intermediate_size"]
    text.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2)
    _rewrite_config(cache, text)
    cfg = TrainConfig(data=cache, out=tmp_path / "run", gpus="cpu", drafter_layers=1)
    with pytest.raises(CacheMismatch, match="give --drafter-intermediate"):
        prepare(cfg, read_manifest(cache), device_kind="cpu")
    text["moe_intermediate_size"] = 32
    _rewrite_config(cache, text)
    resolved, prep = prepare(cfg, read_manifest(cache), device_kind="cpu")
    d = prep.drafter
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (32, 4, 128)
    assert d.intermediate_size == 64  # 2 routed experts of 32 per token
    prepare_run_dir(resolved, prep, read_manifest(cache))
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["drafter"]["num_attention_heads"] == 32
    assert record["drafter"]["intermediate_size"] == 64


def test_a_max_length_past_the_samples_is_refused(tmp_path):
    """--max-length above the cache's own (its samples were cut to it) or above --batch-tokens
    (a row's size) would change nothing: refused, naming the limit; at the limit it is taken."""
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=2, max_length=512)
    manifest = read_manifest(cache)
    cfg = TrainConfig(data=cache, out=tmp_path / "run", gpus="cpu", drafter_layers=1)
    with pytest.raises(RunError) as e:  # the command's to fix, not the cache's
        prepare(cfg.replace(max_length=1024), manifest, device_kind="cpu")
    assert "cannot be used" not in str(e.value)
    assert (
        "--max-length 1024 has no effect: samples are at most 512 tokens here (the cache was "
        "extracted with --max-length 512" in str(e.value)
    )
    assert "give --max-length 512 or less" in str(e.value)
    with pytest.raises(RunError, match=r"at most 256 tokens here \(a micro-batch row holds "):
        prepare(cfg.replace(max_length=400, batch_tokens=256), manifest, device_kind="cpu")
    assert prepare(cfg.replace(max_length=512), manifest, device_kind="cpu")[0].max_length == 512
    assert prepare(cfg, manifest, device_kind="cpu")[0].max_length == 512  # the cache's


def test_export_cli_says_it_exported_once(tmp_path):
    """The export's path on stdout (for scripts), and no log line repeating it on stderr."""
    cfg = tiny_drafter_config()
    ckpt = save_checkpoint(
        tmp_path / "run", 3, {"model": tiny_drafter(cfg).state_dict()}, cfg, keep=1
    )
    out = tmp_path / "export"
    result = CliRunner().invoke(export_main, [str(ckpt), str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"exported to {out}\n"
    assert result.output.count(str(out)) == 1, result.output


def test_a_sliding_window_without_sliding_layers_is_refused(tmp_path):
    """--sliding-window where the target's default layer types do not slide (no --layer-types)
    would change nothing: refused as the command's to fix, naming the option."""
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=2)
    cfg = TrainConfig(data=cache, out=tmp_path / "run", gpus="cpu", drafter_layers=1)
    with pytest.raises(RunError, match=r"--sliding-window 4 has no effect: .*--layer-types"):
        prepare(cfg.replace(sliding_window=4), read_manifest(cache), device_kind="cpu")
    sliding = cfg.replace(sliding_window=4, layer_types="sliding_attention")
    assert prepare(sliding, read_manifest(cache), device_kind="cpu")[0].sliding_window == 4
