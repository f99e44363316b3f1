"""What `--out` may hold, and what `--overwrite` may delete: only this tool's own entries.

A cache folder holds the manifest, the parts, `target/`, the resolved config, and temporary,
progress and lock entries of its writers. Anything else (a user's files, a data file, the
working directory) is never deleted: `--overwrite` refuses and lists it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

from shared.cache import is_own_entry
from shared.fsio import remove_path, within
from shared.target_files import EMBED_FILE, TARGET_DIR

log = logging.getLogger(__name__)

# Entries that hold no committed data: a folder holding only these is a start that was
# interrupted before its manifest, and is cleared without --overwrite.
_LEFTOVER = re.compile(
    r"^(\.manifest\.lock|\.progress|\.lock|\.lock\.[^/]+|target(\.tmp|\.old)?"
    r"|part-\d{6}(\.tar)?\.tmp|extract_config\.json|\.(manifest|extract_config)\.json\.tmp\.[\d.]+)$"
)
_PART = re.compile(r"^part-\d{6}(\.tar)?(\.old)?$")
MAX_LISTED = 10


def entries(out: Path) -> list[str]:
    return sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else []


def is_ours(out: Path, name: str) -> bool:
    """Whether entry `name` of `out` is one this tool wrote: by its name (`is_own_entry`), and
    a `target` folder (or the `target.old` a replacement of it leaves) only where it holds what
    extraction writes there, the embedding file and config.json: a user's folder of that name
    (a build folder, a model passed as --target) is never taken for it."""
    if name in (TARGET_DIR, f"{TARGET_DIR}.old"):
        folder = Path(out) / name
        return (folder / EMBED_FILE).is_file() and (folder / "config.json").is_file()
    return is_own_entry(name)


def foreign_entries(out: Path) -> list[str]:
    """Names in `out` that this tool did not write."""
    return [n for n in entries(out) if not is_ours(out, n)]


def only_leftovers(out: Path) -> bool:
    """True when `out` holds nothing but what an interrupted start leaves (no manifest, no
    committed part): the same command may clear it."""
    return all(_LEFTOVER.match(n) and is_ours(out, n) for n in entries(out))


def part_entries(out: Path) -> list[str]:
    """The parts in `out`, committed or not (a commit cut short, a replaced one): not the
    `.tmp` folders of parts in progress."""
    return [n for n in entries(out) if _PART.match(n)]


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    more = len(names) - MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def protected_reason(out: Path, inputs: Iterable[Path]) -> str | None:
    """Why `out` must never be deleted: it is (or holds) the working directory, or holds one
    of `inputs` (data files, the target). None when it may be replaced."""
    folder = Path(out).resolve()
    cwd = Path.cwd().resolve()
    if within(cwd, folder):
        return f"it is the working directory {cwd} or holds it"
    for item in inputs:
        if within(item, folder):
            return f"it holds {item}, an input of this run"
    if folder == Path(folder.anchor) or folder == Path.home().resolve():
        return "it is a root or home folder"
    return None


def to_clear(out: Path) -> list[str]:
    """This tool's entries in `out` that `clear_cache` deletes (not its output lock)."""
    return [n for n in entries(out) if is_ours(out, n) and not n.startswith(".lock")]


def clear_cache(out: Path) -> None:
    """Delete this tool's entries in `out` (not the folder itself, nor its output lock)."""
    for name in to_clear(out):
        log.info("removing %s", Path(out) / name)
        remove_path(Path(out) / name)
