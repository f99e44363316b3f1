"""A target that cannot be loaded is named as the problem, and leaves nothing in --out that
blocks the same command once the target is fixed; a cache that --overwrite would replace is
left byte for byte as it was."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import signal
from pathlib import Path

import pytest
import torch

from extract.config import ExtractConfig
from extract.run import ExtractError, run
from extract.stops import prepared_unless_stopped, stopped_at_once, stopped_before_preparing
from shared.manifest import drop_parts, read_manifest, update_manifest
from shared.progress import read_counters
from shared.stopping import Stopped, StopRun
from tests.held_file import interrupted_at_open
from tests.test_extract import chat
from tests.test_regenerate_target_load import LAYER_WEIGHT, damaged_target

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4)))
    return path


def request(out: Path, target: Path, data: Path, **over) -> ExtractConfig:
    cfg = dict(out=out, target=str(target), data=(data,), gpus="cpu", rows_per_part=4)
    return ExtractConfig(**{**cfg, "layers": "0,1", "writer_threads": 1, **over})


def with_tokenizer(model: torch.nn.Module, folder: Path, tiny: Path, **save) -> Path:
    model.save_pretrained(folder, **save)
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, folder / name)
    return folder


def test_a_missing_weight_file_is_named_before_anything_is_written(tmp_path, tiny_qwen3, data_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    target = with_tokenizer(model, tmp_path / "sharded", tiny_qwen3, max_shard_size="200KB")
    shards = sorted(target.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(ExtractError, match=f"--target {target}: 1 of the {len(shards)}") as e:
        run(request(tmp_path / "c", target, data_file))
    assert shards[1].name in str(e.value)
    assert not (tmp_path / "c").exists()


def test_an_index_beside_a_single_weight_file_is_not_read(tmp_path, tiny_qwen3, data_file):
    """transformers loads a lone model.safetensors before any shard index: a stale index left
    beside it (listing shards no longer there) is no reason to refuse the target."""
    target = tmp_path / "single"
    shutil.copytree(tiny_qwen3, target)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run(request(tmp_path / "c", target, data_file)).complete


def test_a_target_that_fails_to_load_does_not_block_the_fixed_command(
    tmp_path, tiny_qwen3, data_file
):
    """A target whose decoder has no `layers` list (BERT) passes planning and fails to load:
    the cache folder it began holds no part, and the next command takes it over; a cache with
    parts and other settings is still refused."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertLMHeadModel

    vocab = json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]
    bert = BertLMHeadModel(
        BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, is_decoder=True)
    )  # fmt: skip
    target = with_tokenizer(bert, tmp_path / "bert", tiny_qwen3)
    weights = load_file(target / "model.safetensors")  # with the embedding extraction reads
    weights["model.embed_tokens.weight"] = weights["bert.embeddings.word_embeddings.weight"].clone()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "c"
    with pytest.raises(StopRun, match=f"--target {target}: cannot find the decoder layers"):
        run(request(out, target, data_file))
    assert read_manifest(out).parts == ()
    manifest = run(request(out, tiny_qwen3, data_file))
    assert manifest.complete and manifest.target.path == str(tiny_qwen3)
    with pytest.raises(ExtractError, match="holds a different cache"):
        run(request(out, tiny_qwen3, data_file, layers="0,2"))
    assert read_manifest(out) == manifest


def test_a_config_promising_layers_the_weights_lack_is_refused_before_any_work(
    tmp_path, tiny_qwen3, data_file
):
    target = tmp_path / "more"
    shutil.copytree(tiny_qwen3, target)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 12
    config["layer_types"] = config["layer_types"][:1] * 12
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExtractError, match=f"--target {target}: .* no tensor of 2 of the 10 "):
        run(request(tmp_path / "c", target, data_file, layers="1,9"))
    assert not (tmp_path / "c").exists()


def test_weights_missing_from_the_layers_used_are_an_error(tmp_path, tiny_qwen3, data_file):
    """One tensor of a layer gone (the layer's others there): transformers would fill it with
    random values; a layer the run does not compute may lack its own."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "part"
    shutil.copytree(tiny_qwen3, target)
    weights = load_file(target / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "c"
    with pytest.raises(StopRun, match=f"--target {target}: 1 weight of the layers this run") as e:
        run(request(out, target, data_file, layers="0,2"))
    assert "(model.layers.1.mlp.up_proj.weight)" in str(e.value)
    assert run(request(out, target, data_file, layers="0")).complete


def test_tied_embeddings_are_not_missing_weights(tmp_path, tiny_qwen3, data_file):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_qwen3)
    config.tie_word_embeddings = True
    target = with_tokenizer(AutoModelForCausalLM.from_config(config), tmp_path / "tied", tiny_qwen3)
    assert run(request(tmp_path / "c", target, data_file, layers="0,7")).complete


def test_a_target_without_tokenizer_files_is_named(tmp_path, tiny_qwen3, data_file):
    """transformers makes an empty tokenizer for a folder without tokenizer files, which would
    reject every row as rendering no tokens: the target is named instead, before any work."""
    target = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_qwen3, target)
    for f in target.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ExtractError, match=f"--target {target}: its tokenizer is empty"):
        run(request(tmp_path / "c", target, data_file))
    assert not (tmp_path / "c").exists()


def _files(out: Path) -> dict[str, bytes]:
    """Every file under `out`, by path, with its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def previous(tiny_qwen3, data_file, tmp_path_factory) -> Path:
    """A complete cache of layers 0 and 1 in two parts, to copy into each test."""
    out = tmp_path_factory.mktemp("previous") / "c"
    assert run(request(out, tiny_qwen3, data_file, rows_per_part=2)).complete
    return out


@pytest.mark.parametrize(
    "damage, said",
    [
        ("missing", f"1 weight of the layers this run uses is not in .*{LAYER_WEIGHT}"),
        ("shape", "it did not load on cpu \\(RuntimeError: .*ignore_mismatched_sizes"),
    ],
)
def test_a_target_that_does_not_load_leaves_the_cache_to_overwrite(
    tiny_qwen3, data_file, previous, tmp_path, damage, said
):
    """Both damages pass planning's checks of the weight files and fail as the target loads;
    the same command with a target that loads replaces the cache."""
    out = tmp_path / "c"
    shutil.copytree(previous, out)
    before = _files(out)
    target = damaged_target(tiny_qwen3, tmp_path / "damaged", damage)
    again = dict(layers="0,2", rows_per_part=2, overwrite=True)
    with pytest.raises(StopRun, match=f"--target {target}: {said}") as e:
        run(request(out, target, data_file, **again))
    assert str(e.value).endswith(f"the cache in --out {out} was not touched")
    assert _files(out) == before
    manifest = run(request(out, tiny_qwen3, data_file, **again))
    assert manifest.complete and manifest.layer_ids == (0, 2)
    assert _files(out)["manifest.json"] != before["manifest.json"]


@pytest.mark.slow
def test_a_target_that_loads_on_no_rank_of_two_leaves_the_cache_to_overwrite(
    tiny_qwen3, data_file, previous, tmp_path, monkeypatch, caplog
):
    """Each rank holds a part: both fail alike, neither clears the cache; with a target that
    loads, the same command replaces it. The launcher's bar, drawn while the ranks load, counts
    none of the rows of the cache it is to replace, whose counters stay until rank 0 clears it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned processes
    out = tmp_path / "c"
    shutil.copytree(previous, out)
    assert read_counters(out / ".progress")["done_rows"] == 4
    before = _files(out)
    target = damaged_target(tiny_qwen3, tmp_path / "damaged", "shape")
    two = dict(layers="0,2", rows_per_part=2, overwrite=True, gpus="cpu:2")
    caplog.set_level(logging.INFO, logger="shared.progress")
    with pytest.raises(StopRun, match=f"--target {target}: it did not load .* \\(2 of 2 ranks\\)"):
        run(request(out, target, data_file, **two))
    assert _files(out) == before
    bar = [r.getMessage() for r in caplog.records if r.getMessage().startswith("extract: ")]
    assert bar and all(line.startswith("extract: 0/4 rows") for line in bar), bar
    manifest = run(request(out, tiny_qwen3, data_file, **two))
    assert manifest.complete and manifest.layer_ids == (0, 2)
    assert _files(out)["manifest.json"] != before["manifest.json"]


LOADING = "stopping once the target has loaded, before any part (again: at once)"


def _interrupted(out: Path, tiny: Path, data: Path, more: list[str], **how) -> list[str]:
    """`python -m extract` of a copy of `tiny` stopped as `interrupted_at_open` says (while it
    loads the target, which planning does not): the last two lines it printed, after checking
    that the second gives the command to resume."""
    target = out.parent / "target"
    shutil.copytree(tiny, target)
    args = ["--target", str(target), "--data", str(data), "--out", str(out), *more]
    done = interrupted_at_open("extract", args, target / "generation_config.json", **how)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr
    said = done.stderr.strip().splitlines()[-2:]
    assert said[1] == "resume: " + shlex.join(["python", "-m", "extract", *args]), said
    return said


def test_ctrl_c_while_the_target_loads_leaves_the_cache_to_overwrite(
    tiny_qwen3, data_file, previous, tmp_path
):
    """SIGINT sent while the process is held inside the target's load (where transformers opens
    generation_config.json, which planning does not read): once the load ends it stops with a
    message and the resume command, before it clears the cache that --overwrite would replace."""
    out = tmp_path / "c"
    shutil.copytree(previous, out)
    before = _files(out)
    more = ["--gpus", "cpu", "--layers", "0,2", "--rows-per-part", "2", "--overwrite"]
    said = _interrupted(out, tiny_qwen3, data_file, more, said=[f"SIGINT: {LOADING}"])
    assert said[0] == (
        "Error: stopped by SIGINT while the target loaded, before any part: the cache in --out "
        f"{out} was not touched; rerun the same command to start it."
    )
    assert _files(out) == before


def test_a_second_ctrl_c_while_the_target_loads_stops_it_at_once(tiny_qwen3, data_file, tmp_path):
    """The second SIGINT ends the load where it is: a new cache holds no part."""
    out = tmp_path / "c"
    more = ["--gpus", "cpu", "--layers", "0,2", "--rows-per-part", "2"]
    said = _interrupted(out, tiny_qwen3, data_file, more, said=[f"SIGINT: {LOADING}"], again=True)
    assert said[0] == (
        "Error: stopped at once by a second signal while the target loaded, before any part: no "
        f"part was written to {out}; rerun the same command to start it."
    )
    assert read_manifest(out).parts == ()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_while_the_run_is_planned_says_nothing_was_written(
    tiny_qwen3, data_file, tmp_path, sig
):
    """Ctrl-C or SIGTERM (a job scheduler's) while the run is planned (held where the target's
    tokenizer is read, before --out is locked or the target loads): one line saying so, naming
    SIGTERM, with an error's exit status, and --out not made."""
    out, target = tmp_path / "c", tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out), "--gpus", "cpu"]
    done = interrupted_at_open("extract", args, target / "tokenizer_config.json", sig=sig)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr
    how = " by SIGTERM" if sig == signal.SIGTERM else ""
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: stopped{how} while planning, before extraction began: no part of {out} was "
        "written in this run"
    )
    assert not out.exists()


NOT_TOUCHED = "the cache in --out c was not touched; rerun the same command to start it."
NO_PART = "no part was written to c; rerun the same command to start it."
RESUME = "are kept in c; rerun the same command to resume."


@pytest.mark.parametrize(
    "stage, replaces, before, now, said",
    [
        ("loading", True, 0, 0, f"while the target loaded, before any part: {NOT_TOUCHED}"),
        ("loaded", True, 0, 0, f"after the target loaded, before any part: {NOT_TOUCHED}"),
        ("loaded", False, 0, 0, f"after the target loaded, before any part: {NO_PART}"),
        ("loaded", False, 2, 0, f"after the target loaded, before any part: the parts committed "
         f"before (2) {RESUME}"),
        ("preparing", True, 0, 0, "while --out was prepared, before any part: the cache in "
         "--out c may be partly removed; rerun the same command to start it."),
        ("prepared", True, 0, 0, f"after the target loaded, before any part: {NO_PART}"),
        ("prepared", False, 2, 0, f"after the target loaded, before any part: the parts "
         f"committed before (2) {RESUME}"),
        ("extracting", True, 0, 0, f"while extracting, no part left half-written: {NO_PART}"),
        ("extracting", True, 0, 3, "while extracting, no part left half-written: the parts "
         f"committed in this run (3) {RESUME}"),
        ("extracting", False, 2, 1, "while extracting, no part left half-written: the parts "
         f"committed before (2) and in this run (1) {RESUME}"),
    ],
)  # fmt: skip
def test_a_second_ctrl_c_says_what_the_rank_had_reached(stage, replaces, before, now, said):
    """A second signal in a process started by hand stops it wherever it is: its message says
    how far the rank had got, so what --out holds (no part is in progress before the rank
    extracts; the cache it replaces is untouched until rank 0 prepares --out, and empty after)
    and whether the same command resumes."""
    stop = stopped_at_once(Path("c"), stage, replaces=replaces, before=before, now=now)
    assert isinstance(stop, Stopped)
    assert str(stop) == f"stopped at once by a second signal {said}"


def test_a_signal_after_the_ranks_loaded_stops_them_before_out_is_prepared():
    """Rank 0 looks at its stop flag before it clears the cache to replace: a signal that came
    after the ranks agreed that all had loaded stops them with that cache untouched, saying
    when it came; without one, --out is prepared, and a failure to prepare it is raised (on
    every rank) as it came. With nothing to prepare (no cache to replace), nothing stops."""
    prepared = []

    def prepare() -> None:
        prepared.append("cleared")

    def stopped(name: str) -> Stopped:
        return stopped_before_preparing(Path("c"), name)

    with pytest.raises(Stopped) as stop:
        prepared_unless_stopped(True, prepare, signal_name="SIGTERM", stopped=stopped)
    assert prepared == []
    assert str(stop.value) == (
        f"stopped by SIGTERM after the target loaded, before --out was prepared: {NOT_TOUCHED}"
    )
    assert prepared_unless_stopped(True, None, signal_name="SIGTERM", stopped=stopped) is None
    assert prepared_unless_stopped(True, prepare, signal_name=None, stopped=stopped) is None
    assert prepared == ["cleared"]

    def fails() -> None:
        raise StopRun("c: it could not be prepared")

    with pytest.raises(StopRun, match="^c: it could not be prepared$"):
        prepared_unless_stopped(True, fails, signal_name=None, stopped=stopped)


@pytest.mark.slow
def test_a_stop_of_two_ranks_while_they_load_keeps_the_parts_of_the_cache_it_resumes(
    tiny_qwen3, data_file, previous, tmp_path
):
    """SIGINT to the launcher of --gpus cpu:2, held until both ranks have its SIGTERM: each says
    that it stops once loaded, all stop with one message, and the part committed before stays."""
    out = tmp_path / "c"
    shutil.copytree(previous, out)
    first, second = read_manifest(out).parts
    shutil.rmtree(out / second.name)  # a resume with one part to do
    update_manifest(out, lambda m: drop_parts(m, {second.name}))
    more = ["--gpus", "cpu:2", "--layers", "0,1", "--rows-per-part", "2", "--writer-threads", "1"]
    said = _interrupted(out, tiny_qwen3, data_file, more, said=[f"SIGTERM: {LOADING}"] * 2)
    assert said[0] == (
        "Error: stopped by SIGTERM while the target loaded, before any part: the parts committed "
        f"before (1) are kept in {out}; rerun the same command to resume."
    )
    assert read_manifest(out).parts == (first,)
