"""The whole pipeline on CPU: extract -> train (killed, resumed) -> export -> reference load."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from extract.config import ExtractConfig
from extract.data import demo_dataset
from extract.run import run as extract
from train.checkpoint import list_checkpoints
from train.config import TrainConfig
from train.export import main as export_main
from train.run import run as train


def train_cfg(cache, out, **kw) -> TrainConfig:
    base = dict(
        data=cache,
        out=out,
        gpus="cpu",
        drafter_layers=2,
        num_anchors=8,
        batch_tokens=1024,
        workers=0,
        steps=6,
        checkpoint_every=2,
        log_every=1,
        eval_parts=1,
        eval_every=3,
        target_layers="5,1,3",
    )
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_extract_train_resume_export(tmp_path, tiny_qwen3):
    cache = tmp_path / "shards"
    manifest = extract(
        ExtractConfig(
            out=cache,
            target=str(tiny_qwen3),
            data=(demo_dataset(),),
            gpus="cpu",
            max_rows=48,
            rows_per_part=16,
        )
    )
    assert manifest.complete and len(manifest.parts) == 3
    assert manifest.layer_ids == (1, 2, 3, 4, 5)  # the DFlash rule on an 8-layer target

    whole = train(train_cfg(cache, tmp_path / "whole"))
    broken = tmp_path / "broken"
    train(train_cfg(cache, broken, stop_after_steps=3))
    assert [s for s, _ in list_checkpoints(broken)] == [2]
    resumed = train(train_cfg(cache, broken))
    a, b = (
        load_file(str(whole / "model.safetensors")),
        load_file(str(resumed / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    again = tmp_path / "again"
    result = CliRunner().invoke(export_main, [str(list_checkpoints(broken)[-1][1]), str(again)])
    assert result.exit_code == 0, result.output
    c = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)

    dflash = pytest.importorskip("dflash.model")
    ref = dflash.DFlashDraftModel.from_pretrained(str(again))
    assert list(ref.target_layer_ids) == [1, 3, 5]  # trained as given "5,1,3", sorted
    assert ref.fc.weight.shape == (64, 3 * 64)
