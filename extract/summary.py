"""The table printed at the end of an extract run, ending with the commands to run next."""

from __future__ import annotations

import shlex
from pathlib import Path

from extract.data import REASON_HINTS
from shared.manifest import Manifest

LISTED_REJECTS = 5


def format_summary(
    manifest: Manifest,
    *,
    out: Path,
    seconds: float,
    extract_seconds: float | None = None,
    tokens: int | None = None,
    parts: int | None = None,
) -> str:
    """Totals, rejected rows, size on disk, time, and what to run next, for the cache at `out`
    as this command named it (the manifest's own record is the first run's). `seconds` is the
    whole command; `extract_seconds` the part after planning (loading the target on each
    device, the forwards and the writes), when known; `tokens` those of the parts this command
    extracted (a resume's are fewer than the cache's) and `parts` how many, when known."""
    t = manifest.totals()
    rows = [
        ("cache", out),
        ("complete", f"{manifest.complete} ({t['parts']}/{manifest.num_units} parts)"),
        (
            "target",
            f"{manifest.target.path} ({manifest.target.model_type}, "
            f"{manifest.target.num_layers} layers, hidden {manifest.target.hidden_size})",
        ),
        ("layers", ", ".join(map(str, manifest.layer_ids))),
        ("format / store", f"{manifest.format} / {manifest.store}"),
        ("rows read", f"{t['rows_read']:,}"),
        ("rows kept", f"{t['rows_kept']:,} ({t['rows_truncated']:,} truncated)"),
        ("rows rejected", f"{t['rows_rejected']:,}"),
    ]
    rows += [
        (f"  {reason}", f"{n:,}" + (f" ({REASON_HINTS[reason]})" if reason in REASON_HINTS else ""))
        for reason, n in t["rejected"].items()
    ]
    first = [r for p in manifest.parts for r in p.rejected_rows][:LISTED_REJECTS]
    rows += [("  first rejected" if i == 0 else "", r.describe()) for i, r in enumerate(first)]
    if t["rows_rejected"] > len(first):
        rows.append(("", f"... all of them in {out}/manifest.json"))
    rows += [
        ("tokens", f"{t['tokens']:,} ({t['supervised_tokens']:,} supervised)"),
        ("on disk", on_disk(manifest)),
        (
            "time",
            time_line(seconds, extract_seconds, t["tokens"] if tokens is None else tokens, parts),
        ),
    ]
    rows += [("next" if i == 0 else "", c) for i, c in enumerate(next_commands(manifest, out))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def on_disk(manifest: Manifest) -> str:
    """Bytes on disk, per token, and as a fraction of the same states in raw bf16 (the one
    convention of the project: 0.68 means the cache takes 68% of raw bf16)."""
    t = manifest.totals()
    raw = t["tokens"] * len(manifest.layer_ids) * manifest.target.hidden_size * 2
    return (
        f"{t['nbytes'] / 1e6:,.1f} MB ({t['nbytes'] / max(t['tokens'], 1):,.0f} B/token, "
        f"{t['nbytes'] / max(raw, 1):.3f} of raw bf16)"
    )


def time_line(
    seconds: float, extract_seconds: float | None, tokens: int, parts: int | None = None
) -> str:
    """The command's wall time, split where known into planning (the target, its tokenizer,
    the row index and the size estimate) and extracting (loading the target on each device,
    the forwards and the writes).

    `tokens`: those extracted in this time, in `parts` parts (0: all were committed before).

    >>> time_line(10.8, 2.3, 42101)
    '10.8 s in all: 8.5 s planning, 2.3 s extracting (18,305 tok/s)'
    >>> time_line(5.1, 0.2, 0, parts=0)
    '5.1 s in all: 4.9 s planning and checking; every part was committed before, none extracted'
    """
    if extract_seconds is None:
        return f"{seconds:,.1f} s in all"
    plan, work = seconds - extract_seconds, extract_seconds
    if parts == 0:
        return (
            f"{seconds:,.1f} s in all: {plan:,.1f} s planning and checking; every part was "
            "committed before, none extracted"
        )
    rate = f" ({tokens / extract_seconds:,.0f} tok/s)" if extract_seconds > 0 and tokens else ""
    return f"{seconds:,.1f} s in all: {plan:,.1f} s planning, {work:,.1f} s extracting{rate}"


def next_commands(manifest: Manifest, out: Path) -> list[str]:
    """What to run after this extraction: check and train on a complete cache, else resume."""
    if not manifest.complete:
        return [f"{manifest.extract_command(out)}   (finishes the cache)"]
    return [
        f"{shlex.join(['python', '-m', 'extract.verify', str(out)])}   (checks every part)",
        f"{shlex.join(['python', '-m', 'train', '--data', str(out)])} --out runs/NAME",
    ]
