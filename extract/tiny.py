"""The embedded default target: a tiny Qwen3 (or hybrid Qwen3.5) causal LM built in code.

`tiny_target()` builds it once, deterministically and without network, and caches the folder on
disk. The folder is an ordinary Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, chat template) so stage one loads it through the same `from_pretrained` code path
as a real target.

Tokenizer: byte-level BPE (Qwen2-style pre-tokenizer) trained on the shipped demo corpus, with the
special tokens `<|endoftext|>` (id 0), `<|im_start|>` (1), `<|im_end|>` (2). eos is `<|im_end|>`,
so generation stops at the end of an assistant turn, as with Qwen3 instruct models; pad is
`<|endoftext|>`, deliberately not eos: `<|im_end|>` is a supervised token, so anything that derives
a mask from `ids != pad` must never confuse the two.

Weights: random init with a fixed seed, then a few seconds of single-threaded training on the demo
corpus so that greedy continuations look like the corpus rather than noise. One thread keeps the
result identical from run to run on a machine; other CPUs or torch builds may round differently,
which is harmless since each machine builds and caches its own copy.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from extract.data import demo_dataset
from shared.fsio import public_modes
from shared.models import default_cache_dir

logger = logging.getLogger(__name__)

# Bump whenever anything below changes the built folder (recipe, sizes, demo corpus): the version
# names the cache folder, so a stale build is never reused.
TINY_VERSION = 3
KINDS = ("qwen3", "qwen3_5")

PAD_TOKEN, START_TOKEN, END_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, START_TOKEN, END_TOKEN)
TOKENIZER_SIZE = 500  # entries including the special tokens
# ChatML: a system message is rendered like any other turn; add_generation_prompt opens an
# assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2/Qwen3's pre-tokenizer split: words with one leading non-letter, single digits, punctuation
# runs, newlines.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SEED = 1234
# (steps, batch, sequence length, learning rate) per kind: about 5-10 s on one CPU core, taking
# the loss from 6.2 to about 1.7-1.9 on the corpus. The hybrid learns faster per step but each
# step costs more (the DeltaNet's torch fallback).
_TRAIN_RECIPE = {"qwen3": (80, 16, 64, 3e-3), "qwen3_5": (40, 16, 64, 3e-3)}


def tiny_target(cache_dir: Path | None = None, *, kind: str = "qwen3") -> Path:
    """Path of the tiny target folder `tiny-{kind}-v{TINY_VERSION}`, building it on first use."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"tiny-{kind}-v{TINY_VERSION}"
    return build_once(folder, lambda tmp: build_tiny_target(tmp, kind=kind))


def build_once(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder`, made by `build(tmp)` in a private temporary folder renamed into place if absent.

    A reader never sees a partial folder, and processes racing all end up with one complete copy:
    the first rename wins and the others drop their own build.
    """
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        build(tmp)
        public_modes(tmp)  # mkdtemp and safetensors make them private; the cache may be shared
        os.rename(tmp, folder)
    except OSError:
        # rename refuses to replace a non-empty folder: another process finished first.
        if not folder.is_dir():
            raise
        logger.info("%s was built by another process", folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def build_tiny_target(
    out_dir: Path, *, kind: str = "qwen3", train_steps: int | None = None
) -> None:
    """Build the tiny target into the existing folder `out_dir` (no caching, not atomic).

    `train_steps` overrides the recipe's step count (0: random weights).
    """
    texts = list(_demo_texts())
    tokenizer = build_tokenizer(texts)
    steps, batch, seq_len, lr = _TRAIN_RECIPE[kind]
    steps = steps if train_steps is None else train_steps
    with _deterministic(SEED):
        model = _model_class(kind)(tiny_config(kind, tokenizer))
        if steps > 0:
            stream = _token_stream(tokenizer)
            loss = _train(model, stream, steps=steps, batch=batch, seq_len=seq_len, lr=lr)
            logger.info("tiny %s target: %d training steps, final loss %.3f", kind, steps, loss)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def build_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `TOKENIZER_SIZE` entries trained on `texts`, with the ChatML template.

    The trainer is deterministic (pair ties break on token ids), so the same texts give a
    byte-identical tokenizer.json.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Untrimmed offsets: a token's char span includes its leading space, so spans tile the text.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def tiny_config(kind: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Config of the tiny target of `kind`, sized for `tokenizer` plus spare embedding rows."""
    # Round up past the vocabulary: the first spare row is the drafter's mask token.
    vocab_rows = (len(tokenizer) // 64 + 1) * 64
    common = dict(
        vocab_size=vocab_rows,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,  # the default 5-layer capture rule needs >= 8 distinct ids
        # head_dim 32: the smallest head size vLLM's CPU attention serves (it has no 16).
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    # Three Gated DeltaNet layers per full-attention layer, Qwen3.5's 3:1 pattern.
    return Qwen3_5TextConfig(
        **common,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


def _model_class(kind: str) -> type[PreTrainedModel]:
    if kind == "qwen3":
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    # The text-only causal LM (model_type "qwen3_5_text"), not the multimodal wrapper.
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM


def _demo_texts() -> Iterator[str]:
    """Tokenizer training text: every demo message as `role\\ncontent\\n`."""
    with open(demo_dataset(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                for message in json.loads(line)["messages"]:
                    yield f"{message['role']}\n{message['content']}\n"


def _token_stream(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """All demo conversations rendered with the chat template, tokenized and concatenated."""
    ids: list[int] = []
    with open(demo_dataset(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                text = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
                ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def _train(
    model: PreTrainedModel,
    stream_N: torch.Tensor,
    *,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
) -> float:
    """Next-token training on random windows of the stream; returns the last step's loss."""
    windows_WS = stream_N[: len(stream_N) // seq_len * seq_len].view(-1, seq_len)
    # Constant lr: with only tens of steps a decaying schedule leaves the model visibly worse.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ids_BS = windows_WS[torch.randint(len(windows_WS), (batch,), generator=gen)]
        loss = model(input_ids=ids_BS, labels=ids_BS).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


@contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    """Seeded torch RNG and one intra-op thread, restoring the caller's RNG and thread count."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
