"""python -m train.sweep as a user meets it: why a run did not finish (the last start's word,
not an earlier one's), an --out that is no sweep's folder, a variant whose values cannot
name a file, and the log's count of the runs going and left."""

import json

import pytest
from click.testing import CliRunner

from tests.cachegen import write_cache
from train.sweep.__main__ import main
from train.sweep.grid import GridError, parse_vary, plan_jobs
from train.sweep.jobs import Outcome, check_names, command, log_path
from train.sweep.run import settle

TRAIN = [
    "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "512",
    "--workers", "0", "--shuffle-buffer", "4", "--lr", "3e-3", "--steps", "4", "--log-every", "2",
    "--eval-parts", "1", "--checkpoint-every", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=3, samples_per_part=4)


def plan(cache, out, vary=("optimizer=adamw,muon",), seeds=1):
    grid = parse_vary(list(vary))
    return plan_jobs(data=cache, out=out, grid=grid, seeds=seeds, train_args=TRAIN)


def test_a_run_killed_after_an_earlier_stop_is_said_killed(cache, tmp_path):
    """A run's log holds every start of it: a run stopped by SIGTERM (its log ends with train's
    error), then started again and killed without a word (SIGKILL) is named killed, not with
    the first start's error."""
    job = plan(cache, tmp_path)[0]
    path = log_path(tmp_path, job)
    path.parent.mkdir(parents=True)
    first = " ".join(command(job, "cpu"))
    path.write_text(
        f"$ {first}\nError: stopped by SIGTERM at step 2 of 4: checkpoint saved\n"
        f"$ {first}\n12:00:00 INFO train.loop: first step: 0.1 s\n"
    )
    _, failed = settle([job], Outcome(failed=[(job, -9)]), tmp_path)
    assert failed == [(job, "killed by SIGKILL (see its log)")]
    path.write_text(path.read_text() + "Error: training stopped: the loss is not finite\n")
    _, failed = settle([job], Outcome(failed=[(job, 1)]), tmp_path)
    assert failed == [(job, "training stopped: the loss is not finite")]


def test_an_out_of_other_files_is_refused(cache, tmp_path):
    """An --out that holds files no sweep writes and no sweep.json: refused before any run, as
    train refuses a folder of other files (the sweep would replace its report.md, say)."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("x")
    (out / "report.md").write_text("# my notes\n")
    args = ["--data", str(cache), "--out", str(out), "--vary", "optimizer=muon", "--seeds", "1"]
    result = CliRunner().invoke(main, [*args, "--gpus", "cpu", *TRAIN])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"--out {out}: holds files but no sweep (todo.txt)" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "todo.txt"]
    assert (out / "report.md").read_text() == "# my notes\n"


def test_a_variant_named_longer_than_a_file_name_is_refused_before_any_run(cache, tmp_path):
    """A value as long as a deep --init-from path: its run folder and log (named after the
    values) cannot be made; refused when planned, not taken for a full disk once runs start."""
    deep = "/".join(["."] * 130) + "/export"
    out = tmp_path / "s"
    args = ["--data", str(cache), "--out", str(out), "--seeds", "1", "--gpus", "cpu"]
    result = CliRunner().invoke(main, [*args, "--vary", f"init-from={deep}", *TRAIN])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "bytes where a file name takes at most 255: give shorter values" in result.output
    assert not out.exists()
    check_names(plan(cache, out, [f"init-from={deep[-200:]}"]), out)  # a name that fits
    with pytest.raises(GridError, match=r"variant init_from=\._\._"):
        check_names(plan(cache, out, [f"init-from={deep}"]), out)


def test_the_log_counts_the_runs_and_names_those_left_out(cache, tmp_path):
    """Each run's start says which of how many it is and where its output goes, each end how
    many are left; a second command on the folder with a smaller grid names the runs it keeps
    there but leaves out of its report."""
    out = tmp_path / "s"
    args = ["--data", str(cache), "--out", str(out), "--seeds", "1", "--gpus", "cpu"]
    result = CliRunner().invoke(main, [*args, "--vary", "optimizer=adamw,muon", *TRAIN])
    assert result.exit_code == 0, result.output
    for nth, job in enumerate(plan(cache, out), 1):
        name = f"{job.variant.name} seed 0"
        assert f"starting {name} ({nth} of 2) on cpu, its output in {log_path(out, job)}: " in (
            result.output
        )
        assert f"finished {name} ({nth} of 2 ended, {2 - nth} left)" in result.output
    result = CliRunner().invoke(main, [*args, "--vary", "optimizer=muon", *TRAIN])
    assert result.exit_code == 0, result.output
    assert "1 run: 1 finished already, 0 to run" in result.output
    assert f"{out} also holds 1 run of other variants or seeds than this command's " in (
        result.output
    )
    assert "(optimizer=adamw seed 0): kept, and left out of its report" in result.output
    report = json.loads((out / "report.json").read_text())
    assert [v["variant"] for v in report["variants"]] == ["optimizer=muon"]
