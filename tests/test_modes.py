"""What other users may read: files 0644 and folders 0755 within the umask."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from extract.tiny import build_once
from tests.drafters import tiny_drafter, tiny_drafter_config
from train.export import export_drafter


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_export_is_readable_by_others_within_the_umask(tmp_path, umask):
    cfg = tiny_drafter_config()
    out = export_drafter(tiny_drafter(cfg), cfg, tmp_path / "export")
    assert mode(out) == 0o777 & ~umask
    for f in out.iterdir():
        assert mode(f) == 0o666 & ~umask, f


def test_built_folders_are_readable_by_others(tmp_path, umask):
    def build(folder: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({}))

    out = build_once(tmp_path / "tiny", build)
    assert mode(out) == 0o777 & ~umask
    assert {mode(f) for f in out.iterdir()} == {0o666 & ~umask}


def test_cache_target_files_are_readable_by_others(tmp_path, tiny_qwen3):
    from tests.test_extract import chat
    from tests.test_extract_safety import extract

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat(1)) + "\n")
    extract(tmp_path / "c", tiny_qwen3, data)
    target = tmp_path / "c" / "target"
    mask = os.umask(0o022)
    os.umask(mask)
    assert mode(target) == 0o777 & ~mask
    assert {mode(f) for f in target.iterdir()} == {0o666 & ~mask}
