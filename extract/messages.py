"""One row's chat as OpenAI messages: the accepted schemas checked and normalized.

OpenAI `messages` (a content as text parts is checked and kept: `joined_parts` makes it a string
for a template that reads strings, as vLLM's server does; an assistant message of `tool_calls`
may have a null content, and the row's `tools` ride along as `ToolMessages.tools`) and ShareGPT
`conversations` (converted to OpenAI roles); a pre-tokenized row is returned as its object.
Anything else is a `RowError` with a reason and a detail, never another exception.
"""

from __future__ import annotations

import json
from typing import Any

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
ACCEPTED_KEYS = (
    "a row needs `messages` (OpenAI), `conversations` (ShareGPT), or `input_ids` + `loss_mask`"
)


class RowError(Exception):
    """A row that cannot be used: `reason` (e.g. one of REJECT_REASONS) and a `detail`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def parse_row(raw: bytes | dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any]:
    """The messages of one row (a JSONL line, or a table's row as a dict; ShareGPT converted
    to OpenAI roles), or, for a pre-tokenized row, its object (its tokens are checked by the
    caller).

    Raises `RowError` for bad JSON, an unknown schema, a malformed message or a chat without an
    assistant turn."""
    if isinstance(raw, dict):
        obj = raw
    else:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, absurd nesting
            raise RowError("malformed_json", str(e)) from e
    if not isinstance(obj, dict):
        raise RowError("unknown_schema", f"a JSON {type(obj).__name__}, not an object")
    if "messages" in obj:
        messages = _openai_messages(obj["messages"])
        if obj.get("tools") is not None:
            messages = _with_tools(messages, obj["tools"])
    elif "conversations" in obj:
        messages = _sharegpt_messages(obj["conversations"])
    elif "input_ids" in obj:
        return obj
    else:
        raise RowError("unknown_schema", f"{ACCEPTED_KEYS}; its keys: {sorted(obj)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant_turn", f"roles: {[m['role'] for m in messages]}")
    return messages


class ToolMessages(list):
    """A row's messages with the row's `tools` (OpenAI function definitions), which the chat
    template renders (`apply_chat_template(tools=...)`) where the model's own format puts them."""

    tools: list[dict[str, Any]]


def _with_tools(messages: list[dict[str, Any]], tools: Any) -> ToolMessages:
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RowError("unknown_schema", "tools is not a list of objects")
    out = ToolMessages(messages)
    out.tools = tools
    return out


def _openai_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise RowError("unknown_schema", f"messages is a {type(messages).__name__}, not a list")
    if not messages:
        raise RowError("empty", "no messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]):
            raise RowError("unknown_schema", f"message {i} has no role")
        calls = m.get("tool_calls")
        if calls is not None and not (
            calls and isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise RowError("unknown_schema", f"message {i} tool_calls is not a list of objects")
    for i, m in enumerate(messages):
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and _calls_only(m))):
            _check_text_parts(content, i)
    return messages


def joined_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each content given as text parts (checked by `parse_row`) made one string:
    their texts joined by newlines, as vLLM's OpenAI server joins them for a chat template that
    reads content as a string. A template that reads the parts itself gets them as they are
    (`extract.data`).

    >>> joined_parts([{"role": "user", "content": [{"type": "text", "text": "a"},
    ...                                            {"type": "text", "text": "b"}]}])
    [{'role': 'user', 'content': 'a\\nb'}]
    """
    out = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]
    return _with_tools(out, messages.tools) if isinstance(messages, ToolMessages) else out


def _calls_only(m: dict[str, Any]) -> bool:
    """An assistant message of tool calls, whose content may be null (OpenAI's form)."""
    return m["role"] == "assistant" and bool(m.get("tool_calls"))


def _check_text_parts(content: Any, i: int) -> None:
    """Raise RowError unless a message's content is a non-empty list of OpenAI text parts."""
    if content is None:
        raise RowError("unknown_schema", f"message {i} has no content")
    if not isinstance(content, list) or not content:
        what = "an empty list" if content == [] else f"a {type(content).__name__}"
        raise RowError(
            "unknown_schema", f"message {i} content is {what}, not a string or text parts"
        )
    if not all(isinstance(p, dict) for p in content):
        raise RowError("unknown_schema", f"message {i} content is a list of other than parts")
    other = sorted({str(p.get("type")) for p in content} - {"text"})
    if other:
        raise RowError(
            "unknown_schema",
            f"message {i} has {', '.join(other)} content parts: only text parts are read",
        )
    if not all(isinstance(p.get("text"), str) for p in content):
        raise RowError("unknown_schema", f"message {i} has a text part without a string text")


def _sharegpt_messages(turns: Any) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise RowError("unknown_schema", f"conversations is a {type(turns).__name__}, not a list")
    if not turns:
        raise RowError("empty", "no conversation turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
            who = turn.get("from") if isinstance(turn, dict) else turn
            raise RowError("unknown_schema", f"turn {i} from {who!r}")
        if not isinstance(turn.get("value"), str):
            raise RowError("unknown_schema", f"turn {i} value is not a string")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages
