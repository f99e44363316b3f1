"""Shared fixtures: tiny targets built once per test run (random weights: fast), the tiny
demo tokenizer once per module, and one intra-op thread for modules that ask for it."""

from __future__ import annotations

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
