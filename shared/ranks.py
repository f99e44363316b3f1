"""The launch's environment, read without torch: torchrun's ranks and the usable cores.

With `shared.dist` (which re-exports these), the only reader of RANK / LOCAL_RANK / WORLD_SIZE.
Kept apart so that a command line can decide, before the heavy imports, whether this process
holds its run's output lock (`takes_output_lock`) and refuse a locked folder at once.
"""

from __future__ import annotations

import os

# This process's parent when the module was first imported, before torch's: a torchrun agent
# killed during its ranks' start-up is still the parent they watch (`launching_parent`).
_PARENT = os.getppid()


def launching_parent() -> int:
    """The pid of the process that started this one, as it was early in start-up (a parent
    that died since has left this process another one)."""
    return _PARENT


def usable_cpus() -> int:
    """The cores this process may run on (a cpuset, taskset or Slurm allocation), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        return os.cpu_count() or 1


def processes_on_this_host(world_size: int) -> int:
    """How many ranks share this host's cores: torchrun's LOCAL_WORLD_SIZE (several nodes), else
    the world size (our own launcher starts every rank on this host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, int(local)) if local.isdigit() else max(1, world_size)


def torchrun_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def torchrun_ranks() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as torchrun set them."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch_rank() -> int:
    """This process's rank as launched: torchrun's RANK, else 0 (our launcher, or one process)."""
    return torchrun_ranks()[0] if under_torchrun() else 0


def takes_output_lock() -> bool:
    """True in the process that holds a run's output lock for all its ranks: our launcher, or
    rank 0 under torchrun (torchrun stops every rank when one fails)."""
    return not under_torchrun() or os.environ.get("RANK") == "0"
