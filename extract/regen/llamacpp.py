"""llama.cpp's server (`llama-server`) as a `--server`: its own completion endpoint, which
returns the generated token ids.

llama.cpp's OpenAI-compatible `/v1/completions` answers text only, so a turn's ids would be our
tokenization of that text. Its `/completion` endpoint takes the same prompt ids and, asked with
`return_tokens`, answers the ids it generated (the end-of-generation token included, as vLLM's
`token_ids`). A server is taken for llama.cpp when its model list says so (`owned_by:
"llamacpp"`); its requests are then the OpenAI ones translated here (`native_request`) and its
answers read back into the OpenAI shape (`openai_answer`), so the rest of `--server` is the same.

llama.cpp stops at the end-of-generation tokens of its GGUF file (it takes no stop token ids);
an answer cut short by the slot's context (`truncated`) is `Truncated`, which the client raises as
`TooLong` (vLLM refuses a prompt plus max_tokens beyond its context), not a turn that reached
max_new_tokens.
"""

from __future__ import annotations

from typing import Any

OWNER = "llamacpp"  # `owned_by` of llama-server's model cards
PATH = "/completion"


class Truncated(ValueError):
    """The slot's context ended the answer before max_tokens or an end-of-generation token."""


def is_llamacpp(cards: list[dict[str, Any]]) -> bool:
    """Whether a server's model cards (`/v1/models`' `data`) are llama-server's."""
    return any(isinstance(card, dict) and card.get("owned_by") == OWNER for card in cards)


def slot_context(card: dict[str, Any]) -> int | None:
    """The context of one of llama-server's slots (its `-c` over `-np`), from a model card."""
    meta = card.get("meta")
    length = meta.get("n_ctx") if isinstance(meta, dict) else None
    return int(length) if length else None


def native_request(request: dict[str, Any]) -> dict[str, Any]:
    """`/completion`'s body for an OpenAI completions `request` (`client.completion_request`):
    the same prompt ids and sampling, every sampler llama.cpp would otherwise apply by default
    turned off, and the generated ids asked for."""
    top_k = request["top_k"]
    native = {
        "prompt": request["prompt"],
        "n_predict": request["max_tokens"],
        "temperature": request["temperature"],
        "top_k": top_k if top_k > 0 else 0,  # 0: off, as vLLM's -1
        "top_p": request["top_p"],
        "min_p": request["min_p"],
        "typical_p": 1.0,
        "repeat_penalty": request["repetition_penalty"],
        "presence_penalty": request["presence_penalty"],
        "frequency_penalty": request["frequency_penalty"],
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "mirostat": 0,
        "ignore_eos": False,
        "n_probs": 0,
        "return_tokens": True,
        "cache_prompt": True,
        "stream": False,
    }
    if "seed" in request:
        native["seed"] = request["seed"]
    return native


def openai_answer(body: Any, model: str) -> dict[str, Any]:
    """llama.cpp's `/completion` answer as an OpenAI completions answer with vLLM's
    `token_ids` (left out if the server gave none: an older llama.cpp). ValueError: not an
    answer; `Truncated`: cut short by the slot's context."""
    if not isinstance(body, dict) or not isinstance(body.get("content"), str):
        raise ValueError(f"no completion in {str(body)[:200]}")
    if body.get("truncated"):
        made = body.get("tokens_predicted", "some")
        raise Truncated(
            f"the server's context ended the answer after {made} tokens (llama.cpp's slot "
            "context, its -c over -np, is shorter than the prompt plus --max-new-tokens)"
        )
    stopped = body.get("stop_type") in ("eos", "word")
    choice: dict[str, Any] = {
        "index": 0,
        "text": body["content"],
        "finish_reason": "stop" if stopped else "length",
    }
    if isinstance(body.get("tokens"), list):
        choice["token_ids"] = body["tokens"]
    return {"model": body.get("model", model), "choices": [choice]}
