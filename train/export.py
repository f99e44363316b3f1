"""Export a trained drafter as the folder SGLang, vLLM and the reference packages load.

`config.json` is a Qwen3 config with `architectures: ["DFlashDraftModel"]` (or
`["DFlash2DraftModel"]`, its fields inside `dflash_config`) plus the DFlash fields;
`model.safetensors` holds exactly `export_keys(cfg)` in bf16 with `export_shapes(cfg)`. No
embedding, no lm_head, no `auto_map`. A DSpark drafter goes out in DeepSpec's dense format
instead (train/export_dspark.py: `Qwen3DSparkModel`, its fields at the top level, the target's
embedding and lm_head shipped). SGLang ignores unknown weight names silently (a DFlash2 selector
then degrades to top-1 without an error), so names and shapes are checked both ways. Every
family's config.json also names the target its training cache was extracted from
(`target_identity`: its path, both hashes and model type; `train.export_hf.TARGET_KEY`), which
the engines ignore and the proof commands compare with their `--target`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import click
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from shared.fsio import public_modes, replace_dir, unwritable_reason
from shared.lock import pid_alive
from shared.space import is_disk_full, size_text
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.export_dspark import HEAD_KEYS, dspark_keys, dspark_shapes, export_heads
from train.export_hf import (  # noqa: F401 (train.export's API too)
    DFLASH_FIELDS,
    config_from_hf,
    hf_config,
    missing_fields,
)

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # not "__main__" under -m

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def EXPORT_KEYS(num_layers: int) -> tuple[str, ...]:  # noqa: N802 (name fixed by the API)
    """The exact weight names of an exported drafter with `num_layers` layers.

    >>> len(EXPORT_KEYS(2)), EXPORT_KEYS(1)[:3]
    (25, ('fc.weight', 'hidden_norm.weight', 'norm.weight'))
    """
    per_layer = tuple(f"layers.{i}.{key}" for i in range(num_layers) for key in _LAYER_KEYS)
    return ("fc.weight", "hidden_norm.weight", "norm.weight", *per_layer)


_CONV_KEYS = tuple(
    f"{conv}.{key}"
    for conv in ("attention_conv", "mlp_conv")
    for key in ("base_kernel", "kernel_projection.weight")
)
_SELECTOR_KEYS = tuple(
    f"candidate_selector.{key}"
    for key in ("hidden_projection.weight", "predecessor_codebook", "successor_codebook")
)


def export_keys(cfg: DrafterConfig) -> tuple[str, ...]:
    """The exact weight names of an export of `cfg`'s type (DFlash2: 15 L + 6 tensors; DSpark:
    11 L + 5, its heads and the target's embedding and lm_head).

    The codebooks have no `.weight` suffix, as in the public DFlash2 checkpoints.
    """
    keys = EXPORT_KEYS(cfg.num_layers)
    if cfg.drafter_type == "dspark":
        return (*keys, *dspark_keys(cfg))
    if cfg.drafter_type != "dflash2":
        return keys
    conv = tuple(f"layers.{i}.{key}" for i in range(cfg.num_layers) for key in _CONV_KEYS)
    return (*keys, *conv, *_SELECTOR_KEYS)


def export_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every export key."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if cfg.drafter_type == "dflash2":
        taps, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
        for conv in ("attention_conv", "mlp_conv"):
            layer[f"{conv}.base_kernel"] = (2, taps, h)
            layer[f"{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    shapes = {"fc.weight": (h, cfg.num_context_layers * h), "hidden_norm.weight": (h,)}
    shapes["norm.weight"] = (h,)
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{key}": shape for key, shape in layer.items()})
    if cfg.drafter_type == "dspark":
        shapes.update(dspark_shapes(cfg))
    if cfg.drafter_type == "dflash2":
        r, v = cfg.selector_rank, cfg.vocab_size
        shapes["candidate_selector.hidden_projection.weight"] = (r, h)
        shapes["candidate_selector.predecessor_codebook"] = (v, r)
        shapes["candidate_selector.successor_codebook"] = (v, r)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> None:
    """Raise ValueError naming unknown and missing weight names and wrong shapes."""
    check_shapes({name: tuple(t.shape) for name, t in tensors.items()}, cfg)


def check_shapes(shapes: dict[str, tuple[int, ...]], cfg: DrafterConfig) -> None:
    """`check_tensors` on the weights' names and shapes alone."""
    check_keys(list(shapes), cfg)
    expected = export_shapes(cfg)
    wrong = [
        f"{name} {shape} (expected {expected[name]})"
        for name, shape in sorted(shapes.items())
        if shape != expected[name]
    ]
    if wrong:
        raise ValueError(f"drafter weight shapes differ from the export: {wrong}")


def check_keys(keys: set[str] | list[str], cfg: DrafterConfig | int) -> None:
    """Raise ValueError naming unknown and missing weight names (`cfg`: a config, or a DFlash
    drafter's layer count)."""
    names = EXPORT_KEYS(cfg) if isinstance(cfg, int) else export_keys(cfg)
    expected, got = set(names), set(keys)
    unknown, missing = sorted(got - expected), sorted(expected - got)
    if unknown or missing:
        raise ValueError(
            f"drafter weight names differ from the export keys: unknown {unknown}, "
            f"missing {missing}"
        )


def sort_target_layers(
    state: dict[str, torch.Tensor], cfg: DrafterConfig
) -> tuple[dict[str, torch.Tensor], DrafterConfig]:
    """The same drafter with ascending `target_layer_ids`: `fc.weight`'s column blocks (one of
    width H per target layer, in `target_layer_ids` order) permuted to match.

    SGLang and vLLM concatenate the captured states in layer order whatever the list says, so
    only an ascending export gets each block the features it was trained on. The drafter's
    outputs are unchanged when its context input is permuted the same way.
    """
    ids = list(cfg.target_layer_ids)
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order == list(range(len(ids))):
        return state, cfg
    fc = state["fc.weight"]
    blocks = fc.view(fc.shape[0], len(ids), cfg.hidden_size)[:, order]
    state = {**state, "fc.weight": blocks.reshape(fc.shape).contiguous()}
    new_cfg = dataclasses.replace(cfg, target_layer_ids=tuple(ids[i] for i in order))
    log.info(
        "target layers %s exported in ascending order %s (fc columns permuted to match)",
        ids,
        list(new_cfg.target_layer_ids),
    )
    return state, new_cfg


def export_drafter(
    drafter: DFlashDrafter,
    cfg: DrafterConfig,
    out_dir: str | Path,
    *,
    heads: tuple[torch.Tensor, torch.Tensor] | None = None,
    target: dict[str, Any] | None = None,
) -> Path:
    """Write config.json and bf16 model.safetensors into `out_dir` atomically; return it.

    Target layer ids are written ascending (`sort_target_layers`). `heads`: the target's
    (embedding, lm_head), which a DSpark export ships. `target`: the `target_record` of the
    cache the drafter trained on, which config.json records (None: it records none). The files
    are written into a temporary sibling folder that is renamed to `out_dir` (an earlier export
    there is replaced; any other folder or file is refused, `refuse_foreign_out`), so readers
    never see a half-written export.
    """
    out = Path(out_dir)
    refuse_foreign_out(out)
    state = dict(drafter.state_dict())
    if cfg.drafter_type == "dspark":
        if heads is None:
            raise ValueError("a DSpark export ships the target's embedding and lm_head: give heads")
        state.update(zip(HEAD_KEYS, heads, strict=True))
    check_tensors(state, cfg)
    state, cfg = sort_target_layers(state, cfg)
    # clone: tied heads are one tensor, and safetensors refuses two names for one storage
    tensors = {
        key: state[key].detach().to("cpu", torch.bfloat16).clone().contiguous()
        for key in export_keys(cfg)
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    _drop_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        _save_weights(tensors, tmp / WEIGHTS_FILE, named=out / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config(cfg, target=target), indent=2) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            _fsync_file(tmp / name)
        public_modes(tmp)  # a serving process often runs as another user
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out  # said by the caller: the CLI on stdout, training in its log


def _save_weights(tensors: dict[str, torch.Tensor], path: Path, *, named: Path) -> None:
    """save_file, its I/O errors (a full disk: SafetensorError "... (os error 28)") raised as
    the OSError they are, naming the file (`named`) that the error message shows."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        if not (code := re.search(r"\(os error (\d+)\)", str(e))):
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(named)) from None


def _drop_leftovers(out: Path) -> None:
    """What an export killed before its rename left beside `out`: its temporary folders (those
    of a process still running are its own, and kept), and the earlier export renamed to
    `.old` while the new one took its name (export files only): put back where `out` is
    missing, else deleted."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.removeprefix(f".{out.name}.tmp-").split("-")[0]
        if tmp.is_dir() and not tmp.is_symlink() and not (pid.isdigit() and pid_alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)
    old = out.with_name(out.name + ".old")
    if old.is_dir() and {p.name for p in old.iterdir()} <= {CONFIG_FILE, WEIGHTS_FILE}:
        if out.exists() or out.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, out)


def refuse_foreign_out(out: Path) -> None:
    """ValueError unless `out` is absent, an empty folder or an earlier export (its config and
    weights only): an export replaces its folder whole, so any other folder or file there (a
    cache, a run, the working directory) would be deleted."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ValueError(f"export folder {out}: a file is there; give a new folder")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in (CONFIG_FILE, WEIGHTS_FILE))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ValueError(
            f"export folder {out} holds other files than an export ({shown}): an export replaces "
            "its folder whole, so give a new or empty folder (or an earlier export to replace)"
        )


def export_bytes(
    drafter: DFlashDrafter, cfg: DrafterConfig, heads: tuple[torch.Tensor, ...] | None = None
) -> int:
    """The bytes of the weights `export_drafter` writes (bf16): the drafter's exported tensors,
    and a DSpark export's embedding and lm_head (`heads`) with them."""
    state = dict(drafter.state_dict())
    if cfg.drafter_type == "dspark" and heads is not None:
        state.update(zip(HEAD_KEYS, heads, strict=True))
    return sum(2 * state[key].nelement() for key in export_keys(cfg) if key in state)


def export_if_room(
    drafter: DFlashDrafter,
    cfg: DrafterConfig,
    out_dir: str | Path,
    *,
    heads: tuple[torch.Tensor, torch.Tensor] | None = None,
    target: dict[str, Any] | None = None,
) -> str:
    """Export when the last checkpoint did not fit on the disk: the export (bf16 weights, no
    optimizer state) is several times smaller. Returns a sentence saying whether it was
    written; raises any error that is not a full disk."""
    need = export_bytes(drafter, cfg, heads) + (1 << 20)
    try:
        out = export_drafter(drafter, cfg, out_dir, heads=heads, target=target)
    except (OSError, SafetensorError) as e:
        if not is_disk_full(e, Path(out_dir).parent, need):
            raise
        return f"The export ({size_text(need)}) was not written either."
    return f"The drafter as trained to the last step was exported to {out}."


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--cache",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="DSpark: the cache whose target embedding and lm_head the export ships; default the "
    "cache the checkpoint was trained on",
)
def main(checkpoint: Path, out_dir: Path, cache: Path | None) -> None:
    """Export the drafter of CHECKPOINT (a `runs/NAME/checkpoints/step-N` folder) of any family
    (DFlash, DFlash2, DSpark) to OUT_DIR in the format the serving engines load."""
    from shared.logs import setup_logging
    from train.checkpoint import load_drafter, read_meta

    setup_logging()
    if problem := unwritable_reason(out_dir):
        raise click.ClickException(f"export folder {out_dir}: {problem}")
    try:
        drafter, cfg = load_drafter(checkpoint)
        target = read_meta(checkpoint).get("target")  # none in a checkpoint older than it
        heads = None
        if cache is not None and cfg.drafter_type != "dspark":
            raise ValueError(
                f"--cache has no effect: {checkpoint} holds a {cfg.drafter_type} drafter, and "
                "only a DSpark drafter's export reads the cache (for its heads); drop it"
            )
        if cfg.drafter_type == "dspark":
            heads = export_heads(checkpoint, cache)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    try:
        out = export_drafter(drafter, cfg, out_dir, heads=heads, target=target)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:  # e.g. OUT_DIR /proc/x as root: its temporary sibling cannot be made
        why = e.strerror or e
        raise click.ClickException(f"export folder {out_dir}: cannot write it ({why})") from None
    click.echo(f"exported to {out}")


if __name__ == "__main__":
    main()
