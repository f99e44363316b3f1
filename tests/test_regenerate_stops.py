"""`python -m extract.regen` stopped by Ctrl-C or SIGTERM where no handler of the run's own waits
for either: while it takes the output's lock, while the --server route reads the output's state
or first contacts the server, while an output whose chunks are all done is resumed, and as the
output is merged. Each is one message, exit status 1: when it came, what the output holds, and
what to run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from extract.regen.state import STATE, parts_dir
from shared.lock import LOCK_FILE
from tests.completions_server import servers
from tests.held_file import ROOT, ctrl_c_as_at_a_terminal, interrupted_at_open
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
    with servers(tiny_qwen3) as start:
        yield start


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


def _files(out: Path) -> dict[str, bytes]:
    """OUT and every file under OUT.parts, by path, with their bytes."""
    paths = [out, *sorted(parts_dir(out).rglob("*"))]
    return {str(p.relative_to(out.parent)): p.read_bytes() for p in paths if p.is_file()}


def _planning(out: Path, sig: int) -> str:
    how = " by SIGTERM" if sig == signal.SIGTERM else ""
    return (
        f"Error: stopped{how} while planning, before regeneration began: no part of {out} was "
        "written in this run"
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_while_the_output_lock_is_taken_says_nothing_was_written(
    tiny_qwen3, data_file, tmp_path, sig
):
    """Held where the run opens a stale lock to take it over, before anything is planned."""
    out = tmp_path / "o.jsonl"
    parts_dir(out).mkdir()
    stale = parts_dir(out) / LOCK_FILE
    stale.write_text("{}\n")  # its holder is gone: the run opens it to take it over
    args = _args(tiny_qwen3, data_file, out, "--gpus", "cpu")
    done = interrupted_at_open("extract.regen", args, stale, sig=sig)
    assert _said(done) == _planning(out, sig)
    assert not out.exists() and not (parts_dir(out) / STATE).exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_while_a_served_run_reads_its_state_says_nothing_was_written(
    serve, tiny_qwen3, data_file, tmp_path, sig
):
    """Held where the --server route first reads the state of the output it resumes, before
    the server is contacted: as the other routes say it while they read it."""
    server = serve()
    out = tmp_path / "o.jsonl"
    regen(out, tiny_qwen3, data_file, server=server.url, max_rows=4, **FAST)
    before = _files(out)
    args = _args(tiny_qwen3, data_file, out, "--server", server.url)
    done = interrupted_at_open("extract.regen", args, parts_dir(out) / STATE, sig=sig)
    assert _said(done) == _planning(out, sig)
    assert _files(out) == before


@pytest.mark.parametrize(
    "sig, resumed", [(signal.SIGINT, False), (signal.SIGTERM, True)], ids=["fresh", "resumed"]
)
def test_a_stop_while_the_server_is_first_contacted_says_what_the_output_holds(
    serve, tiny_qwen3, data_file, tmp_path, sig, resumed
):
    """Sent while the run waits for the server's model list (its first contact): at once,
    saying so, and what the output holds, a new one or the chunks of the run it resumes."""
    out = tmp_path / "o.jsonl"
    if resumed:  # one chunk of four committed
        regen(out, tiny_qwen3, data_file, server=serve().url, max_rows=4, **FAST)
    before = _files(out) if resumed else {}
    held = serve(hold_models=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "extract.regen", *_args(tiny_qwen3, data_file, out)]
        + ["--server", held.url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    try:
        assert held.reached.wait(timeout=120), "the run never asked for the model list"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    said = _said(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    when = f"Error: stopped at once by {sig.name} while the server was first contacted, before "
    if resumed:
        assert said == (
            f"{when}any chunk. The committed chunks are kept in {parts_dir(out)}; 3 chunks (10 "
            "rows) are still to do: run the same command to resume."
        )
    else:
        assert (
            said
            == f"{when}any chunk. The output was not touched: run the same command to start it."
        )
    assert _files(out) == before


def test_a_stop_while_a_served_run_prepares_its_output_says_what_it_holds(
    serve, tiny_qwen3, data_file, tmp_path
):
    """Held where the --server run, the server contacted, records its options in the output it
    resumes (the state's lock opened): at once, saying so and that its chunks are kept."""
    server = serve()
    out = tmp_path / "o.jsonl"
    regen(out, tiny_qwen3, data_file, server=server.url, max_rows=4, **FAST)
    before = _files(out)
    args = _args(tiny_qwen3, data_file, out, "--server", server.url)
    sig = signal.SIGTERM
    done = interrupted_at_open("extract.regen", args, parts_dir(out) / STATE_LOCK, sig=sig)
    assert _said(done) == (
        "Error: stopped at once by SIGTERM while --out was prepared, before any chunk. The "
        f"committed chunks are kept in {parts_dir(out)}; 3 chunks (10 rows) are still to do: "
        "run the same command to resume."
    )
    assert _files(out) == before


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_as_the_output_is_merged_says_every_chunk_is_kept(
    serve, tiny_qwen3, data_file, tmp_path, sig
):
    """Held where the --server run, its conversations all done and its own handlers gone, merges
    the chunks (opening the first, committed by the run it resumes): at once, saying that every
    chunk is kept; the same command then merges them, asking the server for nothing."""
    server = serve()
    out = tmp_path / "o.jsonl"
    regen(out, tiny_qwen3, data_file, server=server.url, max_rows=4, **FAST)
    args = _args(tiny_qwen3, data_file, out, "--server", server.url)
    first = parts_dir(out) / "chunk-000000.jsonl"
    done = interrupted_at_open("extract.regen", args, first, sig=sig)
    assert _said(done) == (
        f"Error: stopped at once by {sig.name}. Every chunk is committed in {parts_dir(out)}: "
        "run the same command to finish the output."
    )
    asked = len(server.requests)
    assert regen(out, tiny_qwen3, data_file, server=server.url, **FAST).merged_rows == 14
    assert len(server.requests) == asked


def test_a_ctrl_c_as_rank_0_merges_under_torchrun_is_said_as_a_first_one(
    tiny_qwen3, data_file, tmp_path, monkeypatch
):
    """Held where rank 0 of a torchrun run (one rank here), its chunks all done and its own
    handlers gone, merges them: said as a Ctrl-C, not as a second one that dropped a chunk."""
    out = tmp_path / "o.jsonl"
    regen(out, tiny_qwen3, data_file, max_rows=4)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    args = _args(tiny_qwen3, data_file, out, "--gpus", "cpu")
    done = interrupted_at_open("extract.regen", args, parts_dir(out) / "chunk-000000.jsonl")
    assert _said(done) == (
        f"Error: stopped at once by SIGINT. Every chunk is committed in {parts_dir(out)}: run "
        "the same command to finish the output."
    )
