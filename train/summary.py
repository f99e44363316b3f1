"""The table printed at the end of a training run, from what the run folder holds."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from train.metrics import METRICS_FILE, PLOTS_DIR


def _last(records: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    found = [r for r in records if r.get("kind") == kind]
    return found[-1] if found else None


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _fig(value: float | None, spec: str) -> str:
    """A logged figure, or n/a where its window had nothing to average (null in the file)."""
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def _steps(out: Path, train: dict[str, Any] | None) -> str:
    """The step the run reached: its last log step, or its newest checkpoint where that is later
    (a run stopped between log steps saves one where it stops, with a record of its step since
    checkpoints end logging windows; runs of earlier versions saved none)."""
    from train.checkpoint import checkpoint_problem, list_checkpoints

    logged = train["step"] if train else 0
    for step, path in reversed(list_checkpoints(out)):
        if step <= logged:
            break
        if checkpoint_problem(path) is None:
            return f"{step:,} (the newest checkpoint; last logged at {logged:,})"
    return f"{logged:,}" if train else "none"


def format_summary(
    out: Path,
    *,
    export: Path,
    seconds: float,
    target: str | None = None,
    prompts: Path | None = None,
) -> str:
    """Steps, time, the last train and eval loss and tau, where the outputs are, and what to
    run next with the export (`target`: the target model the cache was extracted from;
    `prompts`: a JSON list of prompts for it, see `shipped_prompts`)."""
    out = Path(out)
    records = _read(out / METRICS_FILE)
    train, evals = _last(records, "train"), _last(records, "eval")
    rows = [
        ("run", str(out)),
        ("steps", _steps(out, train)),
        ("time", f"{seconds:,.1f} s this run"),
        (
            "train (last log)",
            f"loss {_fig(train['loss'], '.4f')}, tau {_fig(train['tau'], '.3f')}"
            if train
            else "no log step",
        ),
        (
            "eval (held out)",
            f"loss {_fig(evals['loss'], '.4f')}, tau {_fig(evals['tau'], '.3f')} "
            f"at step {evals['step']:,}"
            if evals
            else "none yet (stopped before the first evaluation)"
            if not Path(export).is_dir()
            else "none: no samples held out (--eval-fraction, --eval-parts)",
        ),
        ("export", str(export) if Path(export).is_dir() else "none (stopped before the end)"),
        ("metrics", str(out / METRICS_FILE)),
    ]
    plots = sorted((out / PLOTS_DIR).glob("*.png"))
    rows.append(("plots", ", ".join(str(p) for p in plots) if plots else "none"))
    if Path(export).is_dir():
        commands = next_commands(export, target, prompts)
        rows += [("next" if i == 0 else "", c) for i, c in enumerate(commands)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def shipped_prompts(sources: list[str]) -> Path | None:
    """The prompts shipped beside a cache's one data file (`chats.jsonl` -> `chats_prompts.json`,
    as the embedded demo's), or None."""
    if len(sources) != 1:
        return None
    found = Path(sources[0]).with_name(Path(sources[0]).stem + "_prompts.json")
    return found if found.is_file() else None


def next_commands(export: Path, target: str | None, prompts: Path | None = None) -> list[str]:
    """The proof tools on the export: real speculative decoding, then the same through vLLM
    (on `prompts`, else on a JSON list of prompts the user names)."""
    base = ["--target", target or "TARGET", "--drafter", str(export)]
    prompts = shlex.join(["--prompts", str(prompts)]) if prompts else "--prompts PROMPTS.json"
    return [
        f"{shlex.join(['python', '-m', 'train.proof.speculate', *base])} {prompts}"
        "   (tau and lossless, on a JSON list of prompts)",
        f"{shlex.join(['python', '-m', 'train.proof.serve_check', '--engine', 'vllm', *base])} "
        f"{prompts}   (the same through vLLM: README, Serve it)",
    ]
