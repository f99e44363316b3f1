"""ExtractConfig: every option of `python -m extract`, with its help and validation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.cli import option
from shared.format import FORMATS, STORES

COMPILE_MODES = ("auto", "layers", "none")
PACKING_MODES = ("auto", "on", "off")


def parse_layer_list(text: str) -> tuple[int, ...]:
    """`"1,9,17"` -> (1, 9, 17); raises ValueError naming the bad item. What is wrong whatever
    the target (not an id, a negative or a repeated one) is refused here, as a usage error; an
    id past the target's layers only once its config is read (`extract.plan`)."""
    out: list[int] = []
    for item in text.replace(" ", "").split(","):
        if not item.lstrip("-").isdigit():
            raise ValueError(f"--layers {text!r}: {item!r} is not an integer layer id")
        if int(item) < 0:
            raise ValueError(f"--layers {text!r}: {item} is not a layer id (0-based: 0 or more)")
        if int(item) in out:
            raise ValueError(f"--layers {text!r}: layer {int(item)} is given twice")
        out.append(int(item))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    out: Path = option(help="Output cache folder (created; resumed if it holds the same job).")
    target: str | None = option(
        None,
        help="Target model: a local Hugging Face folder (or hub id, if cached locally), or a "
        "named real target (smollm2-135m-instruct: materialized on first use, see "
        "`python -m extract.models`). Default: the embedded tiny Qwen3 demo target, built on "
        "first use.",
    )
    data: tuple[Path, ...] = option(
        (),
        help="JSONL, parquet or arrow file(s), or Hugging Face `datasets` folders (save_to_disk), "
        "of OpenAI `messages`, ShareGPT `conversations` or `input_ids` + `loss_mask` rows; "
        "repeat the option for several. Default: the shipped demo chats.",
    )
    gpus: str | None = option(
        None, help="Devices: 0-4, 0,2,5, cpu or cpu:N. Default: all visible GPUs, else cpu."
    )
    layers: str | None = option(
        None, help="Explicit target layer ids to capture, e.g. 1,9,17 (0-based decoder layers)."
    )
    num_layers: int = option(
        5,
        help="Without --layers: capture this many layers by the DFlash default rule.",
        moot_with="layers",
    )
    max_length: int = option(3072, help="Truncate rows to this many tokens (counted).")
    format: str = option("zarr", help="Shard format.", choices=FORMATS)
    store: str = option(
        "bf16",
        help="bf16 (lossless), fp8 (e4m3 + a scale per token and layer: 0.43 of raw bf16 on "
        "SmolLM2's states) or int4 (rotated 4-bit code, exact top values, fp8 for massive "
        "activations: 0.25 of raw bf16; see the README's 'The cache').",
        choices=STORES,
    )
    batch_tokens: int = option(
        16384,
        help="Tokens per forward: a packed row's size (rounded up to a multiple of 128 and to "
        "--max-length; a row filling no more than a half or a quarter of it runs at that size), "
        "or padded length x rows for padded batches.",
    )
    compile: str = option(
        "auto",
        help="layers: compile every target layer (static shapes: packed rows); none: eager. "
        "auto: layers on GPUs, none on CPUs.",
        choices=COMPILE_MODES,
    )
    attention: str = option(
        "auto",
        help="Packed rows' attention kernel: flex (flex_attention, compiled into the layers), "
        "flash (the same through flash-attention 4's kernels: pip install flash-attn-4; Hopper "
        "and Blackwell GPUs) or sdpa (each row's samples as padded batches: cuDNN or "
        "FlashAttention); auto: flex on GPUs, sdpa on CPUs.",
        choices=("auto", "flex", "flash", "sdpa"),
    )
    packing: str = option(
        "auto",
        help="on: whole samples back to back in rows of --batch-tokens, attention confined to "
        "each (no padding computed); off: rows padded to the longest of their batch. auto: on "
        "when the layers are compiled. Either is checked against rows run alone at start-up, "
        "and padded batches are kept where packing does not give the same states.",
        choices=PACKING_MODES,
    )
    parallel: str = option(
        "none",
        help="How the target is laid out over the processes (transformers' distributed "
        "loading): none (a whole model per process), tp=N (tensor parallel groups of N sharing "
        "inputs), fsdp=N (fully sharded over N, inputs of their own), ep=N (a MoE target's "
        "experts over N), with data parallel copies over the rest (dp=M); auto: none where the "
        "target fits one device, else the first layout that fits. Sharded layouts run the "
        "same forward as one model per process (--compile, --packing), the ranks of a model "
        "in step. fsdp=1 (or tp=1) on one process runs that path with one rank, to see what "
        "it costs.",
    )
    rows_per_part: int = option(512, help="Source rows per part (the unit of work and resume).")
    max_rows: int | None = option(None, help="Only the first N source rows (quick runs).")
    writer_threads: int = option(
        0,
        help="Compression/write threads per process (0: the usable cores / processes, at most 8; "
        "more threads slow the forward loop down through the GIL).",
    )
    staging_buffers: int = option(
        3,
        help="Host buffers between the device and the writer threads (pinned on a GPU, each "
        "one forward's states): the device runs this many batches ahead of the writers, so "
        "more absorb their slow moments at that much more pinned memory.",
    )
    switch_interval_ms: float = option(
        1.0,
        help="Python's GIL switch interval in the extract processes (ms; Python's own is 5): "
        "how long the thread launching the forwards can wait for a writer thread holding the GIL.",
    )
    overwrite: bool = option(
        False,
        help="Replace a cache in --out made with other settings (only this tool's own files; "
        "any other file in --out is refused, never deleted).",
    )
    space_check: bool = option(
        True,
        help="Before any work, estimate the cache's size (from a tokenized sample of the rows) "
        "and refuse to start when its disk has less free space; --no-space-check starts anyway.",
    )
    verbose: bool = option(False, help="Debug logging on every rank.")

    def __post_init__(self) -> None:
        if self.layers is not None:
            parse_layer_list(self.layers)
        least = {  # the smallest value each takes
            "num_layers": 1,
            "max_length": 2,
            "batch_tokens": 2,
            "rows_per_part": 1,
            "writer_threads": 0,
            "staging_buffers": 2,
            "max_rows": 1,
        }
        for name, low in least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: {value} is too small (at least {low})")
        if not 0 < self.switch_interval_ms <= 1000:  # inf and nan too (Python takes inf as 0)
            raise ValueError(
                f"--switch-interval-ms: {self.switch_interval_ms} must be above 0 and at most "
                "1000 (Python's own is 5)"
            )
        if self.attention != "auto" and self.packing == "off":
            raise ValueError(
                f"--attention {self.attention} has no effect with --packing off (it is packed "
                "rows' kernel): drop one of them"
            )
        if self.attention == "flash":
            from extract.packed_attention import flash_unavailable

            why = flash_unavailable()
            if why is not None:
                raise ValueError(f"--attention flash: {why}; or use --attention flex")
        if self.compile == "layers" and self.packing == "off":
            raise ValueError(
                "--compile layers needs packed rows (one static shape): drop --packing off, or "
                "use --compile none"
            )

    @property
    def layer_ids(self) -> tuple[int, ...] | None:
        return parse_layer_list(self.layers) if self.layers is not None else None
