"""Checkpoint folders: atomic, complete-only listing, resume choice, pruning, drafter loading."""

import json

import pytest
import torch

from train.checkpoint import (
    list_checkpoints,
    load_drafter,
    load_state,
    prune,
    resolve_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights


def tiny_drafter_config() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        vocab_size=100,
        block_size=4,
        mask_token_id=99,
        target_layer_ids=(1, 0),
        num_target_layers=3,
        layer_types=("full_attention",),
    )


def _save(run, step, keep=10, model=None):
    cfg = tiny_drafter_config()
    model = model or DFlashDrafter(cfg)
    state = {"step": step, "model": model.state_dict(), "loader": {"epoch": 0}}
    return save_checkpoint(run, step, state, cfg, keep=keep)


def test_save_list_and_resume_choice(tmp_path):
    assert list_checkpoints(tmp_path) == [] and resolve_resume(tmp_path, "auto") is None
    for step in (2, 10, 4):
        _save(tmp_path, step)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 10]
    assert resolve_resume(tmp_path, "auto").name == "step-10"
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path, str(tmp_path / "checkpoints" / "step-4")).name == "step-4"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(tmp_path / "nowhere"))


def test_incomplete_folders_are_ignored(tmp_path):
    _save(tmp_path, 3)
    newest = _save(tmp_path, 5)
    (newest / "meta.json").unlink()  # as if copied only in part
    (tmp_path / "checkpoints" / ".step-7.tmp").mkdir()  # a save killed half way
    assert resolve_resume(tmp_path, "auto").name == "step-3"
    prune(tmp_path, keep=5)
    assert not (tmp_path / "checkpoints" / ".step-7.tmp").exists()


def test_keep_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]


def test_overwriting_a_step_is_atomic(tmp_path):
    _save(tmp_path, 1)
    path = _save(tmp_path, 1)
    assert load_state(path)["step"] == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]


def test_load_drafter_round_trip(tmp_path):
    cfg = tiny_drafter_config()
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, 3)
    path = _save(tmp_path, 8, model=model)
    loaded, loaded_cfg = load_drafter(path)
    assert loaded_cfg == cfg
    assert json.loads((path / "drafter.json").read_text())["target_layer_ids"] == [1, 0]
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_rng_state_round_trip():
    state = rng_state(torch.device("cpu"))
    a = torch.rand(3)
    set_rng_state(state, torch.device("cpu"))
    assert torch.equal(torch.rand(3), a)
