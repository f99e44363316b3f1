"""Chat template rendering and assistant loss masks (extract/chat.py)."""

from __future__ import annotations

import numpy as np
import pytest

from extract.chat import ChatTemplateError, assistant_spans, render_chat, tokenize_chat
from tests.chats import STRICT_TEMPLATE, demo_tokenizer

# A Qwen3-style template: reasoning (`<think>...</think>`) is dropped from assistant turns before
# the last user message, and the final assistant turn always gets a think block (empty if none).
# So `render(messages[:i + 1])` is not a prefix of the full rendering for earlier turns.
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A Llama-3-style template: BOS written by the template, other header and end-of-turn markers.
LLAMA3_LIKE_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def supervised_segments(tokenizer, ids_T: np.ndarray, mask_T: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    segments, run = [], []
    for token, supervised in zip(ids_T.tolist(), mask_T.tolist(), strict=True):
        if supervised:
            run.append(token)
        elif run:
            segments.append(tokenizer.decode(run))
            run = []
    if run:
        segments.append(tokenizer.decode(run))
    return segments


def test_single_turn_masks_exactly_the_answer_and_end_of_turn(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
    ]
    ids_T, mask_T = tokenize_chat(tokenizer, messages)
    assert ids_T.dtype == np.int32 and mask_T.dtype == np.uint8
    assert supervised_segments(tokenizer, ids_T, mask_T) == ["2 plus 3 is 5.<|im_end|>"]
    # Everything up to and including the assistant header is unsupervised, and so is the
    # newline after <|im_end|>.
    header = "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    n_header = len(tokenizer(header, add_special_tokens=False)["input_ids"])
    assert not mask_T[:n_header].any() and mask_T[n_header] == 1
    assert tokenizer.decode(ids_T[-1:]) == "\n" and mask_T[-1] == 0
    assert tokenizer.decode(ids_T[mask_T == 1][-1:]) == "<|im_end|>"


def test_ids_equal_hugging_face_chat_template_tokenization(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Spell 'moon' backwards."},
        {"role": "assistant", "content": "noom"},
    ]
    ids_T, _ = tokenize_chat(tokenizer, messages)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
    assert ids_T.tolist() == list(expected["input_ids"])


def test_multi_turn_masks_every_assistant_turn_once(tokenizer):
    messages = [
        {"role": "user", "content": "What is 4 times 5?"},
        {"role": "assistant", "content": "4 times 5 is 20."},
        {"role": "user", "content": "And if you double that?"},
        {"role": "assistant", "content": "Doubling 20 gives 40."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome!"},
    ]
    ids_T, mask_T = tokenize_chat(tokenizer, messages)
    assert supervised_segments(tokenizer, ids_T, mask_T) == [
        "4 times 5 is 20.<|im_end|>",
        "Doubling 20 gives 40.<|im_end|>",
        "You're welcome!<|im_end|>",
    ]
    # One sequence for the whole conversation: each user question occurs once.
    assert tokenizer.decode(ids_T).count("What is 4 times 5?") == 1


def test_system_prompt_and_trailing_user_turn_are_unsupervised(tokenizer):
    messages = [
        {"role": "system", "content": "Always answer in capital letters."},
        {"role": "user", "content": "What sound does a cow make?"},
        {"role": "assistant", "content": "A COW SAYS 'MOO'."},
        {"role": "user", "content": "Thanks!"},
    ]
    ids_T, mask_T = tokenize_chat(tokenizer, messages)
    assert supervised_segments(tokenizer, ids_T, mask_T) == ["A COW SAYS 'MOO'.<|im_end|>"]


def test_marker_fallback_on_a_template_that_drops_earlier_reasoning():
    tok = demo_tokenizer(QWEN3_LIKE_TEMPLATE)
    messages = [
        {"role": "user", "content": "What is 7 plus 8?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n7 plus 8 is 15."},
        {"role": "user", "content": "And if you double that?"},
        {"role": "assistant", "content": "Doubling 15 gives 30."},
    ]
    text = render_chat(tok, messages)
    assert "add them" not in text  # earlier reasoning dropped: prefixes do not match
    assert not text.startswith(render_chat(tok, messages[:2]))
    ids_T, mask_T = tokenize_chat(tok, messages)
    assert supervised_segments(tok, ids_T, mask_T) == [
        "7 plus 8 is 15.<|im_end|>",
        "<think>\n\n</think>\n\nDoubling 15 gives 30.<|im_end|>",
    ]


def test_reasoning_of_the_final_turn_is_supervised():
    tok = demo_tokenizer(QWEN3_LIKE_TEMPLATE)
    messages = [
        {"role": "user", "content": "Is 9 even or odd?"},
        {"role": "assistant", "content": "<think>\n9 = 2*4 + 1\n</think>\n\n9 is odd."},
    ]
    ids_T, mask_T = tokenize_chat(tok, messages)
    assert supervised_segments(tok, ids_T, mask_T) == [
        "<think>\n9 = 2*4 + 1\n</think>\n\n9 is odd.<|im_end|>"
    ]


def test_both_span_methods_agree_on_a_prefix_consistent_template(tokenizer):
    from extract.chat import _spans_by_markers, _spans_by_prefix

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of Peru?"},
        {"role": "assistant", "content": "The capital of Peru is Lima."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    text = render_chat(tokenizer, messages)
    by_prefix = _spans_by_prefix(tokenizer, messages, text, None)
    assert by_prefix is not None
    assert by_prefix == _spans_by_markers(tokenizer, messages, text, None)
    assert [text[a:b] for a, b in by_prefix] == [
        "The capital of Peru is Lima.<|im_end|>",
        "You're welcome.<|im_end|>",
    ]


def test_other_template_markers_and_template_written_bos():
    tok = demo_tokenizer(LLAMA3_LIKE_TEMPLATE)
    messages = [
        {"role": "user", "content": "What color is snow?"},
        {"role": "assistant", "content": "Snow is white. "},
    ]
    text = render_chat(tok, messages)
    assert text.startswith("<|begin_of_text|>")
    assert [text[a:b] for a, b in assistant_spans(tok, messages, text)] == [
        "Snow is white.<|eot_id|>"
    ]
    ids_T, mask_T = tokenize_chat(tok, messages)
    assert supervised_segments(tok, ids_T, mask_T) == ["Snow is white.<|eot_id|>"]


def test_template_failures_raise_chat_template_error():
    tok = demo_tokenizer(STRICT_TEMPLATE)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Late system prompt."},
        {"role": "assistant", "content": "Hello there."},
    ]
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        tokenize_chat(tok, messages)


def test_marker_fallback_refuses_an_ambiguous_header():
    tok = demo_tokenizer(QWEN3_LIKE_TEMPLATE)
    messages = [
        {"role": "user", "content": "Say <|im_start|>assistant\n please."},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nNo."},
        {"role": "user", "content": "Ok."},
        {"role": "assistant", "content": "Bye."},
    ]
    with pytest.raises(ChatTemplateError, match="occurs 3 times for 2 assistant messages"):
        tokenize_chat(tok, messages)
