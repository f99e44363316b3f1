"""`python -m extract.regen`: the target's own greedy answers as training data.

Only click and the config are imported before the options are parsed: `--help` and a bad option
answer without torch or transformers being imported.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import click

from extract.regen.config import RegenConfig
from shared.cli import build, click_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click_options(RegenConfig)
@click.argument("more_data", nargs=-1, type=click.Path(path_type=Path))
def main(more_data: tuple[Path, ...], **kwargs: Any) -> None:
    """Replace the assistant turns of chat data by the target's own answers (greedy unless
    --temperature), generated here or by a running server (--server)."""
    from shared.logs import setup_logging

    kwargs["data"] = (*kwargs["data"], *more_data)
    cfg = build(RegenConfig, kwargs)
    setup_logging(verbose=cfg.verbose)
    start = time.monotonic()
    from extract.regen.config import RegenError
    from extract.regen.regenerate import run
    from extract.regen.report import format_summary, nothing_kept_error
    from extract.regen.state import DISK_FULL_RERUN, parts_dir
    from extract.regen.stops import stop_while_planning
    from shared.fsio import unwritable_reason
    from shared.lock import LockHeld, output_lock
    from shared.ranks import takes_output_lock
    from shared.space import full_disk_stops
    from shared.stopping import StopRun, resume_command

    problem = unwritable_reason(parts_dir(cfg.out))
    if problem:
        raise click.ClickException(f"--out {cfg.out}: {problem}")
    try:  # one run at a time on an output: its lock lives in OUT.parts (rank 0's, torchrun's)
        command = resume_command("extract.regen")
        lock = output_lock(parts_dir(cfg.out), command, enabled=takes_output_lock())
        # Ctrl-C or SIGTERM before the run's own stops take them (as the lock is taken, say):
        # said as while the run is planned, nothing of --out written (SIGTERM's default would
        # end the process without a word).
        with stop_while_planning(cfg.out), contextlib.ExitStack() as held:
            try:
                held.enter_context(lock)
            except OSError as e:  # e.g. --out /proc/x as root: mkdir fails although "writable"
                where = e.filename or parts_dir(cfg.out)
                raise RegenError(f"--out {cfg.out}: cannot make {where} ({e.strerror})") from None
            with full_disk_stops(parts_dir(cfg.out), rerun=DISK_FULL_RERUN):
                state = run(cfg)
    except (RegenError, LockHeld, StopRun) as e:  # StopRun: a rank's full disk, say
        raise click.ClickException(str(e)) from None
    complete = state.merged_rows == state.config["total_rows"]
    nothing = nothing_kept_error(state, out=cfg.out) if complete else None
    if nothing is None:  # else that error says it all: the rows read, and why none was kept
        click.echo(format_summary(state, out=cfg.out, seconds=time.monotonic() - start))
    if not complete:
        raise SystemExit(1)
    if nothing is not None:
        if takes_output_lock():  # as extraction leaves no cache of no rows
            cfg.out.unlink(missing_ok=True)
            shutil.rmtree(parts_dir(cfg.out), ignore_errors=True)
        raise click.ClickException(nothing)


if __name__ == "__main__":
    main()
