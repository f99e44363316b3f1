"""What every extract process is given (`Job`), and how many writer threads it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from extract.data import RowIndex
from extract.parallel import Layout
from shared.dist import RankInfo, processes_on_this_host, usable_cpus
from shared.progress import SummedBar
from shared.rows import unit_rows


@dataclass(frozen=True)
class Job:
    """What every extract process needs; picklable, identical on all ranks."""

    out: Path
    target: str
    files: tuple[Path, ...]
    index: RowIndex | None  # seek points into `files`, so a rank reads only its rows
    layer_ids: tuple[int, ...]
    max_length: int
    format: str
    store: str
    batch_tokens: int
    compile: str  # ExtractConfig's: resolved per device by extract.layouts.forward_mode
    packing: str
    attention: str  # packed rows' kernel, "auto" for extract.packed's default
    rows_per_part: int
    total_rows: int
    units: tuple[int, ...]  # pending units, sorted; rank r takes units[r::world]
    writer_threads: int
    progress_dir: Path
    draw_bar: bool  # rank 0 draws the bar itself (no launching parent to do it)
    verbose: bool = False
    expected_tokens: int = 0  # of the pending rows, estimated (0: unknown): for the time estimate
    # sys.setswitchinterval while this rank extracts. Qwen3-8B shape, 1M long-tailed tokens, one
    # H200 (bench/e2e_gpu.py, then the same `python -m extract` with --switch-interval-ms):
    # 5 ms (Python's) 0.913-0.916 of the plain forward, 1 and 0.5 ms 0.932: 0.9-1.1 s of device
    # time between forwards instead of 1.6 s (`extract.forward_clock`).
    switch_interval_s: float = 0.001
    # Batches in flight between the device and the writer threads (`--staging-buffers`): the
    # device runs ahead by this many while their samples are compressed in parallel (pinned
    # memory: buffers x batch size).
    staging_buffers: int = 3
    # A sharded layout of the target over the ranks (`extract.parallel`); None: one model per
    # rank. `layout_record`: what each part made under it records (None for one model per rank).
    layout: Layout | None = None
    layout_record: str | None = None
    done_before: int = 0  # units of the cache committed before this run (a resume's)

    def unit_rows(self, unit: int) -> range:
        return unit_rows(unit, rows_per_part=self.rows_per_part, total_rows=self.total_rows)

    @property
    def pending_rows(self) -> int:
        return sum(len(self.unit_rows(u)) for u in self.units)

    def bar(self, earlier: frozenset = frozenset()) -> SummedBar:
        """The bar of every rank's rows this run (`earlier`: counter files to leave out, those an
        earlier run left where rank 0 has yet to clear them)."""
        return SummedBar(
            self.progress_dir,
            total=self.pending_rows,
            unit_key="done_rows",
            desc="extract",
            expected_tokens=self.expected_tokens,
            earlier=earlier,
        )


# Default writer threads per process. More is slower, not faster: each writer thread takes the
# GIL between its Blosc, crc32c and write calls, and the thread that launches the forward pass
# waits for it. Qwen3-8B shape on one H200 with 16 cores, 400K tokens (bench/extract_bench.py
# --writer-threads N): 6 and 8 threads kept up with the device and gave 0.91-0.92 of the pure
# forward until its last batch, 12 and 16 threads 0.85-0.87.
MAX_DEFAULT_WRITER_THREADS = 8


def default_writer_threads(processes: int) -> int:
    """Writer threads per process when --writer-threads is 0: the usable cores shared among the
    host's `processes`, at most MAX_DEFAULT_WRITER_THREADS."""
    return max(1, min(MAX_DEFAULT_WRITER_THREADS, usable_cpus() // max(1, processes)))


def writer_threads(job: Job, info: RankInfo) -> int:
    """The writer threads of one process: `--writer-threads`, or the default for this host."""
    return job.writer_threads or default_writer_threads(processes_on_this_host(info.world_size))
