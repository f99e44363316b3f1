"""DFlash2 export: the public schema (fields inside dflash_config, codebooks without `.weight`),
names and shapes checked, `python -m train.export` from a checkpoint of either type."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

from tests.test_dflash2_model import dflash2_config, inputs, single_block, trained_like
from train.checkpoint import save_checkpoint
from train.drafters.dflash2 import DFlash2Drafter, is_added_parameter
from train.export import export_drafter, export_keys, main
from train.export_load import load_export


def test_config_and_weights_follow_the_public_schema(tmp_path):
    cfg = dflash2_config(sliding_window=2048)
    out = export_drafter(trained_like(cfg), cfg, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": 299,
        "target_layer_ids": [1, 4, 6],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 5,
    }
    assert config["is_causal"] is False and config["sliding_window"] == 2048
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert config["vocab_size"] == 300 and config["num_target_layers"] == 8
    assert config["tie_word_embeddings"] is False and "auto_map" not in config
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "block_size" not in config  # only inside dflash_config
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    assert keys == set(export_keys(cfg)) and len(keys) == 15 * 2 + 6
    assert "candidate_selector.predecessor_codebook" in keys
    assert "layers.0.attention_conv.kernel_projection.weight" in keys


def test_logit_fields_only_when_used(tmp_path):
    cfg = dflash2_config(output_multiplier=0.5, final_logit_softcapping=30.0)
    config = json.loads(
        (export_drafter(DFlash2Drafter(cfg), cfg, tmp_path / "e") / "config.json").read_text()
    )
    assert config["dflash_config"]["output_multiplier"] == 0.5
    assert config["dflash_config"]["final_logit_softcapping"] == 30.0
    assert load_export(tmp_path / "e")[1] == cfg


def test_exporter_rejects_wrong_names_and_shapes(tmp_path):
    cfg = dflash2_config()
    drafter = trained_like(cfg)
    drafter.candidate_selector.successor_codebook = nn.Parameter(torch.zeros(300, 4))
    with pytest.raises(
        ValueError, match="successor_codebook \\(300, 4\\) \\(expected \\(300, 8\\)"
    ):
        export_drafter(drafter, cfg, tmp_path / "export")
    drafter = trained_like(cfg)
    del drafter.layers[0].mlp_conv
    with pytest.raises(ValueError, match="missing.*layers.0.mlp_conv.base_kernel"):
        export_drafter(drafter, cfg, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_export_command_from_a_dflash2_checkpoint(tmp_path):
    cfg = dflash2_config()
    drafter = trained_like(cfg)
    ckpt = save_checkpoint(tmp_path / "run", 3, {"model": drafter.state_dict()}, cfg, keep=1)
    result = CliRunner().invoke(main, [str(ckpt), str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    loaded, loaded_cfg = load_export(tmp_path / "export")
    assert loaded_cfg == cfg and isinstance(loaded, DFlash2Drafter)
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(loaded.state_dict()[name], p.detach().bfloat16().float())


def test_warm_start_from_a_dflash_checkpoint_or_export(tmp_path):
    from tests.drafters import tiny_drafter, tiny_drafter_config
    from train.drafters.registry import build_drafter, init_weights
    from train.warm_start import warm_start

    base_cfg = tiny_drafter_config(layer_types=("sliding_attention",) * 2, sliding_window=2048)
    base = tiny_drafter(dataclasses.replace(base_cfg, is_causal=False), seed=4)
    ckpt = save_checkpoint(tmp_path / "run", 1, {"model": base.state_dict()}, base.cfg, keep=1)
    export = export_drafter(base, base.cfg, tmp_path / "export")
    cfg = dflash2_config()  # all sliding over 2048, non-causal: the same attention as `base`
    for source, exact in ((ckpt, True), (export, False)):
        drafter = build_drafter(cfg)
        init_weights(drafter, 0)
        kept = warm_start(drafter, source)
        assert kept and all(is_added_parameter(name) for name in kept)
        context, noise = inputs(cfg)
        with torch.no_grad():
            got, expected = (
                single_block(drafter.eval(), context, noise),
                single_block(base if exact else load_export(export)[0].eval(), context, noise),
            )
        assert torch.equal(got, expected)  # the additions start as no-ops
    with pytest.raises(ValueError, match="mask_token_id: 299 in .*, 298 here"):
        warm_start(build_drafter(dflash2_config(mask_token_id=298)), ckpt)
    dflash2_export = export_drafter(trained_like(cfg), cfg, tmp_path / "dflash2")
    with pytest.raises(ValueError, match="candidate_selector.hidden_projection.weight: not a"):
        warm_start(build_drafter(base.cfg), dflash2_export)
