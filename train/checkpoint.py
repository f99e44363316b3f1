"""Checkpoints: one folder `runs/NAME/checkpoints/step-N/` per save, written atomically.

A folder holds `state.pt` (model, optimizer, scheduler, loader position, every rank's RNG
states, step, config) and `drafter.json` (the DrafterConfig), then `meta.json`, written last.
It is built as `.step-N.tmp` and renamed, so a `step-N` folder is complete by construction; the
`meta.json` check also rejects a folder copied by hand only in part. `meta.json` records the
size and crc32c of `state.pt` (computed as it is written, the file synced before the rename), so
a state file cut short or overwritten later is found before torch reads it (torch's zip reader
checks no CRC): a resume then takes the checkpoint before it.

The anchor generator has no state to save: every micro-batch reseeds it from its place in the
plan (seed, epoch, stream, round), so a resumed run draws the same anchors by construction.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from shared.checksum import CHECKSUM_PREFIX, HashedFile, crc32c_file
from shared.fsio import atomic_write_json, fsync_dir, replace_dir
from shared.space import DiskFull, free_bytes, is_disk_full, size_text
from shared.stopping import StopRun
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.drafters.registry import build_drafter

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pt"
DRAFTER_FILE = "drafter.json"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def is_complete(path: Path) -> bool:
    return all((Path(path) / f).is_file() for f in (STATE_FILE, DRAFTER_FILE, META_FILE))


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, folder), oldest first."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and path.is_dir() and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def incomplete_steps(run_dir: Path) -> list[tuple[int, Path]]:
    """Step folders of a run that lack a file (a save cut short, a folder emptied or copied in
    part by hand) as (step, folder), oldest first."""
    folder = checkpoints_dir(run_dir)
    found = []
    for path in folder.glob("step-*") if folder.is_dir() else []:
        m = _STEP_DIR.match(path.name)
        if m and path.is_dir() and not is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


class DamagedCheckpoint(ValueError):
    """A checkpoint's files are not what was saved; the message names the file."""


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `auto` (the newest sound one, or none: a damaged one is
    named in a warning and passed over), `none`, or a path (ValueError if it is damaged)."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        for step, path in reversed(found):
            if (problem := checkpoint_problem(path)) is None:
                _warn_incomplete(run_dir, step)
                return path
            _warn_once(f"{problem}: trying the checkpoint before it")
        _warn_incomplete(run_dir, -1)
        if found:
            raise _all_damaged(run_dir)
        return None
    path = Path(resume)
    if not is_complete(path):
        raise ValueError(f"resume: {path} is not a complete checkpoint folder")
    if problem := checkpoint_problem(path):
        raise ValueError(
            f"--resume {path}: {problem}; resume from another checkpoint (--resume auto takes "
            "the newest sound one)"
        )
    return path


def checkpoint_problem(path: Path) -> str | None:
    """Why a complete checkpoint folder is not what was saved (meta.json unreadable, state.pt of
    another size or crc32c than it records), or None. A folder saved before checkpoints recorded
    them is checked by torch.load alone. Files are read once per process while unchanged, and
    the ranks a launcher starts trust its findings (their environment holds them)."""
    path = Path(path)
    try:
        stamps = [[st.st_size, st.st_mtime_ns] for st in map(os.stat, _files(path))]
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    key = json.dumps([str(path.resolve()), stamps])
    if key not in _CHECKED:
        _CHECKED[key] = _problem(path)
        _pass_on()
    return _CHECKED[key]


# What this process found of checkpoints (keyed by path and its files' stamps) and warned of,
# passed on to the processes it starts, so that a launcher's ranks neither read a state file it
# read nor repeat its warnings.
FINDINGS_ENV = "DFLASH_CHECKPOINT_FINDINGS"
_FOUND = json.loads(os.environ.get(FINDINGS_ENV, "{}"))
_CHECKED: dict[str, str | None] = dict(_FOUND.get("checked", []))
_WARNED: set[str] = set(_FOUND.get("warned", []))


def _pass_on() -> None:
    checked = list(_CHECKED.items())[-8:]
    os.environ[FINDINGS_ENV] = json.dumps({"checked": checked, "warned": sorted(_WARNED)[-16:]})


def _files(path: Path) -> list[Path]:
    return [path / META_FILE, path / STATE_FILE]


def _problem(path: Path) -> str | None:
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as e:
        return f"{path / META_FILE} cannot be read ({e})"
    if not isinstance(meta, dict):
        return f"{path / META_FILE} is not a checkpoint's"
    saved = meta.get("state")
    if saved is None:
        return None  # saved before checkpoints recorded it
    if not (isinstance(saved, dict) and isinstance(saved.get("bytes"), int)):
        return f"{path / META_FILE} holds no readable record of {STATE_FILE} ({saved!r:.80})"
    file = path / STATE_FILE
    size = file.stat().st_size
    if size != saved.get("bytes"):
        return f"{file} is damaged: {size:,} bytes where {saved.get('bytes'):,} were saved"
    if (crc := crc32c_file(file)) != saved.get("crc32c"):
        return (
            f"{file} is damaged: its bytes changed after it was saved (crc32c {crc}, saved "
            f"{saved.get('crc32c')})"
        )
    return None


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        _pass_on()
        log.warning("%s", message)


def _warn_incomplete(run_dir: Path, newest: int) -> None:
    """Name the step folders newer than the checkpoint a resume takes (step `newest`) that lack
    a file (a folder emptied or copied in part by hand): the resume passes over them."""
    for step, path in incomplete_steps(run_dir):
        if step > newest:
            missing = [f for f in (STATE_FILE, DRAFTER_FILE, META_FILE) if not (path / f).is_file()]
            _warn_once(f"{path} lacks {', '.join(missing)}: a resume passes over it")


def _all_damaged(run_dir: Path) -> StopRun:
    return StopRun(
        f"every checkpoint in {checkpoints_dir(run_dir)} is damaged: resume from none of "
        "them by deleting the folder's checkpoints (the run starts again), or restore them"
    )


def load_resume(
    run_dir: Path, resume: str, device: torch.device | str = "cpu"
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `resume` names and its state, or None to start from scratch. With `auto`,
    a newest checkpoint whose file is damaged (cut short or overwritten after it was written,
    the same on every rank) is named in a warning and the one before it is used; any other
    failure (memory, a torch that reads it otherwise) is raised, as is every one damaged."""
    if resume != "auto":
        try:
            path = resolve_resume(run_dir, resume)
            return None if path is None else (path, load_state(path, device))
        except ValueError as e:
            raise StopRun(str(e)) from None
    found = list_checkpoints(run_dir)
    for _, path in reversed(found):
        try:
            return path, load_state(path, device)
        except DamagedCheckpoint as e:
            _warn_once(f"{e}: trying the checkpoint before it")
    if found:
        raise _all_damaged(run_dir)
    return None


def is_damaged_archive(e: BaseException) -> bool:
    """Whether torch.load failed on the file's bytes (a zip cut short or overwritten), not
    for want of memory or by its own rules (weights_only's allowed types)."""
    if isinstance(e, EOFError):
        return True
    text = str(e)
    if isinstance(e, pickle.UnpicklingError):
        return "Weights only load failed" not in text
    return "PytorchStreamReader" in text or "zip archive" in text


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], drafter_cfg: DrafterConfig, *, keep: int
) -> Path:
    """Write `state` as checkpoint `step` atomically, then keep only the newest `keep`.

    A disk without room for it (checked before writing, and a write that fails for want of
    space) raises DiskFull, leaving nothing of this checkpoint and every older one in place."""
    folder = checkpoints_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    need = state_nbytes(state) + META_BYTES
    if free_bytes(folder) < need:
        raise _no_room(run_dir, step, need)
    try:
        tmp.mkdir()
        with open(tmp / STATE_FILE, "xb") as f:
            hashed = HashedFile(f)
            torch.save(state, hashed)
            f.flush()
            os.fsync(f.fileno())
        atomic_write_json(tmp / DRAFTER_FILE, drafter_cfg.to_dict())
        meta = {"step": step, "files": [STATE_FILE, DRAFTER_FILE], "loader": state.get("loader")}
        meta["state"] = {"bytes": hashed.size, "crc32c": f"{CHECKSUM_PREFIX}{hashed.crc:08x}"}
        meta["plan"] = state.get("plan")  # a run's view of a cache still being written
        meta["target"] = state.get("target")  # its cache's target, which an export records
        atomic_write_json(tmp / META_FILE, meta)
        fsync_dir(tmp)
        replace_dir(tmp, final)
    except (OSError, RuntimeError) as e:  # torch.save's writer: RuntimeError "unexpected pos"
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e, folder, need):
            raise _no_room(run_dir, step, need) from None
        raise
    prune(run_dir, keep=keep)
    log.info("saved checkpoint %s", final)
    return final


# The two JSON files and the zip container around the tensors: a few KB; a MB to be safe.
META_BYTES = 1 << 20


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what torch.save writes, near enough.

    >>> state_nbytes({"model": {"w": torch.zeros(4, 8)}, "step": 3, "rng": [torch.zeros(2)]})
    136
    """
    if isinstance(state, torch.Tensor):
        return state.nelement() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def _no_room(run_dir: Path, step: int, need: int) -> DiskFull:
    kept = list_checkpoints(run_dir)
    resume = (
        f"the newest checkpoint kept is {kept[-1][1]}, which the same command resumes from"
        if kept
        else "no checkpoint was written before it, so the same command starts again from step 0"
    )
    return DiskFull(
        f"the disk holding {run_dir} is full: checkpoint step-{step} needs about "
        f"{size_text(need)} and {size_text(free_bytes(run_dir))} is free there, so it was not "
        f"written; {resume} once there is room (free space there, or lower "
        "--keep-checkpoints: a checkpoint is written before the older ones are deleted)."
    )


def prune(run_dir: Path, *, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and what interrupted saves and
    deletions left: temporary folders, step folders older than the newest complete one that
    lack a file, a replaced step's `.old` copy (put back where its step is missing)."""
    folder = checkpoints_dir(run_dir)
    for old in folder.glob("step-*.old"):
        step = old.with_name(old.name.removesuffix(".old"))
        if step.exists() or not is_complete(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, step)
    found = list_checkpoints(run_dir)
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = found[-1][0] if found else -1
    for step, path in incomplete_steps(run_dir):
        if step < newest:
            shutil.rmtree(path, ignore_errors=True)
    for tmp in folder.glob(".step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def prune_before(run_dir: Path, resumed: Path, *, keep: int) -> None:
    """Delete the complete checkpoints of a run older than the one it resumes from (`resumed`)
    but the newest `keep - 1` of them: a run resumed with a lower --keep-checkpoints has room
    for its next save, which is written before older ones go. Newer ones (passed over) stay."""
    m, folder = _STEP_DIR.match(Path(resumed).name), checkpoints_dir(run_dir)
    if m is None or not folder.is_dir() or not folder.samefile(Path(resumed).parent):
        return  # another run's checkpoint (--resume PATH): this run's folder keeps its own
    older = [path for step, path in list_checkpoints(run_dir) if step < int(m.group(1))]
    for path in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(path, ignore_errors=True)
        log.info("deleted %s (--keep-checkpoints %d)", path, keep)


def read_meta(path: Path) -> dict[str, Any]:
    """The small `meta.json` of a checkpoint: step and loader position, without loading state."""
    return json.loads((Path(path) / META_FILE).read_text())


def load_state(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The state dict of a checkpoint folder (tensors on `device`); DamagedCheckpoint, naming
    the file, where its bytes are not those saved or torch finds its archive damaged."""
    if problem := checkpoint_problem(path):
        raise DamagedCheckpoint(problem)
    file = Path(path) / STATE_FILE
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        if not is_damaged_archive(e):
            raise
        raise DamagedCheckpoint(f"{file} is damaged ({str(e) or type(e).__name__})") from None


def drafter_config(ckpt_dir: Path) -> DrafterConfig:
    """The drafter config a checkpoint folder records (no weights read)."""
    file = Path(ckpt_dir) / DRAFTER_FILE
    try:
        return DrafterConfig.from_dict(json.loads(file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(f"{file} cannot be read ({e})") from None


def load_drafter(ckpt_dir: Path) -> tuple[DFlashDrafter, DrafterConfig]:
    """The trained drafter (float32, CPU) and its config from a checkpoint folder."""
    ckpt_dir = Path(ckpt_dir)
    if not is_complete(ckpt_dir):
        raise ValueError(f"{ckpt_dir} is not a complete checkpoint folder")
    cfg = drafter_config(ckpt_dir)
    drafter = build_drafter(cfg)
    drafter.load_state_dict(load_state(ckpt_dir)["model"])
    return drafter, cfg


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch RNG states (CPU, and the current CUDA device when on GPU)."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
