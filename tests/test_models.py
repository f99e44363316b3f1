"""Named real targets: the source checks, the name resolution and the mask-token rule (fast);
the slow test materializes SmolLM2-135M-Instruct and checks extraction against a plain forward."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from extract.models import ModelError, locate_source, split_file
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


def test_split_pieces_in_their_own_folders_join_back(tmp_path):
    payload = bytes(range(251)) * 999  # not a multiple of the piece count
    t = fake_target(payload)
    (tmp_path / "model.gguf").write_bytes(payload)
    pieces = split_file(tmp_path / "model.gguf", tmp_path / "split", 3)
    assert [p.parent.name for p in pieces] == ["0", "1", "2"]
    assert max(p.stat().st_size for p in pieces) < len(payload) / 2
    (tmp_path / "work").mkdir()
    assert locate_source(t, tmp_path / "split", tmp_path / "work").read_bytes() == payload


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


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct materialized in the default cache (downloaded once, then reused)."""
    pytest.importorskip("gguf", reason='needs the [real] extra: pip install -e ".[real]"')
    from extract.models import materialize

    return materialize("smollm2-135m-instruct")


@pytest.mark.slow
def test_real_target_extraction_matches_a_plain_forward(tmp_path, smollm2):
    """Real weights end to end: a Llama decoder with tied embeddings and a full tokenizer, its
    ChatML assistant spans, and layers 1, 15 and 29 (the last, after the final norm) against
    `hidden_states[i + 1]` of a plain forward of the materialized folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from extract.config import ExtractConfig
    from extract.data import demo_dataset
    from extract.run import run
    from shared.cache import open_part
    from shared.manifest import read_manifest
    from shared.target_files import load_heads, read_target_config
    from train.drafters.config import DrafterConfig

    cache = tmp_path / "cache"
    cfg = ExtractConfig(
        out=cache,
        target="smollm2-135m-instruct",
        data=(demo_dataset(),),
        gpus="cpu",
        max_rows=4,
        rows_per_part=4,
        layers="1,15,29",
        writer_threads=1,
    )
    m = run(cfg)
    assert m.complete and m.target.model_type == "llama" and m.target.path == str(smollm2)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    samples = list(open_part(cache / read_manifest(cache).parts[0].name).iter_samples())
    assert len(samples) == 4
    for s in samples:
        with torch.no_grad():
            ids = torch.from_numpy(s.input_ids.astype("int64"))[None]
            hs = model(ids, output_hidden_states=True).hidden_states
        ref = torch.stack([hs[i + 1][0] for i in m.layer_ids], dim=1)
        got = s.hidden_tensor(torch.device("cpu")).float()
        assert ref.abs().max() > 1000  # real massive activations, not random weights
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
        supervised = tok.decode(s.input_ids[s.loss_mask == 1])
        assert supervised.endswith("<|im_end|>") and "<|im_start|>" not in supervised
    embed, lm_head = load_heads(cache)
    assert lm_head is embed  # tied: one tensor
    torch.testing.assert_close(embed.float(), model.lm_head.weight, rtol=0, atol=0)
    drafter = DrafterConfig.from_target_config(
        read_target_config(cache),
        target_layer_ids=m.layer_ids,
        tokenizer_vocab_size=m.target.tokenizer_vocab_size,
        unused_token=unused_special_token(cache),
    )
    assert tok.convert_ids_to_tokens(drafter.mask_token_id) == "<empty_output>"
