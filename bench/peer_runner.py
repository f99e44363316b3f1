"""speculators 0.9.0's `train`, patched in this process only (never in the package).

    python bench/peer_runner.py STEP_TIMES_JSON [speculators train arguments...]

Run by bench/peer_speculators.py in the Python that has speculators. Three patches, the first
two on a machine without an accelerator only:
- `Trainer` moves its model and every batch to `get_local_rank()`, an int (`cuda:N`): here
  the CPU device (`speculators.train.trainer` imported the function by name).
- `_StepTimer` calls `torch.accelerator.synchronize()` whether or not there is an
  accelerator (it raises on a CPU-only torch): a no-op without one.
- `--max-steps` breaks out of the epoch, not out of `run_training`'s loop over `--epochs` (each
  later epoch still runs a step, a validation pass and a checkpoint save): `run_training` here
  trains epochs until `max_steps`, then saves the checkpoint once, as the last epoch would.
  The validation pass is left out (the drafters are compared by real decoding instead).
It also records the wall time at the end of every optimizer step (the trainer's own
`step_callback`) into STEP_TIMES_JSON at the end, from which the bench takes the median step
time (the file marks the run complete). STEP_TIMES_JSON.partial is rewritten (atomically) after
every step and each step prints a line to stderr, so a run cut short by a timeout still shows how
far it got and how long its steps took.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def _write(out: str, step_times: list[float]) -> None:
    """The step times so far in `out` (atomically)."""
    steps_s = [b - a for a, b in zip(step_times, step_times[1:], strict=False)]
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"step_s": steps_s, "torch_threads": torch.get_num_threads()}, f)
    os.replace(tmp, out)


def _patch(out: str, step_times: list[float]) -> None:
    from speculators.train import trainer as spec_trainer

    if not torch.accelerator.is_available():  # on a GPU its own rank and synchronize do
        spec_trainer.get_local_rank = lambda: torch.device("cpu")
        torch.accelerator.synchronize = lambda *args, **kwargs: None

    def run_training(self) -> None:
        if self.config.max_steps is None:
            raise ValueError("bench/peer_runner.py: pass --max-steps")
        epoch = self.current_epoch
        step_times.append(time.perf_counter())

        def after_step() -> None:
            step_times.append(time.perf_counter())
            _write(f"{out}.partial", step_times)  # STEP_TIMES_JSON itself marks a finished run
            took = step_times[-1] - step_times[-2]
            print(f"peer_runner: step {len(step_times) - 1} took {took:.3f} s", file=sys.stderr)

        while self.global_step < self.config.max_steps:
            self.train_epoch(epoch, step_callback=after_step)
            epoch += 1
        self.maybe_save_checkpoint(epoch - 1)

    spec_trainer.Trainer.run_training = run_training


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    step_times: list[float] = []
    _patch(out, step_times)
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    sys.argv = [sys.argv[0], *argv]
    spec_main(TrainConfig.resolve(argv))
    _write(out, step_times)


if __name__ == "__main__":
    main()
