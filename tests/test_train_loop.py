"""Stage two end to end on CPU: loss falls, resume is bitwise exact, export, run-folder checks."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from shared.stopping import StopRun
from tests.cachegen import write_cache
from train.__main__ import main
from train.checkpoint import list_checkpoints, load_drafter, load_state
from train.config import TrainConfig
from train.export import EXPORT_KEYS
from train.run import RunError, run
from train.schedule import lr_factor


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=4, samples_per_part=6)


def tiny(cache, out, **kw) -> TrainConfig:
    base = dict(
        data=cache,
        out=out,
        gpus="cpu",
        drafter_layers=1,
        block_size=4,
        num_anchors=8,
        batch_tokens=512,
        workers=0,
        shuffle_buffer=4,
        lr=3e-3,
        epochs=2,
        log_every=1,
        checkpoint_every=1000,
        eval_fraction=0.0,
    )
    return TrainConfig(**{**base, **kw})


def records(out, kind="train"):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_state(out):
    return load_state(list_checkpoints(out)[-1][1])


def test_lr_schedule():
    values = [lr_factor(s, total=100, warmup=4) for s in range(100)]
    assert values[0] == 0.25 and values[3] == 1.0 and max(values) == 1.0
    assert all(a >= b for a, b in zip(values[3:], values[4:], strict=False))
    assert values[-1] < 0.01 and lr_factor(100, total=100, warmup=4) == 0.0


def test_loss_decreases_and_export_is_written(cache, tmp_path):
    out = tmp_path / "run"
    export = run(tiny(cache, out, epochs=3, eval_parts=1, eval_every=10))
    train = records(out)
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert train[-1]["step"] == len(train)
    for key in ("tau", "acc", "lr", "grad_norm", "tokens_per_s", "data_wait"):
        assert key in train[-1]
    assert len(train[-1]["acc"]) == 3  # offsets 1..B-1
    evals = records(out, "eval")
    assert evals and evals[-1]["step"] == train[-1]["step"] and evals[-1]["tau"] >= 1.0
    # the export holds exactly the drafter's keys and the last weights
    tensors = load_file(str(export / "model.safetensors"))
    assert set(tensors) == set(EXPORT_KEYS(1))
    drafter, dcfg = load_drafter(list_checkpoints(out)[-1][1])
    assert dcfg.target_layer_ids == (0, 1, 3) and dcfg.mask_token_id == 300
    for key, value in drafter.state_dict().items():
        assert torch.equal(tensors[key], value.to(torch.bfloat16))
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["attention"] == "sdpa" and saved["train"]["gamma"] == 2.0
    assert saved["train"]["target_layers"] == "0,1,3"


@pytest.mark.parametrize(("workers", "log_every"), [(0, 1), (2, 4)])
def test_killed_run_resumes_bitwise(cache, tmp_path, workers, log_every):
    """Interrupted at step 7 (last checkpoint at 5, mid-epoch 2) then resumed == uninterrupted,
    its metrics too: a checkpoint's step ends a logging window, so both log the same windows."""
    kw = dict(steps=12, checkpoint_every=5, keep_checkpoints=2, target_layers="3,0")
    kw.update(workers=workers, log_every=log_every)
    whole = tmp_path / "whole"
    run(tiny(cache, whole, **kw))
    broken = tmp_path / "broken"
    run(tiny(cache, broken, stop_after_steps=7, **kw))
    assert not (broken / "export").exists()
    assert [s for s, _ in list_checkpoints(broken)] == [5]
    run(tiny(cache, broken, **kw))  # --resume auto
    a, b = final_state(whole), final_state(broken)
    assert a["step"] == b["step"] == 12
    assert a["loader"] == b["loader"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for s, t in zip(
        a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True
    ):
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
    assert [s for s, _ in list_checkpoints(broken)] == [10, 12]  # keeps the newest 2
    logged = [1, 4, 5, 8, 10, 12] if log_every == 4 else list(range(1, 13))
    assert [r["step"] for r in records(broken)] == logged  # rewound to step 5
    assert [r["step"] for r in records(whole)] == logged
    assert [r["loss"] for r in records(broken)] == [r["loss"] for r in records(whole)]


def test_the_same_command_finishes_a_finished_or_damaged_run(cache, tmp_path):
    """Rerun after the end: the export again, not an error (a run killed between its last
    checkpoint and its export gets it); a newest checkpoint damaged after it was written and
    a metrics line torn by a kill: resumed from the checkpoint before it, each step logged once."""
    out = tmp_path / "run"
    export = run(tiny(cache, out, steps=4, checkpoint_every=2, eval_parts=1))
    first = load_file(str(export / "model.safetensors"))
    shutil.rmtree(export)
    last = list_checkpoints(out)[-1][1] / "state.pt"
    saved = last.stat().st_ino
    assert run(tiny(cache, out, steps=4, checkpoint_every=2, eval_parts=1)) == export
    assert last.stat().st_ino == saved  # resumed at its last step: nothing new to save there
    again = load_file(str(export / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert [r["step"] for r in records(out, "eval")] == [4]  # evaluated again, logged once
    with pytest.raises(RunError, match="step-4 is at step 4, past this run's --steps 3"):
        run(tiny(cache, out, steps=3, checkpoint_every=2, eval_parts=1))
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 4  # untouched
    newest = list_checkpoints(out)[-1][1]
    with open(newest / "state.pt", "r+b") as f:
        f.truncate(1000)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "lo')  # what a kill mid-write leaves
    run(tiny(cache, out, steps=6, checkpoint_every=2, eval_parts=1))
    assert final_state(out)["step"] == 6
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 5, 6]  # resumed from step 2
    for _, path in list_checkpoints(out):  # every one damaged: refused, never a fresh start
        with open(path / "state.pt", "r+b") as f:
            f.truncate(1000)
    with pytest.raises(StopRun, match="every checkpoint in .* is damaged"):
        run(tiny(cache, out, steps=8, checkpoint_every=2, eval_parts=1))


def test_run_folder_refuses_a_different_run(cache, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(tiny(cache, out, steps=2))
    with pytest.raises(RunError, match="lr: run has 0.003, now 0.001"):
        run(tiny(cache, out, steps=2, lr=1e-3))
    with pytest.raises(RunError, match="--resume none"):
        run(tiny(cache, out, steps=2, resume="none"))
    # A step left to train: the data order depends on the ranks and loader streams.
    with pytest.raises(RunError, match="1 ranks x 1 loader streams, this run has 2 x 1") as e:
        run(tiny(cache, out, steps=3, gpus="cpu:2"))
    assert "resume with 1 rank (--gpus), or" in str(e.value)
    with pytest.raises(RunError, match="this run has 1 x 2: .* resume with --workers 1 .or 0."):
        run(tiny(cache, out, steps=3, workers=2))
    with monkeypatch.context() as env:  # two processes under torchrun: refused alike, first
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
            env.setenv(name, value)
        with pytest.raises(RunError, match="1 ranks x 1 loader streams, this run has 2 x 1"):
            run(tiny(cache, out, steps=3))
    assert json.loads((out / "config.json").read_text())["ranks"] == 1  # the record stands
    with pytest.raises(RunError, match="not a complete checkpoint"):
        run(tiny(cache, out, steps=2, resume=str(tmp_path / "missing")))
    run(tiny(cache, out, steps=3))  # more steps: harmless, resumes from step 2
    assert final_state(out)["step"] == 3
    assert [r["step"] for r in records(out)] == [1, 2, 3]


def test_incompatible_cache_lists_every_problem(tmp_path):
    bad = write_cache(tmp_path / "bad", num_parts=2, samples_per_part=2, complete=False)
    config = bad / "target" / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 128'))
    result = CliRunner().invoke(
        main,
        ["--data", str(bad), "--out", str(tmp_path / "r"), "--gpus", "cpu"]
        + ["--target-layers", "0,2,7", "--mask-token-id", "5000", "--no-follow"],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    problems = [line for line in result.output.splitlines() if line.startswith("  - ")]
    assert len(problems) == 6, result.output  # five, and the repair of the damaged one
    assert (
        sum(p.startswith("  - to repair them: run `python -m extract.verify ") for p in problems)
        == 1
    )
    text = result.output
    assert "target/config.json: " in text  # edited after its checksum was recorded
    assert "incomplete" in text and "[2, 7]" in text and "mask_token_id" in text
    assert "hidden size 64 in the cache, the drafter needs 128" in text
    assert not (tmp_path / "r").exists()  # refused before any work


def test_unknown_format_version_is_refused(cache, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((cache / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    result = CliRunner().invoke(main, ["--data", str(old), "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and "format version 99" in result.output


def test_cli_errors_are_usage_errors(cache, tmp_path):
    runner = CliRunner()
    out = str(tmp_path / "r")
    r = runner.invoke(main, ["--data", str(cache), "--out", out, "--gpus", "cpu", "--lr", "-1"])
    assert r.exit_code == 2 and "lr" in r.output
    r = runner.invoke(
        main, ["--data", str(cache), "--out", out, "--gpus", "cpu", "--attention", "flex"]
    )
    assert r.exit_code == 1 and "no backward on CPU" in r.output
    r = runner.invoke(main, ["--data", str(cache), "--out", out, "--gpus", "9"])
    assert r.exit_code == 1 and "does not exist" in r.output


def test_drafter_shape_overrides_reach_the_export(cache, tmp_path):
    shape = dict(drafter_heads=2, drafter_kv_heads=1, drafter_head_dim=8, drafter_intermediate=48)
    export = run(tiny(cache, tmp_path / "run", steps=1, **shape))
    hf = json.loads((export / "config.json").read_text())
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (2, 1, 8)
    assert hf["intermediate_size"] == 48
    tensors = load_file(str(export / "model.safetensors"))
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (2 * 8, 64)
    assert tensors["layers.0.mlp.up_proj.weight"].shape == (48, 64)
    result = CliRunner().invoke(
        main,
        ["--data", str(cache), "--out", str(tmp_path / "bad"), "--gpus", "cpu"]
        + ["--drafter-heads", "3", "--drafter-kv-heads", "2"],
    )
    assert result.exit_code == 1 and "num_key_value_heads (2) must divide" in result.output


def test_a_warm_start_that_cannot_fit_is_refused_before_the_run_folder(cache, tmp_path):
    base = tmp_path / "base"
    run(tiny(cache, base, steps=2))
    out = tmp_path / "warm"
    for source, kw, needle in [
        (tmp_path / "missing", {}, "no such folder"),
        (base, {}, f"it is a run folder; give {base / 'export'}"),
        (base / "export", {"drafter_layers": 2}, "num_layers: 1 in"),
    ]:
        with pytest.raises(RunError, match=needle):
            run(tiny(cache, out, steps=2, init_from=source, **kw))
        assert not out.exists()  # nothing written: the corrected command is not refused
    run(tiny(cache, out, steps=2, init_from=base / "export"))
    assert final_state(out)["step"] == 2


def test_a_run_resumes_under_another_spelling_of_its_folder(cache, tmp_path, monkeypatch):
    run(tiny(cache, tmp_path / "run", steps=2))  # an absolute --out
    monkeypatch.chdir(tmp_path)
    run(tiny(cache, Path("run"), steps=3))  # the same folder, relative: resumed, not refused
    assert final_state(tmp_path / "run")["step"] == 3


def test_holding_out_more_than_is_trained_warns(cache, tmp_path, caplog):
    caplog.set_level("WARNING", logger="train.run")
    run(tiny(cache, tmp_path / "run", eval_fraction=0.9, steps=1))
    (warning,) = [r.getMessage() for r in caplog.records if "holds out" in r.getMessage()]
    assert warning.startswith("--eval-fraction 0.9 holds out more samples than it trains on")
    assert "(21 against 3)" in warning  # 24 samples: 0.9 of them, and the rest


def test_resuming_another_runs_checkpoint_needs_its_settings(cache, tmp_path):
    first = tmp_path / "first"
    run(tiny(cache, first, steps=2, checkpoint_every=2, lr=1e-3))
    step2 = first / "checkpoints" / "step-2"
    other = tmp_path / "other"
    with pytest.raises(RunError, match=r"another run \(.*first\) with other settings") as e:
        run(tiny(cache, other, steps=4, resume=str(step2)))
    assert "lr: run has 0.001, now 0.003" in str(e.value) and f"--init-from {step2}" in str(e.value)
    assert not (other / "config.json").exists()  # nothing recorded for a refused run
    run(tiny(cache, other, steps=4, resume=str(step2), lr=1e-3))  # the same settings: a fork
    assert [r["step"] for r in records(other)] == [3, 4]


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(cache, tmp_path):
    out = tmp_path / "run"
    run(tiny(cache, out, steps=3, checkpoint_every=1000, stop_after_steps=2))
    assert not list_checkpoints(out) and [r["step"] for r in records(out)] == [1, 2]
    run(tiny(cache, out, steps=3, checkpoint_every=1000))  # starts again from scratch
    assert [r["step"] for r in records(out)] == [1, 2, 3]


def test_an_export_or_another_tools_folder_is_not_a_run_folder(cache, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (export / "model.safetensors").write_bytes(b"")
    with pytest.raises(RunError, match="its config.json is a drafter export's, not a training"):
        run(tiny(cache, export, steps=1))
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
