"""What a DFlash drafter's loss is: the term per slot and the weight of each block offset.

Torch-free, so that `python -m train --help` (train/config.py) reads the names without importing
torch; the tensors are in train/drafters/target_loss.py and train/drafters/anchors.py.

Per slot n, with q = softmax(drafter logits), y the data token and p = softmax(lm_head(the
target's last hidden state of the row before)), the target's own distribution for that token:

    ce   -log q[y]
    kl   KL(p || q) = sum_v p_v (log p_v - log q_v)
    tv   (1/2) sum_v |q_v - p_v|                       (the total variation distance)
    mix  (1 - kl_weight) ce + kl_weight kl

Slot weights (offset k of a block, counted slots only): exp, exp(-(k - 1) / gamma) (the DFlash
recipe); uniform, 1; dpace, speculators' D-PACE (speculators 0.9.0,
`speculators.losses.utils.dpace_loss_decay`): with c_k = (1 - alpha) exp(-ce_k) + alpha the
smoothed confidence of counted slot k (1 on a slot that does not count), w_k = sum_{j >= k}
prod_{i <= j} c_i over counted j, detached: the weight of slot k in the expected accepted length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOSSES = ("ce", "kl", "tv", "mix")
# The losses that compare with the target's distribution: the cache must hold its last layer.
TARGET_LOSSES = ("kl", "tv", "mix")
SLOT_WEIGHTS = ("exp", "uniform", "dpace")


@dataclass(frozen=True)
class Objective:
    """A DFlash drafter's loss: its kind (LOSSES), the KL weight of "mix", the slot weights
    (SLOT_WEIGHTS) and D-PACE's smoothing alpha.

    >>> Objective("mix", kl_weight=0.25).coefficients, Objective("tv").needs_target
    ((0.75, 0.25, 0.0), True)
    """

    loss: str = "ce"
    kl_weight: float = 0.5
    slot_weights: str = "exp"
    dpace_alpha: float = 0.5

    def __post_init__(self) -> None:
        _check(self.loss in LOSSES, "loss", f"must be one of {LOSSES}, got {self.loss!r}")
        _check(
            self.slot_weights in SLOT_WEIGHTS,
            "slot_weights",
            f"must be one of {SLOT_WEIGHTS}, got {self.slot_weights!r}",
        )
        _check(0 <= self.kl_weight <= 1, "kl_weight", f"must be in [0, 1], got {self.kl_weight}")
        _check(
            0 < self.dpace_alpha <= 1, "dpace_alpha", f"must be in (0, 1], got {self.dpace_alpha}"
        )
        _check(
            self.slot_weights != "dpace" or self.loss == "ce",
            "slot_weights",
            "dpace weighs each slot by the drafter's confidence in the data token: --loss ce only",
        )

    @classmethod
    def of(cls, cfg: Any) -> Objective:
        """The objective of a TrainConfig's options, checked against its drafter type and
        --gamma; ValueError naming the field."""
        objective = cls(
            loss=cfg.loss,
            kl_weight=cfg.kl_weight,
            slot_weights=cfg.slot_weights,
            dpace_alpha=cfg.dpace_alpha,
        )
        _check(
            objective.loss == "ce" or cfg.drafter_type == "dflash",
            "loss",
            "applies to --drafter-type dflash (dspark trains toward the target's distribution "
            "with --dspark-loss full; dflash2 trains on CE)",
        )
        _check(
            objective.slot_weights != "dpace" or cfg.drafter_type == "dflash",
            "slot_weights",
            "dpace applies to --drafter-type dflash",
        )
        _check(
            cfg.gamma is None or objective.slot_weights == "exp",
            "gamma",
            "applies to --slot-weights exp only",
        )
        return objective

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """The (ce, kl, tv) terms' weights in the loss of a slot."""
        return {
            "ce": (1.0, 0.0, 0.0),
            "kl": (0.0, 1.0, 0.0),
            "tv": (0.0, 0.0, 1.0),
            "mix": (1.0 - self.kl_weight, self.kl_weight, 0.0),
        }[self.loss]

    @property
    def needs_target(self) -> bool:
        """Whether the loss reads the target's distribution (the cache's last layer)."""
        return self.loss in TARGET_LOSSES

    @property
    def plain_ce(self) -> bool:
        """Whether this is the CE with fixed slot weights: train/drafters/loss.py's path."""
        return self.loss == "ce" and self.slot_weights != "dpace"


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
