"""Tiny chat tokenizers for the chat and data tests: the demo tokenizer, with another template."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from extract.tiny import _demo_texts, build_tokenizer

# The tiny tokenizer's ChatML layout, but a system message after the first raises in the template.
STRICT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}"
    "{{- raise_exception('system message must come first') }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def demo_tokenizer(template: str | None = None) -> PreTrainedTokenizerFast:
    """A fresh tokenizer trained on the demo texts; `template` replaces its chat template."""
    tok = build_tokenizer(_demo_texts())
    if template is not None:
        tok.chat_template = template
    return tok
