"""The inputs of `python -m extract.regen`: its options (`RegenConfig`) and its source
rows (`iter_chats`: the chats to regenerate, or the rows rejected with a reason).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extract.data import Rejected, RowError, RowIndex, parse_row, raw_rows
from extract.messages import joined_parts
from shared.cli import option

REGEN_REJECT_REASONS = (
    "malformed_json",  # not valid UTF-8 JSON
    "unknown_schema",  # JSON, but neither `messages` nor `conversations` (or a bad message)
    "pretokenized",  # `input_ids` rows hold no text to regenerate
    "no_assistant_turn",  # nothing to regenerate
    "empty",  # no messages, or a prompt that renders to no tokens
    "template_error",  # the chat template failed on a prompt
    "too_long",  # a turn's prompt plus --max-new-tokens exceeds --max-length (or the server's)
    "tool_calls",  # tool use: its turns answer tools' results, which no regeneration has
)
THINKING = ("auto", "on", "off")
ENGINES = ("hf", "vllm")
SERVER_IN_FLIGHT = 64  # a thread each, waiting on the network
ENGINE_IN_FLIGHT = 1024  # vLLM's own batch on the largest GPUs (H100, H200): none left idle


@dataclass(frozen=True, kw_only=True)
class RegenConfig:
    target: str | None = option(
        None,
        help="Target model: a local Hugging Face folder or a named real target "
        "(smollm2-135m-instruct). Default: the embedded tiny demo target.",
    )
    data: tuple[Path, ...] = option(
        (),
        help="Input JSONL, parquet or arrow file(s), or Hugging Face `datasets` folders, of "
        "OpenAI `messages` or ShareGPT `conversations` rows. Several: repeat --data, or list "
        "them after it. Default: the shipped demo chats.",
    )
    out: Path = option(
        help="Output JSONL of OpenAI `messages` rows; OUT.parts/ holds chunks and resume state."
    )
    gpus: str | None = option(
        None, help="Devices: 0-4, 0,2,5, cpu or cpu:N. Default: all visible GPUs, else cpu."
    )
    max_new_tokens: int = option(512, help="Longest generated assistant turn, in tokens.")
    max_length: int | None = option(
        None,
        help="Reject a conversation when a turn's prompt plus --max-new-tokens exceeds this "
        "many tokens. Default: the context length --server reports (llama-server: a slot's), "
        "else the target's max_position_embeddings.",
    )
    batch_size: int = option(32, help="Conversations generated together on one device.")
    rows_per_chunk: int = option(256, help="Source rows per chunk (the unit of work and resume).")
    max_rows: int | None = option(None, help="Only the first N source rows (quick runs).")
    overwrite: bool = option(
        False, help="Replace an existing output that was made with other settings."
    )
    engine: str = option(
        "hf",
        choices=ENGINES,
        help="What generates here: hf (Hugging Face generate, one process per device) or vllm "
        "(vLLM in this process, tensor parallel over --gpus, default the first GPU; needs vLLM "
        "installed). Not with --server.",
    )
    server: str | None = option(
        None,
        help="URL of an OpenAI-compatible server already serving the target (vllm serve, "
        "SGLang, llama.cpp's llama-server, ...), e.g. http://localhost:8000: each turn goes to "
        "its completions endpoint (llama-server's own /completion, which returns token ids) "
        "as token ids of our chat template rendering. --target names the folder it serves "
        "(its tokenizer and template are used here).",
    )
    server_model: str | None = option(
        None, help="Model name to ask --server for. Default: the one model it lists."
    )
    concurrency: int | None = option(
        None,
        help="Conversations in flight at once: with --server (default 64, a thread each), with "
        "--engine vllm (default 1024: vLLM batches what it can hold and queues the rest).",
    )
    request_timeout: float = option(
        600.0, help="Seconds a --server request may take before it counts as timed out."
    )
    retries: int = option(
        4,
        help="Retries of a --server request that timed out, was refused or got a server error, "
        "after waits doubling from --retry-wait; then the conversation counts as failed and the "
        "next run requests it again.",
    )
    retry_wait: float = option(1.0, help="Seconds before the first retry (doubling, at most 60).")
    temperature: float = option(
        0.0, help="0: greedy decoding (default). Above 0: sampling, with --top-p and --top-k."
    )
    top_p: float = option(1.0, help="Nucleus sampling (with --temperature above 0).")
    top_k: int = option(0, help="Top-k sampling, 0 for none (with --temperature above 0).")
    seed: int = option(
        0, help="Sampling seed; with --server, each turn's request gets its own, derived from it."
    )
    thinking: str = option(
        "auto",
        choices=THINKING,
        help="The chat template's enable_thinking (Qwen3 and the like): on or off, or auto for "
        "the template's default. Recorded with the output.",
    )
    verbose: bool = option(False, help="Debug logging on every rank.")

    def __post_init__(self) -> None:
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "max_length": self.max_length is None or self.max_length >= 2,
            "batch_size": self.batch_size >= 1,
            "rows_per_chunk": self.rows_per_chunk >= 1,
            "max_rows": self.max_rows is None or self.max_rows >= 1,
            "concurrency": self.concurrency is None or self.concurrency >= 1,
            "request_timeout": self.request_timeout > 0,
            "retries": self.retries >= 0,
            "retry_wait": self.retry_wait >= 0,
            "temperature": self.temperature >= 0,
            "top_p": self.top_p > 0,
            "top_k": self.top_k >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)} is too small")
        if self.top_p > 1:
            raise ValueError(f"--top-p: {self.top_p} is above 1")
        if self.server is not None and self.engine != "hf":
            raise ValueError(f"--engine {self.engine}: the server generates; drop it or --server")
        if self.server is None:
            if self.server_model is not None:
                raise ValueError("--server-model: names a model of --server, which is not given")
            return
        if not self.server.startswith(("http://", "https://")):
            raise ValueError(f"--server: {self.server!r} is no http:// or https:// URL")
        if self.gpus is not None:
            raise ValueError("--gpus: the server's devices are its own; drop --gpus with --server")

    @property
    def in_flight(self) -> int:
        """--concurrency, or its default for the route."""
        if self.concurrency is not None:
            return self.concurrency
        return ENGINE_IN_FLIGHT if self.engine == "vllm" else SERVER_IN_FLIGHT

    @property
    def sampling(self) -> dict[str, float] | None:
        """None for greedy decoding, else the sampling parameters that are set."""
        if self.temperature == 0:
            return None
        drawn = {"temperature": self.temperature, "top_p": self.top_p}
        return {**drawn, "top_k": self.top_k} if self.top_k else drawn


class RegenError(ValueError):
    """A problem with the request, found before any work; the message says what to do."""


@dataclass(frozen=True)
class Chat:
    row: int
    source: str
    line: int
    messages: list[dict[str, Any]]


def parse_chat(raw: bytes) -> list[dict[str, Any]]:
    """The OpenAI-style messages of one JSONL row (ShareGPT converted); raises `RowError`."""
    parsed = parse_row(raw)
    if isinstance(parsed, dict):
        raise RowError("pretokenized", "a pre-tokenized row holds no text to regenerate")
    if getattr(parsed, "tools", None) or any(
        m.get("tool_calls") or m["role"] == "tool" for m in parsed
    ):
        raise RowError(
            "tool_calls",
            "a conversation with tool calls: its later turns answer the tools' results, which "
            "regeneration has no way to produce; extract such rows as they are",
        )
    return joined_parts(parsed)  # its rows are written with string contents


def iter_chats(
    files: Sequence[Path], rows: range, index: RowIndex | None = None
) -> Iterator[Chat | Rejected]:
    """One `Chat` or `Rejected` per row of `rows`, in row order (rows as in `iter_rows`)."""
    for row, source, line, raw in raw_rows(files, rows.start, rows.stop, index):
        try:
            yield Chat(row, source, line, parse_chat(raw))
        except RowError as e:
            yield Rejected(row, source, line, e.reason, e.detail)
