"""The sweep folder (`--out`): made where it can be, and taken only where it holds a sweep of
the same train options and cache, or nothing yet."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from train.sweep.grid import (
    RUNS_DIR,
    SWEEP_FILE,
    GridError,
    check_same_sweep,
    read_record,
    runs_outside,
)

if TYPE_CHECKING:
    from train.sweep.grid import Job

log = logging.getLogger(__name__)


def check_folder(out: Path, *, data: Path, train_args: list[str]) -> None:
    """A ClickException where the sweep folder cannot take this command's runs: it cannot be
    made or written, its record names other train options or another cache, or it holds other
    files than a sweep's. Changes nothing: said before any wait (`take_folder` looks again
    under the folder's lock)."""
    from shared.fsio import unwritable_reason

    problem = unwritable_reason(out)
    if problem:
        raise click.ClickException(f"--out {out}: {problem}")
    try:
        record = read_record(out)
        check_same_sweep(record, data=data, train_args=train_args)
    except GridError as e:
        raise click.ClickException(f"{out}: {e}") from None
    if record is None and out.is_dir() and (names := foreign(out)):
        raise click.ClickException(
            f"--out {out}: holds files but no sweep ({_some(names)}): give a new or empty "
            "folder, or a sweep's folder to go on with it"
        )


def make_folder(out: Path) -> None:
    """Make the sweep folder (and those above it); a ClickException naming the path at fault
    where it cannot be made."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. --out /proc/x as root: mkdir fails although "writable"
        raise click.ClickException(
            f"--out {out}: cannot make {e.filename or out} ({e.strerror or e})"
        ) from None


def take_folder(out: Path, jobs: list[Job], *, data: Path, train_args: list[str]) -> None:
    """`check_folder` once more, under the folder's lock (another sweep may have taken it
    since), and log the runs the folder holds that this command leaves out."""
    check_folder(out, data=data, train_args=train_args)
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
