"""The drafter, cache files, trainer and micro-batches the training benchmarks share.

`make_trainer` builds the product's `Trainer` (train/loop.py) for a 5-layer drafter of a shape
from bench/shapes.py (hidden, intermediate, heads and vocabulary from the target config, default
capture layers), loading random target heads that `write_target_files` puts where a cache keeps
them. `random_items` and `feed` make micro-batches as the trainer's loader hands them over, for
`Trainer.prepare`. `add_drafter_args` and `finish_args` are the options of every such benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# The benchmarks run as scripts from bench/, so the project root is not on the path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES  # noqa: E402

from extract.target import build_target_layer_ids  # noqa: E402
from shared.dist import RankInfo  # noqa: E402
from shared.fsio import atomic_write_json  # noqa: E402
from shared.target_files import EMBED_FILE, EMBED_KEY, LM_HEAD_KEY, target_dir  # noqa: E402
from train.compiling import configure_compile  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data.catalog import PartInfo  # noqa: E402
from train.drafters.anchors import default_gamma  # noqa: E402
from train.drafters.config import DSPARK_BLOCK_SIZE, DrafterConfig  # noqa: E402
from train.drafters.objective import LOSSES, TARGET_LOSSES  # noqa: E402
from train.loop import Trainer  # noqa: E402
from train.options import OPTIMIZERS  # noqa: E402
from train.prepared import Prepared  # noqa: E402
from train.run import resolve_devices  # noqa: E402

DRAFTER_LAYERS = 5
# The shapes have no tokenizer: the last rows of the embedding count as unused, so a shape
# without a family mask token (tiny) takes the first of them.
SPARE_ROWS = 64
# --seq-len / --anchors defaults: the DESIGN figures' setting, and a CPU-sized one for the tiny
# shapes (sdpa's dense mask and scores at 3072 x 8192 would take minutes on two cores).
SEQ_DEFAULTS = {"tiny": (256, 32), "tiny-hybrid": (256, 32)}
REAL_SEQ_DEFAULT = (3072, 512)
DEFAULT_WORKDIR = Path(os.environ.get("BENCH_WORKDIR", "/tmp/dflash-bench"))


def seq_defaults(shape: str) -> tuple[int, int]:
    """(sequence length, anchors) used when the options are left out."""
    return SEQ_DEFAULTS.get(shape, REAL_SEQ_DEFAULT)


def drafter_config(
    shape: str,
    *,
    num_layers: int = DRAFTER_LAYERS,
    drafter_type: str = "dflash",
    block_size: int | None = None,
) -> DrafterConfig:
    """The drafter the product would build for a target of `shape` (default capture layers).
    A dflash2 drafter keeps DFlash's attention (all full) so that a comparison of the two
    times the DFlash2 additions alone. `block_size`: default 16 (dspark: its released 7)."""
    target = SHAPES[shape]
    return DrafterConfig.from_target_config(
        target,
        num_layers=num_layers,
        target_layer_ids=build_target_layer_ids(target["num_hidden_layers"], 5),
        block_size=block_size or (DSPARK_BLOCK_SIZE if drafter_type == "dspark" else 16),
        tokenizer_vocab_size=target["vocab_size"] - SPARE_ROWS,
        drafter_type=drafter_type,
        layer_types=("full_attention",) * num_layers,
        is_causal=None,
    )


def write_target_files(cache: Path, shape: str, device: torch.device) -> None:
    """`cache/target/`: the shape's config.json and random bf16 embedding and lm_head, which is
    what the trainer loads from a cache. Written once per shape and reused."""
    folder = target_dir(cache)
    config = folder / "config.json"
    if (folder / EMBED_FILE).is_file() and config.is_file():
        if json.loads(config.read_text()) == SHAPES[shape]:
            return
    folder.mkdir(parents=True, exist_ok=True)
    target = SHAPES[shape]
    shape_VH = (target["vocab_size"], target["hidden_size"])
    heads = {
        key: (0.02 * torch.randn(shape_VH, device=device, dtype=torch.bfloat16)).cpu()
        for key in (EMBED_KEY, LM_HEAD_KEY)
    }
    tmp = folder / (EMBED_FILE + ".tmp")
    save_file(heads, str(tmp))
    os.replace(tmp, folder / EMBED_FILE)
    atomic_write_json(config, target)


def make_trainer(
    shape: str,
    cache: Path,
    parts: Sequence[PartInfo],
    *,
    device: torch.device,
    attention: str | None,
    compile: str | None,
    steps: int,
    seq_len: int,
    anchors: int,
    batch_tokens: int,
    workers: int | None = 0,
    grad_ckpt: str | None = None,
    ce: str | None = None,
    ce_chunk_blocks: int | None = None,
    drafter_type: str = "dflash",
    block_size: int | None = None,
    loss: str | None = None,
    optimizer: str | None = None,
) -> Trainer:
    """The product's trainer for one process and device, after `configure_compile`; the
    caller hands it micro-batches with `Trainer.prepare`, which also wraps the model. A dspark
    trainer, or one with a `loss` against the target's distribution, reads one more cached layer,
    the target's last (`random_items` makes it)."""
    drafter = drafter_config(shape, drafter_type=drafter_type, block_size=block_size)
    cfg = TrainConfig(
        data=cache,
        out=cache / "run",
        drafter_type=drafter_type,
        attention=attention,
        compile=compile,
        steps=steps,
        workers=workers,
        **({"grad_ckpt": grad_ckpt} if grad_ckpt else {}),
        **({"ce": ce} if ce else {}),
        **({"ce_chunk_blocks": ce_chunk_blocks} if ce_chunk_blocks else {}),
        **({"loss": loss} if loss else {}),
        **({"optimizer": optimizer} if optimizer else {}),
        batch_tokens=batch_tokens,
        max_length=seq_len,
        num_anchors=anchors,
        block_size=drafter.block_size,
        eval_every=0,
        log_every=steps,
        checkpoint_every=steps,
        resume="none",
    )
    cfg = resolve_devices(cfg, device.type)
    configure_compile(cfg)
    prep = Prepared(
        drafter=drafter,
        parts=tuple(parts),
        train_lengths=tuple(p.lengths for p in parts),
        eval_lengths=tuple((0,) * len(p.lengths) for p in parts),
        layers=tuple(range(cached_layers(drafter, loss))),
        gamma=default_gamma(drafter.block_size, anchor_predicts=drafter.anchor_predicts),
    )
    info = RankInfo(rank=0, world_size=1, local_rank=0, device=device)
    return Trainer(info, cfg, prep)


def cached_layers(cfg: DrafterConfig, loss: str | None = None) -> int:
    """Layers a micro-batch holds: the taps, and for DSpark or a `loss` against the target's
    distribution the target's last hidden state."""
    return cfg.num_context_layers + int(cfg.drafter_type == "dspark" or loss in TARGET_LOSSES)


def prompt_mask(batch: int, seq_len: int) -> torch.Tensor:
    """loss_mask [B, S]: an unsupervised prompt (the first eighth), then supervised tokens."""
    mask_BS = torch.ones(batch, seq_len, dtype=torch.uint8)
    mask_BS[:, : seq_len // 8] = 0
    return mask_BS


def random_items(
    cfg: DrafterConfig,
    *,
    count: int,
    batch: int,
    seq_len: int,
    device: torch.device,
    loss: str | None = None,
) -> list[dict[str, Any]]:
    """`count` collated micro-batches (the loader's item dicts) with random ids and hidden
    states, already on `device`."""
    gen = torch.Generator().manual_seed(0)
    shape_BSKH = (batch, seq_len, cached_layers(cfg, loss), cfg.hidden_size)
    items = []
    for n in range(count):
        ids_BS = torch.randint(0, cfg.mask_token_id, (batch, seq_len), generator=gen)
        items.append(
            {
                "real": True,
                "anchor_seed": n,
                "ids": ids_BS.to(device),
                "loss_mask": prompt_mask(batch, seq_len).to(device),
                # each row one sample of seq_len tokens: a packed row with no padding
                "doc_ids": torch.zeros(batch, seq_len, dtype=torch.int32, device=device),
                "positions": torch.arange(seq_len, dtype=torch.int32, device=device).expand(
                    batch, seq_len
                ),
                "tokens": torch.tensor(batch * seq_len, device=device),
                "hidden": torch.randn(shape_BSKH, dtype=torch.bfloat16, device=device),
            }
        )
    return items


def feed(trainer: Trainer, items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Items as the trainer's loader would hand them: stamped with the epoch it expects (read
    as each item is taken, so the stamp follows the trainer's loader state)."""
    for item in items:
        yield {**item, "epoch": trainer.loader_state.epoch}


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """Options shared by the benchmarks that time drafter training steps."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--drafter-type", choices=("dflash", "dflash2", "dspark"), default="dflash")
    p.add_argument(
        "--block-size", type=int, default=None, help="default 16 (dspark: 7, its released block)"
    )
    p.add_argument("--attention", choices=("sdpa", "flex"), default=None, help="default: product")
    p.add_argument("--compile", choices=("none", "flex", "model"), default=None)
    p.add_argument("--grad-ckpt", choices=("none", "loss", "layers"), default=None)
    p.add_argument("--ce", choices=("fused", "autograd"), default=None, help="default: product")
    p.add_argument("--ce-chunk-blocks", type=int, default=None, help="default: product")
    p.add_argument("--loss", choices=LOSSES, default=None, help="DFlash's loss; default: product")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: product")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (>= 1)")
    p.add_argument("--seq-len", type=int, default=None, help="default 3072 (tiny: 256)")
    p.add_argument("--anchors", type=int, default=None, help="default 512 (tiny: 32)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--json", type=Path, default=None)


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    seq, anchors = seq_defaults(args.shape)
    args.seq_len = args.seq_len or seq
    args.anchors = args.anchors or anchors
    args.warmup = max(args.warmup, 1)
    return args
