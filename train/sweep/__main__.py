"""`python -m train.sweep --data CACHE --out sweeps/NAME --vary optimizer=adamw,muon --seeds 3
[--gpus 0-3] [train options...]`: parse, then `run.run`.

Options this command does not know are `python -m train` options, the same for every run.
"""

from __future__ import annotations

from pathlib import Path

import click


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
    from shared.logs import setup_logging
    from train.sweep.run import run

    setup_logging(0)
    run(data=data, out=out, vary=vary, seeds=seeds, gpus=gpus, train_args=list(ctx.args))


if __name__ == "__main__":
    main()
