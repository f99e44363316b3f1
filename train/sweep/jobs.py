"""Running a sweep's jobs: each one the real `python -m train` command in a child process, as
many at once as there are device slots, skipping finished runs and resuming interrupted ones.

A run is finished when its export exists (train writes it last, after the final evaluation)
and it is not in `redo` (the finished runs whose figures the report cannot read). Any other
run folder is started again with the same command, and train's `--resume auto` takes it from
its newest checkpoint (train refuses, with a message, a folder holding another run).
Children run in their own session, so a Ctrl-C or SIGTERM reaches the sweep alone: it passes
SIGTERM on once to every running child (each saves a checkpoint at its next log step and stops)
and starts no more; a second signal is passed on again (they stop at once). A child also gets
SIGTERM when the sweep dies without a word (`kill -9`: the kernel's parent-death signal), and
may still be saving its checkpoint when the sweep is run again: a run folder whose lock a live
process holds is started once that process has ended (train would refuse the folder), while
the other runs go on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shlex
import signal
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.lock import live_holder
from shared.stopping import STOP_SIGNALS, die_with_parent
from train.sweep.grid import GridError, Job

log = logging.getLogger(__name__)

LOGS_DIR = "logs"
NAME_MAX = 255  # bytes in a file name: Linux's ext4, XFS, btrfs, tmpfs
START_MARK = "$ "  # a log line that starts a run's output: `$ ` and its command
EXPORT_WEIGHTS = Path("export") / "model.safetensors"


def finished(job: Job) -> bool:
    return (job.folder / EXPORT_WEIGHTS).is_file()


def command(job: Job, device: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "train", *job.argv, "--gpus", device]


def log_path(out: Path, job: Job) -> Path:
    return Path(out) / LOGS_DIR / f"{job.variant.name}.seed-{job.seed}.log"


def run_error(path: Path, *, most: int = 3) -> str | None:
    r"""The error a run's log ends with (train's `Error: ...`, its first `most` lines), if any,
    in its last start's part (`_start` appends each start's output after a `$ command` line).

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "r.log"
    >>> _ = p.write_text("step 1\nError: training stopped: the loss is not finite\nfrom step 3\n")
    >>> run_error(p)
    'training stopped: the loss is not finite from step 3'
    >>> _ = p.write_text("$ python -m train\nError: stopped by SIGTERM\n$ python -m train\n")
    >>> run_error(p) is None  # the last start's run was killed without a word
    True
    """
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith(START_MARK)]
    lines = lines[starts[-1] :] if starts else lines
    errors = [i for i, line in enumerate(lines) if line.startswith("Error: ")]
    if not errors:
        return None
    said = lines[errors[-1] : errors[-1] + most]
    return " ".join([said[0].removeprefix("Error: "), *said[1:]]).strip()


def check_names(jobs: list[Job], out: Path) -> None:
    """GridError for a variant whose run folder or log, named after its values, is a name
    longer than a file system takes: found here, not as a failed write once runs started."""
    for job in jobs:
        name = log_path(out, job).name  # VARIANT.seed-S.log: longer than the folder VARIANT
        if len(name.encode()) > NAME_MAX:
            raise GridError(
                f"variant {job.variant.name[:80]}...: its run folder and log are named after "
                f"its values, {len(name.encode())} bytes where a file name takes at most "
                f"{NAME_MAX}: give shorter values (a symlink to a long path, say)"
            )


def exit_reason(code: int) -> str:
    """A run's exit status in words, for a run whose log ends with no error of its own (one
    killed by a signal: the kernel's out-of-memory killer, a `kill -9`).

    >>> exit_reason(-9), exit_reason(1)
    ('killed by SIGKILL (see its log)', 'exited with status 1 (see its log)')
    """
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (see its log)"
        except ValueError:
            pass
    return f"exited with status {code} (see its log)"


@dataclass
class Outcome:
    """What a call of `run_jobs` did."""

    skipped: list[Job] = field(default_factory=list)  # finished before it started
    done: list[Job] = field(default_factory=list)
    failed: list[tuple[Job, int]] = field(default_factory=list)  # (job, exit status)
    not_started: list[Job] = field(default_factory=list)  # left after a stop signal
    stopped_by: str | None = None


def run_jobs(
    jobs: Sequence[Job], *, out: Path, devices: Sequence[str], redo: Collection[Job] = ()
) -> Outcome:
    """Run the unfinished jobs and those in `redo` in order, one per device slot at a time (a
    device may appear more than once: that many at once on it). Each child's output goes to
    `logs/`. A run whose folder a live process holds waits for it (`_startable`); the others go
    on meanwhile."""
    outcome = Outcome(skipped=[j for j in jobs if finished(j) and j not in redo])
    todo = [j for j in jobs if not finished(j) or j in redo]
    runs = f"{len(jobs)} run" + "s" * (len(jobs) != 1)
    log.info("%s: %d finished already, %d to run", runs, len(outcome.skipped), len(todo))
    total, ended = len(todo), 0
    free, running = list(devices), {}  # pid -> (job, device, Popen)
    held: dict[Job, int] = {}  # the runs whose folder a live process holds -> its pid
    told: set[int] = set()  # the children passed SIGTERM since the last stop signal
    sent: set[int] = set()  # every child passed SIGTERM: its end is said to be a stop
    wake_r, wake_w = os.pipe()  # a stop signal ends a wait for holders alone (`_next_event`)
    os.set_blocking(wake_w, False)

    def pass_on() -> None:
        for pid, (_, _, proc) in running.items():
            if pid not in told and proc.poll() is None:  # not one that ended on its own
                told.add(pid)
                sent.add(pid)
                proc.send_signal(signal.SIGTERM)

    def on_signal(signum: int, _frame: object) -> None:
        outcome.stopped_by = signal.Signals(signum).name
        log.warning("%s: passing SIGTERM to the running runs; no new ones", outcome.stopped_by)
        told.clear()  # a second signal is passed on again: the runs stop at once
        pass_on()
        with contextlib.suppress(BlockingIOError):
            os.write(wake_w, b"x")

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        while todo or running:
            while free and outcome.stopped_by is None and (job := _startable(todo, held)):
                todo.remove(job)
                device = free.pop(0)
                proc = _start(job, device, out, f"{total - len(todo)} of {total}")
                running[proc.pid] = (job, device, proc)
                if outcome.stopped_by is not None:  # a signal came while it was starting
                    pass_on()
            if not running and (not held or outcome.stopped_by is not None):
                break
            pid = _next_event(running, held.values(), wake_r)
            if pid not in running:  # a holder ended (its runs may start), or a stop signal
                held = {j: p for j, p in held.items() if p != pid}
                continue
            job, device, proc = running.pop(pid)
            free.append(device)
            ended += 1
            count = f"{ended} of {total} ended, {total - ended} left"
            _ended(outcome, job, proc.wait(), out, stopped=pid in sent, count=count)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)
    outcome.not_started = todo
    return outcome


def _startable(todo: list[Job], held: dict[Job, int]) -> Job | None:
    """The first run of `todo` whose folder no live process holds (train would refuse it). A
    run found held is said once and added to `held` with its holder's pid: skipped until
    that process has ended (`run_jobs` then drops it there)."""
    for job in todo:
        if job in held:
            continue
        holder = live_holder(job.folder)
        if holder is None:
            return job
        held[job] = holder["pid"]
        log.info(
            "waiting for pid %d holding %s: %s seed %d starts once it has ended; its command: %s",
            holder["pid"], job.folder, job.variant.name, job.seed, holder.get("command", "?"),
        )  # fmt: skip
    return None


def _next_event(
    running: dict[int, tuple[Job, str, subprocess.Popen]], holders: Collection[int], wake: int
) -> int | None:
    """The pid of a running child that has exited or of a holder (`_startable`) that has
    ended, waiting for one; None where a stop signal came (`wake` readable). It waits on
    pidfds: no other child of this process is reaped, and a signal is handled meanwhile."""
    for pid, (_, _, proc) in running.items():
        if proc.returncode is not None:  # reaped already (`Popen.send_signal` polls)
            return pid
    fds: dict[int, int] = {}
    try:
        for pid in {*running, *holders}:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:  # ended already
                return pid
        ready, _, _ = select.select([*fds, wake], [], [])
        if wake in ready:
            os.read(wake, 64)  # the signals' bytes: `run_jobs` reads the outcome
        return next((fds[fd] for fd in ready if fd in fds), None)
    finally:
        for fd in fds:
            os.close(fd)


def _ended(outcome: Outcome, job: Job, code: int, out: Path, *, stopped: bool, count: str) -> None:
    """Add the run that ended with status `code` to `outcome`, and log it: finished, stopped by
    the stop signal the sweep passed it (resumed by the same command), or failed; `count`: how
    many ended, how many are left."""
    what, path = f"{job.variant.name} seed {job.seed}", log_path(out, job)
    if code == 0 and finished(job):
        outcome.done.append(job)
        log.info("finished %s (%s)", what, count)
        return
    outcome.failed.append((job, code))
    if stopped:
        log.warning(
            "%s stopped before its export (status %d): see %s (%s)", what, code, path, count
        )
    else:
        log.warning(
            "%s ended with status %d before its export: see %s (%s)", what, code, path, count
        )


def _start(job: Job, device: str, out: Path, nth: str) -> subprocess.Popen:
    """Start `job` on `device`, its output appended to its log; `nth`: '2 of 4' (to run)."""
    path = log_path(out, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(job, device)
    what = f"{job.variant.name} seed {job.seed} ({nth})"
    log.info("starting %s on %s, its output in %s: %s", what, device, path, shlex.join(cmd))
    with open(path, "ab") as sink:  # appended: a resumed run's log follows its first part
        sink.write(f"{START_MARK}{shlex.join(cmd)}\n".encode())
        sink.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )
