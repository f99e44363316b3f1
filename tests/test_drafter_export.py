"""Export: exact key set, config fields, atomic folder, and parity with z-lab's `dflash` package."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

from tests.drafters import drafter_masks, tiny_drafter, tiny_drafter_config
from train.checkpoint import save_checkpoint
from train.drafters.dflash import init_drafter_weights
from train.export import EXPORT_KEYS, export_drafter, main
from train.export_load import load_export


def _drafter(layer_types=("full_attention", "full_attention"), sliding_window=None):
    cfg = tiny_drafter_config(
        num_layers=len(layer_types), layer_types=layer_types, sliding_window=sliding_window
    )
    return tiny_drafter(cfg), cfg


def test_parameter_names_are_the_export_keys():
    drafter, cfg = _drafter()
    names = [name for name, _ in drafter.named_parameters()]
    assert len(names) == len(EXPORT_KEYS(2)) and set(names) == set(EXPORT_KEYS(2))
    assert len(EXPORT_KEYS(5)) == 3 + 5 * 11


def test_export_writes_exact_keys_bf16_and_config(tmp_path):
    drafter, cfg = _drafter(("sliding_attention", "full_attention"), sliding_window=3)
    out = export_drafter(drafter, cfg, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(EXPORT_KEYS(2))
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert "auto_map" not in config and config["tie_word_embeddings"] is False
    assert config["dflash_config"] == {"mask_token_id": 299, "target_layer_ids": [1, 4, 6]}
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["use_sliding_window"] is True and config["sliding_window"] == 3
    assert (config["num_hidden_layers"], config["block_size"], config["num_target_layers"]) == (
        2,
        4,
        8,
    )
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"


def test_export_round_trip_and_replace(tmp_path):
    drafter, cfg = _drafter()
    export_drafter(drafter, cfg, tmp_path / "export")
    init_drafter_weights(drafter, 5)
    export_drafter(drafter, cfg, tmp_path / "export")  # replaces the older export
    loaded, loaded_cfg = load_export(tmp_path / "export")
    assert loaded_cfg == cfg
    for (name, p), q in zip(drafter.named_parameters(), loaded.parameters(), strict=True):
        torch.testing.assert_close(q, p.detach().bfloat16().float(), msg=name)
    # what exports killed before their renames left: temporary folders, an earlier export
    # renamed to .old; the next export clears them (never a folder of other files)
    # (a temporary folder of a process still running is its own: kept)
    shutil.copytree(tmp_path / "export", tmp_path / ".export.tmp-abc123")
    shutil.copytree(tmp_path / "export", tmp_path / ".export.tmp-999999999-abc")
    shutil.copytree(tmp_path / "export", tmp_path / f".export.tmp-{os.getpid()}-abc")
    shutil.copytree(tmp_path / "export", tmp_path / "export.old")
    (tmp_path / "keep.old").mkdir()
    export_drafter(drafter, cfg, tmp_path / "export")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f".export.tmp-{os.getpid()}-abc", "export", "keep.old"])


def test_export_never_replaces_a_folder_or_file_that_is_not_an_export(tmp_path):
    drafter, cfg = _drafter()
    cache = tmp_path / "cache"
    (cache / "part-000000").mkdir(parents=True)
    (cache / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds other files than an export \(manifest.json, part"):
        export_drafter(drafter, cfg, cache)
    assert sorted(p.name for p in cache.iterdir()) == ["manifest.json", "part-000000"]
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="a file is there"):
        export_drafter(drafter, cfg, tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    export_drafter(drafter, cfg, tmp_path / "empty")  # an empty folder is taken
    assert load_export(tmp_path / "empty")[1] == cfg
    assert not list(tmp_path.glob(".*tmp*"))  # nothing left beside them


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_export_command_names_an_out_dir_that_cannot_be_written(tmp_path, where):
    drafter, cfg = _drafter()
    ckpt = save_checkpoint(tmp_path / "run", 1, {"model": drafter.state_dict()}, cfg, keep=1)
    (tmp_path / "afile").write_text("x")
    out = Path("/proc/nope-export") if where == "proc" else tmp_path / "afile" / "export"
    result = CliRunner().invoke(main, [str(ckpt), str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: export folder {out}: " in result.output, result.output
    assert ".tmp-" not in result.output and "Errno" not in result.output
    assert (tmp_path / "afile").read_text() == "x"


def test_export_command_on_a_full_disk_says_so_and_leaves_nothing(tmp_path):
    """safetensors reports a full disk as its own error type: the command says it in one line
    and leaves no temporary folder on the disk."""
    from tests.test_extract_safety import small_disk

    drafter, cfg = _drafter()
    ckpt = save_checkpoint(tmp_path / "run", 1, {"model": drafter.state_dict()}, cfg, keep=1)
    with small_disk(tmp_path / "disk", "16k") as disk:
        result = CliRunner().invoke(main, [str(ckpt), str(disk / "export")])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert f"Error: export folder {disk / 'export'}: " in result.output, result.output
        assert "No space left on device" in result.output
        assert list(disk.iterdir()) == []


def test_export_command_refuses_a_cache_a_dflash_drafter_does_not_read(tmp_path):
    drafter, cfg = _drafter()
    ckpt = save_checkpoint(tmp_path / "run", 1, {"model": drafter.state_dict()}, cfg, keep=1)
    out = tmp_path / "export"
    result = CliRunner().invoke(main, [str(ckpt), str(out), "--cache", str(tmp_path)])
    assert result.exit_code == 1 and "--cache has no effect" in result.output, result.output
    assert not out.exists()


def test_export_rejects_unknown_and_missing_keys(tmp_path):
    drafter, cfg = _drafter()
    drafter.embed_tokens = nn.Embedding(300, 64)
    with pytest.raises(ValueError, match="unknown.*embed_tokens.weight"):
        export_drafter(drafter, cfg, tmp_path / "export")
    drafter, cfg = _drafter()
    del drafter.layers[1].mlp.up_proj
    drafter.layers[1].mlp.up_proj = lambda x: x
    with pytest.raises(ValueError, match="missing.*layers.1.mlp.up_proj.weight"):
        export_drafter(drafter, cfg, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def _ours_single_block(drafter, cfg, target_hidden, noise):
    ctx = target_hidden.shape[1]
    anchors, keep = torch.tensor([[ctx]]), torch.tensor([[True]])
    masks = drafter_masks(cfg, anchors, keep, ctx)
    pos = torch.arange(ctx + cfg.block_size)[None]
    return drafter(target_hidden, noise, pos[:, :ctx], pos[:, ctx:], masks)


@pytest.mark.parametrize(
    ("layer_types", "window"),
    [(("full_attention", "full_attention"), None), (("sliding_attention", "full_attention"), 3)],
)
def test_reference_package_loads_export_and_matches_forward(tmp_path, layer_types, window):
    dflash_model = pytest.importorskip("dflash.model")
    drafter, cfg = _drafter(layer_types, window)
    named = {"path": "/models/base", "revision": "sha256:0", "weights_sample": None}
    export_drafter(drafter, cfg, tmp_path / "export", target={**named, "model_type": "qwen3"})
    ref = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "export", dtype=torch.float32)
    ref.eval()
    assert ref.block_size == 4 and ref.mask_token_id == 299
    assert list(ref.target_layer_ids) == [1, 4, 6]
    for layer, layer_type in zip(ref.layers, layer_types, strict=True):
        sliding = layer_type == "sliding_attention"
        assert layer.self_attn.sliding_window == (window if sliding else None)
        assert layer.self_attn.is_causal == sliding
    ours, _ = load_export(tmp_path / "export")  # the same bf16-rounded weights
    gen = torch.Generator().manual_seed(0)
    ctx = 9
    target_hidden = torch.randn(1, ctx, 3 * 64, generator=gen)
    noise = torch.randn(1, cfg.block_size, 64, generator=gen)
    with torch.no_grad():
        expected = ref(
            target_hidden=target_hidden,
            noise_embedding=noise,
            position_ids=torch.arange(ctx + cfg.block_size)[None],
        )
        got = _ours_single_block(ours.eval(), cfg, target_hidden, noise)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_export_sorts_target_layers_and_permutes_fc(tmp_path):
    """A drafter trained on layers (6, 1, 4) exports as (1, 4, 6) and computes the same outputs
    from the states in that order."""
    cfg = tiny_drafter_config(target_layer_ids=(6, 1, 4))
    drafter = tiny_drafter(cfg)
    with torch.no_grad():  # the export's bf16 rounding, so both sides hold the same weights
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())
    export_drafter(drafter, cfg, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 4, 6]
    ours, sorted_cfg = load_export(tmp_path / "export")
    assert sorted_cfg.target_layer_ids == (1, 4, 6)
    fc, fc_sorted = drafter.fc.weight.detach(), ours.fc.weight.detach()
    for new_block, old_block in enumerate((1, 2, 0)):  # layer 1 was block 1, 4 block 2, 6 block 0
        assert torch.equal(fc_sorted[:, new_block * 64 : (new_block + 1) * 64],
                           fc[:, old_block * 64 : (old_block + 1) * 64])  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    states = {layer: torch.randn(1, 9, 64, generator=gen) for layer in (1, 4, 6)}
    noise = torch.randn(1, cfg.block_size, 64, generator=gen)
    with torch.no_grad():
        before = _ours_single_block(
            drafter, cfg, torch.cat([states[i] for i in (6, 1, 4)], -1), noise
        )
        after = _ours_single_block(
            ours.eval(), sorted_cfg, torch.cat([states[i] for i in (1, 4, 6)], -1), noise
        )
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(  # and the order matters: unpermuted columns would differ
        _ours_single_block(drafter, cfg, torch.cat([states[i] for i in (1, 4, 6)], -1), noise),
        before,
    )


def test_export_keeps_an_ascending_drafter_as_it_is(tmp_path):
    drafter, cfg = _drafter()
    export_drafter(drafter, cfg, tmp_path / "export")
    ours, loaded_cfg = load_export(tmp_path / "export")
    assert loaded_cfg == cfg
    assert torch.equal(ours.fc.weight, drafter.fc.weight.detach().bfloat16().float())
