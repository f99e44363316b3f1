"""Named real targets: the source checks, the name resolution and the mask-token rule (fast);
the slow test materializes SmolLM2-135M-Instruct and checks extraction against a plain forward."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from extract.models import ModelError, locate_source
from shared.models import RealTarget, resolve_target_name
from shared.target_files import unused_special_token


def fake_target(payload: bytes) -> RealTarget:
    return RealTarget(
        name="fake",
        wheel="fake==1",
        member="pkg/model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        version=1,
        about="test",
    )


@pytest.mark.parametrize("form", ["file", "wheel", "pieces", "folder_with_wheel"])
def test_source_forms_give_the_same_checked_file(tmp_path, form):
    payload = bytes(range(256)) * 1000
    t = fake_target(payload)
    src = tmp_path / "src"
    src.mkdir()
    if form == "file":
        (src / "model.gguf").write_bytes(payload)
        source = src / "model.gguf"
    elif form == "pieces":
        for i in range(3):  # joined in name order
            (src / f"model.gguf.part{i}").write_bytes(payload[i * 100_000 : (i + 1) * 100_000])
        source = src
    else:
        with zipfile.ZipFile(src / "fake-1-py3-none-any.whl", "w") as z:
            z.writestr(t.member, payload)
        source = src if form == "folder_with_wheel" else src / "fake-1-py3-none-any.whl"
    work = tmp_path / "work"
    work.mkdir()
    assert locate_source(t, source, work).read_bytes() == payload


def test_source_with_another_hash_is_refused(tmp_path):
    t = fake_target(b"expected")
    (tmp_path / "model.gguf").write_bytes(b"something else")
    with pytest.raises(ModelError, match="sha256"):
        locate_source(t, tmp_path / "model.gguf", tmp_path)


def test_unmaterialized_name_says_what_to_run(tmp_path):
    with pytest.raises(ValueError, match="python -m extract.models smollm2-135m-instruct"):
        resolve_target_name("smollm2-135m-instruct", tmp_path)
    assert resolve_target_name("/some/folder", tmp_path) == "/some/folder"


def test_unused_special_token_rule(tmp_path, tokenizer):
    (tmp_path / "target").mkdir()
    tokenizer.save_pretrained(str(tmp_path / "target"))
    # The tiny tokenizer's specials are pad (named) and the two ChatML markers (in the template).
    assert unused_special_token(tmp_path) is None
    tokenizer.add_special_tokens({"additional_special_tokens": ["<spare_a>", "<spare_b>"]})
    tokenizer.save_pretrained(str(tmp_path / "target"))
    assert unused_special_token(tmp_path) == tokenizer.convert_tokens_to_ids("<spare_b>")
