"""`python -m train.proof.speculate` on inputs a user gets wrong: each refused with one message
naming the input, never a traceback."""

import json
import shutil

import pytest
from click.testing import CliRunner

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.export import export_drafter
from train.proof.speculate import main


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_qwen3):
    target_cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    cfg = DrafterConfig.from_target_config(
        target_cfg, num_layers=1, target_layer_ids=(1, 3), block_size=8, tokenizer_vocab_size=500
    )
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    return export_drafter(drafter, cfg, tmp_path_factory.mktemp("drafter") / "export")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, needle: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert needle in result.output, result.output


def test_a_damaged_target_weight_file_is_named(tmp_path, tiny_qwen3, export):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hi"]))
    cut = shutil.copytree(tiny_qwen3, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # its header intact, its data cut short
    result = run("--target", cut, "--drafter", export, "--prompts", prompts, "--warmup", 0)
    refused(result, f"--target {cut}: cannot load its weights (")


def test_a_target_config_transformers_rejects_is_named(tmp_path, tiny_qwen3, export):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hi"]))
    odd = shutil.copytree(tiny_qwen3, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["layer_types"] = config["layer_types"][:1]  # fewer than num_hidden_layers
    (odd / "config.json").write_text(json.dumps(config))
    result = run("--target", odd, "--drafter", export, "--prompts", prompts)
    refused(result, f"--target {odd}: cannot read its config or tokenizer (")


def test_prompts_given_as_a_folder_or_with_a_bad_entry_name_the_file(tmp_path, tiny_qwen3, export):
    result = run("--target", tiny_qwen3, "--drafter", export, "--prompts", tmp_path)
    refused(result, f"--prompts: {tmp_path} is a folder, not a file")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["fine", None]))
    result = run("--target", tiny_qwen3, "--drafter", export, "--prompts", prompts)
    refused(result, f"--prompts {prompts}: prompt 1: expected a string")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--warmup", -1), "--warmup: must be >= 0, got -1"),
        (("--temperature", -0.5), "--temperature: must be >= 0, got -0.5"),
        (("--max-new-tokens", 1), "--max-new-tokens: must be >= 2 (the first new token"),
        (("--confidence-threshold", 2), "--confidence-threshold: must be in [0, 1], got 2.0"),
        (("--shard", "3/2"), "--shard: must be K/N with 1 <= K <= N"),
    ],
)
def test_an_option_out_of_range_is_named_as_typed(tmp_path, option, message):
    result = run("--target", "t", "--drafter", tmp_path, "--prompts", tmp_path / "p", *option)
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output


def test_progress_is_told_per_prompt_before_the_report(tmp_path, tiny_qwen3, export):
    """Without a terminal (a log file) each decoding ends with a progress line of its prompts,
    named by its drafter where there are several."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hi", [1, 5, 9]]))
    other = shutil.copytree(export, tmp_path / "other")
    common = ["--target", tiny_qwen3, "--prompts", prompts, "--device", "cpu"]
    common += ["--max-new-tokens", 4, "--warmup", 0]

    def events(output):
        said = []
        for line in output.splitlines():
            if ": 2/2 prompts (100%)" in line:
                said.append(line.split(" INFO shared.progress: ")[-1].split(":")[0])
            elif line.startswith("tau "):
                said.append("report")
        return said

    result = run(*common, "--drafter", export)
    assert result.exit_code == 0, result.output
    assert events(result.output) == ["greedy decoding", "speculative decoding", "report"]
    result = run(*common, "--drafter", export, "--drafter", other)
    assert result.exit_code == 0, result.output
    assert events(result.output) == [
        "greedy decoding",
        f"speculative decoding, {export}",
        "report",
        f"speculative decoding, {other}",
        "report",
    ]


def test_a_cache_given_as_the_target_names_the_target_to_give(tmp_path, export):
    from tests.cachegen import write_cache

    cache = write_cache(tmp_path / "cache", num_parts=1, samples_per_part=1)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hi"]))
    for given, what in [(cache, "a hidden-state cache"), (cache / "target", "a cache's target/")]:
        result = run("--target", given, "--drafter", export, "--prompts", prompts)
        refused(result, f"--target {given} is {what}")
        assert "give the target model it was extracted from, synthetic" in result.output


def test_a_drafter_of_another_target_is_named_with_the_target(tmp_path, tiny_qwen3, export):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hi"]))
    other = shutil.copytree(tiny_qwen3, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    result = run("--target", other, "--drafter", export, "--prompts", prompts)
    refused(result, f"the drafter ({export}) does not fit the target {other}:")
    assert "drafter hidden size 64, target 96" in result.output
    assert "give the target its training cache was extracted from" in result.output


def test_the_json_line_is_strict_json_with_no_standard_error_as_null(tmp_path, tiny_qwen3, export):
    """One prompt has no standard error: null, as metrics.jsonl writes a figure with nothing to
    measure, which every JSON reader reads (NaN is no JSON)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 5, 9]]))
    result = run(
        "--target", tiny_qwen3, "--drafter", export, "--prompts", prompts, "--device", "cpu",
        "--max-new-tokens", 6, "--warmup", 0, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    summary = json.loads(result.stdout.splitlines()[-1], parse_constant=refuse)
    assert summary["tau_se"] is None and summary["prompts"] == 1 and summary["tau"] >= 1


def test_prompts_that_run_past_the_targets_positions_are_warned_of(tmp_path, tiny_qwen3, export):
    """A decoding past max_position_embeddings measures the target's extrapolation: said once,
    naming how many prompts and the longest; the decoding still runs. Within them, nothing."""
    target = shutil.copytree(tiny_qwen3, tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5] * 14, [1, 5, 9]]))
    common = ["--target", target, "--drafter", export, "--device", "cpu", "--warmup", 0]
    result = run(*common, "--prompts", prompts, "--max-new-tokens", 4)
    assert result.exit_code == 0, result.output
    said = "1 of 2 prompts run past the target's 16 positions with --max-new-tokens 4"
    assert result.output.count(said) == 1, result.output
    assert "(the longest, prompt 0, to 18)" in result.output
    prompts.write_text(json.dumps([[5] * 10, [1, 5, 9]]))
    result = run(*common, "--prompts", prompts, "--max-new-tokens", 4)
    assert result.exit_code == 0 and "past the target's" not in result.output, result.output
