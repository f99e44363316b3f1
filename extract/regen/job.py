"""The job of `python -m extract.regen`: what every process needs to regenerate its chunks, and
the output's last step, merging the chunks into OUT once every one is done."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extract.data import RowIndex
from extract.regen.state import (
    RegenState,
    merge_chunks,
    pending_chunks,
    read_state,
    update_state,
)
from extract.regen.turns import Prompter
from shared.rows import unit_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What every process needs; picklable, identical on all ranks."""

    target: str
    files: tuple[Path, ...]
    index: RowIndex  # seek points into `files`, so a rank reads only its rows
    parts: Path
    rows_per_chunk: int
    total_rows: int
    max_new_tokens: int
    max_length: int | None
    batch_size: int
    sampling: dict[str, float] | None = None  # None: greedy
    seed: int = 0
    template_kwargs: dict[str, Any] | None = None  # the chat template's (enable_thinking)
    chunks: tuple[int, ...] = ()  # pending chunks, sorted; rank r takes chunks[r::world]
    draw_bar: bool = True  # rank 0 draws the bar itself (no launching parent to do it)
    verbose: bool = False

    @property
    def num_chunks(self) -> int:
        return -(-self.total_rows // self.rows_per_chunk)

    def chunk_rows(self, chunk: int) -> range:
        return unit_rows(chunk, rows_per_part=self.rows_per_chunk, total_rows=self.total_rows)

    def prompter(self, tokenizer: Any) -> Prompter:
        """The job's turns as prompts for `tokenizer` (template options, length limits)."""
        return Prompter(
            tokenizer,
            max_new_tokens=self.max_new_tokens,
            max_length=self.max_length,
            template_kwargs=self.template_kwargs,
        )

    def pending(self, state: RegenState) -> tuple[int, ...]:
        return pending_chunks(
            state, self.parts, rows_per_chunk=self.rows_per_chunk, total_rows=self.total_rows
        )

    @property
    def pending_rows(self) -> int:
        return sum(len(self.chunk_rows(c)) for c in self.chunks)


def finish_output(out: Path, job: Job, *, regenerated: bool) -> RegenState:
    """Merge the chunks into OUT once all are done (again if this run regenerated any)."""
    state = read_state(job.parts)
    left = job.pending(state)
    if left:
        log.error("%d chunks are not done (first: %d); run again to resume", len(left), left[0])
        return state
    sizes = [state.chunks[c].size for c in range(job.num_chunks)]
    changed = None not in sizes and out.is_file() and out.stat().st_size != sum(sizes)
    if regenerated or state.merged_rows != job.total_rows or not out.is_file() or changed:
        merge_chunks(out, job.parts, job.num_chunks)
        state = update_state(
            job.parts, lambda s: dataclasses.replace(s, merged_rows=job.total_rows)
        )
        if state.totals(range(job.num_chunks))["rows_kept"]:  # none: the command deletes OUT
            log.info("wrote %s: rows 0..%d of the source", out, job.total_rows - 1)
    return state
