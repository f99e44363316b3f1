"""A sweep's report: per variant the mean and standard error over seeds of each run's last
held-out evaluation (tau, loss, accuracy per offset), which differences of tau the error bars
resolve, every run in `train.proof.compare`'s table, and plots; all written atomically.

The standard error of a mean over n seeds is stdev / sqrt(n) (n - 1 in the stdev); a difference
of two variants' means has the standard error sqrt(se_a^2 + se_b^2), and it counts as resolved
when it exceeds RESOLVE_SE of those (about 95% for normal errors; with 3 seeds a wide margin
is still left to chance, which is why the report gives the numbers, not only the verdict).
"""

from __future__ import annotations

import io
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.fsio import atomic_write_bytes, atomic_write_json, atomic_write_text
from train.proof.compare import (
    METRICS_FILE,
    CompareError,
    RunSummary,
    fmt,
    markdown_report,
    markdown_table,
    plot_runs,
    read_run,
)
from train.sweep.grid import Job, Variant

RESOLVE_SE = 2.0
REPORT_MD, REPORT_JSON, TAU_PLOT, CURVES_PLOT = "report.md", "report.json", "tau.png", "curves.png"


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, standard error of the mean); the error is None for fewer than two values.

    >>> mean_se([1.0, 2.0, 3.0])
    (2.0, 0.5773502691896258)
    """
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, statistics.stdev(values) / math.sqrt(len(values))


def unusable(jobs: Sequence[Job]) -> list[tuple[Job, str]]:
    """The finished runs whose figures the report cannot take, with why: a run folder that
    cannot be read, a run without metrics, or a run without a held-out evaluation where
    another run has one (its metrics.jsonl cut short or lost, or it stopped before its final
    evaluation): a mean over such a run would mix its training figures into the held-out ones.
    Training the run again (train resumes it from its last checkpoint) evaluates it again."""
    read, out = [], []
    for job in jobs:
        try:
            read.append((job, read_run(job.folder)))
        except CompareError as e:
            out.append((job, str(e)))
    kind = "eval" if any(summary.source == "eval" for _, summary in read) else "train"
    what = "held-out evaluation" if kind == "eval" else "metrics"
    out += [
        (job, f"{job.folder / METRICS_FILE} holds no {what}")
        for job, summary in read
        if summary.source != kind
    ]
    return out


def summarise(jobs: Sequence[Job]) -> tuple[list[dict[str, Any]], list[RunSummary]]:
    """(one record per variant, in grid order; every run's summary). A variant's figures come
    from its runs' last eval records (their last train records where a run has none)."""
    by_variant: dict[Variant, list[Job]] = {}
    for job in jobs:
        by_variant.setdefault(job.variant, []).append(job)
    records, runs = [], []
    for variant, group in by_variant.items():
        summaries = [read_run(job.folder) for job in group]
        runs += summaries
        last = [s.last for s in summaries]
        record: dict[str, Any] = {
            "variant": variant.name,
            "settings": dict(variant.settings),
            "seeds": [job.seed for job in group],
            "source": sorted({s.source for s in summaries}),
            "step": [r.get("step") for r in last],
        }
        for key in ("tau", "loss", "selected_tau"):
            values = [r.get(key) for r in last]
            if all(isinstance(v, (int, float)) for v in values):
                mean, se = mean_se(values)
                record[key] = {"mean": mean, "se": se, "values": values}
        offsets = min(len(r.get("acc") or []) for r in last)
        record["acc"] = [
            mean_se([r["acc"][k] if r["acc"][k] is not None else math.nan for r in last])[0]
            for k in range(offsets)
        ]
        records.append(record)
    return records, runs


def differences(records: list[dict[str, Any]], key: str = "tau") -> list[dict[str, Any]]:
    """Each variant against the best by `key` (the highest mean): difference, its standard
    error, and whether it is resolved (|d| > RESOLVE_SE x se)."""
    scored = [r for r in records if key in r]
    if len(scored) < 2:
        return []
    best = max(scored, key=lambda r: r[key]["mean"])
    out = []
    for r in scored:
        if r is best:
            continue
        d = r[key]["mean"] - best[key]["mean"]
        ses = [best[key]["se"], r[key]["se"]]
        se = None if None in ses else math.sqrt(sum(s * s for s in ses))
        resolved = se is not None and abs(d) > RESOLVE_SE * se
        out.append(
            {
                "a": r["variant"],
                "b": best["variant"],
                "difference": d,
                "se": se,
                "resolved": resolved,
            }
        )
    return out


def difference_line(d: dict[str, Any]) -> str:
    """One of `differences` as the report lists it.

    >>> difference_line({"a": "b", "difference": -0.1, "se": None, "resolved": False})
    '- b: -0.100 (one seed: not resolved)'
    >>> difference_line({"a": "b", "difference": -0.5, "se": 0.1, "resolved": True})
    '- b: -0.500 ± 0.100 (resolved)'
    """
    verdict = "resolved" if d["resolved"] else "not resolved"
    if d["se"] is None:  # a variant of one seed: nothing to measure the spread by
        return f"- {d['a']}: {d['difference']:+.3f} (one seed: {verdict})"
    return f"- {d['a']}: {d['difference']:+.3f} ± {fmt(d['se'], 3)} ({verdict})"


def _pm(figure: dict[str, Any] | None, digits: int = 3) -> str:
    if figure is None:
        return "-"
    se = figure["se"]
    return fmt(figure["mean"], digits) + ("" if se is None else f" ± {fmt(se, digits)}")


def markdown(
    records: list[dict[str, Any]],
    runs: list[RunSummary],
    command: str,
    not_finished: Sequence[dict[str, Any]] = (),
) -> str:
    """The report: the command, the variants' table, the resolved differences, the runs that
    did not finish (if any), every run."""
    offsets = max((len(r["acc"]) for r in records), default=0)
    selected = any("selected_tau" in r for r in records)
    header = ["variant", "seeds", "step", "tau", *(["selected tau"] * selected), "loss"]
    header += [f"acc@{k}" for k in range(1, offsets + 1)]
    rows = []
    for r in records:
        steps = sorted({s for s in r["step"] if s is not None})
        row = [
            r["variant"],
            str(len(r["seeds"])),
            ",".join(map(str, steps)) or "-",
            _pm(r.get("tau")),
        ]
        row += [_pm(r.get("selected_tau"))] * selected + [_pm(r.get("loss"), 4)]
        rows.append(row + [fmt(a, 3) for a in r["acc"]] + ["-"] * (offsets - len(r["acc"])))
    lines = ["# Sweep", "", f"`{command}`", ""]
    held_out = all(r["source"] == ["eval"] for r in records)
    what = (
        "last held-out evaluation"
        if held_out
        else "last training log step (no held-out evaluation: --eval-fraction 0, or runs that "
        "stopped before their final one)"
    )
    lines += [
        f"Mean ± standard error over seeds of each run's {what} (`tau`: acceptance length "
        "estimate).",
        "",
    ]
    lines += markdown_table(header, rows, numeric_from=1)
    diffs = differences(records)
    if diffs:
        lines += [
            "",
            f"Tau against the best ({diffs[0]['b']}); resolved where |difference| > "
            f"{RESOLVE_SE:g} x its standard error:",
            "",
        ]
        lines += [difference_line(d) for d in diffs]
    if not_finished:
        lines += ["", "Not finished (the figures above leave them out):", ""]
        lines += [f"- {r['variant']} seed {r['seed']}: {r['error']}" for r in not_finished]
    if not runs:
        return "\n".join([*lines, "", "No run has finished."]) + "\n"
    every = markdown_report(runs).replace("# Drafter runs", "## Every run", 1)
    return "\n".join(lines) + "\n\n" + every


def write_report(
    out: Path,
    jobs: Sequence[Job],
    command: str,
    not_finished: Sequence[tuple[Job, str]] = (),
) -> dict[str, Any]:
    """report.md, report.json, tau.png and curves.png in the sweep folder (plots need
    matplotlib) over the finished `jobs`; `not_finished` (job, why) are listed apart, so a
    variant that failed leaves the others' figures readable. Returns report.json's content."""
    out = Path(out)
    records, runs = summarise(jobs)
    left = [{"variant": j.variant.name, "seed": j.seed, "error": why} for j, why in not_finished]
    report = {"command": command, "variants": records, "differences": differences(records)}
    report["not_finished"] = left
    atomic_write_json(out / REPORT_JSON, report)
    atomic_write_text(out / REPORT_MD, markdown(records, runs, command, left))
    if not runs:  # no plot of an earlier command's runs is left beside this report
        for name in (TAU_PLOT, CURVES_PLOT):
            (out / name).unlink(missing_ok=True)
    elif plot_runs(runs, out / CURVES_PLOT):
        atomic_write_bytes(out / TAU_PLOT, _tau_png(records))
    return json.loads(json.dumps(report))


def _tau_png(records: list[dict[str, Any]]) -> bytes:
    """Each variant's seeds (points) and mean ± standard error (bar) of tau."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(records)), 4))
    for i, r in enumerate(records):
        if "tau" not in r:
            continue
        tau = r["tau"]
        ax.plot([i] * len(tau["values"]), tau["values"], "o", color="C0", alpha=0.4)
        ax.errorbar([i], [tau["mean"]], yerr=[tau["se"] or 0.0], fmt="s", color="C1", capsize=6)
    ax.set_xticks(range(len(records)), [r["variant"] for r in records], rotation=30, ha="right")
    ax.set(ylabel="held-out tau", title="tau per variant: seeds (dots), mean ± standard error")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
