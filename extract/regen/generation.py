"""Regeneration of assistant turns in batches on one device: `BatchGenerator` (Hugging Face
`generate`, greedy or sampled) and `regenerate_chats` (every assistant turn of a list of chats,
in rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from extract.data import Rejected, RowError
from extract.regen.config import Chat
from extract.regen.state import ChunkResult
from extract.regen.turns import Conversation, Prompter, Turn, end_turn, eos_ids


class BatchGenerator:
    """Batched generation on one device (left padding + attention mask); each row stops at an
    eos. Greedy unless `sampling` asks for temperature, top_p and top_k."""

    def __init__(
        self,
        model: Any,
        prompter: Prompter,
        *,
        sampling: Mapping[str, float] | None = None,
    ):
        from transformers import GenerationConfig

        self.model, self.prompter = model, prompter
        self.eos = eos_ids(model.generation_config.eos_token_id, prompter.tokenizer)
        pad = prompter.tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.eos)
        eos = sorted(self.eos)
        # A fresh config replaces the checkpoint's: its sampling settings, repetition penalty and
        # the like would otherwise fill every field left unset here. Greedy = argmax each step.
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=self.pad)
        drawn = dict(sampling or {})
        if drawn:  # top_k 0 turns top-k off; left unset, GenerationConfig's default 50 applies
            drawn.setdefault("top_k", 0)
        self.config = GenerationConfig(
            do_sample=bool(drawn),
            max_new_tokens=prompter.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=self.pad,
            **drawn,
        )

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
        return [end_turn(new, self.eos) for new in out_BT[:, width:].tolist()]


def regenerate_chats(
    chats: Sequence[Chat],
    gen: BatchGenerator,
    *,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> ChunkResult:
    """Regenerate every assistant turn of `chats`, in rounds: round r generates the r-th
    assistant turn of every conversation that has one, `batch_size` prompts at a time (sorted by
    length, so a batch pads little). `progress(rows_finished, new_tokens)` after each batch."""
    result = ChunkResult(rows=[], rejected=[])
    convs = [Conversation(c) for c in chats]
    active = [c for c in convs if c.advance()]
    failed: set[int] = set()
    report = progress or (lambda rows, tokens: None)
    while active:
        ready = []
        for c in active:
            try:
                ready.append((c, gen.prompter.prompt(c.out)))
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
            for (c, prompt), turn in zip(batch, turns, strict=True):
                c.answer(gen.prompter, prompt, turn)
                result.turns += 1
                result.turns_at_limit += turn.at_limit
                result.new_tokens += len(turn.token_ids)
                if c.advance():
                    active.append(c)
                else:
                    result.turns_retokenized += c.retokenized(gen.prompter)
                    finished += 1
            report(finished, sum(len(t.token_ids) for t in turns))
    result.rows = [c.row() for c in convs if c.chat.row not in failed]
    result.rejected.sort(key=lambda r: r.row)
    return result
