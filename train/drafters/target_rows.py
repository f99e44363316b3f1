"""Which of the target's cached states each loss row reads, and the distinct ones per chunk.

A block anchored at p reads the target's last hidden state at rows p .. p+B-1; blocks overlap,
so a chunk of loss rows reads many states more than once. The target's lm_head (a vocabulary-
sized product per state) runs once per distinct state of a chunk instead of once per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TargetRows:
    """The target's last hidden states `states_MH` (after the final norm) and, for each loss row,
    the one it reads (`index_N`, into states_MH): rows of overlapping blocks read one state."""

    states_MH: torch.Tensor
    index_N: torch.Tensor

    @classmethod
    def each(cls, last_NH: torch.Tensor) -> TargetRows:
        """Row n reads state n."""
        return cls(last_NH, torch.arange(last_NH.shape[0], device=last_NH.device))

    @classmethod
    def at(cls, last_BSH: torch.Tensor, rows_BQ: torch.Tensor) -> TargetRows:
        """Slot q of sequence b reads last_BSH[b, rows_BQ[b, q]] (slots in [B, Q] order)."""
        batch, seq = last_BSH.shape[:2]
        first_B1 = seq * torch.arange(batch, device=rows_BQ.device)[:, None]
        return cls(last_BSH.flatten(0, 1), (rows_BQ + first_B1).flatten())


def chunk_logits(
    target: TargetRows | None,
    reads: list[tuple[torch.Tensor, torch.Tensor]] | None,
    chunk: int,
    lm_head_VH: torch.Tensor,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the target's logits of the distinct states chunk `chunk` reads (`chunk_reads`), each
    row's place among them), or (None, None) without the target. Into the first rows of `out`
    when given: a compiled loss body sees one [chunk_rows, V] buffer whatever their number."""
    if target is None:
        return None, None
    distinct_u, place_n = reads[chunk]
    states_uH = target.states_MH[distinct_u].to(lm_head_VH.dtype)
    if out is None:
        return F.linear(states_uH, lm_head_VH), place_n
    torch.mm(states_uH, lm_head_VH.t(), out=out[: distinct_u.shape[0]])
    return out, place_n


def chunk_reads(
    index_N: torch.Tensor, states: int, chunk_rows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk of `chunk_rows` rows: (the distinct states its rows read [U], ascending; each
    row's place among them [n]). The counts and the index's range come to the host in one read
    (torch.unique has waited for the device already).

    >>> [(u.tolist(), i.tolist()) for u, i in chunk_reads(torch.tensor([4, 5, 5, 6, 0]), 7, 3)]
    [([4, 5], [0, 1, 1]), ([0, 6], [1, 0])]
    >>> chunk_reads(torch.tensor([0, 7]), 7, 2)
    Traceback (most recent call last):
    ValueError: rows read states 0..7, there are 7
    """
    num = index_N.shape[0]
    chunks = -(-num // chunk_rows)
    chunk_N = torch.arange(num, device=index_N.device) // chunk_rows
    distinct, place_N = torch.unique(chunk_N * states + index_N, return_inverse=True)
    counts = torch.bincount(distinct // states, minlength=chunks)
    *counts, low, high = torch.cat([counts, index_N.min()[None], index_N.max()[None]]).tolist()
    if low < 0 or high >= states:
        raise ValueError(f"rows read states {low}..{high}, there are {states}")
    out, first = [], 0
    for c, count in enumerate(counts):
        rows = slice(c * chunk_rows, (c + 1) * chunk_rows)
        out.append((distinct[first : first + count] % states, place_N[rows] - first))
        first += count
    return out
