"""TrainConfig validation, parsing of list options, and which changes a resume accepts."""

from pathlib import Path

import pytest

from shared.cli import to_json
from train.config import TrainConfig
from train.run_dir import config_changes


def cfg(**kw) -> TrainConfig:
    return TrainConfig(data=Path("c"), out=Path("o"), **kw)


def test_defaults_follow_the_recipe():
    c = cfg()
    assert (c.drafter_layers, c.block_size, c.anchors_per_row) == (5, 16, 512)
    assert c.batch_tokens == 3072 and c.replace(batch_tokens=6144).anchors_per_row == 1024
    assert (c.lr, c.warmup, c.weight_decay, c.grad_clip, c.epochs) == (6e-4, 0.04, 0.0, 1.0, 6)
    assert c.grad_ckpt == "loss" and c.resume == "auto"
    assert c.layer_type_names == ("full_attention",) * 5 and c.target_layer_ids is None


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(lr=0), "lr"),
        (dict(block_size=1), "block_size"),
        (dict(attention="xformers"), "attention"),
        (dict(target_layers="1,x"), "target_layers"),
        (dict(layer_types="full,diagonal"), "layer_types"),
        (dict(layer_types="sliding"), "sliding_window"),
        (dict(layer_types="full,full", drafter_layers=3), "layer_types"),
        (dict(warmup=1.0), "warmup"),
        (dict(eval_fraction=-0.1), "eval_fraction"),
        (dict(resume=" "), "resume"),
    ],
)
def test_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        cfg(**kw)


def test_resume_words_in_any_case():
    assert (cfg(resume="AUTO").resume, cfg(resume=" None").resume) == ("auto", "none")
    assert cfg(resume="runs/x/checkpoints/step-4").resume == "runs/x/checkpoints/step-4"


def test_list_options():
    c = cfg(target_layers="9, 1,17", layer_types="sliding,full", drafter_layers=2, sliding_window=8)
    assert c.target_layer_ids == (9, 1, 17)
    assert c.layer_type_names == ("sliding_attention", "full_attention")
    assert (
        cfg(layer_types="sliding", sliding_window=4).layer_type_names == ("sliding_attention",) * 5
    )


def test_config_changes_split_harmless_from_harmful():
    old = to_json(cfg(steps=100))
    harmful, harmless = config_changes(old, to_json(cfg(steps=200, gpus="0-3", lr=1e-3)))
    assert harmless == ["gpus: run has None, now '0-3'", "steps: run has 100, now 200"]
    assert harmful == ["lr: run has 0.0006, now 0.001"]
    assert config_changes(old, old) == ([], [])
