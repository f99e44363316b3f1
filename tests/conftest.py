"""Shared fixtures: tiny targets built once per test run (random weights: fast), the tiny
demo tokenizer once per module."""

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
