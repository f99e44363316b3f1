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


@pytest.mark.slow
def test_the_commands_each_summary_names_next_run_as_printed(tmp_path, tiny_qwen3):
    """extract's summary names train, train's names speculate: each runs as printed (the
    prompt file, which only the user has, filled in)."""
    import json
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from extract.__main__ import main as extract_main
    from train.__main__ import main as train_main

    def next_lines(output: str) -> list[str]:
        lines = output.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("next"))
        return [line.split("  ", 1)[1].strip().split("   (")[0] for line in lines[at:]]

    cache = tmp_path / "shards"
    args = ["--out", str(cache), "--target", str(tiny_qwen3), "--gpus", "cpu", "--max-rows", "32"]
    r = CliRunner().invoke(extract_main, args)
    assert r.exit_code == 0, r.output
    command = next_lines(r.output)[1].replace("runs/NAME", str(tmp_path / "run"))
    assert command.startswith("python -m train --data ")
    more = ["--gpus", "cpu", "--drafter-layers", "1", "--batch-tokens", "512", "--steps", "2"]
    r = CliRunner().invoke(train_main, [*shlex.split(command)[3:], *more, "--workers", "0"])
    assert r.exit_code == 0, r.output
    speculate = next_lines(r.output)[0]
    assert speculate.startswith(f"python -m train.proof.speculate --target {tiny_qwen3}")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["What is 2 plus 2?"]))
    argv = shlex.split(speculate.replace("PROMPTS.json", str(prompts)))
    done = subprocess.run(
        [sys.executable, *argv[1:], "--max-new-tokens", "8"],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "lossless" in done.stdout, done.stderr[-2000:]
