"""`python -m train --data shards/ --out runs/NAME [--gpus 5-7] ...`: parse, build, run.

Only click and the config are imported before the options are parsed and the run folder's lock
is checked: `--help`, a bad option and a folder in use answer without torch being imported.
"""

from __future__ import annotations

import time

import click

from shared.cli import build, click_options
from shared.ranks import launch_rank, takes_output_lock  # notes the parent process, early
from train.config import TrainConfig


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click_options(TrainConfig)
def main(**kwargs: object) -> None:
    """Train a DFlash, DFlash2 or DSpark drafter from a hidden-state cache written by
    `python -m extract`."""
    from shared.lock import LockHeld, refuse_if_held
    from shared.logs import setup_logging

    cfg = build(TrainConfig, kwargs)
    setup_logging(launch_rank(), verbose=cfg.verbose)
    start = time.monotonic()
    try:
        if takes_output_lock():
            refuse_if_held(cfg.out)
    except LockHeld as e:
        raise click.ClickException(str(e)) from None
    from shared.manifest import CacheMismatch, read_manifest
    from shared.stopping import Stopped, StopRun, Terminated, resume_command, sigterm_raises
    from train.run import RunError, run
    from train.summary import format_summary, shipped_prompts

    try:
        with sigterm_raises():  # until the run's own handlers take SIGTERM (and after them)
            out = run(cfg)
    except Stopped as e:
        raise click.ClickException(f"{e}\nresume: {resume_command('train')}") from None
    except (KeyboardInterrupt, Terminated) as e:  # a second Ctrl-C; either, before the run began
        from train.checkpoint import list_checkpoints

        found = list_checkpoints(cfg.out)
        kept = (
            f"the newest checkpoint, step {found[-1][0]} ({found[-1][1]}), is kept and the "
            "steps after it are lost"
            if found
            else f"no checkpoint of this run was saved (--checkpoint-every {cfg.checkpoint_every})"
        )
        how = " by SIGTERM" if isinstance(e, Terminated) else ""
        raise click.ClickException(
            f"stopped at once{how}: {kept}\nresume: {resume_command('train')}"
        ) from None
    except (CacheMismatch, RunError, StopRun) as e:
        raise click.ClickException(str(e)) from None
    if not takes_output_lock():
        return  # torchrun's other ranks: rank 0 prints the summary
    manifest = read_manifest(cfg.data)
    seconds = time.monotonic() - start
    prompts = shipped_prompts([s.path for s in manifest.sources])
    click.echo(
        format_summary(
            cfg.out, export=out, seconds=seconds, target=manifest.target.path, prompts=prompts
        )
    )


if __name__ == "__main__":
    main()
