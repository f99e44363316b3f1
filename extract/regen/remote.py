"""One conversation of `python -m extract.regen --server`: its turns asked of the server one
request each, every answer checked (another model's token ids stop the run; a server that
answers text only is warned about once), and its outcome: kept, rejected or failed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from extract.data import Rejected, RowError
from extract.regen.client import (
    AnswersCapped,
    RequestFailed,
    RequestRefused,
    ServerClient,
    ServerGone,
    TooLong,
    completion_request,
    foreign_ids,
    parse_completion,
)
from extract.regen.config import Chat
from extract.regen.driver import Failed, Outcome, kept, turn_seed
from extract.regen.turns import Conversation, Prompter, end_turn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Server:
    """What the worker threads need to ask the server for one conversation's turns."""

    client: ServerClient
    model: str
    prompter: Prompter
    eos: frozenset[int]
    sampling: dict[str, float] | None
    seed: int
    text_only: threading.Event = field(default_factory=threading.Event)  # warned: no token ids
    lock: threading.Lock = field(default_factory=threading.Lock)


def converse(chat: Chat, server: Server) -> Outcome:
    """Every assistant turn of `chat` from the server, one request each; never raises for
    the server's or the row's problems."""
    conv, prompter = Conversation(chat), server.prompter
    new_tokens = from_text = 0
    try:
        while conv.advance():
            prompt = prompter.prompt(conv.out)
            seed = turn_seed(server.seed, chat.row, len(conv.generated))
            request = completion_request(
                model=server.model,
                prompt=prompt,
                max_tokens=prompter.max_new_tokens,
                stop_token_ids=sorted(server.eos),
                sampling=server.sampling,
                seed=seed if server.sampling else None,
            )
            done = parse_completion(server.client.complete(request), _tokenize(prompter))
            stopped = done.finish_reason == "stop"
            turn = end_turn(done.token_ids, set(server.eos), stopped=stopped)
            if done.from_text:
                _warn_text_only(server)
            elif foreign := foreign_ids(done.text, turn.token_ids, prompter.tokenizer):
                reports = f"it reports model {done.model or server.model!r}, not --target's"
                return Failed("other_model", f"{reports}: {foreign}", stops_run=True)
            conv.answer(prompter, prompt, turn)
            new_tokens += len(turn.token_ids)
            from_text |= done.from_text
    except RowError as e:
        return Rejected(chat.row, chat.source, chat.line, e.reason, e.detail)
    except TooLong as e:
        return Rejected(chat.row, chat.source, chat.line, "too_long", str(e))
    except ServerGone as e:
        return Failed(e.reason, e.detail, stops_run=True)
    except RequestFailed as e:
        return Failed(e.reason, e.detail, stops_run=False)
    except AnswersCapped as e:
        return Failed("answers_capped", str(e), stops_run=True)
    except RequestRefused as e:
        return Failed("refused_request", str(e), stops_run=True)
    return kept(conv, prompter, new_tokens, from_text=bool(from_text))


def _warn_text_only(server: Server) -> None:
    """Once, at the server's first answer without token ids."""
    with server.lock:
        if server.text_only.is_set():
            return
        server.text_only.set()
    log.warning(
        "%s answers text without token ids (vLLM's return_token_ids): each turn's ids are the "
        "target tokenizer's tokenization of that text, which may differ from the ids the model "
        "generated (one text has several token sequences; special tokens or a last partial "
        "character may be missing from it), so the drafter may learn sequences the target did "
        "not produce; and a server of another model than --target cannot be told apart. A "
        "server that returns token ids (vLLM; llama.cpp's llama-server) avoids both.",
        server.client.url,
    )


def _tokenize(prompter: Prompter) -> Callable[[str], list[int]]:
    return lambda text: prompter.tokenizer(text, add_special_tokens=False)["input_ids"]
