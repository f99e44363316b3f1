"""python -m train.sweep: a tiny grid x seeds through the real train command, finished runs
skipped on a rerun, an interrupted run resumed, and the report's figures over seeds."""

import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from tests.cachegen import write_cache
from tests.test_train_loop import records
from train.proof.compare import read_run
from train.run import run
from train.sweep.__main__ import main
from train.sweep.grid import GridError, check, parse_vary, plan_jobs
from train.sweep.report import RESOLVE_SE, differences, mean_se

TRAIN = [
    "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "512",
    "--workers", "0", "--shuffle-buffer", "4", "--lr", "3e-3", "--steps", "6", "--log-every", "2",
    "--eval-parts", "1", "--checkpoint-every", "2",
]  # fmt: skip
GRID = ["--vary", "optimizer=adamw,muon", "--seeds", "2", "--gpus", "cpu"]
DFLASH2 = ["--drafter-type", "dflash2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=3, samples_per_part=6)


def sweep(cache, out):
    result = CliRunner().invoke(main, ["--data", str(cache), "--out", str(out), *GRID, *TRAIN])
    return result


@pytest.fixture(scope="module")
def swept(cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "s"
    result = sweep(cache, out)
    assert result.exit_code == 0, result.output
    return out


def jobs_of(cache, out):
    grid = parse_vary(["optimizer=adamw,muon"])
    return plan_jobs(data=cache, out=out, grid=grid, seeds=2, train_args=TRAIN)


def test_report_is_the_mean_and_error_of_the_runs(cache, swept):
    report = json.loads((swept / "report.json").read_text())
    assert [v["variant"] for v in report["variants"]] == ["optimizer=adamw", "optimizer=muon"]
    for variant in report["variants"]:
        runs = [read_run(swept / "runs" / variant["variant"] / f"seed-{s}") for s in (0, 1)]
        assert {r.source for r in runs} == {"eval"} and [r.last["step"] for r in runs] == [6, 6]
        assert runs[0].train["optimizer"] == variant["settings"]["optimizer"]
        for key in ("tau", "loss"):
            values = [r.last[key] for r in runs]
            assert variant[key]["values"] == values
            assert variant[key]["mean"] == pytest.approx(statistics.fmean(values))
            assert variant[key]["se"] == pytest.approx(statistics.stdev(values) / math.sqrt(2))
    # the two seeds of a variant differ (init, data order, anchors); the variants differ too
    losses = [v["loss"]["values"] for v in report["variants"]]
    assert losses[0][0] != losses[0][1] and losses[0] != losses[1]
    text = (swept / "report.md").read_text()
    assert "| optimizer=adamw | 2 | 6 |" in text and "## Every run" in text
    assert (swept / "tau.png").stat().st_size > 0 and (swept / "curves.png").stat().st_size > 0
    logs = sorted(p.name for p in (swept / "logs").iterdir())
    assert logs == [f"optimizer={o}.seed-{s}.log" for o in ("adamw", "muon") for s in (0, 1)]


def test_a_rerun_skips_finished_runs(cache, swept):
    before = {p: p.read_bytes() for p in swept.glob("runs/*/*/metrics.jsonl")}
    result = sweep(cache, swept)
    assert result.exit_code == 0, result.output
    assert {p: p.read_bytes() for p in swept.glob("runs/*/*/metrics.jsonl")} == before
    assert len(before) == 4
    assert all(p.read_text().count("\n$ ") == 0 for p in (swept / "logs").iterdir())


def test_a_rerun_with_other_train_options_or_cache_is_refused(cache, swept, tmp_path):
    before = {p: p.read_bytes() for p in swept.glob("runs/*/*/metrics.jsonl")}
    steps = TRAIN.index("--steps") + 1
    longer = [*TRAIN[:steps], "7", *TRAIN[steps + 1 :]]
    args = ["--data", str(cache), "--out", str(swept), *GRID]
    result = CliRunner().invoke(main, [*args, *longer])
    assert result.exit_code == 1 and "trained with the train options" in result.output
    other = write_cache(tmp_path / "other", num_parts=3, samples_per_part=6)
    result = CliRunner().invoke(main, ["--data", str(other), *args[2:], *TRAIN])
    assert result.exit_code == 1 and f"trained on {cache.resolve()}" in result.output
    assert {p: p.read_bytes() for p in swept.glob("runs/*/*/metrics.jsonl")} == before


def test_an_interrupted_run_resumes(cache, swept, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(swept / "runs", out / "runs")
    job = next(j for j in jobs_of(cache, out) if j.variant.name == "optimizer=muon" and j.seed == 1)
    shutil.rmtree(job.folder)
    run(check(job.variant, [*job.argv, "--stop-after-steps", "3"]))  # as if killed at step 3
    assert not (job.folder / "export").exists()
    result = sweep(cache, out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["optimizer=muon.seed-1.log"]
    first = read_run(swept / "runs" / "optimizer=muon" / "seed-1")
    again = read_run(job.folder)

    # the same records but for the logging windows around the stop (a resumed first step is
    # a window of its own)
    def losses(summary):
        return {r["step"]: r["loss"] for r in summary.train_history if r["step"] not in (3, 4)}

    assert sorted(losses(again)) == sorted(losses(first)) == [1, 2, 6]
    assert_runs_agree(job.folder, swept / "runs" / "optimizer=muon" / "seed-1", skip=(3, 4))
    ours = json.loads((out / "report.json").read_text())["variants"]
    theirs = json.loads((swept / "report.json").read_text())["variants"]
    assert [v["step"] for v in ours] == [v["step"] for v in theirs]
    for x, y in zip(ours, theirs, strict=True):
        for key in ("tau", "loss"):
            assert x[key]["values"] == pytest.approx(y[key]["values"], rel=1e-4), key


def assert_runs_agree(folder, whole, skip=()) -> None:
    """Two processes of one command can round a step apart (README, "What a fresh clone
    reproduces"): the same logged losses (train and eval) within 1e-4, not bit for bit. AdamW
    divides each update by the root of its squared gradients' average, so where a gradient is
    near zero a last-bit difference becomes an update difference of up to the learning rate:
    most weights within 1e-6, none further than the run's 6 steps of lr 3e-3 can move one."""
    ours = [r for k in ("train", "eval") for r in records(folder, k) if r["step"] not in skip]
    theirs = [r for k in ("train", "eval") for r in records(whole, k) if r["step"] not in skip]
    assert [(r["kind"], r["step"]) for r in ours] == [(r["kind"], r["step"]) for r in theirs]
    for x, y in zip(ours, theirs, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4), (x["kind"], x["step"])
    a = load_file(str(whole / "export" / "model.safetensors"))
    b = load_file(str(folder / "export" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        diff = (b[k].float() - a[k].float()).abs()
        assert float(diff.median()) <= 1e-6 and float(diff.max()) <= 6 * 3e-3, k


def test_a_failed_run_is_named_with_its_error(cache, tmp_path):
    """A variant whose runs fail (a learning rate that makes the loss not finite): the sweep
    ends naming each failed run and the error its log ends with, and says a rerun retries it
    once the cause is fixed; the other variant's runs finish, are kept and reported."""
    out = tmp_path / "s"
    args = ["--data", str(cache), "--out", str(out), "--vary", "lr=3e-3,1e30", "--seeds", "1"]
    at = TRAIN.index("--lr")
    result = CliRunner().invoke(main, [*args, "--gpus", "cpu", *TRAIN[:at], *TRAIN[at + 2 :]])
    assert result.exit_code == 1
    assert "runs failed; not finished: lr=1e30 seed 0" in result.output, result.output
    assert "  lr=1e30 seed 0: training stopped: the loss or the gradient norm is not finite" in (
        result.output
    )
    assert "once their cause is fixed, the same command runs what is not finished" in result.output
    assert (out / "runs" / "lr=3e-3" / "seed-0" / "export").is_dir()
    report = json.loads((out / "report.json").read_text())
    assert [v["variant"] for v in report["variants"]] == ["lr=3e-3"]
    ok = read_run(out / "runs" / "lr=3e-3" / "seed-0")
    assert report["variants"][0]["tau"]["values"] == [ok.last["tau"]]
    assert [(r["variant"], r["seed"]) for r in report["not_finished"]] == [("lr=1e30", 0)]
    assert "not finite" in report["not_finished"][0]["error"]
    text = (out / "report.md").read_text()
    assert "| lr=3e-3 | 1 | 6 |" in text and "- lr=1e30 seed 0: training stopped" in text
    assert "| lr=3e-3 | 1 | 6 |" in result.output  # the report's head is printed too


def test_the_grid_is_checked_before_any_run(cache, tmp_path):
    def plan(vary, train=()):
        return plan_jobs(
            data=cache, out=tmp_path, grid=parse_vary(vary), seeds=1, train_args=list(train)
        )

    with pytest.raises(GridError, match="same for every run"):
        plan(["steps=5,10"])
    with pytest.raises(GridError, match="is in the cache .* \\(--data\\)"):
        plan_jobs(data=cache, out=cache / "sweeps", grid=parse_vary(["lr=1e-3"]), seeds=1,
                  train_args=[])  # fmt: skip
    with pytest.raises(GridError, match="has an empty value"):
        plan(["lr=1e-3,,3e-3"])
    assert parse_vary(["target-layers=0,1;", "lr=1e-3,"]) == [
        ("target_layers", ["0,1"]),
        ("lr", ["1e-3"]),
    ]
    with pytest.raises(GridError, match="no option of python -m train"):
        plan(["optimiser=muon"])
    with pytest.raises(GridError, match="set by the sweep"):
        plan(["lr=1e-3"], ["--seed", "3"])
    with pytest.raises(GridError, match="--resume: not for a sweep"):
        plan(["lr=1e-3"], ["--resume", "none"])
    with pytest.raises(GridError, match="--stop-after-steps: not for a sweep"):
        plan(["lr=1e-3"], ["--stop-after-steps=3"])
    with pytest.raises(GridError, match="lr=1e-3 and lr=0.001 train the same runs"):
        plan(["lr=1e-3,0.001"])
    with pytest.raises(GridError, match="varied by --vary"):
        plan(["lr=1e-3,3e-3"], ["--lr", "1e-3"])
    with pytest.raises(GridError, match="variant optimizer=sgd: .*sgd"):
        plan(["optimizer=sgd"])
    with pytest.raises(GridError, match="variant noise_std=-1: .*--noise-std"):
        plan(["noise-std=-1"])
    with pytest.raises(GridError, match="would share the run folder init_from=a_b"):
        plan(["init-from=a/b,a_b"])
    with pytest.raises(GridError, match="--markov-rank has no effect unless --drafter-type"):
        plan(["markov-rank=64,128"])  # a DFlash run twice under two names
    jobs = plan(["selector-stop-grad=true,false", "target-layers=0,1;1,3"], DFLASH2)
    assert [j.variant.args()[0] for j in jobs[::2]] == [
        "--selector-stop-grad",
        "--no-selector-stop-grad",
    ]
    assert jobs[1].argv[-2:] == ("--target-layers", "1,3") and len(jobs) == 4
    with pytest.raises(GridError, match=r"variant target_layers=1,9: the cache .*\[9\]"):
        plan(["target-layers=0,1;1,9"])  # a layer the cache does not hold: before the first
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("x")
    with pytest.raises(GridError, match=r"--data .*notes: no manifest.json, and files no"):
        plan_jobs(data=notes, out=tmp_path, grid=parse_vary(["lr=1e-3"]), seeds=1, train_args=[])
    assert not tmp_path.joinpath("runs").exists()  # planning writes nothing


@pytest.mark.parametrize("where", ["file", "under_a_file", "proc"])
def test_an_out_that_cannot_be_a_folder_is_named(cache, tmp_path, where):
    (tmp_path / "afile").write_text("x")
    out = {
        "file": tmp_path / "afile",
        "under_a_file": tmp_path / "afile" / "sub",
        "proc": Path("/proc/nope-sweep"),
    }[where]
    result = CliRunner().invoke(main, ["--data", str(cache), "--out", str(out), *GRID, *TRAIN])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: --out {out}: " in result.output and "Traceback" not in result.output
    assert (tmp_path / "afile").read_text() == "x"


def test_differences_against_the_best():
    records = [
        {"variant": "a", "tau": {"mean": 2.0, "se": 0.1}},
        {"variant": "b", "tau": {"mean": 1.5, "se": 0.1}},
        {"variant": "c", "tau": {"mean": 1.9, "se": 0.1}},
        {"variant": "d", "tau": {"mean": 1.0, "se": None}},
    ]
    found = {d["a"]: d for d in differences(records)}
    assert set(found) == {"b", "c", "d"} and all(d["b"] == "a" for d in found.values())
    assert found["b"]["difference"] == pytest.approx(-0.5)
    assert found["b"]["se"] == pytest.approx(math.sqrt(0.02)) and found["b"]["resolved"]
    assert abs(found["c"]["difference"]) < RESOLVE_SE * found["c"]["se"]
    assert not found["c"]["resolved"] and not found["d"]["resolved"]
    assert mean_se([3.0]) == (3.0, None)


def test_sigterm_stops_the_sweep_and_the_same_command_finishes_it(cache, swept, tmp_path):
    """SIGTERM to the sweep while its one unfinished run trains: the run is passed SIGTERM, the
    sweep exits non-zero printing the resume command, which then finishes it (as the run of the
    uninterrupted sweep)."""
    out = tmp_path / "s"
    shutil.copytree(swept / "runs", out / "runs")
    folder = out / "runs" / "optimizer=adamw" / "seed-0"
    shutil.rmtree(folder)
    cmd = [sys.executable, "-m", "train.sweep", "--data", str(cache), "--out", str(out)]
    cmd += [*GRID, *TRAIN]
    sweep_proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in sweep_proc.stderr:  # its log: stop it once the run has started
        if "starting optimizer=adamw seed 0" in line:
            sweep_proc.send_signal(signal.SIGTERM)
            break
    rest = sweep_proc.stderr.read()
    assert sweep_proc.wait() == 1, rest
    assert "stopped by SIGTERM; not finished: optimizer=adamw seed 0" in rest
    assert "optimizer=adamw seed 0 stopped before its export (status " in rest
    assert "resume: python -m train.sweep --data" in rest
    assert not (folder / "export").exists()
    result = sweep(cache, out)
    assert result.exit_code == 0, result.output
    assert_runs_agree(folder, swept / "runs" / "optimizer=adamw" / "seed-0")


def test_a_run_without_its_figures_is_trained_again(cache, swept, tmp_path):
    """A finished run whose metrics.jsonl lost its held-out evaluation is not averaged in with
    its training figures: the same command trains it again (from its last checkpoint); a run
    whose config.json is damaged is named with train's error, not a traceback."""
    out = tmp_path / "s"
    shutil.copytree(swept / "runs", out / "runs")
    cut = out / "runs" / "optimizer=muon" / "seed-0" / "metrics.jsonl"
    cut.write_text("".join(x for x in cut.read_text().splitlines(True) if '"eval"' not in x))
    (out / "runs" / "optimizer=adamw" / "seed-1" / "config.json").write_text('{"train": ')
    result = sweep(cache, out)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "  optimizer=adamw seed 1: " in result.output and "config.json" in result.output
    assert sorted(p.name for p in (out / "logs").iterdir()) == [
        "optimizer=adamw.seed-1.log",
        "optimizer=muon.seed-0.log",
    ]
    report = json.loads((out / "report.json").read_text())
    theirs = json.loads((swept / "report.json").read_text())["variants"]
    assert report["variants"][1]["tau"]["values"] == pytest.approx(theirs[1]["tau"]["values"])
    assert report["variants"][0]["seeds"] == [0]
    assert [(r["variant"], r["seed"]) for r in report["not_finished"]] == [("optimizer=adamw", 1)]


def test_a_report_that_cannot_be_written_is_named(cache, swept, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(swept / "runs", out / "runs")
    (out / "report.md").mkdir()  # as a full disk: the write fails
    result = sweep(cache, out)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: --out {out}: cannot write " in result.output and "report.md" in result.output


def test_the_same_train_options_in_another_order_are_the_same_sweep(cache, swept, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(swept, out)
    at = TRAIN.index("--lr")
    moved = [*TRAIN[at : at + 2], *TRAIN[:at], *TRAIN[at + 2 :]]
    result = CliRunner().invoke(main, ["--data", str(cache), "--out", str(out), *GRID, *moved])
    assert result.exit_code == 0, result.output
    assert "4 runs: 4 finished already, 0 to run" in result.output


def test_a_run_killed_by_a_signal_is_said_so(cache, tmp_path):
    from train.sweep.jobs import Outcome
    from train.sweep.run import settle

    jobs = jobs_of(cache, tmp_path)
    done, failed = settle(jobs, Outcome(failed=[(jobs[1], -9), (jobs[0], 1)]), tmp_path)
    assert done == [] and [j for j, _ in failed] == jobs[:2]
    assert [why for _, why in failed] == [
        "exited with status 1 (see its log)",
        "killed by SIGKILL (see its log)",
    ]


def test_a_report_of_training_figures_says_so():
    from train.proof.compare import RunSummary
    from train.sweep.report import markdown

    last = {"kind": "train", "step": 6, "tau": 1.5, "loss": 2.0, "acc": [0.5]}
    run = RunSummary("r", {"train": {}}, "train", [last])
    record = {"variant": "a", "seeds": [0], "step": [6], "source": ["train"], "acc": [0.5]}
    record["tau"] = {"mean": 1.5, "se": None, "values": [1.5]}
    text = markdown([record], [run], "cmd")
    assert "held-out evaluation (" not in text and "last training log step" in text
    record["source"] = ["eval"]
    assert "each run's last held-out evaluation (" in markdown([record], [run], "cmd")


def test_a_run_without_metrics_leaves_its_variant_figures(cache, tmp_path):
    """Runs without a held-out evaluation (--eval-fraction 0): one whose metrics.jsonl is
    lost is left out (and trained again), not a blank for its whole variant."""
    from train.sweep.report import summarise, unusable

    jobs = jobs_of(cache, tmp_path)
    for job in jobs:
        job.folder.mkdir(parents=True)
        (job.folder / "config.json").write_text('{"train": {}}')
        if job.seed == 1:
            record = {"kind": "train", "step": 6, "tau": 1.5 + job.seed, "loss": 2.0, "acc": []}
            (job.folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    assert [j for j, _ in unusable(jobs)] == [jobs[0], jobs[2]]
    assert "metrics.jsonl holds no metrics" in unusable(jobs)[0][1]
    records, _ = summarise([jobs[1], jobs[3]])
    assert [r["tau"]["values"] for r in records] == [[2.5], [2.5]]


def test_a_run_found_without_its_evaluation_late_is_trained_again(cache, swept, tmp_path):
    """A finished run without a held-out evaluation is seen so only once another run has
    one: the same command still trains it again, and the report takes all four."""
    out = tmp_path / "s"
    shutil.copytree(swept / "runs", out / "runs")
    cut = out / "runs" / "optimizer=muon" / "seed-0" / "metrics.jsonl"
    cut.write_text("".join(x for x in cut.read_text().splitlines(True) if '"eval"' not in x))
    for folder in (out / "runs").glob("*/*"):
        if folder != cut.parent:
            shutil.rmtree(folder / "export")
    result = sweep(cache, out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [v["seeds"] for v in report["variants"]] == [[0, 1], [0, 1]]
    assert {s for v in report["variants"] for s in v["source"]} == {"eval"}


def test_a_sweep_whose_runs_all_fail_replaces_an_earlier_report(cache, tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    for name in ("report.json", "report.md", "tau.png", "curves.png"):
        (out / name).write_text("{}")  # an earlier command's
    args = ["--data", str(cache), "--out", str(out), "--vary", "lr=1e30", "--seeds", "1"]
    at = TRAIN.index("--lr")
    result = CliRunner().invoke(main, [*args, "--gpus", "cpu", *TRAIN[:at], *TRAIN[at + 2 :]])
    assert result.exit_code == 1, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["variants"] == [] and [r["seed"] for r in report["not_finished"]] == [0]
    assert "No run has finished." in (out / "report.md").read_text()
    assert not (out / "tau.png").exists() and not (out / "curves.png").exists()
