"""The embedded tiny targets (extract/tiny.py): build, cache, determinism, HF loading, padding."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from extract.tiny import (
    CHAT_TEMPLATE,
    KINDS,
    TINY_VERSION,
    TOKENIZER_SIZE,
    _token_stream,
    build_once,
    build_tiny_target,
    default_cache_dir,
    tiny_target,
)

QUICK_STEPS = 3  # the full recipe's code path with fewer steps, to keep this file fast


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The default target exactly as `python -m extract` gets it (full recipe)."""
    return tiny_target(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Two independent builds of each kind, for determinism and the per-kind checks."""
    builds = {}
    for kind in KINDS:
        pair = tmp_path_factory.mktemp(f"{kind}-a"), tmp_path_factory.mktemp(f"{kind}-b")
        for folder in pair:
            build_tiny_target(folder, kind=kind, train_steps=QUICK_STEPS)
        builds[kind] = pair
    return builds


@pytest.mark.slow
def test_tiny_target_is_built_once_into_a_versioned_folder(trained):
    assert trained.name == f"tiny-qwen3-v{TINY_VERSION}"
    weights = trained / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert tiny_target(trained.parent) == trained
    assert weights.stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in trained.parent.iterdir()) == [trained.name]  # no temp leftovers


@pytest.mark.slow
def test_trained_target_has_learnt_the_demo_corpus(trained):
    model = AutoModelForCausalLM.from_pretrained(trained).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained)
    stream_N = _token_stream(tokenizer)
    windows_WS = stream_N[: len(stream_N) // 128 * 128].view(-1, 128)[::40]
    with torch.no_grad():
        loss = model(input_ids=windows_WS, labels=windows_WS).loss.item()
    # Uniform guessing costs log(vocab) nats; a few seconds of training at least halve it.
    assert loss < 0.5 * math.log(model.config.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_builds_are_byte_identical(quick, kind):
    a, b = quick[kind]
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.slow
def test_training_leaves_the_tokenizer_unchanged(quick, trained):
    quick_json = (quick["qwen3"][0] / "tokenizer.json").read_bytes()
    assert (trained / "tokenizer.json").read_bytes() == quick_json


@pytest.mark.parametrize("kind", KINDS)
def test_loads_with_auto_classes(quick, kind):
    folder = quick[kind][0]
    model = AutoModelForCausalLM.from_pretrained(folder)
    expected = {"qwen3": "Qwen3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}[kind]
    assert type(model).__name__ == expected
    assert next(model.parameters()).dtype == torch.float32
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 1)
    # head_dim 32: vLLM's CPU attention has no kernel for head size 16.
    assert (cfg.head_dim, cfg.intermediate_size) == (32, 128)
    assert cfg.num_hidden_layers == 8  # distinct ids under the default 5-layer capture rule
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # A spare embedding row past the vocabulary, for the drafter's mask token.
    assert model.get_input_embeddings().weight.shape[0] == cfg.vocab_size > len(tokenizer)
    assert model.get_output_embeddings().weight.data_ptr() != (
        model.get_input_embeddings().weight.data_ptr()
    )
    if kind == "qwen3_5":
        assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
        assert hasattr(model.model.layers[0], "linear_attn")


def test_tokenizer_specials_template_and_offsets(quick):
    tokenizer = AutoTokenizer.from_pretrained(quick["qwen3"][0])
    assert len(tokenizer) == TOKENIZER_SIZE
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [0, 1, 2]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert "".join(text[a:b] for a, b in enc["offset_mapping"]) == text  # spans tile the text
    assert tokenizer.decode(enc["input_ids"]) == text
    assert tokenizer.decode(tokenizer("naïve café ✓")["input_ids"]) == "naïve café ✓"


@pytest.mark.parametrize("kind", KINDS)
def test_right_padding_gives_the_states_of_the_row_run_alone(quick, kind):
    model = AutoModelForCausalLM.from_pretrained(quick[kind][0]).eval()
    gen = torch.Generator().manual_seed(0)
    short_1S = torch.randint(3, 500, (1, 40), generator=gen)
    long_1L = torch.randint(3, 500, (1, 100), generator=gen)
    ids_BL = torch.zeros(2, 100, dtype=torch.long)  # pad id 0, right padding
    ids_BL[0, :40], ids_BL[1] = short_1S[0], long_1L[0]
    attn_BL = (torch.arange(100) < torch.tensor([[40], [100]])).long()
    with torch.no_grad():
        alone = model(input_ids=short_1S, output_hidden_states=True).hidden_states
        batch = model(input_ids=ids_BL, attention_mask=attn_BL, output_hidden_states=True)
    assert len(alone) == model.config.num_hidden_layers + 1
    for layer, (one_1SH, both_BLH) in enumerate(zip(alone, batch.hidden_states, strict=True)):
        torch.testing.assert_close(both_BLH[0, :40], one_1SH[0], atol=1e-5, rtol=1e-4, msg=layer)
    # Left padding would move the real tokens to positions 60..99 (position ids default to
    # 0..L-1). RoPE attention depends only on relative positions, so the states then agree only
    # up to rounding that grows with the pad count (tiny qwen3, fp32: exact with right padding,
    # ~1e-5 off after 600 left pads; far more in bf16), i.e. a cached state would depend on which
    # rows shared its batch. The DeltaNet layers zero padded inputs, so their recurrent state is
    # unaffected either way. Right padding keeps positions 0..S-1 exactly as when run alone.


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("DFLASH_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "dflash-offline"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "dflash-offline"


def test_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        tiny_target(tmp_path, kind="llama")


def test_racing_builders_end_with_one_complete_folder(tmp_path):
    folder = tmp_path / "cache" / "thing-v1"
    both_built = threading.Barrier(2)

    def build(tmp: Path) -> None:
        (tmp / "owner.txt").write_text(threading.current_thread().name)
        (tmp / "payload.bin").write_bytes(b"x" * 1000)
        both_built.wait(timeout=30)  # both finish building before either publishes

    results: dict[str, Path] = {}

    def run(name: str) -> None:
        results[name] = build_once(folder, build)

    threads = [threading.Thread(target=run, args=(t,), name=t) for t in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {"first": folder, "second": folder}
    assert (folder / "owner.txt").read_text() in {"first", "second"}
    assert (folder / "payload.bin").stat().st_size == 1000
    assert [p.name for p in folder.parent.iterdir()] == ["thing-v1"]  # losers cleaned up
