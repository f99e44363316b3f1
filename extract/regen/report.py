"""What `python -m extract.regen` shows: the row progress bar and the closing summary."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from extract.data import Rejected
from extract.regen.state import RegenState
from extract.rejects import nothing_kept
from shared.manifest import RejectedRow
from shared.progress import LINE_EVERY_S, on_terminal, progress_bar, read_counters

log = logging.getLogger(__name__)


class RowBar:
    """Rows done (kept or rejected: in the output), failed this run (left out: the same
    command requests them again) and waiting, summed from every rank's counter file
    (`shared.progress`: counters `rows`, `failed`, `new_tokens`). On a terminal a tqdm bar over
    the rows answered either way; else a log line every `every` seconds and at the end (a job's
    log file gets no redraws). `earlier`: counter files of an earlier run, left out
    (`shared.progress.counter_files`)."""

    def __init__(
        self,
        folder: Path,
        *,
        total: int,
        every: float = LINE_EVERY_S,
        earlier: frozenset = frozenset(),
    ):
        self.folder, self.total, self.every, self.earlier = folder, total, every, earlier
        self.start = self.logged = time.monotonic()
        self.bar = (
            progress_bar(total=total, desc="regenerate", unit="rows") if on_terminal() else None
        )

    def refresh(self, *, final: bool = False) -> None:
        counts = read_counters(self.folder, earlier=self.earlier)
        done, failed = int(counts.get("rows", 0)), int(counts.get("failed", 0))
        waiting = max(self.total - done - failed, 0)
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-6)
        rows = f"{done:,} done, {failed:,} failed this run, {waiting:,} waiting"
        rate = f"{counts.get('new_tokens', 0) / elapsed:,.0f} new tok/s"
        if self.bar is not None:
            self.bar.n = done + failed
            self.bar.set_postfix_str(f"{rows}, {rate}", refresh=False)
            self.bar.refresh()
            return
        if not final and now - self.logged < self.every:
            return
        self.logged = now
        per_s = (done + failed) / elapsed
        left = f", about {waiting / per_s:,.0f} s left" if waiting and per_s else ""
        log.info(
            "regenerate: of %s rows, %s; %s, %.0f s elapsed%s",
            f"{self.total:,}",
            rows,
            rate,
            elapsed,
            left,
        )

    def close(self) -> None:
        self.refresh(final=True)
        if self.bar is not None:
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
    if state.failed:  # left out of the output, not recorded: a rerun requests them
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(state.failed.items()))
        failed = f"{sum(state.failed.values()):,} this run ({reasons})"
        rows.append(("rows failed", f"{failed}; the same command requests them again"))
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


def nothing_kept_error(state: RegenState, *, out: Path) -> str | None:
    """Where every row read was rejected, what the run says instead of its summary: the rows
    read, rejected by reason, the first of them, that nothing was written, and what to change;
    else None."""
    t = state.totals(range(-(-state.config["total_rows"] // state.config["rows_per_chunk"])))
    if t["rows_kept"]:
        return None
    first = [RejectedRow.of(Rejected(**r)) for r in t["rejected_rows"]]
    return nothing_kept(
        t["rows_read"],
        t["rejected"],
        first,
        out,
        then="",
        written="nothing",
        hints=_hints(set(t["rejected"])),
    )


def _hints(reasons: set[str]) -> list[str]:
    """What to change about rows rejected for `reasons` (of `REGEN_REJECT_REASONS`)."""
    hints = []
    if reasons & {"malformed_json", "unknown_schema", "empty", "no_assistant_turn"}:
        hints.append(
            "--data takes JSONL, parquet or arrow files and Hugging Face `datasets` folders whose "
            "rows hold OpenAI `messages` or ShareGPT `conversations` with an assistant turn to "
            "regenerate"
        )
    if reasons & {"pretokenized", "tool_calls"}:
        hints.append(
            "pre-tokenized rows hold no text, and tool calls answer tools' results: neither can "
            "be regenerated; give such rows to `python -m extract` as they are"
        )
    if "template_error" in reasons:
        hints.append(
            "the target's chat template failed on a row (the detail above says how): "
            "regeneration needs a target whose chat template renders these messages"
        )
    if "too_long" in reasons:
        hints.append(
            "a turn's prompt plus --max-new-tokens exceeded --max-length (by default the target's "
            "context, or the one --server reports): a smaller --max-new-tokens, or a larger "
            "--max-length where the target (or the server) takes one, keeps these rows"
        )
    return hints
