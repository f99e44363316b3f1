"""The local route of `python -m extract.regen` loads the target before it touches --out: a
target whose weights do not load (on one process or on any of several), or Ctrl-C while it
loads, is named, and an output that --overwrite would replace stays byte for byte as it was; one
that loads replaces it. A second Ctrl-C while that output is removed says it may be partly
removed, and one while a new output is begun says so. Ctrl-C while the run is still planned
(either route) says that nothing was written."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from extract.regen.config import RegenError
from extract.regen.state import PROGRESS_DIR, STATE, parts_dir
from extract.regen.stops import BEFORE_PREPARING, stopped_before_any_chunk
from extract.stops import prepared_unless_stopped
from shared.progress import read_counters
from shared.stopping import Stopped
from tests.held_file import interrupted_at_open
from tests.test_regenerate import regen, write_chats

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_WEIGHT = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


def _files(out: Path) -> dict[str, bytes]:
    """OUT and every file under OUT.parts, by path, with their bytes."""
    paths = [out, *sorted(parts_dir(out).rglob("*"))]
    return {str(p.relative_to(out.parent)): p.read_bytes() for p in paths if p.is_file()}


def damaged_target(tiny: Path, folder: Path, damage: str) -> Path:
    """A copy of the tiny target whose weights file is damaged: `truncated` (its header names
    bytes it lacks), or rewritten with one layer weight `missing` or of another `shape` (both
    pass the header checks made before anything is written)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
        return folder
    tensors = load_file(weights)
    if damage == "missing":
        del tensors[LAYER_WEIGHT]
    else:
        tensors[LAYER_WEIGHT] = tensors[LAYER_WEIGHT][:-1].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def previous(tiny_qwen3, data_file, tmp_path_factory) -> Path:
    """A complete output of 4 rows, to copy into each test."""
    out = tmp_path_factory.mktemp("previous") / "out.jsonl"
    regen(out, tiny_qwen3, data_file, max_rows=4, max_new_tokens=2)
    return out


def _copy(previous: Path, folder: Path) -> Path:
    out = folder / previous.name
    shutil.copyfile(previous, out)
    shutil.copytree(parts_dir(previous), parts_dir(out))
    return out


@pytest.mark.parametrize(
    "damage, said",
    [
        ("missing", f"1 weight of the layers this run uses is not in .*{LAYER_WEIGHT}"),
        ("shape", "it did not load on cpu \\(RuntimeError: .*ignore_mismatched_sizes"),
        ("truncated", ".*/model.safetensors cannot be read"),  # refused by its header check
    ],
)
def test_a_target_that_does_not_load_leaves_the_output_to_overwrite(
    tiny_qwen3, data_file, previous, tmp_path, damage, said
):
    out = _copy(previous, tmp_path)
    before = _files(out)
    target = damaged_target(tiny_qwen3, tmp_path / "damaged", damage)
    with pytest.raises(RegenError, match=f"--target {target}: {said}"):
        regen(out, target, data_file, max_rows=4, overwrite=True)
    assert _files(out) == before


@pytest.mark.slow
def test_one_rank_of_two_that_cannot_load_stops_both_and_leaves_the_output(
    tiny_qwen3, data_file, previous, tmp_path, monkeypatch, caplog
):
    """Rank 0 holds rows 0-3 and rank 1 rows 4-7: both load, both fail alike, and neither
    prepares the output; with a target that loads, the same command replaces it. The launcher's
    bar, drawn while the ranks load, counts none of the rows of the output it is to replace,
    whose counters stay until rank 0 prepares it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned processes
    out = _copy(previous, tmp_path)
    assert read_counters(parts_dir(out) / PROGRESS_DIR)["rows"] == 4
    before = _files(out)
    target = damaged_target(tiny_qwen3, tmp_path / "damaged", "shape")
    two = dict(max_rows=8, overwrite=True, gpus="cpu:2")
    caplog.set_level(logging.INFO, logger="extract.regen.report")
    with pytest.raises(RegenError, match=f"--target {target}: it did not load .* \\(2 of 2 ranks"):
        regen(out, target, data_file, **two)
    assert _files(out) == before
    bar = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate: ")]
    assert bar and all(line.startswith("regenerate: of 8 rows, 0 done,") for line in bar), bar
    state = regen(out, tiny_qwen3, data_file, **two)
    assert state.merged_rows == 8 and state.settings["max_new_tokens"] != 2
    assert _files(out)[out.name] != before[out.name]


@pytest.mark.parametrize(
    "again, said",
    [
        (False, "stopped by SIGINT while the target loaded, before any chunk"),
        (True, "stopped at once by a second signal while the target loaded, before any chunk"),
    ],
)
def test_ctrl_c_while_the_target_loads_leaves_the_output_to_overwrite(
    tiny_qwen3, data_file, previous, tmp_path, again, said
):
    """SIGINT sent while the process is held inside the target's load (where transformers opens
    generation_config.json, which planning does not read): it says that it stops once the load
    ends (no chunk is in progress) and does, with one message, before it prepares the output;
    a second SIGINT ends the load at once."""
    out = _copy(previous, tmp_path)
    before = _files(out)
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out), "--gpus", "cpu"]
    args += ["--max-rows", "4", "--overwrite"]  # its other --max-new-tokens: a run to replace
    first = "SIGINT: stopping once the target has loaded, before any chunk (again: at once)"
    held = target / "generation_config.json"
    done = interrupted_at_open("extract.regen", args, held, said=[first], again=again)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: {said}. The output was not touched: run the same command to start it."
    )
    assert _files(out) == before


def test_a_signal_after_the_ranks_loaded_stops_them_before_the_output_is_prepared():
    """Rank 0 looks at its stop flag before it prepares the output (under --overwrite: replaces
    it): a signal that came after the ranks agreed that all had loaded stops them, the output
    not prepared, saying when it came; without one, the output is prepared."""
    prepared = []

    def prepare() -> str:
        prepared.append("replaced")
        return "prepared job"

    def stopped(name: str) -> Stopped:
        return stopped_before_any_chunk(f"by {name}", BEFORE_PREPARING)

    with pytest.raises(Stopped) as stop:
        prepared_unless_stopped(True, prepare, signal_name="SIGTERM", stopped=stopped)
    assert prepared == []
    assert str(stop.value) == (
        "stopped by SIGTERM after the target loaded, before --out was prepared"
    )
    assert prepared_unless_stopped(True, prepare, signal_name=None, stopped=stopped) == (
        "prepared job"
    )
    assert prepared == ["replaced"]


def test_a_second_ctrl_c_while_the_old_output_is_removed_says_it_may_be_partly_removed(
    tiny_qwen3, data_file, previous, tmp_path, monkeypatch
):
    """Two SIGINTs as --overwrite removes the first chunk file of another run's output: the run
    stops at once saying that output may be partly removed (not that it was left untouched);
    its state file, replaced last, is still the old one, and the same command replaces it."""
    out = _copy(previous, tmp_path)
    old_state = (parts_dir(out) / STATE).read_bytes()
    unlink = Path.unlink

    def interrupted(path: Path, missing_ok: bool = False) -> None:
        if path.name.startswith("chunk-"):
            monkeypatch.setattr(Path, "unlink", unlink)
            os.kill(os.getpid(), signal.SIGINT)  # stop once the target has loaded
            os.kill(os.getpid(), signal.SIGINT)  # again: at once
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", interrupted)
    said = f"stopped at once while the old output in --out {out} was removed, before any chunk"
    with pytest.raises(RegenError, match=re.escape(f"{said}: it may be partly removed; run")):
        regen(out, tiny_qwen3, data_file, max_rows=4, overwrite=True)
    assert (parts_dir(out) / STATE).read_bytes() == old_state
    state = regen(out, tiny_qwen3, data_file, max_rows=4, overwrite=True)
    assert state.merged_rows == 4 and state.settings["max_new_tokens"] != 2


def test_a_second_ctrl_c_while_a_new_output_is_begun_says_when_it_came(
    tiny_qwen3, data_file, tmp_path, monkeypatch
):
    """Two SIGINTs as a fresh output is begun (no old one to replace): the run stops at once
    saying that it came while --out was prepared (no chunk had begun, so none was dropped);
    the same command then starts it."""
    out = tmp_path / "o.jsonl"
    unlink = Path.unlink

    def interrupted(path: Path, missing_ok: bool = False) -> None:
        if path == out:  # a stale OUT removed before the state is written
            monkeypatch.setattr(Path, "unlink", unlink)
            os.kill(os.getpid(), signal.SIGINT)  # stop once the target has loaded
            os.kill(os.getpid(), signal.SIGINT)  # again: at once
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", interrupted)
    said = (
        "stopped at once by a second signal while --out was prepared, before any chunk. The "
        "output was not touched: run the same command to start it."
    )
    with pytest.raises(RegenError) as stop:
        regen(out, tiny_qwen3, data_file, max_rows=4)
    assert str(stop.value) == said
    assert regen(out, tiny_qwen3, data_file, max_rows=4).merged_rows == 4


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("route", [[], ["--engine", "vllm"]], ids=["local", "vllm"])
def test_a_stop_while_the_run_is_planned_says_nothing_was_written(
    tiny_qwen3, data_file, tmp_path, route, sig
):
    """Ctrl-C or SIGTERM while the run is planned (held where the tokenizer is first read, the
    rows already indexed, before the target or vLLM loads), on either route: one line saying
    so (naming SIGTERM), as `python -m extract` says it, and no output."""
    out = tmp_path / "o.jsonl"
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out), "--gpus", "cpu"]
    held = target / "tokenizer_config.json"
    done = interrupted_at_open("extract.regen", [*args, *route], held, sig=sig)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr
    how = " by SIGTERM" if sig == signal.SIGTERM else ""
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: stopped{how} while planning, before regeneration began: no part of {out} was "
        "written in this run"
    )
    assert not out.exists() and not (parts_dir(out) / STATE).exists()
