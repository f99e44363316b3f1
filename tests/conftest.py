"""Shared fixtures: tiny targets built once per test run (random weights: fast), the tiny
demo tokenizer once per module, and one intra-op thread for modules that ask for it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def _tiny(root: Path, kind: str) -> Path:
    from extract.tiny import build_tiny_target

    folder = root / f"tiny-{kind}"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        build_tiny_target(folder, kind=kind, train_steps=0)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3 target folder (tokenizer, chat template, random weights)."""
    return _tiny(tmp_path_factory.getbasetemp() / "targets", "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory) -> Path:
    """A tiny hybrid Qwen3.5 target folder (Gated DeltaNet + attention, random weights)."""
    return _tiny(tmp_path_factory.getbasetemp() / "targets", "qwen3_5")


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny demo tokenizer with its ChatML template (built per module, in code: fast)."""
    from tests.chats import demo_tokenizer

    return demo_tokenizer()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny matmuls on shared cores run several times faster
    without intra-op threads. Opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(*cmd: object) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True).stdout.decode()


@pytest.fixture
def failing_disk(tmp_path):
    """(a folder on ext4, `fail` and `heal` its disk): ext4 on a loop device whose 1 GB image
    lies on a 64 MB tmpfs, which `fail` fills up to 2 MB (or `room`) and `heal` frees again. A
    write there succeeds (ext4 has room) and its writeback fails later, the way a thin-
    provisioned or network disk fails. Skips where it cannot be built (not root, no loop
    devices, no mkfs.ext4)."""
    backing, folder = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    folder.mkdir()
    undo = []
    try:
        _run("mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", backing)
        undo.append(("umount", "-l", backing))
        image = backing / "img"
        with open(image, "wb") as f:
            f.truncate(1 << 30)
        _run("mkfs.ext4", "-q", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", image)
        loop = _run("losetup", "-f", "--show", image).strip()
        undo.append(("losetup", "-d", loop))
        _run("mount", loop, folder)
        undo.append(("umount", "-l", folder))
        os.sync()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError) as e:
        for cmd in reversed(undo):
            subprocess.run([str(c) for c in cmd], capture_output=True)
        pytest.skip(f"cannot build a failing disk here: {e}")
    filler = backing / "filler"

    def fail(room: int = 2 << 20) -> None:
        """The disk below fails writes once `room` more bytes have reached it."""
        free = os.statvfs(backing).f_bavail * os.statvfs(backing).f_frsize
        with open(filler, "wb") as f:
            f.write(bytes(max(0, free - room)))

    try:
        yield folder, fail, filler.unlink
    finally:
        for cmd in reversed(undo):
            subprocess.run([str(c) for c in cmd], capture_output=True)
