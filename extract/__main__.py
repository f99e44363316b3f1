"""`python -m extract`: target hidden states -> compressed, resumable cache."""

import time

import click

from extract.config import ExtractConfig
from shared.cli import build, click_options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click_options(ExtractConfig)
def main(**kwargs) -> None:
    """Run the target over a chat dataset and cache the hidden states of chosen layers."""
    from extract.run import ExtractError, run
    from extract.summary import format_summary
    from shared.logs import setup_logging
    from shared.stopping import Stopped, StopRun, resume_command

    cfg = build(ExtractConfig, kwargs)
    setup_logging(verbose=cfg.verbose)
    start = time.monotonic()
    try:
        manifest = run(cfg)
    except Stopped as e:
        raise click.ClickException(f"{e}\nresume: {resume_command('extract')}") from None
    except (ExtractError, StopRun) as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_summary(manifest, seconds=time.monotonic() - start))
    if not manifest.complete:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
