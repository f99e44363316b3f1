"""A resume never continues from something other than what the run saved: another cache with
the same settings, a checkpoint whose bytes changed, a record that cannot be read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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


def test_a_longer_run_resumed_takes_the_new_schedule_and_says_so(tmp_path, capfd):
    """--steps raised on a resume: allowed (a run extended); from the next step on the lr is
    the new length's schedule, as a run of that length from the start has it, and a warning
    says where it jumps; a resume of the same length says nothing."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out, whole = tmp_path / "run", tmp_path / "whole"
    run(tiny(cache, whole, steps=12, checkpoint_every=2))
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=4))
    capfd.readouterr()
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=5))
    assert not [w for w in warnings_of(capfd) if "schedule" in w]
    run(tiny(cache, out, steps=12, checkpoint_every=2))
    (said,) = [w for w in warnings_of(capfd) if "schedule" in w]
    lrs = {r["step"]: r["lr"] for r in records(out)}
    wanted = {r["step"]: r["lr"] for r in records(whole)}
    assert said.startswith("the learning-rate schedule changed with the run's length")
    # a record's lr is the one its step leaves for the next: step 5 takes the whole run's [4]
    assert f"step 5 takes lr {wanted[4]:.3g} where the saved schedule gave {lrs[4]:.3g}" in said
    assert "of 12 steps" in said
    assert [lrs[s] for s in range(5, 13)] == pytest.approx([wanted[s] for s in range(5, 13)])
    assert lrs[4] != pytest.approx(wanted[4])  # the 6-step schedule's, before the resume


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
    shutil.rmtree(out / "export")  # a run killed after its last checkpoint: resumed at its end
    run(tiny(cache, out, steps=6, checkpoint_every=2))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))


def test_a_damaged_checkpoint_of_the_older_format_is_saved_again(tmp_path):
    """A checkpoint saved before checkpoints recorded their checksum, its state.pt cut short:
    the resume takes the one before it, and reaching its step saves it again (only the
    checkpoint a run resumed from is not saved twice)."""
    from train.checkpoint import load_state

    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=6, checkpoint_every=2, stop_after_steps=4))
    step4 = out / "checkpoints" / "step-4"
    meta = json.loads((step4 / "meta.json").read_text())
    del meta["state"]  # as the older format wrote it
    (step4 / "meta.json").write_text(json.dumps(meta))
    with open(step4 / "state.pt", "r+b") as f:
        f.truncate(1000)
    run(tiny(cache, out, steps=6, checkpoint_every=2))
    assert load_state(step4)["step"] == 4 and "state" in json.loads(
        (step4 / "meta.json").read_text()
    )


def test_ranks_trust_the_launchers_check_while_the_files_are_unchanged(tmp_path):
    """The launcher checks the checkpoint it resumes; the ranks it starts read its finding from
    their environment instead of reading the state file again, while its size and mtime are
    those it checked (a state file changed since is checked again)."""
    import subprocess
    import sys

    from train.checkpoint import FINDINGS_ENV

    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=4, checkpoint_every=2, stop_after_steps=2))
    step = out / "checkpoints" / "step-2"
    env = dict(os.environ)
    env.pop(FINDINGS_ENV, None)
    code = (
        "import os, sys, json; from train.checkpoint import checkpoint_problem, FINDINGS_ENV;"
        "print(json.dumps([checkpoint_problem(sys.argv[1]), os.environ.get(FINDINGS_ENV)]))"
    )

    def rank(environ):
        done = subprocess.run(
            [sys.executable, "-c", code, str(step)], env=environ, capture_output=True, text=True,
            cwd=Path(__file__).resolve().parent.parent, check=True,
        )  # fmt: skip
        return json.loads(done.stdout)

    problem, found = rank(env)  # a launcher: checks, and passes on what it found sound
    assert problem is None and str(step.resolve()) in found
    state = step / "state.pt"
    stamp = state.stat()
    flip(state, stamp.st_size // 2)
    os.utime(state, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # same size and mtime
    assert rank({**env, FINDINGS_ENV: found})[0] is None  # trusted: not read again
    assert "is damaged" in rank(env)[0]  # checked afresh: found


def test_a_launchers_ranks_do_not_repeat_its_checkpoint_warning(tmp_path, capfd, caplog):
    """Two ranks started by the launcher, which found the newest checkpoint damaged: the
    warning is said once, by the launcher, and the run resumes from the one before."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    kw = dict(gpus="cpu:2", grad_accum=1, steps=4, checkpoint_every=1, keep_checkpoints=3)
    run(tiny(cache, out, stop_after_steps=3, **kw))
    state = out / "checkpoints" / "step-3" / "state.pt"
    flip(state, state.stat().st_size // 2)
    capfd.readouterr()
    caplog.clear()
    run(tiny(cache, out, **kw))
    launcher = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    said = [line for line in launcher + warnings_of(capfd) if "damaged" in line]
    assert len(said) == 1, said
    assert said[0].startswith(f"{state} is damaged")
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]  # step 3 again, once


def test_a_run_that_saved_nothing_does_not_block_the_corrected_command(tmp_path, capfd):
    """A run that failed before its first checkpoint left config.json and metrics: the same
    --out with other options starts afresh there, as if the folder were new, with a warning;
    a run that saved a checkpoint is still protected."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    from train.finite import NonFiniteError

    with pytest.raises(NonFiniteError, match="no target token"):
        run(tiny(cache, out, steps=4, batch_tokens=16))
    assert (out / "config.json").is_file() and not list_checkpoints(out)
    capfd.readouterr()
    run(tiny(cache, out, steps=4, checkpoint_every=2))
    said = " ".join(warnings_of(capfd))
    assert "holds a run that saved nothing" in said and "batch_tokens: run has 16, now 512" in said
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
    assert (out / "export").is_dir()
    with pytest.raises(RunError, match="holds a different run"):
        run(tiny(cache, out, steps=4, checkpoint_every=2, lr=1e-3))


def test_a_lower_keep_checkpoints_makes_room_on_resume(tmp_path):
    """A full disk's message says to free space or lower --keep-checkpoints: on a tmpfs that
    holds the run's three checkpoints but not a fourth, the same command with
    --keep-checkpoints 1 deletes the older ones as it resumes (never the one it resumes from),
    so its next checkpoint fits."""
    import subprocess

    from tests.test_extract_safety import small_disk

    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    with small_disk(tmp_path / "disk", "64m") as disk:
        out = disk / "run"
        run(tiny(cache, out, steps=8, checkpoint_every=2, stop_after_steps=6))
        assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6]
        stats = os.statvfs(disk)
        used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
        ckpt = sum(p.stat().st_size for p in list_checkpoints(out)[-1][1].iterdir())
        room = used + (1 << 20) + ckpt // 2  # a checkpoint's estimate does not fit beside them
        subprocess.run(["mount", "-o", f"remount,size={room}", str(disk)], check=True)
        run(tiny(cache, out, steps=8, checkpoint_every=2, keep_checkpoints=1))
        assert [s for s, _ in list_checkpoints(out)] == [8]
        assert (out / "export" / "model.safetensors").is_file()


def test_a_warm_started_run_resumes_after_its_source_is_gone(tmp_path):
    """Its checkpoints hold every weight the warm start gave: the same command resumes a run
    whose --init-from folder was deleted since (another run's checkpoint, pruned as that run
    went on), and ends as the whole run did."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    run(tiny(cache, tmp_path / "source", steps=2))
    start = tmp_path / "start"
    shutil.copytree(tmp_path / "source" / "export", start)
    whole, out = tmp_path / "whole", tmp_path / "run"
    run(tiny(cache, whole, steps=6, checkpoint_every=2, init_from=start))
    run(tiny(cache, out, steps=6, checkpoint_every=2, init_from=start, stop_after_steps=3))
    shutil.rmtree(start)
    run(tiny(cache, out, steps=6, checkpoint_every=2, init_from=start))
    assert [r["loss"] for r in records(out)] == [r["loss"] for r in records(whole)]
    ours, theirs = (load_file(str(f / "export" / "model.safetensors")) for f in (out, whole))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_run_shortened_to_its_checkpoint_warns_of_no_step_it_will_not_take(tmp_path, capfd):
    """--steps lowered to the step of the checkpoint a resume takes: the run evaluates and
    exports it without another step, so no warning about the lr of a next step."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=8, checkpoint_every=2, stop_after_steps=5))
    capfd.readouterr()
    run(tiny(cache, out, steps=4, checkpoint_every=2))
    assert not [w for w in warnings_of(capfd) if "schedule" in w]
    assert (out / "export").is_dir() and [r["step"] for r in records(out)][-1] == 4


def test_files_added_to_the_runs_export_are_named_before_it_trains(tmp_path):
    """A model card put in a finished run's export folder: the export replaces that folder
    whole, so the same command (or a longer run) refuses at once, naming the file, rather than
    failing after its training; the run's folder is left as it was."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=4, checkpoint_every=2))
    (out / "export" / "README.md").write_text("my drafter")
    with pytest.raises(RunError, match=r"export holds files .*\(README\.md\).* move them"):
        run(tiny(cache, out, steps=6, checkpoint_every=2))
    assert (out / "export" / "README.md").read_text() == "my drafter"
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]


def test_a_damaged_run_record_says_how_the_run_resumes(tmp_path, capfd):
    """config.json cut short: the message says the run resumes once it is restored or deleted,
    and deleting it does resume from the checkpoint (its steps not taken again)."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=2, checkpoint_every=2))
    record = out / "config.json"
    record.write_text(record.read_text()[:20])
    with pytest.raises(RunError, match="cannot be read .*or delete it, and the run resumes") as e:
        run(tiny(cache, out, steps=4, checkpoint_every=2))
    assert "restore it from a copy and the same command resumes" in str(e.value)
    record.unlink()
    capfd.readouterr()
    run(tiny(cache, out, steps=4, checkpoint_every=2))
    assert "step-2 at step 2 of 4" in capfd.readouterr().err
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]


def test_a_run_recorded_with_a_max_length_past_the_samples_resumes_without_it(tmp_path):
    """A run folder whose record holds a --max-length above what its samples can be (accepted
    before such a value was refused): the command without it resumes the run, as the value
    acted the same."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(cache, out, steps=2, checkpoint_every=2))
    record = json.loads((out / "config.json").read_text())
    record["train"]["max_length"] = 100_000
    (out / "config.json").write_text(json.dumps(record))
    run(tiny(cache, out, steps=4, checkpoint_every=2))
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
