"""torch.compile settings of a training process: bounded recompiles, and an error (never a
silent fallback to eager) when the bound is hit."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from train.config import TrainConfig

log = logging.getLogger(__name__)


class RecompileLimitError(RuntimeError):
    """torch.compile would recompile once more than allowed (never a silent fallback)."""

    @classmethod
    def hit(cls, limit: int) -> RecompileLimitError:
        return cls(
            f"torch.compile hit its recompile limit ({limit}): some shape or guard changes from "
            "step to step. Raise --recompile-limit, or narrow it down with --compile flex or "
            "--compile none; see TORCH_LOGS=recompiles"
        )


def configure_compile(cfg: TrainConfig) -> None:
    """Bound recompiles and make hitting the bound an error rather than a fall back to eager."""
    if cfg.compile == "none" and cfg.attention == "sdpa":
        return  # nothing is compiled; importing dynamo alone takes seconds
    import torch._dynamo

    dynamo = torch._dynamo.config
    if hasattr(dynamo, "recompile_limit"):
        dynamo.recompile_limit = cfg.recompile_limit
    else:  # torch < 2.6 spelled it cache_size_limit
        dynamo.cache_size_limit = cfg.recompile_limit
    if hasattr(dynamo, "fail_on_recompile_limit_hit"):
        dynamo.fail_on_recompile_limit_hit = True
    elif cfg.compile != "none":
        log.warning("this torch cannot fail on the recompile limit; recompiles are not bounded")
    if cfg.compile == "model":
        import torch._inductor.config as inductor

        # Inductor's coalescing analysis (torch 2.11, "does not yet apply to dynamic shapes")
        # failed an assertion in tiling_utils.get_pw_red_splits when shapes varied; shapes are
        # now fixed, but the analysis stays off until measured without it.
        if hasattr(inductor.triton, "coalesce_tiling_analysis"):
            inductor.triton.coalesce_tiling_analysis = False


@contextlib.contextmanager
def recompile_errors(limit: int) -> Iterator[None]:
    """Turn torch.compile's recompile-limit failure in the block into a RecompileLimitError
    that says what to do."""
    try:
        yield
    except Exception as e:
        dynamo_exc = sys.modules.get("torch._dynamo.exc")
        if dynamo_exc is None or not isinstance(e, dynamo_exc.FailOnRecompileLimitHit):
            raise
        raise RecompileLimitError(
            f"torch.compile hit its recompile limit ({limit}): some shape or guard changes "
            "from step to step. Raise --recompile-limit, or narrow it down with --compile flex "
            "or --compile none; see TORCH_LOGS=recompiles"
        ) from e


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (0 if dynamo never loaded).
    Every micro-batch has one shape, so after the first step this must not grow."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    return int(dynamo_utils.counters["stats"]["unique_graphs"])
