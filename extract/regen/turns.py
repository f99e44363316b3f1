"""Assistant turns, whatever engine generates them: the prompt of a turn (our chat template's
rendering of the conversation so far, as token ids), where a generated turn ends, and a
conversation rebuilt turn by turn.

Every engine is handed token ids, never text: the template is applied here, once, so the
sequence the engine generates from is the one this module rendered. Whether extraction will see
the same tokens is checked after the fact (`Conversation.retokenized`): extraction renders the
finished conversation and tokenizes its text, and a turn's text may tokenize differently from
the ids the engine produced (a byte-level BPE has several token sequences for one string).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extract.chat import ChatTemplateError, render_chat
from extract.data import RowError
from extract.regen.config import Chat, RegenError

THINKING_KWARGS = {"auto": None, "on": {"enable_thinking": True}, "off": {"enable_thinking": False}}


@dataclass(frozen=True)
class Turn:
    token_ids: list[int]  # without the eos that ended it
    at_limit: bool  # stopped by max_new_tokens, not by eos


def end_turn(new_ids: Iterable[int], eos: Container[int], *, stopped: bool = False) -> Turn:
    """The turn in `new_ids`: up to its first eos (after which a batched row holds padding).
    Without one it ran to max_new_tokens, unless the engine reports that it `stopped` at an eos
    it left out of the ids.

    >>> end_turn([5, 6, 2, 0, 0], {2})
    Turn(token_ids=[5, 6], at_limit=False)
    >>> end_turn([5, 6], {2}), end_turn([5, 6], {2}, stopped=True)
    (Turn(token_ids=[5, 6], at_limit=True), Turn(token_ids=[5, 6], at_limit=False))
    """
    new = list(new_ids)
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    if stop is not None:
        return Turn(new[:stop], False)
    return Turn(new, not stopped)


def eos_ids(generation_eos: int | list[int] | None, tokenizer: Any) -> set[int]:
    """The tokens that end a turn: the checkpoint's generation config ones plus the
    tokenizer's (Qwen3 instruct lists both `<|im_end|>` and `<|endoftext|>`)."""
    eos = set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    eos.discard(None)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    if not eos:
        raise RegenError("the target's tokenizer and generation config name no eos token")
    return eos


def target_eos(target: str, tokenizer: Any) -> set[int]:
    """`eos_ids` of a target folder without loading its weights: generation_config.json, or
    the config's defaults where there is none (as `from_pretrained` does)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(target)
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(target))
    return eos_ids(generation.eos_token_id, tokenizer)


class Prompter:
    """A turn's prompt as token ids, and a turn's ids back to text."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        max_length: int | None,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        self.template_kwargs = template_kwargs

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation with the template's generation prompt."""
        try:
            text = render_chat(
                self.tokenizer,
                messages,
                add_generation_prompt=True,
                template_kwargs=self.template_kwargs,
            )
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

    def decode(self, token_ids: list[int]) -> str:
        # Special tokens stay: the text must render back to what the target produced.
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def extraction_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens extraction reads for these messages (its template call: no kwargs)."""
        try:
            text = render_chat(self.tokenizer, messages)
        except ChatTemplateError:
            return []
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Conversation:
    """One chat being regenerated: its messages so far, the next one to copy or regenerate,
    and each generated turn's (prompt ids, new ids)."""

    chat: Chat
    out: list[dict[str, Any]] = field(default_factory=list)
    next: int = 0  # index in chat.messages of the next message to copy or regenerate
    at_limit: list[int] = field(default_factory=list)
    generated: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def advance(self) -> bool:
        """Copy the messages before the next assistant turn; False when no turn is left."""
        messages = self.chat.messages
        while self.next < len(messages) and messages[self.next]["role"] != "assistant":
            self.out.append(messages[self.next])
            self.next += 1
        return self.next < len(messages)

    def answer(self, prompter: Prompter, prompt: list[int], turn: Turn) -> None:
        if turn.at_limit:
            self.at_limit.append(len(self.out))
        self.out.append({"role": "assistant", "content": prompter.decode(turn.token_ids)})
        self.generated.append((prompt, turn.token_ids))
        self.next += 1

    def retokenized(self, prompter: Prompter) -> int:
        """Generated turns whose prompt and new tokens are not what extraction will read at
        their place in the finished conversation."""
        seen = prompter.extraction_ids(self.out)
        return sum(seen[: len(p) + len(new)] != p + new for p, new in self.generated)

    def row(self) -> dict[str, Any]:
        return {"messages": self.out, "source_row": self.chat.row, "turns_at_limit": self.at_limit}
