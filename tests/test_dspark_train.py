"""`python -m train --drafter-type dspark` on CPU: the objective's terms and per-slot metrics in
metrics.jsonl and eval, the taps and the last layer read from the cache, the clear error for a
cache without the last layer, `--dspark-loss ce`, and the export in DeepSpec's dense format
(through `python -m train.export` too)."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from shared.manifest import CacheMismatch
from shared.target_files import load_heads
from tests.cachegen import write_cache
from tests.test_train_loop import records, tiny
from train.checkpoint import list_checkpoints, load_drafter
from train.export import export_keys
from train.export import main as export_main
from train.export_load import load_export
from train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # 4 target layers; layers 0, 1 and the last, 3 (stored after the final norm)
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=3, samples_per_part=6)


def test_trains_with_its_terms_and_slot_metrics_and_exports(cache, tmp_path):
    out = tmp_path / "run"
    export = run(tiny(cache, out, drafter_type="dspark", markov_rank=8, epochs=10, eval_parts=1))
    train = records(out)
    for key in ("loss", "ce", "conf"):
        assert sum(r[key] for r in train[-5:]) < 0.8 * sum(r[key] for r in train[:5]), key
    last = train[-1]
    assert len(last["acc"]) == len(last["accept_prob"]) == 4  # block 4: four drafts
    assert 1.0 <= last["tau_prob"] <= 5.0 and 0 <= last["l1"] <= 2
    assert last["loss"] == pytest.approx(0.1 * last["ce"] + 0.9 * last["l1"] + last["conf"])
    evals = records(out, "eval")
    assert evals and {"conf_ece", "conf_auc", "tau_prob", "accept_prob"} <= set(evals[-1])
    saved = json.loads((out / "config.json").read_text())
    # Default taps: the cached layers but the last, which is the target's distribution.
    assert saved["train"]["target_layers"] == "0,1" and saved["train"]["gamma"] == 4.0
    assert saved["drafter"]["drafter_type"] == "dspark" and saved["drafter"]["markov_rank"] == 8
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert config["confidence_head_with_markov"] is True and config["enable_confidence_head"]
    assert (config["target_layer_ids"], config["block_size"], config["num_anchors"]) == (
        [0, 1],
        4,
        8,
    )
    _, cfg = load_export(export)
    embed, lm_head = load_heads(cache)
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(export_keys(cfg))
        assert torch.equal(f.get_tensor("embed_tokens.weight"), embed.to(torch.bfloat16))
        assert torch.equal(f.get_tensor("lm_head.weight"), lm_head.to(torch.bfloat16))
        assert f.get_tensor("confidence_head.proj.weight").shape == (1, 64 + 8)
    # python -m train.export of the last checkpoint writes the same files
    step = list_checkpoints(out)[-1][1]
    result = CliRunner().invoke(export_main, [str(step), str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config
    again, _ = load_export(tmp_path / "again")
    ours, _ = load_export(export)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    drafter, _ = load_drafter(step)
    assert set(drafter.state_dict()) | {"embed_tokens.weight", "lm_head.weight"} == set(
        export_keys(cfg)
    )


def test_a_cache_without_the_last_layer_names_the_flag_and_ce_trains(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=6, layer_ids=(0, 1))
    with pytest.raises(CacheMismatch) as err:
        run(tiny(cache, tmp_path / "full", drafter_type="dspark", markov_rank=8))
    message = str(err.value)
    assert "--layers 0,1,3" in message and "--dspark-loss ce" in message
    out = tmp_path / "ce"
    export = run(tiny(cache, out, drafter_type="dspark", markov_rank=8, dspark_loss="ce"))
    last = records(out)[-1]
    assert last["loss"] == pytest.approx(last["ce"]) and "tau_prob" not in last
    config = json.loads((export / "config.json").read_text())
    assert config["enable_confidence_head"] is False and config["markov_rank"] == 8
    _, cfg = load_export(export)
    assert not any(k.startswith("confidence_head") for k in export_keys(cfg))


def test_plain_anchor_first_drafter_and_option_errors(cache, tmp_path):
    with pytest.raises(ValueError, match="markov_rank: 0 leaves the confidence head"):
        tiny(cache, tmp_path / "x", drafter_type="dspark", markov_rank=0)
    export = run(
        tiny(cache, tmp_path / "plain", drafter_type="dspark", markov_rank=0, epochs=1,
             confidence_head=False)
    )  # fmt: skip
    config = json.loads((export / "config.json").read_text())
    assert (config["markov_rank"], config["enable_confidence_head"]) == (0, False)
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if k.startswith(("markov", "confidence"))]


def test_export_command_says_to_give_the_cache_where_the_recorded_one_is_not_found(
    cache, tmp_path, monkeypatch
):
    """A run records --data as its command spelled it: relative to the folder it ran in. From
    another folder the export cannot find the target's heads there, and says to give --cache."""
    monkeypatch.chdir(cache.parent)
    run(tiny(cache.relative_to(cache.parent), tmp_path / "run", drafter_type="dspark",
             markov_rank=8, dspark_loss="ce", steps=2))  # fmt: skip
    ckpt = list_checkpoints(tmp_path / "run")[-1][1]
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(export_main, [str(ckpt), "export"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert (
        f"--data {cache.name}" in result.output and "give the cache with --cache" in result.output
    )
    assert not (tmp_path / "export").exists()
    result = CliRunner().invoke(export_main, [str(ckpt), "export", "--cache", str(cache)])
    assert result.exit_code == 0, result.output
