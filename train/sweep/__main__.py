"""`python -m train.sweep --data CACHE --out sweeps/NAME --vary optimizer=adamw,muon --seeds 3
[--gpus 0-3] [train options...]`: parse, plan, run, report.

Options this command does not know are `python -m train` options, the same for every run.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from train.sweep.grid import (
    RUNS_DIR,
    SWEEP_FILE,
    GridError,
    check,
    check_same_sweep,
    parse_vary,
    plan_jobs,
    read_record,
    runs_outside,
)

if TYPE_CHECKING:
    from train.sweep.grid import Job
    from train.sweep.jobs import Outcome

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # not "__main__" under -m


@click.command(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
        "ignore_unknown_options": True,
        "allow_extra_args": True,
    }
)
@click.option("--data", required=True, type=click.Path(path_type=Path), help="the cache folder")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="the sweep folder")
@click.option(
    "--vary",
    multiple=True,
    metavar="NAME=V1,V2",
    help="a train option and its values (repeat: every combination); values split on ';' "
    "instead where the text has one (target-layers=0,1;1,3)",
)
@click.option(
    "--seeds",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="seeds 0..N-1 per variant",
)
@click.option(
    "--gpus",
    default=None,
    help="devices, one run on each at a time: 0-3 (four runs at once), cpu (one at a time), "
    "cpu:N (N at once); default all GPUs, else cpu",
)
@click.pass_context
def main(
    ctx: click.Context, data: Path, out: Path, vary: tuple[str, ...], seeds: int, gpus: str | None
) -> None:
    """Train every variant of a grid with several seeds on one cache, then report tau with
    standard errors (report.md, report.json, tau.png, curves.png in the sweep folder)."""
    from shared.fsio import atomic_write_json
    from shared.lock import LockHeld, output_lock
    from shared.logs import setup_logging
    from shared.stopping import resume_command
    from train.sweep.report import REPORT_MD, write_report

    setup_logging(0)
    command = resume_command("train.sweep")
    train_args = list(ctx.args)
    with said_when_stopped(command) as doing:
        doing("checking the grid, before any run started")
        grid, jobs, devices = prepare(
            data, out, vary, seeds=seeds, gpus=gpus, train_args=train_args
        )
        try:
            with output_lock(out, "python -m train.sweep"):
                take_folder(out, jobs, data=data, train_args=train_args)
                record = {"command": command, "grid": grid, "seeds": seeds, "train_args": ctx.args}
                record["data"] = str(data.resolve())
                atomic_write_json(out / SWEEP_FILE, record)
                doing("checking which runs to run (the finished ones are kept)")
                outcome = run_all(jobs, out=out, devices=devices)
                if outcome.stopped_by:
                    unfinished = [*(j for j, _ in outcome.failed), *outcome.not_started]
                    lines = ", ".join(f"{j.variant.name} seed {j.seed}" for j in unfinished)
                    raise click.ClickException(
                        f"stopped by {outcome.stopped_by}; not finished: {lines} (logs in "
                        f"{out / 'logs'})\nresume: {command}"
                    )
                doing(
                    "writing the report (each of its files is the old one or the new one, "
                    "whole; the finished runs are kept)"
                )
                done, failed = settle(jobs, outcome, out)
                write_report(out, done, command, not_finished=failed)  # none done: the failures
        except LockHeld as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # the sweep's own files: a full disk, a folder where a file goes
            raise click.ClickException(
                f"--out {out}: cannot write {e.filename or out} ({e.strerror or e}); once there "
                f"is room, the same command goes on (the finished runs are kept): {command}"
            ) from None
        if done:
            click.echo((out / REPORT_MD).read_text().split("\n## Every run")[0])
    if failed:
        lines = ", ".join(f"{j.variant.name} seed {j.seed}" for j, _ in failed)
        raise click.ClickException(
            "\n".join(
                [
                    f"runs failed; not finished: {lines} (logs in {out / 'logs'})",
                    *(f"  {j.variant.name} seed {j.seed}: {why}" for j, why in failed),
                    ("the report covers the finished runs; " if done else "")
                    + "once their cause is fixed, the same command runs what is not finished "
                    f"(the finished runs are kept): {command}",
                ]
            )
        )


@contextlib.contextmanager
def said_when_stopped(command: str) -> Iterator[Callable[[str], None]]:
    """A Ctrl-C outside the runs (Python's KeyboardInterrupt: the sweep handles the stop
    signals itself only while runs are running, `jobs.run_jobs`) as a ClickException naming
    what the sweep was doing, the last words given to the `doing(...)` this yields, and the
    command that goes on: the sweep's files are written atomically, none is left half done."""
    said = ["starting"]
    try:
        yield said.append
    except KeyboardInterrupt:
        raise click.ClickException(f"stopped while {said[-1]}\nresume: {command}") from None


def prepare(
    data: Path,
    out: Path,
    vary: tuple[str, ...],
    *,
    seeds: int,
    gpus: str | None,
    train_args: list[str],
) -> tuple[list[tuple[str, list[str]]], list[Job], list[str]]:
    """(the grid, its runs, the device of each slot) once the grid and the options are
    checked, the cache is there and the sweep folder is made; a ClickException where not."""
    from shared.dist import parse_gpus
    from shared.fsio import unwritable_reason
    from train.sweep.jobs import check_names

    try:
        grid = parse_vary(vary)
        jobs = plan_jobs(data=data, out=out, grid=grid, seeds=seeds, train_args=train_args)
        check_names(jobs, out)
        spec = parse_gpus(gpus)
    except (GridError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    devices = ["cpu"] * spec.nprocs if spec.kind == "cpu" else [str(d) for d in spec.devices]
    await_cache(jobs)
    problem = unwritable_reason(out)
    if problem:
        raise click.ClickException(f"--out {out}: {problem}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. --out /proc/x as root: mkdir fails although "writable"
        raise click.ClickException(
            f"--out {out}: cannot make {e.filename or out} ({e.strerror or e})"
        ) from None
    return grid, jobs, devices


def await_cache(jobs: list[Job]) -> None:
    """Wait once, as each run would, for an extraction to start writing a --data that holds no
    cache yet; a ClickException when none did (each run would have waited its 10 minutes)."""
    from shared.manifest import CacheMismatch
    from shared.stopping import Stopped
    from train.follow_start import await_manifest

    if not jobs:
        return
    try:
        await_manifest(check(jobs[0].variant, list(jobs[0].argv)))
    except (CacheMismatch, Stopped) as e:
        raise click.ClickException(f"{e}; no run was started") from None


def take_folder(out: Path, jobs: list[Job], *, data: Path, train_args: list[str]) -> None:
    """Check that the sweep folder can take this command's runs (a ClickException where its
    record names other train options or another cache, or where it holds other files than a
    sweep's), and log the runs it holds that this command leaves out."""
    try:
        record = read_record(out)
        check_same_sweep(record, data=data, train_args=train_args)
    except GridError as e:
        raise click.ClickException(f"{out}: {e}") from None
    if record is None and (names := foreign(out)):
        raise click.ClickException(
            f"--out {out}: holds files but no sweep ({_some(names)}): give a new or empty "
            "folder, or a sweep's folder to go on with it"
        )
    if others := runs_outside(out, jobs):
        log.info(
            "%s also holds %d run%s of other variants or seeds than this command's (%s): "
            "kept, and left out of its report",
            out, len(others), "s" * (len(others) != 1), _some(others),
        )  # fmt: skip


def _some(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def foreign(out: Path) -> list[str]:
    """The names in `out` that no sweep writes (its lock and atomic writes' files aside): a
    folder of other files, whose report.md, say, the sweep would replace."""
    from shared.fsio import is_atomic_tmp
    from shared.lock import LOCK_FILE
    from train.sweep.jobs import LOGS_DIR
    from train.sweep.report import CURVES_PLOT, REPORT_JSON, REPORT_MD, TAU_PLOT

    own = {RUNS_DIR, LOGS_DIR, SWEEP_FILE, REPORT_MD, REPORT_JSON, TAU_PLOT, CURVES_PLOT}
    names = (n for n in os.listdir(out) if not (n.startswith(LOCK_FILE) or is_atomic_tmp(n)))
    return sorted(set(names) - own)


def run_all(jobs: list[Job], *, out: Path, devices: list[str]) -> Outcome:
    """`run_jobs` over the unfinished runs and the finished ones whose figures the report
    cannot take (`report.unusable`), then once more over those found so only by the runs just
    finished (the first held-out evaluation of the sweep, say)."""
    from train.sweep.jobs import finished, run_jobs
    from train.sweep.report import unusable

    redo = _train_again(unusable([j for j in jobs if finished(j)]))
    outcome = run_jobs(jobs, out=out, devices=devices, redo=redo)
    done = [j for j in jobs if finished(j)]
    late = [(j, why) for j, why in unusable(done) if j in outcome.skipped]
    if late and outcome.stopped_by is None:
        late = _train_again(late)
        more = run_jobs(late, out=out, devices=devices, redo=late)
        outcome.failed += more.failed
        outcome.not_started += more.not_started
        outcome.stopped_by = more.stopped_by
    return outcome


def _train_again(found: list[tuple[Job, str]]) -> list[Job]:
    """The runs of `found` (with why each is unusable), each logged as trained again."""
    for job, why in found:
        log.warning("%s seed %d: %s: training it again", job.variant.name, job.seed, why)
    return [j for j, _ in found]


def settle(jobs: list[Job], outcome: Outcome, out: Path) -> tuple[list[Job], list[tuple[Job, str]]]:
    """(the runs the report takes, the others with why) once `run_jobs` is done: a run is
    taken when its export exists and its figures can be read (`report.unusable`); one that is
    not is trained again by the next run of the command."""
    from train.sweep.jobs import exit_reason, finished, log_path, run_error
    from train.sweep.report import unusable

    ran = dict(outcome.failed)  # the runs that exited with an error: their status
    failed = [
        (j, run_error(log_path(out, j)) or exit_reason(code))
        for j, code in ran.items()
        if not finished(j)
    ]
    done = [j for j in jobs if finished(j)]
    for job, why in unusable(done):  # an error after its export: the error says more
        error = run_error(log_path(out, job)) if job in ran else None
        failed.append((job, error or f"{why}; the same command trains it again"))
    taken = {j for j, _ in failed}
    return [j for j in done if j not in taken], sorted(failed, key=lambda f: jobs.index(f[0]))


if __name__ == "__main__":
    main()
