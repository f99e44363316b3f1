"""Data whose every row is rejected: found while planning, before the target or `--out` is
touched, and the error that says why and what to change."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from extract.data import Rejected, RowIndex, iter_rows
from extract.sources import ACCEPTED_INPUT
from shared.manifest import RejectedRow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
LISTED = 5  # rejected rows an error lists


@dataclass(frozen=True)
class AllRejected:
    """Every row read was rejected: how many, the count per reason and the first few rows."""

    read: int
    reasons: dict[str, int]
    first: tuple[RejectedRow, ...]


def all_rejected(
    files: Sequence[Path],
    tokenizer: PreTrainedTokenizerBase,
    *,
    index: RowIndex,
    total: int,
    max_length: int,
) -> AllRejected | None:
    """None as soon as one of the first `total` rows is kept, else what rejected them all.
    Rows are tokenized as extraction does, so a row kept here is kept there."""
    read, reasons, first = 0, {}, []
    for item in iter_rows(files, tokenizer, max_length=max_length, rows=range(total), index=index):
        if not isinstance(item, Rejected):
            return None
        read += 1
        reasons[item.reason] = reasons.get(item.reason, 0) + 1
        if len(first) < LISTED:
            first.append(RejectedRow.of(item))
    return AllRejected(read, dict(sorted(reasons.items())), tuple(first))


def nothing_kept(
    read: int,
    reasons: Mapping[str, int],
    first: Iterable[RejectedRow],
    out: Path,
    *,
    then: str,
    written: str = "no cache",
    hints: Sequence[str] | None = None,
) -> str:
    """The error for data of which no row was kept: the counts, the first rejected rows with
    what is wrong with each, and what to change (`hints`; default: extraction's for `reasons`).
    `written`: what was not written to `out`; `then`: what became of `out`."""
    said = ", ".join(f"{n} {r}" for r, n in reasons.items()) or "none"
    lines = "".join(f"\n  {r.describe()}" for r in list(first)[:LISTED])
    hints = nothing_kept_hints(reasons) if hints is None else hints
    return (
        f"no row of --data was kept ({read} read; rejected: {said}), so {written} was written "
        f"to {out}{then}. The first rejected rows:{lines}\n" + "\n".join(hints)
    )


def nothing_kept_hints(reasons: Iterable[str]) -> list[str]:
    """What to do about rows rejected for `reasons`: the data's form, the target's chat
    template, or --max-length, as the reasons say.

    >>> hints = nothing_kept_hints(["unknown_schema", "too_few_supervised_tokens"])
    >>> [h.split(" ")[:3] for h in hints]
    [['--data', 'takes', 'JSONL'], ['no', 'row', 'has']]
    """
    hints = []
    if {"malformed_json", "unknown_schema", "no_assistant_turn", "empty", "bad_tokens"} & set(
        reasons
    ):
        hints.append(ACCEPTED_INPUT)
    if "template_error" in reasons:
        hints.append(
            "the target's chat template failed on a row (the detail above says how); a base "
            "model has none (tokenizer.chat_template): give it --data as pre-tokenized "
            "`input_ids` + `loss_mask`"
        )
    if "too_few_supervised_tokens" in reasons:
        hints.append(
            "no row has two supervised (assistant) tokens in its first --max-length tokens: "
            "a larger --max-length keeps more of each row"
        )
    return hints
