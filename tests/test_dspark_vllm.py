"""vLLM's CPU build reads our DSpark export (marked `vllm`: run where DFLASH_VLLM_PYTHON names a
Python with vLLM installed, as `.ci/run` sets it): the export resolves to `Qwen3DSparkModel` with
our taps and heads, and the engine stops only at its model runner, which has no DSpark on CPU."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_speculate import drafter_config
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.dspark import DSparkDrafter, init_dspark_weights
from train.export import export_drafter

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.environ.get("DFLASH_VLLM_PYTHON"), reason="DFLASH_VLLM_PYTHON unset"),
]


def vllm_view(target, export):
    command = [os.environ["DFLASH_VLLM_PYTHON"], "-m", "train.proof.vllm_config"]
    command += ["--target", str(target), "--drafter", str(export)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_reads_the_dspark_export_and_stops_only_at_its_runner(tmp_path, tiny_qwen3):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    heads = (target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    cfg = drafter_config(tiny_qwen3, drafter_type="dspark", block_size=7, markov_rank=16)
    drafter = DSparkDrafter(cfg)
    init_dspark_weights(drafter, 0)
    view = vllm_view(tiny_qwen3, export_drafter(drafter, cfg, tmp_path / "dspark", heads=heads))
    assert view["method"] == "dspark" and view["architectures"] == ["Qwen3DSparkModel"]
    assert view["model_class"] == "Qwen3DSparkForCausalLM"
    assert view["aux_layers"] == [i + 1 for i in cfg.target_layer_ids]  # ids 1, 4, 6
    assert view["num_speculative_tokens"] == 7
    assert (view["markov_rank"], view["enable_confidence_head"]) == (16, True)
    assert view["confidence_head_with_markov"] is True
    assert "Model Runner V1 does not support: dspark" in view["engine_error"]
    # a DFlash export of the same target goes through the whole engine config
    dflash_cfg = drafter_config(tiny_qwen3)
    dflash = DFlashDrafter(dflash_cfg)
    init_drafter_weights(dflash, 0)
    view = vllm_view(tiny_qwen3, export_drafter(dflash, dflash_cfg, tmp_path / "dflash"))
    assert view["method"] == "dflash" and view["engine_error"] is None
    assert view["aux_layers"] == [i + 1 for i in dflash_cfg.target_layer_ids]
