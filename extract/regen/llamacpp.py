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


# llama.cpp's sampler chain, in the order vLLM and transformers apply them (temperature first;
# at 0 only the largest logit is left: greedy); named, so that the chain of the server's launch
# flags (its defaults put temperature last and add others) never applies.
SAMPLERS = ["temperature", "top_k", "top_p", "min_p"]
NO_SEED = 0xFFFFFFFF  # llama.cpp's seed is 32-bit, and this one means "draw one at random"


class Truncated(ValueError):
    """The slot's context ended the answer before max_tokens or an end-of-generation token."""


class Capped(ValueError):
    """The server ends every answer before max_tokens (its own -n): no row can be answered."""


def is_llamacpp(cards: list[dict[str, Any]]) -> bool:
    """Whether a server's model cards (`/v1/models`' `data`) are llama-server's."""
    return any(isinstance(card, dict) and card.get("owned_by") == OWNER for card in cards)


def slot_context(card: dict[str, Any]) -> int | None:
    """The context of one of llama-server's slots (its `-c` over `-np`), from a model card."""
    meta = card.get("meta")
    length = meta.get("n_ctx") if isinstance(meta, dict) else None
    return length if isinstance(length, int) and length > 0 else None


def native_request(request: dict[str, Any]) -> dict[str, Any]:
    """`/completion`'s body for an OpenAI completions `request` (`client.completion_request`):
    the same prompt ids and sampling through `SAMPLERS` alone (no other sampler of llama.cpp,
    whatever its launch flags), and the generated ids asked for."""
    top_k = request["top_k"]
    native = {
        "prompt": request["prompt"],
        "n_predict": request["max_tokens"],
        "samplers": SAMPLERS,
        "temperature": request["temperature"],
        "dynatemp_range": 0.0,
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
        native["seed"] = request["seed"] % NO_SEED
    return native


def openai_answer(body: Any, request: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's `/completion` answer to `request` as an OpenAI completions answer with vLLM's
    `token_ids` (left out if the server gave none: an older llama.cpp). ValueError: not an
    answer; `Truncated`: cut short by the slot's context before any of the request's stop ids;
    `Capped`: ended short of max_tokens by the server's own limit."""
    if not isinstance(body, dict) or not isinstance(body.get("content"), str):
        raise ValueError(f"no completion in {str(body)[:200]}")
    ids = body.get("tokens")
    if isinstance(ids, list):
        if not all(isinstance(t, int) for t in ids):
            raise ValueError(f"token ids that are not integers: {str(ids)[:200]}")
    else:
        ids = None
    ended = ids is not None and any(t in request["stop_token_ids"] for t in ids)
    made = body.get("tokens_predicted")
    if body.get("truncated") and not ended:
        raise Truncated(
            f"the server's context ended the answer after {made} tokens (llama.cpp's slot "
            "context, its -c over -np, is shorter than the prompt plus --max-new-tokens)"
        )
    stopped = body.get("stop_type") in ("eos", "word")
    if not stopped and not ended and isinstance(made, int) and made < request["max_tokens"]:
        raise Capped(
            f"it ended an answer after {made} of the {request['max_tokens']} tokens asked for "
            "by a limit of its own (llama-server's -n)"
        )
    choice: dict[str, Any] = {
        "index": 0,
        "text": body["content"],
        "finish_reason": "stop" if stopped or ended else "length",
    }
    if ids is not None:
        choice["token_ids"] = ids
    return {"model": body.get("model", request["model"]), "choices": [choice]}


def foreign_stop(answer: dict[str, Any], stop_ids: list[int]) -> int | None:
    """The token an answer (`openai_answer`'s) stopped at that is none of `stop_ids`, if any:
    an end-of-generation token of the GGUF that the target's generation config does not list
    (the local route would have gone on there)."""
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    if choice["finish_reason"] != "stop" or not ids or any(t in stop_ids for t in ids):
        return None
    return ids[-1]
