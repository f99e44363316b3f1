"""Source rows -> Tokenized / Rejected (extract/data.py) and the shipped demo dataset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from extract.chat import tokenize_chat
from extract.data import (
    REJECT_REASONS,
    Rejected,
    Tokenized,
    count_rows,
    demo_dataset,
    index_rows,
    iter_rows,
    source_fingerprint,
    template_fingerprint,
)
from tests.chats import STRICT_TEMPLATE, demo_tokenizer
from tests.make_demo_data import demo_text

CHAT = [
    {"role": "user", "content": "What is the opposite of 'hot'?"},
    {"role": "assistant", "content": "The opposite of 'hot' is 'cold'."},
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def chat_row(content: str) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": content}]}
    )


def test_demo_dataset_is_the_generators_output_and_small():
    assert demo_dataset().read_text(encoding="utf-8") == demo_text()
    assert demo_dataset().stat().st_size < 300_000
    rows = [json.loads(line) for line in demo_dataset().read_text().splitlines()]
    assert 300 <= len(rows) <= 600
    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in rows]
    with_system = [r["messages"][0]["role"] == "system" for r in rows]
    assert turns.count(1) > 50 and sum(t > 1 for t in turns) > 50 and sum(with_system) > 50


def test_every_demo_row_is_kept(tokenizer):
    out = list(iter_rows([demo_dataset()], tokenizer, max_length=4096))
    assert [type(o) for o in out] == [Tokenized] * count_rows([demo_dataset()])[0]
    assert [o.row for o in out] == list(range(len(out)))
    assert not any(o.truncated for o in out)


def test_sharegpt_row_equals_the_same_openai_row(tokenizer, tmp_path):
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is 3 plus 4?"},
            {"from": "gpt", "value": "7"},
            {"from": "user", "value": "Thanks!"},
            {"from": "assistant", "value": "You're welcome."},
        ]
    }
    roles = {"system": "system", "human": "user", "user": "user"}
    openai = {
        "messages": [
            {"role": roles.get(t["from"], "assistant"), "content": t["value"]}
            for t in sharegpt["conversations"]
        ]
    }
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps(sharegpt), json.dumps(openai)])
    a, b = iter_rows([path], tokenizer, max_length=512)
    assert isinstance(a, Tokenized) and isinstance(b, Tokenized)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    ids_T, mask_T = tokenize_chat(tokenizer, openai["messages"])
    np.testing.assert_array_equal(a.input_ids, ids_T)
    np.testing.assert_array_equal(a.loss_mask, mask_T)


def test_pretokenized_row_passes_through(tokenizer, tmp_path):
    row = {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]}
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps(row)])
    (out,) = iter_rows([path], tokenizer, max_length=512)
    assert isinstance(out, Tokenized)
    assert out.input_ids.dtype == np.int32 and out.loss_mask.dtype == np.uint8
    assert out.input_ids.tolist() == row["input_ids"]
    assert out.loss_mask.tolist() == row["loss_mask"]


def test_each_reject_reason_with_its_line_number(tokenizer, tmp_path):
    vocab = len(tokenizer)
    lines = {
        "ok": chat_row("Fine, thanks."),
        "malformed_json": '{"messages": [',
        "unknown_schema": json.dumps({"text": "plain text"}),
        "bad_tokens": json.dumps({"input_ids": [1, 2, vocab], "loss_mask": [0, 1, 1]}),
        "no_assistant_turn": json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
        "empty": json.dumps({"messages": []}),
        "too_few_supervised_tokens": chat_row(""),  # only <|im_end|> is supervised
        "template_error": json.dumps(
            {"messages": [CHAT[0], {"role": "system", "content": "late"}, CHAT[1]]}
        ),
    }
    # Blank and whitespace-only lines are not rows but still count as physical lines.
    text = "\n".join([lines["ok"], "", "   "] + list(lines.values())[1:]) + "\n"
    path = tmp_path / "rows.jsonl"
    path.write_text(text, encoding="utf-8")
    tokenizer = demo_tokenizer(STRICT_TEMPLATE)
    out = list(iter_rows([path], tokenizer, max_length=512))
    assert isinstance(out[0], Tokenized) and (out[0].row, out[0].line) == (0, 1)
    rejected = out[1:]
    assert all(isinstance(r, Rejected) for r in rejected)
    assert [r.reason for r in rejected] == list(lines)[1:]
    assert [r.row for r in rejected] == list(range(1, len(lines)))
    assert [r.line for r in rejected] == list(range(4, 4 + len(lines) - 1))
    assert all(r.source == str(path) for r in out)
    assert set(REJECT_REASONS) == set(lines) - {"ok"}
    assert "system message must come first" in rejected[-1].detail


@pytest.mark.parametrize(
    "row",
    [
        {"input_ids": [1, 2, 3], "loss_mask": [1, 1]},  # lengths differ
        {"input_ids": [1, 2, 3]},  # no mask
        {"input_ids": [1, 2.0, 3], "loss_mask": [1, 1, 1]},  # float id
        {"input_ids": [1, True, 3], "loss_mask": [1, 1, 1]},  # bool id
        {"input_ids": [1, -1, 3], "loss_mask": [1, 1, 1]},  # negative id
        {"input_ids": [1, 2, 3], "loss_mask": [1, 2, 1]},  # mask not 0/1
        {"input_ids": "1 2 3", "loss_mask": [1, 1, 1]},  # not a list
    ],
)
def test_bad_pretokenized_rows(tokenizer, tmp_path, row):
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps(row)])
    (out,) = iter_rows([path], tokenizer, max_length=512)
    assert isinstance(out, Rejected) and out.reason == "bad_tokens"


@pytest.mark.parametrize(
    "line, reason",
    [
        ("\udcff", "malformed_json"),  # written below as an invalid UTF-8 byte
        ("[1, 2]", "unknown_schema"),
        ("null", "unknown_schema"),
        ('{"messages": 5}', "unknown_schema"),
        ('{"messages": [{"role": "user"}]}', "unknown_schema"),
        ('{"messages": [{"role": "user", "content": ["a"]}]}', "unknown_schema"),
        ('{"messages": [{"role": "user", "content": []}]}', "unknown_schema"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "unknown_schema"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
            "unknown_schema",
        ),
        ('{"conversations": [{"from": "tool", "value": "x"}]}', "unknown_schema"),
        ('{"conversations": []}', "empty"),
        ('{"input_ids": [], "loss_mask": []}', "empty"),
        ('{"input_ids": [1, 2, 3, 4], "loss_mask": [1, 0, 1, 0]}', "too_few_supervised_tokens"),
        ("[" * 100_000, "malformed_json"),
    ],
)
def test_garbage_is_rejected_never_raised(tokenizer, tmp_path, line, reason):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(line.encode("utf-8", errors="surrogateescape") + b"\n")
    (out,) = iter_rows([path], tokenizer, max_length=512)
    assert isinstance(out, Rejected) and out.reason == reason and out.line == 1


def test_text_parts_read_as_their_texts_joined_by_newlines(tokenizer, tmp_path):
    """OpenAI content parts (`[{"type": "text", "text": ...}]`) give the tokens and mask of the
    string vLLM's server makes of them; an image part names itself in the rejection."""
    parts = [
        {"type": "text", "text": "What is the opposite"},
        {"type": "text", "text": "of 'hot'?"},
    ]
    answer = [{"type": "text", "text": "The opposite of 'hot' is 'cold'."}]
    as_parts = {
        "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]
    }
    as_text = {
        "messages": [{"role": "user", "content": "What is the opposite\nof 'hot'?"}, CHAT[1]]
    }
    image = [{"type": "image_url", "image_url": {"url": "x.png"}}, *parts]
    with_image = {"messages": [{"role": "user", "content": image}, CHAT[1]]}
    rows = [json.dumps(r) for r in (as_parts, as_text, with_image)]
    a, b, c = iter_rows([write_lines(tmp_path / "p.jsonl", rows)], tokenizer, max_length=512)
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert isinstance(c, Rejected) and c.reason == "unknown_schema"
    assert "image_url content parts: only text parts are read" in c.detail


# ChatML whose template reads a content given as parts itself (a multimodal model's does).
PARTS_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string %}{{- m.content }}"
    "{%- else %}{%- for p in m.content %}{{- p.text }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_reads_parts_gets_them_as_they_are(tmp_path):
    tok = demo_tokenizer(PARTS_TEMPLATE)
    parts = [
        {"type": "text", "text": "What is the opposite"},
        {"type": "text", "text": " of 'hot'?"},
    ]
    as_parts = {"messages": [{"role": "user", "content": parts}, CHAT[1]]}
    as_text = {"messages": [{"role": "user", "content": "What is the opposite of 'hot'?"}, CHAT[1]]}
    rows = [json.dumps(as_parts), json.dumps(as_text)]
    a, b = iter_rows([write_lines(tmp_path / "p.jsonl", rows)], tok, max_length=512)
    assert np.array_equal(a.input_ids, b.input_ids)  # the template's own rendering: no newline


# A ChatML template with tool use in Qwen3's manner (tools in a system turn, calls in the
# assistant turn, results in a user turn); FORGETFUL_TEMPLATE leaves the calls out.
_TURNS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "CALLS"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for t in tools %}{{- t.function.name + ': ' + t.function.description + '\\n' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
_CALLS = (
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + c.function.name + ' ' }}"
    "{{- c.function.arguments | tojson }}{{- '</tool_call>' }}{%- endfor %}"
)
TOOL_TEMPLATE = _TOOLS + _TURNS.replace("CALLS", _CALLS)
FORGETFUL_TEMPLATE = _TOOLS + _TURNS.replace("CALLS", "")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather now"}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
TOOL_ROW = {
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "cold and windy"},
        {"role": "assistant", "content": "It is cold in Oslo."},
    ],
}


def test_tool_calls_are_supervised_and_tools_and_results_are_not(tmp_path):
    tok = demo_tokenizer(TOOL_TEMPLATE)
    (out,) = iter_rows(
        [write_lines(tmp_path / "t.jsonl", [json.dumps(TOOL_ROW)])], tok, max_length=512
    )
    assert isinstance(out, Tokenized), out
    text = tok.decode(out.input_ids)
    assert "# Tools" in text and "get_weather: weather now" in text  # the row's tools, rendered
    supervised = tok.decode(out.input_ids[out.loss_mask == 1])
    assert '<tool_call>get_weather {"city": "Oslo"}</tool_call>' in supervised
    assert "It is cold in Oslo." in supervised
    assert "cold and windy" not in supervised and "weather now" not in supervised


def test_tool_calls_a_template_leaves_out_reject_the_row(tmp_path):
    rows = [json.dumps(TOOL_ROW)]
    no_content = {"messages": [CHAT[0], {"role": "assistant", "content": None}]}
    bad_tools = {**TOOL_ROW, "tools": "get_weather"}
    rows += [json.dumps(no_content), json.dumps(bad_tools)]
    path = write_lines(tmp_path / "t.jsonl", rows)
    forgot, no_content, bad_tools = iter_rows(
        [path], demo_tokenizer(FORGETFUL_TEMPLATE), max_length=512
    )
    assert forgot.reason == "template_error" and "does not render tool calls" in forgot.detail
    assert no_content.reason == "unknown_schema" and "has no content" in no_content.detail
    assert bad_tools.reason == "unknown_schema" and "tools is not a list" in bad_tools.detail


def test_truncation_is_flagged_and_checked_after_the_cut(tokenizer, tmp_path):
    long_answer = "The capital of Norway is Oslo. " * 20
    row = {"messages": CHAT[:1] + [{"role": "assistant", "content": long_answer}]}
    (full,) = iter_rows(
        [write_lines(tmp_path / "a.jsonl", [json.dumps(row)])], tokenizer, max_length=4096
    )
    keep = int(np.argmax(full.loss_mask)) + 4  # cut four tokens into the answer
    # Supervised only on the two tokens past the cut.
    late = {"input_ids": [7] * (keep + 2), "loss_mask": [0] * keep + [1, 1]}
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps(row), json.dumps(late)])
    cut, late_out = iter_rows([path], tokenizer, max_length=keep)
    assert not full.truncated and len(full.input_ids) > keep
    assert cut.truncated and len(cut.input_ids) == keep and cut.loss_mask.sum() == 4
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:keep])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[:keep])
    assert isinstance(late_out, Rejected) and late_out.reason == "too_few_supervised_tokens"
    assert f"in its first {keep} tokens (--max-length)" in late_out.detail


def test_count_rows_skips_blank_lines(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_bytes(b'{"x": 1}\n\n  \n{"x": 2}\r\n\t\n{"x": 3}')  # no final newline
    b = tmp_path / "b.jsonl"
    b.write_bytes(b"")
    c = write_lines(tmp_path / "c.jsonl", ["not json"])
    assert count_rows([a, b, c]) == [3, 0, 1]


def test_row_ranges_across_files_with_and_without_an_index(tokenizer, tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [chat_row(f"Answer {i} here.") for i in range(5)])
    b = write_lines(tmp_path / "b.jsonl", ["", chat_row("B0 answer."), "", chat_row("B1 answer.")])
    c = write_lines(tmp_path / "c.jsonl", [chat_row(f"C{i} answer.") for i in range(4)])
    files = [a, b, c]
    every = [(r.row, r.source, r.line) for r in iter_rows(files, tokenizer, max_length=512)]
    assert every[5:7] == [(5, str(b), 2), (6, str(b), 4)]
    assert every[7] == (7, str(c), 1) and len(every) == 11
    index = index_rows(files, every=2)
    assert index.counts == (5, 2, 4)
    for start, stop in [(0, 11), (3, 8), (5, 6), (6, 10), (9, 11), (10, 20), (4, 4)]:
        want = every[start:stop]
        got = iter_rows(files, tokenizer, max_length=512, rows=range(start, stop))
        assert [(r.row, r.source, r.line) for r in got] == want
        got = iter_rows(files, tokenizer, max_length=512, rows=range(start, stop), index=index)
        assert [(r.row, r.source, r.line) for r in got] == want


def test_reading_stops_after_the_range(tokenizer, tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [chat_row("One answer."), chat_row("Two answer.")])
    missing = tmp_path / "never-opened.jsonl"
    out = list(iter_rows([a, missing], tokenizer, max_length=512, rows=range(0, 2)))
    assert [r.row for r in out] == [0, 1]
    with pytest.raises(FileNotFoundError):  # a missing file in range is the caller's error
        list(iter_rows([a, missing], tokenizer, max_length=512, rows=range(1, 3)))


def test_source_fingerprint_is_the_sha256_of_the_bytes(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", [chat_row("x")])
    assert source_fingerprint(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    before = source_fingerprint(path)
    path.write_bytes(path.read_bytes() + b"\n")
    assert source_fingerprint(path) != before


def test_template_fingerprint_survives_a_save_and_load_and_separates_the_template(
    tokenizer, tmp_path
):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    fp = template_fingerprint(tokenizer)
    assert template_fingerprint(loaded) == fp
    assert fp["chat_template"] == hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    loaded.chat_template = STRICT_TEMPLATE
    changed = template_fingerprint(loaded)
    assert (
        changed["tokenizer"] == fp["tokenizer"] and changed["chat_template"] != fp["chat_template"]
    )
    loaded.add_tokens(["<extra>"])
    assert template_fingerprint(loaded)["tokenizer"] != fp["tokenizer"]
