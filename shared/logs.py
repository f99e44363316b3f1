"""Logging set-up: stdlib logging, rank 0 at INFO by default, other ranks at WARNING."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(rank: int = 0, *, verbose: bool = False) -> None:
    """Log lines to stderr: through tqdm on a terminal (`_BarSafeHandler`); without one (a
    job's log file) plain lines only, so Hugging Face's own progress bars (loading weights,
    saving shards) are turned off there too, unless HF_HUB_DISABLE_PROGRESS_BARS says
    otherwise. Ranks started after this inherit it."""
    if not sys.stderr.isatty():
        # Read by huggingface_hub when transformers is first imported: set before that.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    level = logging.DEBUG if verbose else logging.INFO
    if rank != 0 and not verbose:
        level = logging.WARNING
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if rank != 0:
        fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    handler = _BarSafeHandler() if sys.stderr.isatty() else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("urllib3", "filelock", "asyncio", "numcodecs", "zarr", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _BarSafeHandler(logging.StreamHandler):
    """On a terminal, log lines go through tqdm.write (as tqdm's logging_redirect_tqdm does):
    the progress bar is cleared, the line printed, and the bar drawn again below it, instead
    of the line being written into the bar."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)
