"""Before extracting: how large the cache will be, and whether its disk can hold it.

The token count comes from tokenizing a sample of the rows spread over the data (16 rows at
each of 16 places, at seek points of the row index in a large file, so it is not read
through); the bytes from the tokens, the layers, the hidden size and the store, at the
fractions of raw bf16 the caches measured so far took (`STORED_FRACTION`), with what a small
hidden size makes count (fp8's scale and int4's record per vector, a tar's member headers per
sample). The time comes later, from the rate the first batches run at
(`shared.progress.SummedBar`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from extract.data import RowIndex, Tokenized, iter_rows
from shared.fsio import filesystem_type
from shared.space import free_bytes, size_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bytes on disk as a fraction of the same states in raw bf16, rounded up from what caches took:
# bf16 (`planes`) 0.680-0.702 on SmolLM2's real states and 0.66-0.69 on random weights, fp8
# 0.430-0.437 (README: "Real model", "Results"), int4 about 0.24 on SmolLM2's (README: "The
# cache"; random weights' states, without massive activations, code alike). Each token also
# stores its id and mask.
STORED_FRACTION = {"bf16": 0.72, "fp8": 0.45, "int4": 0.27}
ID_AND_MASK_BYTES = 5
FP8_SCALE_BYTES = 4  # a float32 per vector, stored as is
# An int4 vector is its record's codes, scales and exact values (`Int4Scheme.int4_bytes`), which
# hardly compress, plus its zeros: 1.05 x those bytes, 0.27 of raw at hidden 4096.
INT4_RECORD_FACTOR = 1.05
# A webdataset sample's 5 or 6 tar members: a 512-byte header each and padding to 512 bytes.
TAR_BYTES_PER_SAMPLE = 6 * 1024
SAMPLE_ROWS = 256
SAMPLE_SPOTS = 16


class SpaceError(ValueError):
    """The cache would not fit on its disk; the message says what to change."""


@dataclass(frozen=True)
class CacheEstimate:
    rows: int  # rows to extract
    sampled: int  # rows tokenized for the estimate
    tokens_per_row: float  # mean over the sampled rows, rejected ones counting 0
    bytes_per_token: float
    layers: int
    hidden: int
    store: str
    bytes_per_row: float = 0.0  # a sample's own bytes whatever its length (a tar's headers)

    @property
    def tokens(self) -> int:
        return round(self.rows * self.tokens_per_row)

    @property
    def nbytes(self) -> int:
        return round(self.tokens * self.bytes_per_token + self.rows * self.bytes_per_row)

    @property
    def of_raw(self) -> float:
        """The estimate as a fraction of the same states in raw bf16."""
        return self.nbytes / max(self.tokens * self.layers * self.hidden * 2, 1)

    def describe(self) -> str:
        """
        >>> CacheEstimate(480, 256, 87.6, 465.8, 5, 64, "bf16").describe()
        'about 42,048 tokens (480 rows x 87.6 tokens a row, from 256 rows tokenized) x 5 layers x hidden 64, bf16 at about 0.73 of raw: about 19.6 MB'
        """  # noqa: E501
        return (
            f"about {self.tokens:,} tokens ({self.rows:,} rows x {self.tokens_per_row:,.1f} "
            f"tokens a row, from {self.sampled:,} rows tokenized) x {self.layers} layers x hidden "
            f"{self.hidden}, {self.store} at about {self.of_raw:.2f} of raw: "
            f"about {size_text(self.nbytes)}"
        )


def bytes_per_token(layers: int, hidden: int, store: str) -> float:
    """Expected bytes on disk per token.

    >>> [round(bytes_per_token(5, 4096, s)) for s in ("bf16", "fp8", "int4")]
    [29496, 18457, 11135]
    >>> [round(bytes_per_token(5, 64, s) / (5 * 64 * 2), 2) for s in ("bf16", "fp8", "int4")]
    [0.73, 0.49, 0.34]
    """
    if store == "int4":
        from shared.int4 import Int4Scheme

        vector = Int4Scheme(hidden=hidden).int4_bytes * INT4_RECORD_FACTOR
    else:
        vector = hidden * 2 * STORED_FRACTION[store] + (FP8_SCALE_BYTES if store == "fp8" else 0)
    return layers * vector + ID_AND_MASK_BYTES


def sample_rows(index: RowIndex, total: int) -> list[range]:
    """`SAMPLE_SPOTS` row ranges of `SAMPLE_ROWS` rows in all, spread evenly over the first
    `total` rows; in data of many seek points each starts at one, so nothing before it is read.

    >>> sample_rows(RowIndex(counts=(10_000,), every=4096, seeks=()), 10_000)[:2]
    [range(0, 16), range(625, 641)]
    >>> sample_rows(RowIndex(counts=(10**6,), every=4096, seeks=()), 10**6)[1]
    range(61440, 61456)
    >>> sample_rows(RowIndex(counts=(100,), every=4096, seeks=()), 100)
    [range(0, 100)]
    """
    if total <= SAMPLE_ROWS:
        return [range(total)]
    per = SAMPLE_ROWS // SAMPLE_SPOTS
    starts = [k * total // SAMPLE_SPOTS for k in range(SAMPLE_SPOTS)]
    if total >= index.every * SAMPLE_SPOTS:
        starts = [s // index.every * index.every for s in starts]
    return [range(s, min(s + per, total)) for s in starts]


def estimate_cache(
    files: list[Path],
    index: RowIndex,
    tokenizer: PreTrainedTokenizerBase,
    *,
    total: int,
    max_length: int,
    layers: int,
    hidden: int,
    store: str,
    fmt: str = "zarr",
) -> CacheEstimate:
    """The cache's expected size, from the lengths of a spread sample of the rows."""
    lengths = []
    for rows in sample_rows(index, total):
        for item in iter_rows(files, tokenizer, max_length=max_length, rows=rows, index=index):
            lengths.append(len(item.input_ids) if isinstance(item, Tokenized) else 0)
    return CacheEstimate(
        rows=total,
        sampled=len(lengths),
        tokens_per_row=sum(lengths) / max(len(lengths), 1),
        bytes_per_token=bytes_per_token(layers, hidden, store),
        layers=layers,
        hidden=hidden,
        store=store,
        bytes_per_row=TAR_BYTES_PER_SAMPLE if fmt == "wds" else 0.0,
    )


def check_space(out: Path, estimate: CacheEstimate, *, rows: int, freed: int = 0) -> str:
    """A sentence on the space `rows` of the estimate need and the disk has; SpaceError when
    they do not fit. `freed`: the bytes of what the run deletes before it writes (the cache an
    --overwrite replaces), counted as free."""
    need = round(estimate.nbytes * rows / max(estimate.rows, 1))
    free = free_bytes(out) + freed
    fs = filesystem_type(out)
    line = f"{size_text(need)} to write, {size_text(free)} free on the disk holding {out}"
    line += f" ({size_text(freed)} of it in what this run replaces)" if freed else ""
    line += f" (file system: {fs})" if fs else ""
    if need > free:
        fp8 = STORED_FRACTION["fp8"] / STORED_FRACTION["bf16"]
        smaller = f", store fp8 (--store fp8: about {fp8:.2f} of the size)"
        smaller = smaller if estimate.store == "bf16" else ""
        replaced = f", counting the {size_text(freed)} this run replaces" if freed else ""
        raise SpaceError(
            f"--out {out}: the cache needs about {size_text(need)} and its disk has "
            f"{size_text(free)} free{replaced} (the estimate: {estimate.describe()}).\nFree "
            "space there, "
            f"choose another --out, extract fewer rows (--max-rows){smaller}"
            ", or pass --no-space-check to start anyway (a full disk then stops it, keeping the "
            "parts committed by then)"
        )
    return line
