"""Training never goes on with non-finite values: a NaN or inf stops the run before any save.

Checking every step would read a value back from the device and make the host wait for it
(the step's queued work drains, see README "Stage two"). Instead `FiniteGuard.observe` folds
each step's loss sum and gradient norm into a device-side record (the first bad step, and the
loss weight seen) with a few scalar kernels and no read-back, and `check` reads it back only
where the host syncs anyway or must know: on log steps, and before every checkpoint save (the
end-of-run save comes before the export). The ranks combine their records with one small
all-reduce, so all of them stop at the same step with the same message.

The updates between the bad step and the check (at most `--log-every` steps) are not skipped:
they cannot reach a file, since no checkpoint and no export is written after a bad step
unchecked, and the last checkpoint saved before it stays the newest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shared.stopping import Stopped, StopRequest, StopRun


class NonFiniteError(StopRun):
    """The loss or the gradient norm stopped being finite, or no step had any target."""


class FiniteGuard:
    def __init__(self, device: torch.device, *, every: int, total: int, data: Path, out: Path):
        self.every, self.total, self.data, self.out = every, total, data, out
        # [first bad step (0: none), loss weight since the last check]
        self.record = torch.zeros(2, dtype=torch.float64, device=device)
        self.loss = torch.zeros((), dtype=torch.float64, device=device)  # this step's so far
        self.checked = 0  # the step of the last check that passed
        self.seen = 0  # the last step `check_due` was called for
        self.stop = StopRequest()  # replaced by the rank's installed one (train_rank)

    def add(self, loss_sum: torch.Tensor, weight: torch.Tensor) -> None:
        """Fold one micro-batch's loss sum and weight in (no device read-back)."""
        self.loss += loss_sum.detach().double()
        self.record[1] += weight.detach().double()

    def observe(self, step: int, grad_norm: torch.Tensor) -> None:
        """Close optimizer step `step` (1-based) with its gradient norm (no device read-back)."""
        bad = ~(torch.isfinite(self.loss) & torch.isfinite(grad_norm.detach()))
        first = bad & (self.record[0] == 0)
        self.record[0] = torch.where(first, float(step), self.record[0])
        self.loss.zero_()

    def stops_at(self, step: int | None = None) -> int:
        """The step after `step` (default: the last one seen) at which a stop signal takes
        effect: the next one where the run is one process (no rank to agree with), else the
        next log step (the ranks agree there, through the collective `check` makes anyway), or
        the last."""
        step = self.seen if step is None else step
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return min(step + 1, self.total)
        return min((step // self.every + 1) * self.every, self.total)

    def check_due(self, step: int, *, save: Callable[[], None]) -> None:
        """`check` on log steps and the last step, and where a stop signal takes effect
        (`stops_at`); when a stop signal reached any rank, all of them `save()` a checkpoint of
        this step and raise Stopped."""
        due = step % self.every == 0 or step == self.total
        if self.stop.requested and self.stops_at(step - 1) == step:
            due = True
        self.seen = step
        # At the last step a stop request is moot: the run ends and exports as usual.
        if due and self.check(step) and step < self.total:
            save()
            raise Stopped(
                f"stopped by {self.stop.signal_name or 'a signal on another rank'} at step "
                f"{step} of {self.total}: checkpoint saved in {self.out}; rerun the same "
                "command to resume from it (--resume auto)."
            )

    def check(self, step: int) -> bool:
        """Raise NonFiniteError (on every rank alike) if a step since the last check was bad;
        True when a stop was requested on any rank."""
        if step == self.checked:
            return False
        stop = 1.0 if self.stop.requested else 0.0
        first, weight = self.record[0], self.record[1]
        # [min over ranks of the first bad step (via max of its negation), any bad, any stop]
        worst = torch.stack([-first, first.clamp(max=1.0), torch.full_like(first, stop)])
        if dist.is_initialized():
            worst, weight = worst.clone(), weight.clone()
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            dist.all_reduce(weight, op=dist.ReduceOp.SUM)
        neg_first, any_bad, any_stop = worst.tolist()
        weight = float(weight)
        if any_bad:
            raise NonFiniteError(self._message(int(-neg_first), step))
        if weight <= 0:
            raise NonFiniteError(
                f"training stopped at step {step}: steps {self.checked + 1}..{step} had no "
                "target token at all (every sample shorter than two supervised tokens, or no "
                "supervised token within --max-length or a --batch-tokens row?). Nothing was "
                f"saved since; check the cache's supervised tokens (`python -m extract.verify "
                f"{self.data}`), --max-length and --batch-tokens."
            )
        self.record[1].zero_()
        self.checked = step
        return bool(any_stop)

    def _message(self, first: int, step: int) -> str:
        from train.checkpoint import list_checkpoints

        found = list_checkpoints(self.out)
        kept = (
            f"the newest checkpoint, {found[-1][1]}, is from before it and is kept"
            if found
            else "no checkpoint had been saved yet"
        )
        return (
            f"training stopped: the loss or the gradient norm is not finite (NaN or inf) from "
            f"step {first} (seen at step {step}). Nothing was saved after it and no drafter was "
            f"exported; {kept}.\nLikely causes: a damaged cache (run `python -m extract.verify "
            f"{self.data}`), a learning rate too high (--lr, --warmup), or values that overflow "
            "in bf16 (try a smaller --lr or --grad-clip)."
        )
