"""Reading an exported drafter folder back (`train.export` writes it): its config, a header-only
check of its weights, and the drafter loaded from it. Speculative decoding, warm starts and the
tests read exports through these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.drafters.registry import build_drafter
from train.export import CONFIG_FILE, WEIGHTS_FILE, check_shapes
from train.export_dspark import HEAD_KEYS
from train.export_hf import DFLASH_FIELDS, TARGET_KEY, config_from_hf, missing_fields


def export_config(export_dir: str | Path) -> DrafterConfig:
    """The drafter config of an exported folder (its config.json; no weights read). ValueError,
    its message starting with the folder, says what the folder is not."""
    folder = Path(export_dir)
    file = folder / CONFIG_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{folder}: {file} cannot be read ({getattr(e, 'strerror', 0) or e})"
        ) from None
    try:
        missing = missing_fields(data)
        if not missing:
            return config_from_hf(data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        said = e if isinstance(e, ValueError) else repr(e)
        raise ValueError(f"{folder} is not a drafter export: its {CONFIG_FILE}: {said}") from None
    fix = " (a target model's config?)" if set(DFLASH_FIELDS) <= set(missing) else ""
    raise ValueError(
        f"{folder} is not a drafter export: its {CONFIG_FILE} has no {', '.join(missing)}"
        + (fix or f"; {export_again(folder)}")
    )


def recorded_target(export_dir: str | Path) -> dict[str, Any] | None:
    """The target an export names as its training cache's (`TARGET_KEY`); None for an export
    written before it was recorded, or a config.json that cannot be read."""
    try:
        recorded = json.loads((Path(export_dir) / CONFIG_FILE).read_text()).get(TARGET_KEY)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) else None


def export_again(folder: Path) -> str:
    return f"export it again (python -m train.export CHECKPOINT {folder})"


def weights_problem(export_dir: str | Path, cfg: DrafterConfig) -> str | None:
    """Why an export's model.safetensors cannot load into `cfg`'s drafter (missing, cut short,
    other names or shapes), read from its header alone; None when it can. The message starts
    with the folder."""
    folder = Path(export_dir)
    file = folder / WEIGHTS_FILE
    try:
        with safe_open(str(file), "pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        check_shapes(shapes, cfg)
    except FileNotFoundError:
        return f"{folder}: {file} is missing; {export_again(folder)}"
    except (OSError, SafetensorError) as e:
        return f"{folder}: {file} is damaged ({e}); {export_again(folder)}"
    except ValueError as e:
        return f"{folder}: {file} does not fit its {CONFIG_FILE} ({e}); {export_again(folder)}"
    return None


def load_export(export_dir: str | Path) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported folder into a float32 drafter of its type (checks names and shapes).
    ValueError, its message starting with the folder, names a file that cannot be read."""
    folder = Path(export_dir)
    cfg = export_config(folder)
    if problem := weights_problem(folder, cfg):
        raise ValueError(problem)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    drafter = build_drafter(cfg)
    own = {k: v.float() for k, v in tensors.items() if k not in HEAD_KEYS}
    drafter.load_state_dict(own, strict=True)
    return drafter, cfg
