"""How the CLIs take their options: a missing required one, and one typed beside the option that
makes it have no effect (both named), are usage errors before any work; the same option left at
its default, or given alone, is taken as ever."""

from __future__ import annotations

import importlib

import click
import pytest
from click.testing import CliRunner

from extract.__main__ import main as extract_main
from extract.config import ExtractConfig
from shared.cli import build
from train.__main__ import main as train_main
from train.config import TrainConfig
from train.sweep.grid import GridError, Variant, check


def _build(command: click.Command, cls: type, argv: list[str]):
    with command.make_context("prog", argv) as ctx:
        return build(cls, ctx.params)


EXTRACT = ["--out", "cache", "--gpus", "cpu"]
TRAIN = ["--data", "cache", "--out", "run", "--gpus", "cpu"]


@pytest.mark.parametrize(
    "command, cls, argv, named",
    [
        (extract_main, ExtractConfig, [*EXTRACT, "--layers", "1,2", "--num-layers", "3"],
         ("--num-layers 3", "--layers 1,2")),
        (train_main, TrainConfig, [*TRAIN, "--steps", "5", "--epochs", "2"],
         ("--epochs 2", "--steps 5")),
        (train_main, TrainConfig, [*TRAIN, "--eval-fraction", "0.1", "--eval-parts", "1"],
         ("--eval-fraction 0.1", "--eval-parts 1")),
    ],
)  # fmt: skip
def test_moot_option_beside_its_overrider_is_refused(command, cls, argv, named):
    with pytest.raises(click.UsageError) as e:
        _build(command, cls, argv)
    message = e.value.format_message()
    assert all(part in message for part in named), message


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--markov-rank", "3"], "--markov-rank has no effect unless --drafter-type is dspark"),
        (["--no-confidence-head"], "--confidence-head has no effect unless --drafter-type"),
        (["--drafter-type", "dspark", "--selector-rank", "4"],
         "--selector-rank has no effect unless --drafter-type is dflash2 (this command's: dspark)"),
        (["--muon-lr", "0.1"], "--muon-lr has no effect unless --optimizer is muon"),
        (["--kl-weight", "0.3", "--loss", "kl"], "--kl-weight has no effect unless --loss is mix"),
        (["--dpace-alpha", "0.9"], "--dpace-alpha has no effect unless --slot-weights is dpace"),
        (["--drafter-type", "dspark", "--dspark-loss", "ce", "--confidence-head"],
         "--confidence-head has no effect unless --dspark-loss is full (this command's: ce): "
         "drop it, or give --dspark-loss full"),
        (["--drafter-type", "dspark", "--dspark-loss", "ce", "--dspark-l1-weight", "0.5"],
         "--dspark-l1-weight has no effect unless --dspark-loss is full"),
        (["--dspark-loss", "ce", "--confidence-head"],  # the outer condition named first
         "--confidence-head has no effect unless --drafter-type is dspark"),
    ],
)  # fmt: skip
def test_an_option_of_another_family_or_mode_is_refused(argv, named):
    with pytest.raises(click.UsageError) as e:
        _build(train_main, TrainConfig, [*TRAIN, *argv])
    assert named in e.value.format_message()


def test_each_alone_or_at_its_default_is_taken():
    cfg = _build(extract_main, ExtractConfig, [*EXTRACT, "--layers", "1,3"])
    assert cfg.layer_ids == (1, 3)
    assert _build(extract_main, ExtractConfig, [*EXTRACT, "--num-layers", "3"]).num_layers == 3
    cfg = _build(train_main, TrainConfig, [*TRAIN, "--steps", "5"])
    assert (cfg.steps, cfg.epochs) == (5, 6)  # --epochs's default stays, and has no effect
    assert _build(train_main, TrainConfig, [*TRAIN, "--epochs", "2"]).epochs == 2
    assert _build(train_main, TrainConfig, [*TRAIN, "--eval-parts", "1"]).eval_parts == 1
    dspark = [*TRAIN, "--drafter-type", "dspark", "--markov-rank", "3", "--no-confidence-head"]
    assert _build(train_main, TrainConfig, dspark).markov_rank == 3
    ce = [*TRAIN, "--drafter-type", "dspark", "--dspark-loss", "ce"]
    assert not _build(train_main, TrainConfig, ce).with_confidence_head  # its default stays
    full = [*TRAIN, "--drafter-type", "dspark", "--dspark-loss", "full", "--confidence-head"]
    assert _build(train_main, TrainConfig, full).with_confidence_head
    muon = [*TRAIN, "--optimizer", "muon", "--muon-lr", "0.1"]
    assert _build(train_main, TrainConfig, muon).muon_lr == 0.1


def test_the_whole_command_exits_with_a_usage_error(tmp_path):
    result = CliRunner().invoke(
        extract_main, ["--out", str(tmp_path / "c"), "--layers", "1,2", "--num-layers", "3"]
    )
    assert result.exit_code == 2
    assert "--num-layers 3 has no effect with --layers 1,2" in result.output
    assert not (tmp_path / "c").exists()


def test_a_sweep_names_the_variant():
    with pytest.raises(GridError, match=r"variant lr=1e-3: --epochs 2 has no effect with --steps"):
        check(Variant((("lr", "1e-3"),)), [*TRAIN[:4], "--steps", "5", "--epochs", "2"])


@pytest.mark.parametrize(
    "module, argv, missing",
    [
        ("extract.__main__", [], "--out"),
        ("train.__main__", ["--out", "run"], "--data"),
        ("train.__main__", ["--data", "cache"], "--out"),
        ("extract.regen.__main__", [], "--out"),
    ],
)
def test_a_missing_required_option_is_a_usage_error(module, argv, missing):
    main = importlib.import_module(module).main
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and f"Missing option '{missing}'" in result.output, result.output


def test_a_too_small_value_names_the_least_one():
    with pytest.raises(click.UsageError) as e:
        _build(extract_main, ExtractConfig, [*EXTRACT, "--staging-buffers", "1"])
    assert "--staging-buffers: 1 is too small (at least 2)" in e.value.format_message()


@pytest.mark.parametrize(
    "layers, named",
    [
        ("3,3", "--layers '3,3': layer 3 is given twice"),
        ("1,-1", "--layers '1,-1': -1 is not a layer id (0-based: 0 or more)"),
        ("1,,2", "--layers '1,,2': '' is not an integer layer id"),
        ("x", "--layers 'x': 'x' is not an integer layer id"),
    ],
)
def test_a_malformed_layer_list_is_a_usage_error(tmp_path, layers, named):
    """What is wrong with --layers whatever the target is refused before it is read."""
    result = CliRunner().invoke(extract_main, ["--out", str(tmp_path / "c"), "--layers", layers])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "c").exists()


def test_a_layer_past_the_target_is_named_with_the_value_given(tmp_path, tiny_qwen3):
    args = ["--out", str(tmp_path / "c"), "--target", str(tiny_qwen3), "--layers", "1,8"]
    result = CliRunner().invoke(extract_main, args)
    assert result.exit_code == 1, result.output
    assert "--layers '1,8': ids [8] out of range: the target has 8 decoder layers" in result.output
    assert not (tmp_path / "c").exists()
