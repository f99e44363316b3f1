"""What `python -m extract.regen` shows: the row progress bar and the closing summary."""

from __future__ import annotations

import time
from pathlib import Path

from extract.regen.state import RegenState
from shared.progress import LineProgress, progress_bar, read_counters


class RowBar:
    """A bar over rows, summed from every rank's counter file (`shared.progress`): tqdm on a
    terminal, else a plain log line every 30 s (a job's log file gets no redraws)."""

    def __init__(self, folder: Path, *, total: int):
        self.folder, self.start = folder, time.monotonic()
        self.bar = progress_bar(total=total, desc="regenerate", unit="rows")

    def refresh(self) -> None:
        counts = read_counters(self.folder)
        self.bar.n = int(counts.get("rows", 0))
        rate = counts.get("new_tokens", 0) / max(time.monotonic() - self.start, 1e-6)
        self.bar.set_postfix_str(f"{rate:,.0f} new tok/s", refresh=False)
        if isinstance(self.bar, LineProgress):
            self.bar.refresh(only_when_due=True)
        else:
            self.bar.refresh()

    def close(self) -> None:
        self.refresh()
        self.bar.close()


def format_summary(state: RegenState, *, out: Path, seconds: float, listed: int = 5) -> str:
    """The table printed at the end of a run: totals, and the first bad lines of each reason."""
    total = state.config["total_rows"]
    t = state.totals(range(-(-total // state.config["rows_per_chunk"])))
    merged = state.merged_rows == total
    rows = [
        ("output", f"{out} ({t['rows_kept']:,} rows)" if merged else f"{out} (not written)"),
        ("target", state.config["target"]),
        ("rows read", f"{t['rows_read']:,} of {total:,}"),
        ("rows kept", f"{t['rows_kept']:,}"),
        ("rows rejected", f"{t['rows_rejected']:,}"),
    ]
    for reason, n in t["rejected"].items():
        bad = [r for r in t["rejected_rows"] if r["reason"] == reason]
        where = [f"{Path(r['source']).name}:{r['line']}" for r in bad]
        more = ", ..." if n > listed else ""
        rows.append((f"  {reason}", f"{n:,} (lines {', '.join(where[:listed])}{more})"))
    if state.failed:
        rows.append(("failed, to retry", f"{sum(state.failed.values()):,} (this run)"))
        rows += [(f"  {reason}", f"{n:,}") for reason, n in sorted(state.failed.items())]
    rows += [
        ("turns", f"{t['turns']:,} ({t['turns_at_limit']:,} stopped at --max-new-tokens)"),
        ("new tokens", f"{t['new_tokens']:,}"),
    ]
    if t["turns_retokenized"]:  # the drafter will see tokens the target did not generate
        rows.append(("turns retokenized", f"{t['turns_retokenized']:,} (text -> other token ids)"))
    engine = state.settings.get("engine", "hf")
    if engine == "server":
        engine = f"{state.config.get('server')} ({state.settings['server_model']})"
    rows += [("engine", engine), ("time", f"{seconds:,.1f} s this run")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
