"""`python -m extract` and `python -m train` on one cache at once, through the real CLIs:
started together, each killed (-9) or stopped (SIGTERM) mid-way and resumed. The cache verifies,
the run's first pass covers every sample of the finished cache, and a resumed run trains exactly
as one run over the finished cache."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shared.manifest import read_manifest, write_manifest
from tests.cachegen import write_cache
from tests.test_extract import chat
from tests.test_train_loop import records
from train.checkpoint import list_checkpoints, load_state

ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread per process: the extraction and the training share the two cores.
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
TIMEOUT_S = 300  # for any one line or exit; a failing test ends there, a passing one never waits

pytestmark = pytest.mark.slow


class Proc:
    """A CLI in its own session, its stderr read by a thread so that waiting on one process's
    lines never leaves another's pipe full."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of output
            self.changed.notify_all()

    @property
    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, needle: str, count: int = 1) -> str:
        """The `count`-th line holding `needle`, once printed."""

        def found() -> list[str]:
            return [line for line in self.lines if needle in line]

        with self.changed:
            self.changed.wait_for(
                lambda: len(found()) >= count or (self.lines and self.lines[-1] == ""),
                timeout=TIMEOUT_S,
            )
            hits = found()
        assert len(hits) >= count, f"{needle!r} x{count} never printed:\n{self.text}"
        return hits[count - 1]

    def finish(self) -> int:
        code = self.proc.wait(timeout=TIMEOUT_S)
        self.reader.join(timeout=TIMEOUT_S)
        return code

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(160)))
    return path


def extract_args(cache: Path, target: Path, data: Path) -> list[str]:
    return [
        "extract", "--out", str(cache), "--target", str(target), "--data", str(data),
        "--gpus", "cpu", "--rows-per-part", "4", "--batch-tokens", "256", "--layers", "1",
    ]  # fmt: skip


def train_args(cache: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--data", str(cache), "--out", str(out), "--gpus", "cpu",
        "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8",
        "--batch-tokens", "512", "--shuffle-buffer", "16", "--workers", "1", "--steps", "24",
        "--eval-fraction", "0.05", "--checkpoint-every", "2", "--keep-checkpoints", "100",
        "--log-every", "1", *extra,
    ]  # fmt: skip


def verify(cache: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "extract.verify", str(cache)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def first_pass(text: str) -> tuple[int, int, int]:
    """(samples trained, training samples of the finished cache, held out) of the first pass."""
    m = re.search(
        r"the first pass is done at step \d+: ([\d,]+) samples .* of the ([\d,]+) training "
        r"samples of the finished cache \((\d+) held out",
        text,
    )
    assert m, text
    return tuple(int(g.replace(",", "")) for g in m.groups())


def covers_the_finished_cache(text: str, cache: Path) -> None:
    kept = read_manifest(cache).totals()["rows_kept"]
    trained, training, held = first_pass(text)
    assert trained == training and trained + held == kept and held >= 1


def same_as_one_run_over_the_finished_cache(
    tmp_path: Path, cache: Path, run: Path, *extra: str, log: str = ""
) -> None:
    """Train again with the same options, on a copy of the finished cache, from scratch: the
    first pass's rows depend on the finished cache alone, so both runs train on the same rows
    with the same anchors. Compared as separate processes: every step's loss within 1e-4
    (another row moves a step's loss by far more) and the weights within 1e-4, not bit for bit,
    since two processes of the same command on one CPU have been seen to round a step apart
    (README, "What a fresh clone reproduces"). `log`: the followed run's output, shown with the
    first checkpoint where the two runs part."""
    copy, reference = tmp_path / "finished", tmp_path / "reference"
    shutil.copytree(cache, copy)
    write_manifest(copy, dataclasses.replace(read_manifest(copy), complete=False))
    ref = Proc(*train_args(copy, reference, *extra))
    assert ref.finish() == 0, ref.text
    ours, theirs = ({r["step"]: r["loss"] for r in records(d)} for d in (run, reference))
    a = load_file(str(run / "export" / "model.safetensors"))
    b = load_file(str(reference / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and ours.keys() == theirs.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    parted = [s for s in ours if ours[s] != pytest.approx(theirs[s], rel=1e-4)]
    if parted or worst > 1e-4:
        pytest.fail(
            f"steps whose loss differs: {parted}; exports differ by up to {worst:.3g}; "
            f"{first_difference(run, reference)}\nfollowed:\n{log}\nreference:\n{ref.text}"
        )


def first_difference(run: Path, reference: Path) -> str:
    """Where two runs' checkpoints first hold other weights, and by how much (rounding parts
    them far less than another row or anchor seed at one step does)."""
    theirs = dict(list_checkpoints(reference))
    for step, path in list_checkpoints(run):
        if step not in theirs:
            continue
        a, b = (load_state(p)["model"] for p in (path, theirs[step]))
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        if worst > 0:
            return f"the weights first differ at checkpoint {step} ({worst:.3g})"
    return "no common checkpoint differs"


def test_extract_and_train_started_together(tmp_path, tiny_qwen3, chats):
    cache, run = tmp_path / "c", tmp_path / "r"
    train = Proc(*train_args(cache, run))
    train.wait_for("waiting for an extraction to start writing")  # no manifest.json yet
    extract = Proc(*extract_args(cache, tiny_qwen3, chats))
    assert extract.finish() == 0, extract.text
    assert train.finish() == 0, train.text
    start = re.search(r"following the extraction of \S+: (\d+) of (\d+) parts", train.text)
    assert start and int(start.group(1)) < int(start.group(2)) == 40, train.text
    assert "an extraction is writing it (pid" in train.text
    covers_the_finished_cache(train.text, cache)
    assert (run / "export" / "model.safetensors").is_file()


def test_kill_9_of_both_sides_mid_way_and_a_resume_of_both(tmp_path, tiny_qwen3, chats):
    cache, run = tmp_path / "c", tmp_path / "r"
    extract = Proc(*extract_args(cache, tiny_qwen3, chats))
    extract.wait_for("committed part-", count=12)
    extract.signal(signal.SIGKILL)
    extract.finish()
    assert not read_manifest(cache).all_recorded
    train = Proc(*train_args(cache, run))
    waiting = train.wait_for("waiting at step")
    assert "is no longer running (killed, failed or stopped)" in waiting  # its lock is stale
    train.signal(signal.SIGKILL)
    train.finish()
    saved = list_checkpoints(run)[-1][0]
    assert saved >= 2
    train = Proc(*train_args(cache, run))
    assert f"at step {saved} of 24" in train.wait_for("resumed from")
    train.wait_for("is no longer running")
    extract = Proc(*extract_args(cache, tiny_qwen3, chats))  # the same command resumes it
    assert extract.finish() == 0, extract.text
    assert "taking over the stale lock" in extract.text
    assert train.finish() == 0, train.text
    assert re.search(rf"continuing at step {saved}: \d+ of 40 parts", train.text), train.text
    covers_the_finished_cache(train.text, cache)
    verify(cache)
    same_as_one_run_over_the_finished_cache(tmp_path, cache, run, log=train.text)


def test_sigterm_of_both_sides_and_a_resume_after_the_extraction_finished(
    tmp_path, tiny_qwen3, chats
):
    """Two training ranks: the wait, the stop and the resume are agreed between them."""
    cache, run = tmp_path / "c", tmp_path / "r"
    extract = Proc(*extract_args(cache, tiny_qwen3, chats))
    extract.wait_for("committed part-", count=12)
    extract.signal(signal.SIGTERM)
    assert extract.finish() == 1 and "stopped by SIGTERM" in extract.text
    train = Proc(*train_args(cache, run, "--gpus", "cpu:2"))
    step = int(re.search(r"waiting at step (\d+)", train.wait_for("waiting at step")).group(1))
    train.signal(signal.SIGTERM)
    assert train.finish() == 1
    assert f"stopped by SIGTERM while waiting for the extraction at step {step} of 24" in (
        train.text
    )
    assert [s for s, _ in list_checkpoints(run)][-1] == step
    extract = Proc(*extract_args(cache, tiny_qwen3, chats))
    assert extract.finish() == 0 and read_manifest(cache).complete  # finished in between
    train = Proc(*train_args(cache, run, "--gpus", "cpu:2"))
    assert train.finish() == 0, train.text
    assert f"at step {step} of 24" in train.wait_for("resumed from")
    trained, training, held = first_pass(train.text)
    assert training + held == read_manifest(cache).totals()["rows_kept"]
    assert 0 <= training - trained <= 2  # two ranks: the samples of a last odd row wait
    verify(cache)
    same_as_one_run_over_the_finished_cache(tmp_path, cache, run, "--gpus", "cpu:2", log=train.text)


def test_sigterm_while_waiting_for_the_first_step_starts_nothing(tmp_path):
    """A window that the committed parts do not fill yet: the launcher waits, says why, and a
    stop signal ends it before any rank started."""
    cache = write_cache(tmp_path / "c", num_parts=4, samples_per_part=5, complete=False)
    full = read_manifest(cache)
    write_manifest(cache, dataclasses.replace(full, parts=full.parts[:2]))
    train = Proc(*train_args(cache, tmp_path / "r", "--shuffle-buffer", "1000"))
    line = train.wait_for("waiting before the first step")
    assert "2 of 4 parts committed" in line and "no extraction is running on it" in line
    train.signal(signal.SIGTERM)
    assert train.finish() == 1
    assert "stopped by SIGTERM while waiting for the first step's parts" in train.text
    assert not list_checkpoints(tmp_path / "r")
