"""The `--server` side of `python -m extract.regen`: an OpenAI-compatible completions client.

One request per assistant turn, to `/v1/completions` with the prompt as token ids (vLLM, SGLang
and llama.cpp take a list of ints there), asking for the generated token ids back (vLLM's
`return_token_ids`); to llama.cpp's own `/completion` where the model list shows llama-server
(`extract.regen.llamacpp`: its OpenAI endpoint answers text only). Every sampling field is sent
explicitly: a server fills the fields a request leaves out from the checkpoint's
generation_config.json (vLLM's default), whose repetition penalty or temperature would change
greedy answers.

The first contact, the model list (`models`), is tried once and waits at most
`FIRST_CONTACT_S`. A later request that times out, is refused, loses its connection or gets a
5xx or 429 is retried after waits doubling from `retry_wait` (at most 60 s); the last failure
is raised as `RequestFailed` with its reason. A refused connection through every retry is
`ServerGone` (no server there any more), a 400 about the context length `TooLong`, and any
other 4xx `RequestRefused`: the server does not take requests of this form, whatever the row.
Threads share one client; each keeps its own HTTP connection.

An answer's token ids are read back with the target's tokenizer and compared with its text
(`foreign_ids`): a server of another model answers ids of its own vocabulary.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from extract.regen import llamacpp

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
# The first request (the model list) waits at most this long: a server that is not answering
# (a port that accepts but never replies, a host that drops packets) is told at once, not after
# --request-timeout, which is sized for long generations.
FIRST_CONTACT_S = 10
# vLLM: "maximum context length is N tokens"; SGLang: "longer than the model's context length";
# llama.cpp: "exceeds the available context size".
_TOO_LONG = re.compile(
    r"context length|context window|available context size|max_model_len|too long", re.IGNORECASE
)
FAILURE_REASONS = (
    "timeout",  # no answer within --request-timeout
    "refused",  # no server listening
    "disconnected",  # the connection dropped before the answer
    "server_error",  # HTTP 5xx or 429
    "bad_response",  # an answer that is not a completion
)


class RequestFailed(Exception):
    """A request that failed through all its retries, or was stopped between them."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class ServerGone(RequestFailed):
    """Connections refused through every retry: the server is not running."""


class TooLong(Exception):
    """The server says prompt + max_tokens exceed its context."""


class RequestRefused(Exception):
    """A 4xx other than the context length: no request of this form will be served."""


class AnswersCapped(RequestRefused):
    """The server ends answers short of max_tokens by a limit of its own (llama-server's -n)."""


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    finish_reason: str | None  # "stop" (eos or a stop token) or "length"
    from_text: bool  # the server gave no token ids: these are its text's tokenization
    text: str = ""
    model: str | None = None  # the model the answer says it came from


class ServerClient:
    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        retries: int,
        retry_wait: float,
        stop: threading.Event | None = None,
    ):
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        self.url = url
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port
        base = parts.path[: -len("/v1")] if parts.path.endswith("/v1") else parts.path
        self.base = base.rstrip("/")
        self.timeout, self.retries, self.retry_wait = timeout, retries, retry_wait
        self.stop = stop or threading.Event()  # set: no more retries, waits end at once
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self._local = threading.local()
        self.llamacpp = False  # set by `models`: llama-server, asked through its own endpoint
        self._warned_stop = threading.Event()  # llama.cpp stopped at a token not in stop ids

    def models(self, *, timeout: float = FIRST_CONTACT_S) -> list[dict[str, Any]]:
        """The server's model cards (`/v1/models`): the first contact, tried once and waited
        for at most `timeout` seconds (later requests wait `self.timeout`)."""
        self._drop_connection()  # its own connection, with its own timeout
        try:
            body = self._request("GET", "/v1/models", None, timeout=min(timeout, self.timeout))
        finally:
            self._drop_connection()
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise RequestFailed("bad_response", f"/v1/models answered {str(body)[:200]}")
        self.llamacpp = llamacpp.is_llamacpp(data)
        return data

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST `request` (an OpenAI completions body), retried with backoff; the parsed
        answer, in the OpenAI shape whichever endpoint was asked."""
        if not self.llamacpp:
            return self._post("/v1/completions", request)
        native = self._post(llamacpp.PATH, llamacpp.native_request(request))
        try:
            answer = llamacpp.openai_answer(native, request)
        except llamacpp.Truncated as e:
            raise TooLong(str(e)) from None
        except llamacpp.Capped as e:
            raise AnswersCapped(str(e)) from None
        except ValueError as e:
            raise RequestFailed("bad_response", str(e)) from None
        stop = llamacpp.foreign_stop(answer, request["stop_token_ids"])
        if stop is not None and not self._warned_stop.is_set():
            self._warned_stop.set()
            log.warning(
                "%s stopped an answer at token %d, an end-of-generation token of its GGUF file "
                "that the target's generation config does not list: such turns end there, "
                "where the local route would go on",
                self.url,
                stop,
            )
        return answer

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        wait = self.retry_wait
        for attempt in range(self.retries + 1):
            try:
                return self._request("POST", path, body)
            except RequestFailed as e:
                last = e
            if attempt == self.retries or self.stop.is_set():
                break
            log.debug("retrying in %.1f s after %s", wait, last)
            if self.stop.wait(wait):
                break
            wait = min(2 * wait, MAX_WAIT_S)
        if last.reason == "refused":
            raise ServerGone(last.reason, last.detail)
        raise last

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = kind(self.host, self.port, timeout=timeout)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, *, timeout: float | None = None
    ) -> Any:
        """One request; `timeout` (of a new connection) defaults to the client's. A kept-alive
        connection that the server closed meanwhile is reopened once without counting as a
        failure."""
        data = None if body is None else json.dumps(body).encode()
        wait = self.timeout if timeout is None else timeout
        for fresh in (False, True):
            reused = getattr(self._local, "conn", None) is not None
            try:
                conn = self._connection(wait)
                conn.request(method, self.base + path, body=data, headers=self.headers)
                response = conn.getresponse()
                status, raw = response.status, response.read()
            except TimeoutError as e:
                self._drop_connection()
                raise RequestFailed("timeout", f"no answer in {wait:g} s ({e})") from None
            except ConnectionRefusedError as e:
                self._drop_connection()
                raise RequestFailed("refused", f"{self.url}: {e}") from None
            except (http.client.HTTPException, OSError) as e:
                self._drop_connection()
                if reused and not fresh:
                    continue
                raise RequestFailed("disconnected", f"{type(e).__name__}: {e}") from None
            break
        return _answer(status, raw)


def _answer(status: int, raw: bytes) -> Any:
    text = raw.decode("utf-8", "replace")
    if status == 429 or status >= 500:
        raise RequestFailed("server_error", f"HTTP {status}: {text[:300]}")
    if status >= 400:
        message = _error_message(text)
        if status == 400 and _TOO_LONG.search(message):
            raise TooLong(message)
        raise RequestRefused(f"HTTP {status}: {message}")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RequestFailed("bad_response", f"not JSON: {text[:200]!r}") from None


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:500]


def completion_request(
    *,
    model: str,
    prompt: list[int],
    max_tokens: int,
    stop_token_ids: list[int],
    sampling: dict[str, float] | None,
    seed: int | None,
) -> dict[str, Any]:
    """The body of one turn's request: greedy (temperature 0) unless `sampling`; penalties
    off, whatever the checkpoint's generation config says."""
    drawn = sampling or {"temperature": 0.0}
    request = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": drawn["temperature"],
        "top_p": drawn.get("top_p", 1.0),
        "top_k": drawn.get("top_k", -1),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": stop_token_ids,
        "skip_special_tokens": False,
        "return_token_ids": True,
        "n": 1,
        "stream": False,
    }
    if seed is not None:
        request["seed"] = seed
    return request


def parse_completion(body: Any, tokenize: Any) -> Completion:
    """The generated ids of a completions answer; `tokenize(text)` where it has none."""
    try:
        choice = body["choices"][0]
        ids, finish, text = choice.get("token_ids"), choice.get("finish_reason"), choice["text"]
        model = body.get("model")
        if ids is None:
            return Completion(list(tokenize(text)), finish, True, text, model)
        return Completion([int(t) for t in ids], finish, False, str(text), model)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise RequestFailed("bad_response", f"no completion in {str(body)[:200]} ({e})") from None


# Same-tokenizer answers read back the same, up to detokenizer details (spaces, special tokens,
# a last partial character); another vocabulary's ids read as unrelated text, similar well under
# half (about 0.1 on the tests' tiny tokenizer).
SAME_TEXT = 0.5


def foreign_ids(text: str, token_ids: list[int], tokenizer: Any) -> str | None:
    """Why `token_ids` (without the eos that ended them) cannot be the server's tokens of
    `text` in the vocabulary of `tokenizer`, or None: a server of another model answers ids
    that our tokenizer reads as unrelated text. Spaces, special tokens and replacement
    characters are left out of the comparison (servers detokenize them differently). A model
    that shares the tokenizer passes: its ids are the target's tokens."""
    ours = tokenizer.decode(
        token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    specials = tokenizer.all_special_tokens
    a, b = _plain(ours, specials), _plain(text, specials)
    if a == b or SequenceMatcher(None, a, b, autojunk=False).ratio() >= SAME_TEXT:
        return None
    return f"its text {text[:60]!r} came with ids that --target's tokenizer reads {ours[:60]!r}"


def _plain(text: str, specials: list[str]) -> str:
    for token in specials:
        text = text.replace(token, "")
    return "".join(text.replace("\ufffd", "").split())
