"""Greedy regeneration of assistant turns: `GreedyGenerator` (batched greedy decoding on one
device) and `regenerate_chats` (every assistant turn of a list of chats, in rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from extract.chat import ChatTemplateError, render_chat
from extract.data import Rejected, RowError
from extract.regen.config import Chat, RegenError
from extract.regen.state import ChunkResult


@dataclass(frozen=True)
class Turn:
    token_ids: list[int]  # without the eos that ended it
    at_limit: bool  # stopped by max_new_tokens, not by eos


class GreedyGenerator:
    """Batched greedy generation (left padding + attention mask); each row stops at an eos.

    eos: the tokenizer's plus the checkpoint's generation_config ones (Qwen3 instruct lists both
    `<|im_end|>` and `<|endoftext|>`).
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int, max_length: int | None):
        from transformers import GenerationConfig

        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if not eos:
            raise RegenError("the target's tokenizer and generation config name no eos token")
        self.eos = eos
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(eos)
        # A fresh config replaces the checkpoint's: its sampling settings, repetition penalty and
        # the like would otherwise fill every field left unset here. Greedy = argmax each step.
        model.generation_config = GenerationConfig(eos_token_id=sorted(eos), pad_token_id=self.pad)
        self.config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos),
            pad_token_id=self.pad,
        )

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation with the template's generation prompt."""
        try:
            text = render_chat(self.tokenizer, messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise RowError("template_error", str(e)) from e
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RowError("empty", "the chat template rendered no tokens")
        if self.max_length is not None and len(ids) + self.max_new_tokens > self.max_length:
            raise RowError(
                "too_long", f"prompt of {len(ids)} tokens + {self.max_new_tokens} new tokens"
            )
        return ids

    def generate(self, prompts: Sequence[list[int]]) -> list[Turn]:
        width = max(len(p) for p in prompts)
        ids_BS = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask_BS = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids_BS[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask_BS[b, width - len(p) :] = 1
        device = self.model.device
        with torch.inference_mode():
            out_BT = self.model.generate(
                input_ids=ids_BS.to(device),
                attention_mask=mask_BS.to(device),
                generation_config=self.config,
            )
        turns = []
        for new in out_BT[:, width:].tolist():
            # After its eos a finished row is filled with pad until the batch ends; a row without
            # eos ran to max_new_tokens.
            stop = next((i for i, t in enumerate(new) if t in self.eos), None)
            turns.append(Turn(new, True) if stop is None else Turn(new[:stop], False))
        return turns

    def decode(self, token_ids: list[int]) -> str:
        # Special tokens stay: the text must render back to what the target produced.
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


@dataclass
class _Conversation:
    chat: Chat
    out: list[dict[str, Any]] = field(default_factory=list)
    next: int = 0  # index in chat.messages of the next message to copy or regenerate
    at_limit: list[int] = field(default_factory=list)

    def advance(self) -> bool:
        """Copy the messages before the next assistant turn; False when no turn is left."""
        messages = self.chat.messages
        while self.next < len(messages) and messages[self.next]["role"] != "assistant":
            self.out.append(messages[self.next])
            self.next += 1
        return self.next < len(messages)

    def answer(self, text: str, at_limit: bool) -> None:
        if at_limit:
            self.at_limit.append(len(self.out))
        self.out.append({"role": "assistant", "content": text})
        self.next += 1

    def row(self) -> dict[str, Any]:
        return {"messages": self.out, "source_row": self.chat.row, "turns_at_limit": self.at_limit}


def regenerate_chats(
    chats: Sequence[Chat],
    gen: GreedyGenerator,
    *,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> ChunkResult:
    """Regenerate every assistant turn of `chats`, in rounds: round r generates the r-th
    assistant turn of every conversation that has one, `batch_size` prompts at a time (sorted by
    length, so a batch pads little). `progress(rows_finished, new_tokens)` after each batch."""
    result = ChunkResult(rows=[], rejected=[])
    convs = [_Conversation(c) for c in chats]
    active = [c for c in convs if c.advance()]
    failed: set[int] = set()
    report = progress or (lambda rows, tokens: None)
    while active:
        ready = []
        for c in active:
            try:
                ready.append((c, gen.prompt(c.out)))
            except RowError as e:
                failed.add(c.chat.row)
                chat = c.chat
                result.rejected.append(
                    Rejected(chat.row, chat.source, chat.line, e.reason, e.detail)
                )
        report(len(active) - len(ready), 0)
        ready.sort(key=lambda item: len(item[1]))
        active = []
        for start in range(0, len(ready), batch_size):
            batch = ready[start : start + batch_size]
            turns = gen.generate([p for _, p in batch])
            finished = 0
            for (c, _), turn in zip(batch, turns, strict=True):
                c.answer(gen.decode(turn.token_ids), turn.at_limit)
                result.turns += 1
                result.turns_at_limit += turn.at_limit
                result.new_tokens += len(turn.token_ids)
                if c.advance():
                    active.append(c)
                else:
                    finished += 1
            report(finished, sum(len(t.token_ids) for t in turns))
    result.rows = [c.row() for c in convs if c.chat.row not in failed]
    result.rejected.sort(key=lambda r: r.row)
    return result
