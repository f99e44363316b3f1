"""Device lists and process launch: one process per device, torchrun-compatible.

This module and `shared.ranks` (the same environment read without torch, for the command lines'
early checks) are the only ones that read RANK / LOCAL_RANK / WORLD_SIZE. Everything below them
receives a `RankInfo` as an argument.

`--gpus` grammar: `0-4`, `0,2,5`, `5-7`, `cpu` (one CPU process), `cpu:N` (N CPU processes on
gloo). Without `--gpus`: all visible GPUs, else `cpu`. Under torchrun the environment wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import multiprocessing.util
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.collectives import (  # noqa: F401 (re-exported: where stage code imports them)
    all_gather_objects,
    all_reduce_sum,
    barrier,
    broadcast_object,
    main_first,
)
from shared.ranks import (  # noqa: F401 (re-exported: the launch's environment)
    processes_on_this_host,
    takes_output_lock,
    torchrun_ranks,
    torchrun_world_size,
    under_torchrun,
    usable_cpus,
)
from shared.stopping import (
    Stopped,
    StopRequest,
    StopRun,
    die_with_parent,
    error_kind,
    rank_died,
    stop_class,
    stop_error,
    stop_with_parent,
)

log = logging.getLogger(__name__)

STOP_EXIT = 3  # exit status of a spawned rank that raised StopRun (its message is queued)
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cuda" or "cpu"
    devices: tuple[int, ...]  # CUDA ordinals; for cpu, one entry per process (all 0)

    @property
    def nprocs(self) -> int:
        return len(self.devices)

    def __str__(self) -> str:
        if self.kind == "cpu":
            return "cpu" if self.nprocs == 1 else f"cpu:{self.nprocs}"
        return ",".join(map(str, self.devices))

    @property
    def label(self) -> str:
        """For a log line: 'GPU 0', 'GPUs 5,6,7', 'cpu', 'cpu:2'.

        >>> DeviceSpec("cuda", (0,)).label, DeviceSpec("cuda", (5, 6)).label
        ('GPU 0', 'GPUs 5,6')
        """
        if self.kind == "cpu":
            return str(self)
        return f"GPU {self}" if self.nprocs == 1 else f"GPUs {self}"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def parse_gpus(spec: str | None, *, visible: int | None = None) -> DeviceSpec:
    """Parse a `--gpus` value; raise ValueError naming the bad part.

    >>> parse_gpus("0-2,5", visible=8).devices
    (0, 1, 2, 5)
    >>> parse_gpus("0-2", visible=2)
    Traceback (most recent call last):
    ValueError: --gpus '0-2': GPU 2 does not exist (2 visible); use --gpus cpu to run on the CPU
    >>> parse_gpus("cpu:2")
    DeviceSpec(kind='cpu', devices=(0, 0))
    """
    visible = torch.cuda.device_count() if visible is None else visible
    if spec is not None and not spec.strip():  # `--gpus $VAR` with VAR unset: not every GPU
        raise ValueError(
            f"--gpus {spec!r} is empty: give GPU ids (0-4 or 0,2,5), cpu or cpu:N, or leave "
            "--gpus out for all visible GPUs"
        )
    if spec is None or spec.strip().lower() == "auto":
        return DeviceSpec("cuda", tuple(range(visible))) if visible else DeviceSpec("cpu", (0,))
    spec = spec.strip().lower()
    if spec == "cpu" or spec.startswith("cpu:"):
        n = spec.partition(":")[2] or "1"
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--gpus {spec!r}: expected cpu or cpu:N with N >= 1")
        return DeviceSpec("cpu", (0,) * int(n))
    devices: list[int] = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"--gpus {spec!r}: {part!r} is not N or N-M (e.g. 0-4 or 0,2,5)")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"--gpus {spec!r}: range {part!r} runs backwards")
        devices.extend(range(first, last + 1))
    if len(set(devices)) != len(devices):
        raise ValueError(f"--gpus {spec!r} names a GPU twice")
    bad = [d for d in devices if d >= visible]
    if bad:
        raise ValueError(
            f"--gpus {spec!r}: GPU {bad[0]} does not exist ({visible} visible); "
            "use --gpus cpu to run on the CPU"
        )
    return DeviceSpec("cuda", tuple(devices))


def parse_device(name: str | None) -> torch.device:
    """A `--device` value as a torch device (default cuda where there is one, else cpu);
    ValueError naming it when torch does not know it or this machine has no such device.

    >>> parse_device("cpu"), parse_device("gpu0")
    Traceback (most recent call last):
    ValueError: --device gpu0: not a torch device (cpu, cuda, cuda:N)
    """
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"--device {name}: not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: {torch.cuda.device_count()} CUDA devices here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda devices are supported")
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a collective may wait for the other ranks before the process group fails it.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def _init(
    rank: int,
    world: int,
    local_rank: int,
    spec: DeviceSpec,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> RankInfo:
    if spec.kind == "cuda":
        device = torch.device("cuda", spec.devices[local_rank])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        _init_group(device, rank=rank, world_size=world, timeout=timeout)
    return RankInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _init_group(device: torch.device, **kwargs: Any) -> None:
    """The process group: NCCL bound to `device` on GPUs, gloo on CPUs."""
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)


def one_rank_group(info: RankInfo) -> None:
    """A process group of this process alone, where a run of one process has none: a sharded
    layout of one rank (`--parallel fsdp=1`) runs its probe and forwards in lock-step, which
    needs one. `launch` destroys the group when the run ends."""
    if dist.is_initialized():
        return
    _init_group(info.device, store=dist.HashStore(), rank=0, world_size=1)


def _spawned(
    local_rank: int,
    fn: Callable,
    spec: DeviceSpec,
    args: tuple,
    errors: Any,
    timeout: datetime.timedelta,
    launcher: int,
) -> None:
    die_with_parent(parent=launcher)  # a launcher killed by -9 takes its ranks with it
    if spec.kind == "cuda":  # transformers' distributed loading uses cuda:LOCAL_RANK
        os.environ["LOCAL_RANK"] = str(spec.devices[local_rank])
    info = _init(local_rank, spec.nprocs, local_rank, spec, timeout)
    code = 0
    try:
        fn(info, *args)
    except Stopped as e:  # a signal reached every rank: each stops at its own consistent point
        errors.put((local_rank, error_kind(e), str(e)))  # the launcher waits for all of them
    except StopRun as e:
        errors.put((local_rank, error_kind(e), str(e)))
        code = STOP_EXIT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_now(code)


def _exit_now(code: int) -> None:
    """End a spawned rank that finished (or stopped) without the interpreter's finalization.

    A gloo worker thread may still hold the last reference to a finished collective's tensors;
    releasing it takes the GIL, and a thread taking the GIL during finalization is ended inside
    that (noexcept) release: `terminate called without an active exception`, SIGABRT, after a
    run that had saved and exported everything (seen once under load on a 2-core machine).
    Everything a rank writes is written and closed when its function returns, so only the logs
    need flushing, and multiprocessing's own exit hooks run (the semaphore numcodecs' Blosc
    makes for its lock is otherwise reported leaked at shutdown). A failing rank keeps the
    normal path: torch records its traceback.
    """
    with contextlib.suppress(Exception):
        multiprocessing.util._run_finalizers(0)  # what its process bootstrap runs at exit
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):  # C's buffers too (NCCL's debug output)
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


def _join(
    ctx: Any,
    errors: Any,
    monitor: Callable[[], None] | None,
    every: float,
    tick: Callable[[], None],
) -> None:
    """Wait for the spawned ranks; a StopRun in any is re-raised here with its message. A rank
    stopped by a signal (`Stopped`) ends with 0, so that the others finish their own work in
    progress rather than being ended STOP_GRACE_S later; its message is raised once all end."""
    try:
        # A failed rank: the others get STOP_GRACE_S to end by themselves (the same StopRun
        # reaches all ranks at once), then SIGTERM, then SIGKILL.
        while not ctx.join(timeout=every, grace_period=STOP_GRACE_S):
            tick()
            if monitor is not None:
                monitor()
    except mp.ProcessExitedException as e:
        if e.exit_code == STOP_EXIT and not errors.empty():
            raise _queued(errors) from None
        raise
    if monitor is not None:
        monitor()
    if not errors.empty():  # ranks that stopped on a signal
        raise _queued(errors)


def _queued(errors: Any) -> StopRun:
    """The error to raise of those the ranks queued (rank, class name, message): a failure
    before a signal's stop, then the lowest rank's.

    >>> import queue
    >>> q = queue.SimpleQueue()
    >>> q.put((0, "Stopped", "a")), q.put((1, "StopRun", "b"))
    (None, None)
    >>> str(_queued(q))
    'b'
    """
    out = []
    while not errors.empty():
        out.append(errors.get())
    _, kind, message = min(out, key=lambda e: (issubclass(stop_class(e[1]), Stopped), e[0]))
    return stop_error(kind, message)


def launch(
    fn: Callable[..., None],
    args: tuple,
    spec: DeviceSpec,
    *,
    monitor: Callable[[], None] | None = None,
    monitor_every: float = 0.5,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Run `fn(rank_info, *args)` once per device.

    Under torchrun this process is one rank (devices come from LOCAL_RANK; `spec` picks cuda or
    cpu). Otherwise one process runs in place, or N are spawned; while spawned processes run,
    `monitor()` is called in the parent every `monitor_every` seconds (for a progress bar).
    `timeout`: the process group's (a collective waiting longer fails). An exception in any
    process is re-raised here.
    """
    if under_torchrun():
        stop_with_parent()  # torchrun's agent killed by -9: stop as on a signal
        rank, world, local = torchrun_ranks()
        if spec.kind == "cuda":
            spec = DeviceSpec("cuda", tuple(range(torch.cuda.device_count())))
        info = _init(rank, world, local, spec, timeout)
        try:
            fn(info, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return
    if spec.nprocs == 1:
        had_group = dist.is_initialized()
        try:
            fn(_init(0, 1, 0, spec, timeout), *args)
        finally:
            if dist.is_initialized() and not had_group:  # one_rank_group's
                dist.destroy_process_group()
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    errors = mp.get_context("spawn").SimpleQueue()
    started = time.time()
    ctx = mp.start_processes(
        _spawned,
        args=(fn, spec, args, errors, timeout, os.getpid()),
        nprocs=spec.nprocs,
        join=False,
        start_method="spawn",
    )
    log.debug("started %d ranks: pids %s", spec.nprocs, [p.pid for p in ctx.processes])
    # The ranks stop by themselves on a signal; this process passes one sent only to it on to
    # them, and a second one stops them at once.
    stop = StopRequest()
    killed: list[bool] = []
    stop.on_repeat = lambda: (killed.append(True), _signal_ranks(ctx, signal.SIGKILL))
    stop.install("passing it on to the ranks (again to stop them at once)")
    try:
        _join(ctx, errors, monitor, monitor_every, lambda: _forward(stop, ctx))
    except mp.ProcessExitedException as e:
        if killed:  # the second signal's doing, not a failure
            raise Stopped(
                f"stopped at once by a second {stop.signal_name}: the ranks were killed and "
                "their work in progress is dropped (what they had committed is kept)"
            ) from None
        died = rank_died(e.error_index, e.error_pid, e.exit_code, e.signal_name, started)
        raise Stopped(died) from None
    finally:
        stop.restore()


def _forward(stop: StopRequest, ctx: Any) -> None:
    if stop.requested and not getattr(ctx, "forwarded", False):
        ctx.forwarded = True
        _signal_ranks(ctx, signal.SIGTERM)


def _signal_ranks(ctx: Any, sig: int) -> None:
    for proc in ctx.processes:
        if proc.is_alive():
            os.kill(proc.pid, sig)
