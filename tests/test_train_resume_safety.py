"""A resume never continues from something other than what the run saved: another cache with
the same settings, a checkpoint whose bytes changed, a record that cannot be read."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.cachegen import write_cache
from tests.test_train_loop import records, tiny
from train.checkpoint import checkpoint_problem, list_checkpoints, prune
from train.run import RunError, run


def test_a_resume_on_a_cache_of_other_rows_is_refused(tmp_path):
    """Two caches of the same files and settings but --max-rows (here: rows in all): the plan a
    checkpoint holds a place in is the first one's, so the second cannot continue it."""
    first = write_cache(tmp_path / "a", num_parts=3, samples_per_part=6)
    fewer = write_cache(tmp_path / "b", num_parts=2, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(first, out, steps=4, checkpoint_every=2, stop_after_steps=3))
    with pytest.raises(RunError, match=r"the cache differs \(manifest identity: total_rows\)"):
        run(tiny(fewer, out, steps=4, checkpoint_every=2))
    run(tiny(first, out, steps=4, checkpoint_every=2))  # its own cache resumes it
    assert (out / "export").is_dir()


def flip(path, at: int, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        data = bytearray(f.read(n))
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def warnings_of(capfd) -> list[str]:
    """The warning lines a run logged (its ranks log to stderr: `shared.logs.setup_logging`)."""
    return [
        line.split(": ", 1)[1]
        for line in capfd.readouterr().err.splitlines()
        if " WARNING " in line
    ]


def test_a_checkpoint_whose_bytes_changed_is_passed_over(tmp_path, capfd):
    """Bytes of the newest state.pt overwritten in place (its size kept: torch.load would read
    it, its zip checks no CRC): a resume warns, naming it, and continues from the one before,
    as the whole run did; --resume naming it is refused."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    whole, out = tmp_path / "whole", tmp_path / "run"
    run(tiny(cache, whole, steps=6, checkpoint_every=2))
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=4))
    newest = list_checkpoints(out)[-1][1]
    assert newest.name == "step-4"
    state = newest / "state.pt"
    flip(state, state.stat().st_size // 2)
    with pytest.raises(RunError, match=r"--resume .*step-4: .*state.pt is damaged: its bytes"):
        run(tiny(cache, out, steps=6, checkpoint_every=2, resume=str(newest)))
    capfd.readouterr()
    run(tiny(cache, out, steps=6, checkpoint_every=2))
    said = [line for line in warnings_of(capfd) if "damaged" in line]
    assert len(said) == 1, said  # once, though the run and its rank both look
    assert said[0].startswith(f"{state} is damaged: its bytes changed after it was saved (crc32c")
    assert said[0].endswith(": trying the checkpoint before it")
    assert [r["step"] for r in records(out)] == list(range(1, 7))  # steps 3-4 again
    a, b = (load_file(str(d / "export" / "model.safetensors")) for d in (whole, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unreadable_or_incomplete_newest_checkpoints_are_named_and_passed_over(tmp_path, capfd):
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=8, checkpoint_every=2, keep_checkpoints=4, stop_after_steps=6))
    (out / "checkpoints" / "step-6" / "meta.json").write_text('{"step": 6, "lo')  # torn
    (out / "checkpoints" / "step-4" / "state.pt").unlink()  # a folder emptied in part
    capfd.readouterr()
    run(tiny(cache, out, steps=8, checkpoint_every=2, keep_checkpoints=4))
    said = "\n".join(warnings_of(capfd))
    assert f"{out / 'checkpoints' / 'step-6' / 'meta.json'} cannot be read" in said
    assert f"{out / 'checkpoints' / 'step-4'} lacks state.pt: a resume passes over it" in said
    assert [r["step"] for r in records(out)] == list(range(1, 9))  # from step 2
    assert (out / "export").is_dir()
    assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6, 8]


def test_prune_puts_back_a_replaced_steps_copy_and_drops_leftovers(tmp_path):
    """What a kill inside a save or a deletion leaves: a step renamed to `.old` before its new
    copy took its name (put back), an older step missing a file, a temporary folder."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=6, checkpoint_every=2, keep_checkpoints=3, stop_after_steps=4))
    folder = out / "checkpoints"
    os.replace(folder / "step-4", folder / "step-4.old")
    (folder / "step-2" / "meta.json").unlink()
    (folder / ".step-5.tmp").mkdir()
    assert [s for s, _ in list_checkpoints(out)] == []
    prune(out, keep=3)
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]
    assert checkpoint_problem(folder / "step-4") is None


def test_a_longer_run_resumed_says_its_learning_rate_jumps(tmp_path, capfd):
    """--steps raised on a resume: allowed (a run extended), but the cosine schedule of the new
    length gives another lr at the resumed step, which the warning says; the same length says
    nothing."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=4))
    capfd.readouterr()
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=5))
    assert not [w for w in warnings_of(capfd) if "schedule" in w]
    run(tiny(cache, out, steps=12, checkpoint_every=2))
    (said,) = [w for w in warnings_of(capfd) if "schedule" in w]
    lrs = {r["step"]: r["lr"] for r in records(out)}
    assert said.startswith("the learning-rate schedule changed with the run's length")
    assert f"at step 4 the lr was {lrs[4]:.3g} and is" in said and "of 12 steps" in said
    assert lrs[5] > lrs[4]  # the new, longer schedule's lr at step 5


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """The steps logged after the last checkpoint by a run that stopped are logged again by the
    resumed run: TensorBoard shows each step once, as metrics.jsonl holds it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=3))
    run(tiny(cache, out, steps=6, checkpoint_every=2))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/loss")]
    logged = [(r["step"], r["loss"]) for r in records(out)]
    assert [s for s, _ in shown] == list(range(1, 7))
    assert shown == [(s, pytest.approx(v, rel=1e-6)) for s, v in logged]
