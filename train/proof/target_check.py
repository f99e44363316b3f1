"""Whether a proof command's `--target` is the target a drafter was trained for.

An export names the target its training cache was extracted from (`train.export_hf.TARGET_KEY`).
A drafter given another target of the same shape (its base model's fine-tune, say) decodes
without a complaint, so its tau and acceptance would silently be about another pair: a warning
says so. Not a refusal: measuring a drafter on a fine-tune of its target is a fair question.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.target_identity import content_hash, safetensors_files, weights_sample
from train.export_load import recorded_target


def other_target(recorded: dict[str, Any] | None, target: Path) -> tuple[str, str, str] | None:
    """(what is compared, the recorded hash, `target`'s) where the target folder is not the one
    recorded; None where it is, where nothing is recorded, or where `target` is no folder or
    holds no safetensors files (its weights in another format: nothing to compare, as
    extraction reads safetensors only).

    Compared by `weights_sample`, which reads 1 MiB of each weight file whatever its size and
    tells two checkpoints of one shape apart. `revision` (`content_hash`) reads only the headers
    of files over 64 MiB, the same for two checkpoints of one shape, and every byte of smaller
    files (all of a checkpoint of many small shards): it is compared only where the record has
    no sample (a cache extracted before samples were kept).
    """
    if not recorded or not target.is_dir():
        return None
    if not (files := safetensors_files(target)):
        return None
    if recorded.get("weights_sample"):
        return _differ("weights", recorded["weights_sample"], weights_sample(files))
    if recorded.get("revision") and (target / "config.json").is_file():
        now = content_hash(target / "config.json", files)
        return _differ("content hash", recorded["revision"], now)
    return None


def _differ(what: str, was: str, now: str) -> tuple[str, str, str] | None:
    return None if was == now else (what, was, now)


def other_target_warning(drafter: Path, target: str) -> str | None:
    """The warning where the export `drafter` names another target than `target`; else None."""
    if (recorded := recorded_target(drafter)) is None:
        return None  # an export written before exports named their target
    try:
        found = other_target(recorded, Path(target))
    except OSError:  # a weight file that cannot be read: loading the target names it
        return None
    if found is None:
        return None
    what, was, now = found
    return (
        f"--drafter {drafter} was trained on the cache of {recorded.get('path')} ({what} "
        f"{short(was)}), not of --target {target} ({what} {short(now)}): its figures measure "
        "this drafter against another target than the one it was trained for"
    )


def short(digest: str) -> str:
    """A hash as a warning shows it: its first 12 hex digits.

    >>> short("sha256:0123456789abcdef0123")
    '0123456789ab'
    """
    return str(digest).removeprefix("sha256:")[:12]
