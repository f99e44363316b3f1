"""Data of which no row can be kept is refused while planning: before the target loads, and
before anything in --out is written or deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extract.config import ExtractConfig
from extract.plan import plan_manifest
from extract.run import ExtractError, run
from tests.test_extract import chat


def config(out: Path, target: Path, data: Path, **over) -> ExtractConfig:
    cfg = dict(out=out, target=str(target), data=(data,), gpus="cpu", rows_per_part=4)
    return ExtractConfig(**{**cfg, "layers": "0,2", "writer_threads": 1, **over})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_overwrite_with_data_of_no_usable_row_keeps_the_cache(tmp_path, tiny_qwen3):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4)))
    wrong = tmp_path / "wrongfields.jsonl"
    wrong.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    out = tmp_path / "cache"
    run(config(out, tiny_qwen3, good))
    before = snapshot(out)
    with pytest.raises(ExtractError, match=r"no row of --data was kept \(2 read") as e:
        run(config(out, tiny_qwen3, wrong, overwrite=True))
    assert f"{wrong}:1: unknown_schema" in str(e.value) and "left as it was" in str(e.value)
    assert snapshot(out) == before


def test_every_row_rejected_is_refused_while_planning(tmp_path, tiny_qwen3):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(3)))
    with pytest.raises(ExtractError, match="3 read; rejected: 3 too_few_supervised_tokens"):
        plan_manifest(config(tmp_path / "c", tiny_qwen3, data, max_length=4))
    assert not (tmp_path / "c").exists()


def test_rows_past_the_sample_are_read_before_refusing(tmp_path, tiny_qwen3):
    """300 rows: the size estimate tokenizes 256 of them, not rows 16 and 17."""
    rows = ["{not json"] * 300
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows) + "\n")
    with pytest.raises(ExtractError, match=r"300 read; rejected: 300 malformed_json"):
        plan_manifest(config(tmp_path / "c", tiny_qwen3, data))
    rows[17] = json.dumps(chat(1))
    data.write_text("\n".join(rows) + "\n")
    planned, _, estimate = plan_manifest(config(tmp_path / "c", tiny_qwen3, data))
    assert estimate.tokens == 0 and planned.total_rows == 300  # the one kept row is unsampled
