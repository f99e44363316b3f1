"""A sweep from its checked options to its report: the grid planned and checked, the sweep
folder checked (`folder`), the cache waited for, the folder taken under its lock, the runs run
(`jobs`), the report written (`report`). Every problem is a ClickException: one message, and
the command that goes on."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from train.sweep.folder import check_folder, make_folder, take_folder
from train.sweep.grid import SWEEP_FILE, GridError, check, parse_vary, plan_jobs

if TYPE_CHECKING:
    from train.sweep.grid import Job
    from train.sweep.jobs import Outcome

log = logging.getLogger(__name__)


def run(
    *,
    data: Path,
    out: Path,
    vary: tuple[str, ...],
    seeds: int,
    gpus: str | None,
    train_args: list[str],
) -> None:
    """Train every run of the grid that is not finished, then write the report and print its
    summary; a ClickException where the sweep stops or runs fail."""
    from shared.fsio import atomic_write_json
    from shared.lock import LockHeld, output_lock
    from shared.stopping import resume_command
    from train.sweep.report import REPORT_MD, write_report

    command = resume_command("train.sweep")
    with said_when_stopped(command) as doing:
        doing("checking the grid, before any run started")
        grid, jobs, devices = plan_sweep(
            data, out, vary, seeds=seeds, gpus=gpus, train_args=train_args
        )
        check_folder(out, data=data, train_args=train_args)  # before the wait for the cache
        await_cache(jobs)
        make_folder(out)
        try:
            with output_lock(out, command):
                take_folder(out, jobs, data=data, train_args=train_args)
                record = {"command": command, "grid": grid, "seeds": seeds}
                record |= {"train_args": train_args, "data": str(data.resolve())}
                atomic_write_json(out / SWEEP_FILE, record)
                doing("checking which runs to run (the finished ones are kept)")
                outcome = run_all(jobs, out=out, devices=devices)
                if outcome.stopped_by:
                    raise click.ClickException(_stopped(outcome, out, command))
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
        raise click.ClickException(_failed(failed, out, command, any_done=bool(done)))


def _stopped(outcome: Outcome, out: Path, command: str) -> str:
    """The message of a sweep stopped by a signal while its runs ran."""
    unfinished = [*(j for j, _ in outcome.failed), *outcome.not_started]
    lines = ", ".join(f"{j.variant.name} seed {j.seed}" for j in unfinished)
    return (
        f"stopped by {outcome.stopped_by}; not finished: {lines} (logs in {out / 'logs'})\n"
        f"resume: {command}"
    )


def _failed(failed: list[tuple[Job, str]], out: Path, command: str, *, any_done: bool) -> str:
    """The message of a sweep whose runs (`failed`, with why each) did not finish."""
    lines = ", ".join(f"{j.variant.name} seed {j.seed}" for j, _ in failed)
    return "\n".join(
        [
            f"runs failed; not finished: {lines} (logs in {out / 'logs'})",
            *(f"  {j.variant.name} seed {j.seed}: {why}" for j, why in failed),
            ("the report covers the finished runs; " if any_done else "")
            + "once their cause is fixed, the same command runs what is not finished "
            f"(the finished runs are kept): {command}",
        ]
    )


@contextlib.contextmanager
def said_when_stopped(command: str) -> Iterator[Callable[[str], None]]:
    """A Ctrl-C or SIGTERM outside the runs (Python's KeyboardInterrupt, and
    `shared.stopping.Terminated`: the sweep handles the stop signals itself only while runs
    are running, `jobs.run_jobs`) as a ClickException naming what the sweep was doing, the
    last words given to the `doing(...)` this yields, and the command that goes on: the
    sweep's files are written atomically, none is left half done."""
    from shared.stopping import Terminated, sigterm_raises

    said = ["starting"]
    try:
        with sigterm_raises():
            yield said.append
    except KeyboardInterrupt:
        raise click.ClickException(f"stopped while {said[-1]}\nresume: {command}") from None
    except Terminated:
        raise click.ClickException(
            f"stopped by SIGTERM while {said[-1]}\nresume: {command}"
        ) from None


def plan_sweep(
    data: Path,
    out: Path,
    vary: tuple[str, ...],
    *,
    seeds: int,
    gpus: str | None,
    train_args: list[str],
) -> tuple[list[tuple[str, list[str]]], list[Job], list[str]]:
    """(the grid, its runs, the device of each slot) once the grid, the train options, the
    runs' names and the devices are checked; a ClickException where one is not right."""
    from shared.dist import parse_gpus
    from train.sweep.jobs import check_names

    try:
        grid = parse_vary(vary)
        jobs = plan_jobs(data=data, out=out, grid=grid, seeds=seeds, train_args=train_args)
        check_names(jobs, out)
        spec = parse_gpus(gpus)
    except (GridError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    devices = ["cpu"] * spec.nprocs if spec.kind == "cpu" else [str(d) for d in spec.devices]
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
