"""Training metrics: device-side sums between log steps, one dict per log step on rank 0.

Sums stay on the device until a log step, where one all-reduce and one host copy turn them
into a dict (the only synchronisation). Rank 0 appends the dict to `metrics.jsonl`, writes it to
TensorBoard when `torch.utils.tensorboard` imports, and at the end plots loss and per-offset
accuracy when matplotlib is installed.
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from shared.dist import all_reduce_sum
from shared.fsio import atomic_write_bytes, atomic_write_text, named, remove_stale_tmp
from train.compiling import compiled_graphs
from train.drafters.dspark_metrics import CALIBRATION_SIZE, auc, ece

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOTS_DIR = "plots"


class StatSums:
    """Running sums of a window of micro-batches: loss terms, per-offset counts, tau terms.
    `first`: the first block offset that drafts (1; 0 for DSpark, whose anchor slot drafts)."""

    def __init__(self, block_size: int, device: torch.device, *, first: int = 1) -> None:
        self.block_size, self.device, self.first = block_size, device, first
        # [weighted_sum, weight_total, accepted_sum, num_blocks, tokens, grad_norm, steps]
        self.scalars = torch.zeros(7, dtype=torch.float64, device=device)
        self.correct = torch.zeros(block_size, dtype=torch.float64, device=device)
        self.count = torch.zeros(block_size, dtype=torch.float64, device=device)
        # DFlash2's selector (zero for DFlash; same size on every rank, so one all-reduce):
        # [micro-batches with a selector, selected accepted_sum, ce_base_sum, selector_ce_sum,
        #  selector_weight, selected correct per offset x block_size]
        self.selected = torch.zeros(5 + block_size, dtype=torch.float64, device=device)
        # DSpark's (zero for the others): [micro-batches with a target's distribution, ce_sum,
        #  l1_sum, conf_sum, accepted_prob_sum, L1 per slot x block_size, calibration sums]
        self.dspark = torch.zeros(
            5 + block_size + CALIBRATION_SIZE, dtype=torch.float64, device=device
        )
        # A DFlash loss other than the plain CE (train/drafters/target_loss.py; zero otherwise):
        # [sum w, sum w ce, sum w kl, sum w tv] with the slot weights it used.
        self.objective = torch.zeros(4, dtype=torch.float64, device=device)

    def add(
        self,
        weighted_sum: torch.Tensor,
        weight_total: torch.Tensor,
        stats: dict[str, torch.Tensor],
        tokens: torch.Tensor,
    ) -> None:
        """One micro-batch (no synchronisation: all on the device)."""
        s = self.scalars
        s[0] += weighted_sum.detach().double()
        s[1] += weight_total.detach().double()
        s[2] += stats["accepted_sum"].double()
        s[3] += stats["num_blocks"].double()
        s[4] += tokens.double()
        self.correct += stats["correct_per_offset"].double()
        self.count += stats["count_per_offset"].double()
        if "selected_accepted_sum" in stats:
            keys = ("selected_accepted_sum", "ce_base_sum", "selector_ce_sum", "selector_weight")
            self.selected[0] += 1
            self.selected[1:5] += torch.stack([stats[k].double() for k in keys])
            self.selected[5:] += stats["selected_correct_per_offset"].double()
        if "l1_per_slot" in stats:
            keys = ("has_target", "ce_sum", "l1_sum", "conf_sum", "accepted_prob_sum")
            self.dspark[:5] += torch.stack([stats[k].detach().double() for k in keys])
            self.dspark[5 : 5 + self.block_size] += stats["l1_per_slot"].double()
            self.dspark[5 + self.block_size :] += stats["calibration"].double()
        if "objective_terms" in stats:
            self.objective += stats["objective_terms"].detach().double()

    def add_step(self, grad_norm: torch.Tensor) -> None:
        self.scalars[5] += grad_norm.detach().double()
        self.scalars[6] += 1

    def reduce(self) -> dict[str, Any]:
        """Sum over ranks, copy to the host, summarise, reset. Every rank must call it."""
        parts = [self.scalars, self.correct, self.count, self.selected, self.dspark, self.objective]
        values = all_reduce_sum(torch.cat(parts)).tolist()
        for part in parts:
            part.zero_()
        size = 7 + 2 * self.block_size + 5 + self.block_size
        weight, *sums = values[-4:]
        terms = {k: v / max(weight, 1e-30) for k, v in zip(OBJECTIVE_KEYS, sums, strict=True)}
        return {
            **summarise(values[:size], self.block_size, first=self.first),
            **summarise_dspark(values[size:-4], values, self.block_size),
            **(terms if weight > 0 else {}),
        }


SELECTOR_KEYS = ("selected_tau", "selected_acc", "ce_base", "selector_ce", "selector_coverage")
DSPARK_KEYS = ("ce", "l1", "conf", "accept_prob", "tau_prob", "conf_ece", "conf_auc")
# A DFlash loss other than the plain CE: each term's mean over the slot weights it used.
OBJECTIVE_KEYS = ("ce", "kl", "tv")
# The family-specific keys a metrics record carries beside loss, tau and acc.
EXTRA_KEYS = SELECTOR_KEYS + DSPARK_KEYS + ("kl", "tv")


def summarise_dspark(sums: list[float], values: list[float], block_size: int) -> dict[str, Any]:
    """DSpark's terms (each a mean over the weight), the acceptance probability 1 - L1/2 per
    slot, tau_prob, and the confidence calibration (`train.drafters.dspark_metrics`); only the
    CE without the target's distribution (`--dspark-loss ce`); {} for the other families."""
    wt, blocks = values[1], values[3]
    count = values[7 + block_size : 7 + 2 * block_size]
    if wt <= 0 or not any(count[:1]):
        return {}
    has_target, ce, l1, conf, accepted = sums[:5]
    out: dict[str, Any] = {"ce": ce / wt}
    if has_target <= 0:
        return out
    l1_slots, calibration = sums[5 : 5 + block_size], sums[5 + block_size :]
    out["l1"], out["conf"] = l1 / wt, conf / wt
    out["accept_prob"] = [
        1.0 - 0.5 * s / n if n > 0 else math.nan for s, n in zip(l1_slots, count, strict=True)
    ]
    out["tau_prob"] = 1.0 + accepted / blocks if blocks > 0 else math.nan
    if any(calibration):
        out["conf_ece"], out["conf_auc"] = ece(calibration), auc(calibration)
    return out


def _summarise_selected(values: list[float], block_size: int) -> dict[str, Any]:
    """DFlash2's selected-token tau and accuracy per offset, the two CE terms (each a mean over
    its own weight) and the fraction of weight whose data token is among the candidates."""
    base = 7 + 2 * block_size
    if len(values) < base + 5 + block_size or values[base] <= 0:
        return {}
    wt, blocks = values[1], values[3]
    count = values[7 + block_size : base]
    _, accepted, ce_base, ce_sel, sel_weight = values[base : base + 5]
    correct = values[base + 5 : base + 5 + block_size]
    return {
        "selected_tau": 1.0 + accepted / blocks if blocks > 0 else math.nan,
        "selected_acc": [
            c / n if n > 0 else math.nan for c, n in zip(correct[1:], count[1:], strict=True)
        ],
        "ce_base": ce_base / wt if wt > 0 else math.nan,
        "selector_ce": ce_sel / sel_weight if sel_weight > 0 else math.nan,
        "selector_coverage": sel_weight / wt if wt > 0 else math.nan,
    }


def summarise(values: list[float], block_size: int, *, first: int = 1) -> dict[str, Any]:
    """Loss, tau and accuracy per drafting block offset (`first`..B-1: the k-th draft at
    index k - 1) from packed sums (see StatSums); with a DFlash2 selector also SELECTOR_KEYS."""
    ws, wt, accepted, blocks, tokens, gnorm, steps = values[:7]
    correct = values[7 : 7 + block_size][first:]
    count = values[7 + block_size : 7 + 2 * block_size][first:]
    return {
        **_summarise_selected(values, block_size),
        "loss": ws / wt if wt > 0 else math.nan,
        "tau": 1.0 + accepted / blocks if blocks > 0 else math.nan,
        "acc": [c / n if n > 0 else math.nan for c, n in zip(correct, count, strict=True)],
        "tokens": tokens,
        "grad_norm": gnorm / steps if steps > 0 else math.nan,
        "steps": int(steps),
    }


def train_record(
    summary: dict[str, Any],
    *,
    step: int,
    epoch: int,
    lr: float,
    elapsed: float,
    waited: float,
    device: torch.device,
) -> dict[str, Any]:
    """The record of one training log window: `summary` (`StatSums.reduce`) over `elapsed`
    seconds, `waited` of them waiting for data."""
    record = {
        "kind": "train",
        "step": step,
        "epoch": epoch,
        "loss": summary["loss"],
        "tau": summary["tau"],
        "acc": summary["acc"],
        "lr": lr,
        "grad_norm": summary["grad_norm"],
        "tokens_per_s": summary["tokens"] / elapsed,
        "step_ms": 1e3 * elapsed / max(summary["steps"], 1),
        "data_wait": waited / elapsed,
        "compiled_graphs": compiled_graphs(),
        **{key: summary[key] for key in EXTRA_KEYS if key in summary},
    }
    if device.type == "cuda":
        record["peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return record


class MetricsWriter:
    """Rank 0's sink: metrics.jsonl, optional TensorBoard, plots at the end."""

    def __init__(self, run_dir: Path, *, enabled: bool) -> None:
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.history: list[dict[str, Any]] = []
        self.tb = None
        if not enabled:
            return
        self.path = self.run_dir / METRICS_FILE
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.debug("tensorboard is not installed: metrics go to %s only", METRICS_FILE)
        else:
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def rewind(self, step: int, *, last: bool = False) -> None:
        """Drop records after `step` (logged by a run that died before its next checkpoint),
        so a resumed run's log has each step once. `last`: `step` is the run's last, whose
        evaluation follows its checkpoint and runs again on a resume, so its record goes too.
        TensorBoard's events from `purge` on are purged from what it shows (the last step's
        too, with its eval), and the kept records from there are written to it again."""
        purge = step if last else step + 1
        if self.tb is not None:
            tensorboard = type(self.tb)
            self.tb.close()
            self.tb = tensorboard(self.tb.log_dir, purge_step=purge)
        if not self.enabled or not self.path.is_file():
            return
        lines = self.path.read_text(errors="replace").splitlines()
        read = [(line, _record(line)) for line in lines]  # a torn last line: None

        def keep(r: dict[str, Any] | None) -> bool:
            if r is None or r["step"] > step:
                return False
            return not (last and r["step"] == step and r.get("kind") == "eval")

        kept = [(line, r) for line, r in read if keep(r)]
        if len(kept) < len(lines):
            atomic_write_text(self.path, "".join(line + "\n" for line, _ in kept))
        self.history = [r for _, r in kept]
        for r in self.history:
            if r["step"] >= purge:
                self._to_tensorboard(r)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        try:
            with open(self.path, "a") as f:
                f.write(json_line(record) + "\n")
        except OSError as e:  # a write's error names no file: a full disk's message should
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self._to_tensorboard(record)

    def _to_tensorboard(self, record: dict[str, Any]) -> None:
        if self.tb is not None:
            prefix = "eval/" if record.get("kind") == "eval" else "train/"
            for key, value in record.items():
                if key in ("step", "kind", "epoch"):
                    continue
                if isinstance(value, list):  # a null (re-read: no target there) is not drawn
                    for k, v in enumerate(value, start=1):
                        if isinstance(v, (int, float)):
                            self.tb.add_scalar(f"{prefix}{key}/offset_{k}", v, record["step"])
                elif isinstance(value, (int, float)):
                    self.tb.add_scalar(prefix + key, value, record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            self.tb.close()
        plot_metrics(self.history, self.run_dir / PLOTS_DIR)


def json_line(record: dict[str, Any]) -> str:
    """One metrics.jsonl line, strict JSON: a figure with nothing to average in its window (NaN,
    e.g. `selector_ce` when no data token was a candidate) is written as null.

    >>> json_line({"step": 3, "loss": 1.5, "selector_ce": math.nan, "acc": [0.5, math.nan]})
    '{"step": 3, "loss": 1.5, "selector_ce": null, "acc": [0.5, null]}'
    """
    return json.dumps(_finite_or_none(record), allow_nan=False)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def plot_metrics(history: list[dict[str, Any]], out_dir: Path) -> None:
    """loss.png (train and eval loss by step) and accuracy.png (last accuracy per offset)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: skipping the plots")
        return
    train = [r for r in history if r.get("kind") == "train"]
    evals = [r for r in history if r.get("kind") == "eval"]
    if not train:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(out_dir)  # an image a killed run was writing
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend()
    _save_figure(fig, out_dir / "loss.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, records in (("train", train), ("eval", evals)):
        if records:
            acc = records[-1]["acc"]
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"{name} @ {records[-1]['step']}")
    ax.set(xlabel="block offset k", ylabel="accuracy", title="accuracy per block offset")
    ax.legend()
    _save_figure(fig, out_dir / "accuracy.png")
    plt.close(fig)


def _save_figure(fig: Any, path: Path) -> None:
    """A PNG written atomically (a run killed there leaves the old image or none, never a part
    of one), an error naming the file (a full disk's message says which)."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    try:
        atomic_write_bytes(path, png.getvalue())
    except OSError as e:
        raise named(e, path) from None


def _record(line: str) -> dict[str, Any] | None:
    """A metrics line's record; None for one a killed run left half-written.

    >>> _record('{"step": 3, "loss": 1.5}'), _record('{"step": 4, "lo')
    ({'step': 3, 'loss': 1.5}, None)
    """
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
