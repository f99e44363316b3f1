"""SIGTERM/SIGINT stop extract and train cleanly; after kill -9 no child process lingers."""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.manifest import read_manifest
from shared.oom import kernel_log
from tests.cachegen import write_cache
from tests.held_file import interrupted_at_open
from train.checkpoint import list_checkpoints
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
TIMEOUT_S = 240


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # signals from the test reach only what it sends them to
    )


def read_until(proc: subprocess.Popen, needle: str) -> list[str]:
    """stderr lines up to the first holding `needle` (the pipe blocks: no sleeping)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} never printed:\n{''.join(seen)}")


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=TIMEOUT_S)
    return proc.returncode, err


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after `timeout` seconds (waits on pidfds: no polling)."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    left = dict(fds)
    try:
        while left:
            ready, _, _ = select.select(list(left), [], [], timeout)
            if not ready:
                break
            for fd in ready:
                left.pop(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return list(left.values())


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    from tests.test_extract import chat

    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    # Enough rows that the forwards are still running when the first commit is seen: with a few
    # dozen, a fast machine has submitted every part by then, and the run rightly ends complete.
    path.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(400)))
    return path


def test_sigterm_stops_extract_between_parts(tmp_path, tiny_qwen3, data_file):
    out = tmp_path / "c"
    args = ["extract", "--out", str(out), "--target", str(tiny_qwen3), "--data", str(data_file)]
    args += ["--gpus", "cpu", "--rows-per-part", "4", "--batch-tokens", "256", "--layers", "1"]
    proc = start(*args)
    read_until(proc, "committed part-")
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 1 and "stopped by SIGTERM" in err and "resume: python -m extract" in err, err
    partial = read_manifest(out)
    assert not partial.complete and 1 <= len(partial.parts) < partial.num_units
    assert not list(out.glob("part-*.tmp"))  # nothing half-written
    code, err = finish(start(*args))
    assert code == 0, err
    assert read_manifest(out).complete


def test_a_killed_rank_ends_extract_with_a_message_and_a_resume(tmp_path, tiny_qwen3, data_file):
    """A rank killed (the kernel's out-of-memory killer, say): the launcher stops the others and
    says which rank ended and how, with the command that resumes; no traceback."""
    out = tmp_path / "c"
    args = ["extract", "--out", str(out), "--target", str(tiny_qwen3), "--data", str(data_file)]
    args += ["--gpus", "cpu:2", "--rows-per-part", "4", "--batch-tokens", "256", "--layers", "1"]
    proc = start(*args)
    read_until(proc, "committed part-")
    ranks = [
        pid for pid in descendants(proc.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]  # fmt: skip
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1 and "was killed by SIGKILL" in err, err
    if kernel_log() is not None:  # where the kernel's log is read, it tells a kill -9 apart
        assert "not by the kernel's out-of-memory killer" in err, err
    else:
        assert "(most often the kernel's out-of-memory killer: `dmesg` says)" in err, err
    assert "resume: python -m extract" in err and "Traceback" not in err, err
    assert not read_manifest(out).complete
    code, err = finish(start(*args))
    assert code == 0, err
    assert read_manifest(out).complete


def in_session(sid: int) -> list[int]:
    """The processes of session `sid` (a process started with start_new_session leads one, and
    its children stay in it when it dies)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[3]) == sid and int(entry.name) != sid:
            found.append(int(entry.name))
    return found


def test_ranks_spawned_as_their_launcher_is_killed_end_with_it(tmp_path, tiny_qwen3, data_file):
    """The launcher killed by -9 while its ranks still import torch: they end with it (their
    parent-death signal set for the launcher's pid, not for whichever process adopted them by
    then), instead of extracting the whole cache unwatched, beside a rerun's ranks."""
    out = tmp_path / "c"
    args = ["extract", "--out", str(out), "--target", str(tiny_qwen3), "--data", str(data_file)]
    args += ["--gpus", "cpu:2", "--rows-per-part", "4", "--batch-tokens", "256", "--layers", "1"]
    proc = start(*args, "--verbose")
    read_until(proc, "started 2 ranks")  # said as they begin to import torch
    proc.kill()
    proc.wait(timeout=TIMEOUT_S)
    left = wait_gone(in_session(proc.pid), timeout=TIMEOUT_S)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after {TIMEOUT_S} s: {left}"
    written = (out / "manifest.json").is_file() and read_manifest(out).parts
    assert not written  # nothing extracted after the launcher died


def train_args(cache: Path, out: Path, *extra: str) -> list[str]:
    args = ["train", "--data", str(cache), "--out", str(out), "--gpus", "cpu"]
    args += ["--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8"]
    args += ["--batch-tokens", "512", "--eval-fraction", "0", "--log-every", "1", "--verbose"]
    return args + list(extra)


@pytest.mark.parametrize("gpus", ["cpu", "cpu:2"])
def test_sigterm_checkpoints_train_at_the_step_reached(tmp_path, gpus):
    """To the launching process only: with two ranks it passes the signal on to them."""
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=12)
    out = tmp_path / "run"
    args = train_args(cache, out, "--steps", "400", "--workers", "2")
    args[args.index("cpu")] = gpus
    proc = start(*args)
    read_until(proc, "step 2:")
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 1 and "stopped by SIGTERM at step" in err, err
    assert "resume: python -m train" in err and "--steps 400" in err
    steps = [s for s, _ in list_checkpoints(out)]
    assert len(steps) == 1 and 2 <= steps[0] < 400
    assert not (out / "export").exists()
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().split("\n")
              if line]  # fmt: skip
    assert logged[-1] == steps[0]  # the step it stopped at has its record, which a resume keeps


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_while_train_is_planned_says_nothing_was_saved(tmp_path, sig):
    """Ctrl-C or SIGTERM (a job scheduler's) while the run is planned (held where it first reads
    the cache's manifest, before any handler of its own is installed): one message naming
    SIGTERM, with an error's exit status, and the run folder not made."""
    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=4)
    out = tmp_path / "run"
    args = train_args(cache, out, "--steps", "2")
    done = interrupted_at_open("train", args[1:], cache / "manifest.json", sig=sig)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr
    how = " by SIGTERM" if sig == signal.SIGTERM else ""
    assert done.stderr.strip().splitlines()[-2:] == [
        f"Error: stopped at once{how}: no checkpoint of this run was saved (--checkpoint-every "
        f"{TrainConfig.checkpoint_every})",
        "resume: " + shlex.join(["python", "-m", *args]),
    ]
    assert not out.exists()


def test_one_process_stops_train_at_the_next_step_not_the_next_log_step(tmp_path):
    """One process has no rank to agree with: a stop signal takes effect after the step in
    progress, at the step its warning names, however far off the next log step is."""
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=12)
    out = tmp_path / "run"
    args = train_args(cache, out, "--steps", "400", "--workers", "2")
    args[args.index("--log-every") + 1] = "200"
    proc = start(*args)
    read_until(proc, "first step:")
    proc.send_signal(signal.SIGINT)
    said = read_until(proc, "SIGINT: saving a checkpoint at step")[-1]
    code, err = finish(proc)
    at = int(re.search(r"at step (\d+) of 400, then stopping \(a second signal", said).group(1))
    assert code == 1 and f"stopped by SIGINT at step {at} of 400" in err, said + err
    assert [s for s, _ in list_checkpoints(out)] == [at] and at < 200


@pytest.mark.parametrize("gpus", ["cpu", "cpu:2"])
def test_no_child_outlives_a_killed_trainer(tmp_path, gpus):
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=12)
    args = train_args(cache, tmp_path / "run", "--steps", "400", "--workers", "2")
    args[args.index("cpu")] = gpus
    proc = start(*args)
    read_until(proc, "step 2:")
    kids = descendants(proc.pid)
    assert len(kids) >= 3  # forkserver, resource tracker, DataLoader workers (and ranks)
    proc.kill()
    proc.wait(timeout=TIMEOUT_S)
    left = wait_gone(kids, timeout=30)
    for pid in left:  # don't leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after 30 s: {left}"


def test_torchrun_ranks_stop_with_a_checkpoint_when_its_agent_is_killed(tmp_path):
    """torchrun's agent killed by -9 leaves its ranks no parent: they stop as on SIGTERM (a
    checkpoint where they agree, then exit) instead of training on unwatched to the end."""
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=12)
    out = tmp_path / "run"
    args = train_args(cache, out, "--steps", "400", "--workers", "1")
    proc = start("torch.distributed.run", "--nproc_per_node", "2", "-m", *args)
    read_until(proc, "step 2:")
    ranks = [pid for pid in descendants(proc.pid) if b"train" in _cmdline(pid)]
    proc.kill()
    proc.wait(timeout=TIMEOUT_S)
    left = wait_gone(ranks, timeout=TIMEOUT_S)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert ranks and not left, f"ranks still running after {TIMEOUT_S} s: {left}"
    steps = [s for s, _ in list_checkpoints(out)]
    assert len(steps) == 1 and 2 <= steps[0] < 400, steps


def test_torchrun_prints_one_summary_and_rank_1_logs_as_rank_1(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=12)
    args = train_args(cache, tmp_path / "run", "--steps", "4", "--workers", "1")
    args.remove("--verbose")
    proc = start("torch.distributed.run", "--nproc_per_node", "2", "-m", *args)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert [line.split()[0] for line in out.splitlines() if line.startswith("run ")] == ["run"]
    assert out.count("\nexport ") == 1, out
    assert err.count("training a 1-layer drafter") == 1, err  # rank 0's INFO lines only


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def test_second_ctrl_c_stops_a_process_run_by_hand_at_once():
    code = (
        "import logging, sys; logging.basicConfig(); from shared.stopping import StopRequest; "
        "s = StopRequest().install('stopping soon'); print('ready', flush=True); "
        "sys.stdin.readline()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    read_until(proc, "SIGINT: stopping soon")  # the first one only asks to stop
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code != 0 and "KeyboardInterrupt" in err


def test_a_rank_whose_parent_died_during_its_start_up_still_stops():
    """A torchrun agent killed while its rank imports torch: the rank, adopted by another
    process by the time it watches its parent, stops as on SIGTERM all the same."""
    rank = (
        "import os, signal, sys\n"
        "from shared.ranks import launching_parent\n"
        "print('started', flush=True)\n"
        "while os.getppid() == launching_parent():\n"  # the heavy imports, until the agent dies
        "    signal.sigtimedwait([signal.SIGUSR1], 0.01)\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stopped', flush=True), sys.exit(0)))\n"
        "from shared.stopping import stop_with_parent\n"
        "stop_with_parent()\n"
        "signal.pause()\n"
    )
    agent = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", agent],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.kill()
        proc.wait(timeout=TIMEOUT_S)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "stopped"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
