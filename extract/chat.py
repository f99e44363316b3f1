"""Chat conversations -> token ids and a loss mask on the assistant turns, for any HF template.

The mask covers every assistant turn from right after its header (`<|im_start|>assistant\\n` in
ChatML) through its end-of-turn token (`<|im_end|>`) inclusive; everything else (system and user
turns, headers, the newline after `<|im_end|>`) is 0. One conversation gives one sequence.

How assistant turns are found, in the rendered text, then mapped to tokens by char offsets:

1. Prefix method (exact, used whenever it applies): for assistant message i, the turn starts where
   `render(messages[:i], add_generation_prompt=True)` ends and ends where
   `render(messages[:i + 1])` ends, minus trailing whitespace. Valid only if both renders are
   prefixes of the full rendering, i.e. the template is prefix-consistent.
2. Marker method (fallback): some templates render earlier turns differently once later turns
   exist (Qwen3 drops `<think>` reasoning from assistant turns before the last user message and
   adds an empty think block to the final turn), so prefixes do not match. The assistant header
   and end-of-turn marker are then learnt from probe conversations, and each assistant turn is
   the text from a header occurrence through the next end-of-turn marker. It requires the header
   to occur exactly once per assistant message.

A token is supervised iff its first char lies inside an assistant span.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the type only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]
_PROBE_USER, _PROBE_ASSISTANT = "PROBEUSERTEXT", "PROBEASSISTANTTEXT"


class ChatTemplateError(ValueError):
    """The chat template failed to render the conversation, or its turns could not be located."""


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation rendered by the tokenizer's chat template, as text."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    # Templates are third-party Jinja code that may raise anything (raise_exception(), missing
    # keys, type errors); a bad row must be rejected, not crash the run.
    except Exception as e:
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"template rendered {type(text).__name__}, expected str")
    return text


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    text: str,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[tuple[int, int]]:
    """Char spans `[start, end)` in `text` (the full rendering) of each assistant turn."""
    spans = _spans_by_prefix(tokenizer, messages, text, template_kwargs)
    if spans is None:
        spans = _spans_by_markers(tokenizer, messages, text, template_kwargs)
    return spans


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`(input_ids_T int32, loss_mask_T uint8)` of one conversation.

    Example: ChatML `[user "Hi", assistant "Hello"]` renders
    `<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n` and the mask
    is 1 exactly on the tokens of `Hello<|im_end|>`.
    """
    text = render_chat(tokenizer, messages, template_kwargs=template_kwargs)
    spans = assistant_spans(tokenizer, messages, text, template_kwargs=template_kwargs)
    try:
        # The template already wrote any BOS it wants: add nothing (as apply_chat_template does).
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as e:  # slow tokenizers have no offsets
        raise ChatTemplateError(f"tokenizer gives no char offsets: {e}") from e
    ids_T = np.asarray(enc["input_ids"], dtype=np.int32)
    starts_T = np.asarray([start for start, _ in enc["offset_mapping"]], dtype=np.int64)
    mask_T = np.zeros(len(ids_T), dtype=np.uint8)
    for start, end in spans:
        mask_T[(starts_T >= start) & (starts_T < end)] = 1
    return ids_T, mask_T


def _spans_by_prefix(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    text: str,
    template_kwargs: Mapping[str, Any] | None,
) -> list[tuple[int, int]] | None:
    """Spans from renders of each prefix, or None where the template is not prefix-consistent."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:
            before = render_chat(
                tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=template_kwargs
            )
            through = render_chat(tokenizer, messages[: i + 1], template_kwargs=template_kwargs)
        except ChatTemplateError:  # e.g. a template that refuses an empty or partial chat
            return None
        start, end = len(before), len(through.rstrip())
        if not (text.startswith(before) and text.startswith(through) and end > start):
            return None
        spans.append((start, end))
    return spans


def _spans_by_markers(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    text: str,
    template_kwargs: Mapping[str, Any] | None,
) -> list[tuple[int, int]]:
    """Spans from header .. end-of-turn marker occurrences; see the module docstring."""
    header, end_of_turn = _turn_markers(tokenizer, template_kwargs)
    expected = sum(1 for m in messages if m.get("role") == "assistant")
    if text.count(header) != expected:
        raise ChatTemplateError(
            f"assistant header {header!r} occurs {text.count(header)} times for "
            f"{expected} assistant messages"
        )
    spans, pos = [], 0
    for _ in range(expected):
        start = text.index(header, pos) + len(header)
        stop = text.find(end_of_turn, start)
        if stop < 0:
            raise ChatTemplateError(f"assistant turn at char {start} has no {end_of_turn!r}")
        pos = stop + len(end_of_turn)
        spans.append((start, pos))
    return spans


def _turn_markers(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None
) -> tuple[str, str]:
    """(assistant header, end-of-turn marker) of the template, learnt from probe chats.

    The header is taken from an assistant turn that is not the last message, the form every
    earlier turn has; the end-of-turn marker is what follows the last assistant message's content,
    without trailing whitespace.
    """
    user = {"role": "user", "content": _PROBE_USER}
    assistant = {"role": "assistant", "content": _PROBE_ASSISTANT}
    kw = {"template_kwargs": template_kwargs}
    one = render_chat(tokenizer, [user], **kw)
    middle = render_chat(tokenizer, [user, assistant, user], **kw)
    last = render_chat(tokenizer, [user, assistant], **kw)
    content_at = middle.find(_PROBE_ASSISTANT, len(one))
    if not middle.startswith(one) or content_at < 0 or _PROBE_ASSISTANT not in last:
        raise ChatTemplateError("cannot locate the assistant turn in the template's output")
    header = middle[len(one) : content_at]
    end_of_turn = last[last.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT) :].rstrip()
    if not header.strip() or not end_of_turn:
        raise ChatTemplateError(f"template has no assistant header {header!r} or end of turn")
    return header, end_of_turn
