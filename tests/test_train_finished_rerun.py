"""A finished run rerun with other ranks (--gpus) or loader streams (--workers): nothing is left
to train, so it evaluates and exports as the run did; a run with steps left is refused, its data
order depending on both."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cachegen import write_cache
from tests.test_train_loop import tiny
from train.checkpoint import list_checkpoints, read_meta
from train.run import RunError, run

REFUSED = "loader streams, this run has .*: the data's order depends on both"


def saved(out) -> dict[str, bytes]:
    """Every file a run wrote but its config.json, by path in the run folder."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "config.json" and not p.name.startswith(".")
    }


def record(out) -> dict:
    """config.json without the folder's own name, which differs between copies."""
    rec = json.loads((out / "config.json").read_text())
    rec["train"].pop("out")
    return rec


def test_a_finished_run_on_other_ranks_and_workers_evaluates_and_exports_only(tmp_path, capfd):
    """By --epochs (the tiny default), whose length in steps depends on the ranks: 16 steps on
    one rank, 8 a pass on two. A copy of the finished run rerun on two ranks with two loader
    streams writes what the run wrote (its final evaluation over held-out rows split between
    the ranks; its export) and keeps its record; with its export deleted, it exports it again."""
    cache = write_cache(tmp_path / "c", num_parts=8, samples_per_part=6)
    out, copy = tmp_path / "run", tmp_path / "copy"
    kw = dict(checkpoint_every=4, eval_fraction=0.5)
    run(tiny(cache, out, **kw))
    assert list_checkpoints(out)[-1][0] == 16
    shutil.copytree(out, copy)
    for export in (False, True):
        if export:
            shutil.rmtree(copy / "export")
        capfd.readouterr()
        run(tiny(cache, copy, gpus="cpu:2", workers=2, **kw))
        err = capfd.readouterr().err
        assert "evaluating and exporting a 1-layer drafter" in err and "training a " not in err
        files = saved(copy)
        assert "export/model.safetensors" in files and "metrics.jsonl" in files
        assert [k for k in files if k.startswith("tensorboard")]
        # TensorBoard's events hold wall times; every other file is the run's, byte for byte
        same = {k: v for k, v in saved(out).items() if not k.startswith("tensorboard")}
        assert {k: v for k, v in files.items() if not k.startswith("tensorboard")} == same
        assert record(copy) == record(out)  # ranks 1, gpus "cpu", workers 0: as it trained
        assert record(out)["ranks"] == 1 and record(out)["train"]["workers"] == 0


def test_a_run_with_steps_left_is_refused_on_other_ranks_or_workers(tmp_path):
    """Stopped at step 2 of 4, then finished at 4 and lengthened to 6: each time steps are left,
    another --gpus or --workers is refused before any work, its record untouched."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=4, checkpoint_every=2, stop_after_steps=2))
    for steps in (4, 6):
        before = (out / "config.json").read_text()
        with pytest.raises(RunError, match="1 ranks x 1 " + REFUSED):
            run(tiny(cache, out, steps=steps, checkpoint_every=2, gpus="cpu:2"))
        with pytest.raises(RunError, match="1 ranks x 1 " + REFUSED):
            run(tiny(cache, out, steps=steps, checkpoint_every=2, workers=2))
        assert (out / "config.json").read_text() == before
        assert list_checkpoints(out)[-1][0] == steps - 2
        run(tiny(cache, out, steps=4, checkpoint_every=2))  # its own ranks: finishes it
    assert list_checkpoints(out)[-1][0] == 4


def test_a_finished_run_that_followed_an_extraction_exports_again_on_other_ranks(tmp_path):
    """A run that followed the extraction of a cache, by --epochs: its length is its estimate
    of a pass on its one rank (13 steps; 6 on two). Its export deleted, a rerun on two ranks
    writes it again as it was, with the run's final evaluation."""
    cache = write_cache(tmp_path / "c", num_parts=6, samples_per_part=5, complete=False)
    out, copy = tmp_path / "run", tmp_path / "copy"
    kw = dict(epochs=1, checkpoint_every=4, eval_fraction=0.2)
    run(tiny(cache, out, **kw))
    newest = list_checkpoints(out)[-1][1]
    assert newest.name == "step-13" and read_meta(newest)["plan"]["follow"] is True
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "export")
    run(tiny(cache, copy, gpus="cpu:2", **kw))
    files = {k: v for k, v in saved(copy).items() if not k.startswith("tensorboard")}
    assert files == {k: v for k, v in saved(out).items() if not k.startswith("tensorboard")}
    assert "export/model.safetensors" in files
    assert record(copy) == record(out)
