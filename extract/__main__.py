"""`python -m extract`: target hidden states -> compressed, resumable cache.

Only click and the config are imported before the options are parsed and the output folder's
lock is checked: `--help`, a bad option and a folder in use answer without torch or
transformers being imported.
"""

import time

import click

from extract.config import ExtractConfig
from shared.cli import build, click_options
from shared.ranks import launch_rank, takes_output_lock  # notes the parent process, early


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click_options(ExtractConfig)
def main(**kwargs) -> None:
    """Run the target over a chat dataset and cache the hidden states of chosen layers."""
    from shared.lock import LockHeld, refuse_if_held
    from shared.logs import setup_logging

    cfg = build(ExtractConfig, kwargs)
    setup_logging(launch_rank(), verbose=cfg.verbose)
    start = time.monotonic()
    try:
        if takes_output_lock():
            refuse_if_held(cfg.out)
    except LockHeld as e:
        raise click.ClickException(str(e)) from None
    from extract.run import ExtractError, run
    from extract.stops import stopped_while_planning
    from extract.summary import format_summary
    from shared.stopping import Stopped, StopRun, Terminated, resume_command, sigterm_raises

    started: list[float] = []  # when planning ended and extracting began
    units: set[int] = set()  # the parts this run extracts

    def begin(pending: tuple[int, ...]) -> None:
        started.append(time.monotonic())
        units.update(pending)

    try:
        with sigterm_raises():  # until the run's own handlers take SIGTERM (and after them)
            manifest = run(cfg, started=begin)
    except Stopped as e:
        raise click.ClickException(f"{e}\nresume: {resume_command('extract')}") from None
    except (KeyboardInterrupt, Terminated) as e:  # planning, or before or after a rank
        name = "SIGTERM" if isinstance(e, Terminated) else None
        if not started:
            said = stopped_while_planning(cfg.out, "extraction", name)
            raise click.ClickException(said) from None
        how = f" by {name}" if name else ""
        raise click.ClickException(
            f"stopped at once{how}: no part was left half-written; the parts committed in "
            f"{cfg.out} are kept\nresume: {resume_command('extract')}"
        ) from None
    except (ExtractError, StopRun) as e:
        raise click.ClickException(str(e)) from None
    if not takes_output_lock():
        return  # torchrun's other ranks: rank 0 prints the summary
    end = time.monotonic()
    working = end - started[0] if started else None
    tokens = sum(p.tokens for p in manifest.parts if p.unit in units)
    click.echo(
        format_summary(
            manifest,
            out=cfg.out,
            seconds=end - start,
            extract_seconds=working,
            tokens=tokens,
            parts=len(units) if started else None,
        )
    )
    if not manifest.complete:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
