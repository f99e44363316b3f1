"""`python -m extract.regen` stopped by Ctrl-C or SIGTERM where no handler of the run's own waits
for either: while an output whose chunks are all done is resumed. Each is one message, exit
status 1: when it came, what the output holds, and what to run.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from extract.regen.state import parts_dir
from tests.completions_server import CompletionsServer
from tests.held_file import interrupted_at_open
from tests.test_regenerate import MAX_LENGTH, MAX_NEW, ROWS_PER_CHUNK, regen, write_chats

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = dict(gpus=None, concurrency=3, retries=1, retry_wait=0.0)
STATE_LOCK = ".state.lock"  # opened first where the state is updated (`update_state`)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


@pytest.fixture()
def serve(tiny_qwen3):
    """Start completions servers on the tiny target; all are stopped after the test."""
    started = []

    def start(**kwargs) -> CompletionsServer:
        started.append(CompletionsServer(tiny_qwen3, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _args(target: Path, data: Path, out: Path, *more: str) -> list[str]:
    """The command's arguments, with the settings of `regen` (`tests.test_regenerate`)."""
    args = ["--target", str(target), "--data", str(data), "--out", str(out)]
    args += ["--max-new-tokens", str(MAX_NEW), "--max-length", str(MAX_LENGTH)]
    return [*args, "--rows-per-chunk", str(ROWS_PER_CHUNK), *more]


def _said(done: subprocess.CompletedProcess) -> str:
    """The last line of a run that ended with one message, exit status 1 and no traceback."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "route, sig", [("server", signal.SIGINT), ("local", signal.SIGTERM)], ids=["server", "local"]
)
def test_a_stop_while_a_complete_output_is_resumed_says_every_chunk_is_kept(
    serve, tiny_qwen3, data_file, tmp_path, route, sig
):
    """Held where the run resuming an output whose chunks are all done first updates its
    state: at once, saying that every chunk is kept; the same command then finishes it."""
    out = tmp_path / "o.jsonl"
    over = dict(server=serve().url, **FAST) if route == "server" else {}
    regen(out, tiny_qwen3, data_file, max_rows=4, **over)
    before = out.read_bytes()
    more = ["--server", over["server"]] if route == "server" else ["--gpus", "cpu"]
    args = _args(tiny_qwen3, data_file, out, "--max-rows", "4", *more)
    done = interrupted_at_open("extract.regen", args, parts_dir(out) / STATE_LOCK, sig=sig)
    assert _said(done) == (
        f"Error: stopped at once by {sig.name} while the complete output was resumed. Every chunk "
        f"is committed in {parts_dir(out)}: run the same command to finish the output."
    )
    assert regen(out, tiny_qwen3, data_file, max_rows=4, **over).merged_rows == 4
    assert out.read_bytes() == before
