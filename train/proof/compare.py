"""Compare drafter runs trained on one cache: loss, tau and accuracy per block offset.

`python -m train.proof.compare runs/A runs/B ... [--out report.md] [--plot compare.png]`

Each run folder holds `config.json` (the resolved TrainConfig under "train", the drafter, and the
cache's manifest identity under "cache") and `metrics.jsonl` (one record per log step: "kind"
"train" or "eval", "step", "loss", "tau", "acc" = accuracy of a block's k-th draft (offsets
1..B-1; DSpark's slots 0..B-1, its anchor slot drafting too), for DFlash2 "selected_tau" and for
DSpark "tau_prob", each shown beside tau when any run has it). A run is summarised by its last
eval record, else its last train record; the plot draws every train record as the training
curve, with the eval records as points on it. The report warns when the runs read different
caches (manifest identity or folder) or evaluated on different held-out splits, since their
figures then do not compare.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from shared.fsio import atomic_write_bytes, atomic_write_text
from shared.logs import setup_logging
from shared.manifest import identity_changes

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # not "__main__" under -m

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
# TrainConfig fields that decide which held-out tokens an evaluation scores.
EVAL_SPLIT_KEYS = ("eval_parts", "eval_fraction", "eval_batches", "max_length")
# Fields that differ between runs without changing what is trained or measured.
NOT_SETTINGS = frozenset(
    {"out", "data", "resume", "verbose", "log_every", "checkpoint_every", "keep_checkpoints"}
    | {"prefetch", "workers", "stop_after_steps", "gpus", "compile", "recompile_limit"}
)


class CompareError(ValueError):
    """A run folder cannot be read; the message names it."""


@dataclass(frozen=True)
class RunSummary:
    name: str
    config: dict[str, Any]
    source: str  # "eval", "train", or "none" when metrics.jsonl holds no record yet
    history: list[dict[str, Any]]  # the records of `source` kind, in step order
    train_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def last(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    @property
    def train(self) -> dict[str, Any]:
        return self.config.get("train", {})


def read_run(folder: Path | str) -> RunSummary:
    """The run's config and its eval records, else its train records."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise CompareError(f"{folder}: no {CONFIG_FILE}, not a run folder") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{folder}/{CONFIG_FILE} unreadable ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("train"), dict):
        export = (folder / "model.safetensors").is_file()
        raise CompareError(
            f"{folder}: a drafter export, not a run folder (give {folder.parent})"
            if export
            else f"{folder}/{CONFIG_FILE} is not a training run's: not a run folder"
        )
    records = []
    path = folder / METRICS_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            log.warning("%s line %d is not JSON: skipped", path, number)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:  # a damaged or hand-edited file
            log.warning("%s line %d is not a metrics record: skipped", path, number)
    trained = [r for r in records if r.get("kind") == "train"]
    for kind in ("eval", "train"):
        history = [r for r in records if r.get("kind") == kind]
        if history:
            return RunSummary(str(folder), config, kind, history, trained)
    log.warning("%s: no metrics yet", folder)
    return RunSummary(str(folder), config, "none", [])


def mismatch_warnings(runs: list[RunSummary]) -> list[str]:
    """Why the runs' figures may not compare: caches, eval splits, metric sources."""
    first, warnings = runs[0], []
    for run in runs[1:]:
        ident_a, ident_b = first.config.get("cache", {}), run.config.get("cache", {})
        keys = identity_changes(ident_a, ident_b)
        if keys:
            warnings.append(
                f"{run.name} was trained on another cache than {first.name} "
                f"(manifest identity differs in: {', '.join(keys)})"
            )
        elif _cache_folder(first) != _cache_folder(run):
            warnings.append(
                f"{run.name} read its cache from {run.train.get('data')}, {first.name} from "
                f"{first.train.get('data')} (same manifest identity)"
            )
        split = [k for k in EVAL_SPLIT_KEYS if first.train.get(k) != run.train.get(k)]
        if split:
            changes = ", ".join(f"{k} {first.train.get(k)} vs {run.train.get(k)}" for k in split)
            warnings.append(f"eval splits differ between {first.name} and {run.name}: {changes}")
    sources = {run.source for run in runs}
    if len(sources) > 1:
        by_source = ", ".join(f"{run.name}: {run.source}" for run in runs)
        warnings.append(f"figures come from different records ({by_source})")
    return warnings


def _cache_folder(run: RunSummary) -> str | None:
    """The run's --data, a relative one resolved from the folder training ran in where that can
    be told: the run folder's absolute path less its --out as recorded (relative too)."""
    data, out = run.train.get("data"), run.train.get("out")
    if data is None:
        return None
    if os.path.isabs(data) or out is None or os.path.isabs(out):
        return os.path.normpath(str(data))
    here = Path(os.path.abspath(run.name)).parts
    out_parts = Path(os.path.normpath(str(out))).parts
    if ".." in out_parts or here[len(here) - len(out_parts) :] != out_parts:
        return os.path.normpath(str(data))
    return os.path.normpath(Path(*here[: len(here) - len(out_parts)], data))


def differing_settings(runs: list[RunSummary]) -> list[tuple[str, list[Any]]]:
    """(TrainConfig field, value per run) for the fields that differ: what the runs ablate.
    The number of training processes is one ("ranks": each step takes a micro-batch from every
    one, so it scales the global batch); --gpus itself is not (the same count on other cards)."""
    keys = sorted({k for run in runs for k in run.train} - NOT_SETTINGS)
    rows = [(k, [run.train.get(k) for run in runs]) for k in keys]
    rows.append(("ranks", [run.config.get("ranks") for run in runs]))
    return [(k, values) for k, values in rows if any(v != values[0] for v in values)]


def fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_table(header: list[str], rows: list[list[str]], numeric_from: int) -> list[str]:
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(cells) + " |" for cells in (header, align, *rows)]


def markdown_report(runs: list[RunSummary]) -> str:
    """The comparison as markdown: warnings, the metrics table, the settings that differ."""
    offsets = max((len(run.last.get("acc") or []) for run in runs), default=0)
    # DFlash2 runs also report the tau of the tokens their selector picks, DSpark runs the
    # tau of their acceptance probabilities (1 - L1/2 to the target's distribution).
    selected = any("selected_tau" in run.last for run in runs)
    prob = any("tau_prob" in run.last for run in runs)
    header = ["run", "metrics", "step", "loss", "tau"] + ["selected tau"] * selected
    header += ["tau_prob"] * prob + [f"acc@{k}" for k in range(1, offsets + 1)]
    rows = []
    for run in runs:
        acc = list(run.last.get("acc") or [])
        acc += [None] * (offsets - len(acc))
        figures = [fmt(run.last.get("loss")), fmt(run.last.get("tau"), 3)]
        figures += [fmt(run.last.get("selected_tau"), 3)] * selected
        figures += [fmt(run.last.get("tau_prob"), 3)] * prob
        rows.append([run.name, run.source, fmt(run.last.get("step"))] + figures)
        rows[-1] += [fmt(a, 3) for a in acc]
    lines = ["# Drafter runs", ""]
    for warning in mismatch_warnings(runs):  # one quote block each: markdown joins adjacent ones
        lines += [f"> **Warning:** {warning}", ""]
    lines += markdown_table(header, rows, numeric_from=2)
    settings = differing_settings(runs)
    if settings:
        lines += ["", "Settings that differ:", ""]
        body = [[key] + [fmt(v) for v in values] for key, values in settings]
        lines += markdown_table(["setting"] + [run.name for run in runs], body, numeric_from=1)
    return "\n".join(lines) + "\n"


def plot_runs(runs: list[RunSummary], path: Path) -> bool:
    """`figure(runs)` as a PNG at `path`; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning(
            "matplotlib is not installed: no plot written to %s (pip install matplotlib)", path
        )
        return False
    fig = figure(runs)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return True


def figure(runs: list[RunSummary]) -> Any:
    """Accuracy per offset (the last record), then tau and loss by step: each run's training
    curve (every train record, a line) and its held-out evaluations (markers), in one colour
    per run."""
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_tau, ax_loss) = plt.subplots(1, 3, figsize=(15, 4))
    for i, run in enumerate(runs):
        colour = f"C{i}"
        acc = run.last.get("acc") or []
        ax_acc.plot(range(1, len(acc) + 1), acc, "o-", color=colour, label=run.name)
        for ax, key in ((ax_tau, "tau"), (ax_loss, "loss")):
            curve = run.train_history
            ax.plot(
                [r["step"] for r in curve],
                [_value(r.get(key)) for r in curve],
                "-",
                color=colour,
                alpha=0.6,
                label=f"{run.name} train",
            )
            if run.source == "eval":
                ax.plot(
                    [r["step"] for r in run.history],
                    [_value(r.get(key)) for r in run.history],
                    "o",
                    color=colour,
                    label=f"{run.name} eval",
                )
    ax_acc.set(xlabel="block offset k", ylabel="accuracy", title="accuracy per offset (last)")
    ax_tau.set(xlabel="step", ylabel="tau", title="acceptance length tau: train, eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss: train, eval")
    ax_acc.legend(fontsize="small")
    ax_tau.legend(fontsize="small")
    return fig


def _value(value: Any) -> float:
    """A figure to plot: null (a window with nothing to average) as a gap."""
    return math.nan if value is None else float(value)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="also write the markdown report here")
@click.option("--plot", type=click.Path(path_type=Path), help="write a PNG plot here")
def main(runs: tuple[Path, ...], out: Path | None, plot: Path | None) -> None:
    """Compare the metrics of run folders trained on the same cache."""
    setup_logging(0)
    try:
        summaries = [read_run(folder) for folder in runs]
    except CompareError as e:
        raise click.ClickException(str(e)) from None
    report = markdown_report(summaries)
    click.echo(report, nl=False)
    where = out
    try:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, report)
        where = plot
        if plot is not None and plot_runs(summaries, plot):
            log.info("plot written to %s", plot)
    except OSError as e:  # a folder given as the file, a file as its folder, no permission
        # the path given: e.filename may be the temporary file beside it
        raise click.ClickException(f"cannot write {where}: {e.strerror or e}") from None


if __name__ == "__main__":
    main()
