"""DFlash2 speculative decoding: the selector walk drafts, the output stays lossless, and every
verify step equals z-lab's `dflash_generate` with `DFlash2DraftModel` on the same export."""

import json
import time

import pytest
import torch
from click.testing import CliRunner

from tests.test_speculate import EOS, agree_with_reference, drafter_config, keep_only_dim0, prompt
from train.drafters.dflash2 import DFlash2Drafter, init_dflash2_weights, is_added_parameter
from train.export import export_drafter
from train.export_load import load_export
from train.proof.speculate import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def two_token_target(tiny_qwen3):
    """test_speculate's two-token target: the tiny target whose final norm keeps dim 0 only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    keep_only_dim0(model.model.norm)
    return model


def two_token_dflash2(cfg) -> DFlash2Drafter:
    """As test_speculate's two-token drafter (DFlash weights x10, final norm keeping dim 0), with
    perturbed convolutions and codebooks so that both additions change the drafts."""
    drafter = DFlash2Drafter(cfg)
    init_dflash2_weights(drafter, 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if is_added_parameter(name):
                scale = 0.1 if "codebook" in name else 0.2
                param.add_(scale * torch.randn(param.shape, generator=gen))
            elif not name.endswith("norm.weight"):
                param.mul_(10.0)
    keep_only_dim0(drafter.norm)
    return drafter.eval()


def reference(monkeypatch, export_dir):
    dflash_model = pytest.importorskip("dflash.model")
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    ref = dflash_model.DFlash2DraftModel.from_pretrained(export_dir, dtype=torch.float32)
    return dflash_model.dflash_generate, ref.eval()


@pytest.mark.parametrize(
    ("layer_types", "window", "causal"),
    [(None, 5, False), (("sliding_attention", "full_attention"), 5, True)],
)
def test_equals_greedy_and_reference_per_step(
    tmp_path, monkeypatch, tiny_qwen3, two_token_target, layer_types, window, causal
):
    cfg = drafter_config(
        tiny_qwen3,
        drafter_type="dflash2",
        layer_types=layer_types,
        sliding_window=window,
        is_causal=causal,
        selector_rank=16,
        selector_top_k=4,
    )
    export_drafter(two_token_dflash2(cfg), cfg, tmp_path / "export")
    ours, _ = load_export(tmp_path / "export")
    assert isinstance(ours, DFlash2Drafter)
    generate, ref = reference(monkeypatch, tmp_path / "export")
    prompts = [prompt(seed) for seed in range(100, 104)]
    lengths = agree_with_reference(
        generate, ref, ours, two_token_target, prompts, max_new_tokens=32, eos=[EOS]
    )
    assert max(lengths) >= 3 and min(lengths) == 1  # drafts accepted and rejected


def test_cli_reports_tau_of_a_dflash2_export(tmp_path, tiny_qwen3):
    cfg = drafter_config(tiny_qwen3, drafter_type="dflash2", selector_rank=16, selector_top_k=4)
    export = export_drafter(two_token_dflash2(cfg), cfg, tmp_path / "export")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 5, 9, 13], [7, 8, 9]]))
    args = ["--target", tiny_qwen3, "--drafter", export, "--prompts", prompts, "--device", "cpu"]
    args += ["--max-new-tokens", 10, "--warmup", 0, "--json"]
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["lossless"] is True and summary["block_size"] == cfg.block_size
    assert summary["tau"] >= 1.0 and summary["steps"] >= 1
