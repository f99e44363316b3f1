"""A small OpenAI-compatible completions server for tests, in the test's process: the target's
plain one-prompt greedy `generate` on the prompt ids, answered as vLLM answers (`token_ids`
with the stop token, `finish_reason`), and the faults a test asks for.

`fault(prompt_text, attempt)` names what the request with that prompt (its `attempt`-th time)
gets instead of a completion: "503", "drop" (the connection closes without an answer), "hang"
(no answer until the server stops), "too_long" (vLLM's 400 about the context length), "block"
(`reached` is set, then the answer waits for `release`; dropped if the server stopped meanwhile)
or "stop" (the server stops: this and every later request, on any connection, is dropped or
refused). Two faults change the completion instead: "text_only" (no `token_ids`, as a server
without vLLM's `return_token_ids` answers) and "other_model" (the ids of another model's
vocabulary, ours in reverse order, with the same text: a server of another model than the
test's --target).

`llamacpp=True` answers as llama.cpp's llama-server: model cards `owned_by: "llamacpp"` with a
slot context (`meta.n_ctx`), completions on its own `/completion` endpoint (`n_predict`, the
generated ids in `tokens` when asked with `return_tokens`, `stop_type`; `truncated` where the
slot's context ends the answer; its 400 "exceeds the available context size" for a prompt
longer than that; `answer_cap`, its -n, ends every answer at that length), and a 404 on
`/v1/completions`, so a client that does not switch fails.

`hold_models=True` holds the first contact: the model list (`/v1/models`) sets `reached`, then
waits for `release` (dropped if the server stopped meanwhile).

`servers(target)` gives a function that starts servers on the target, all stopped on leaving.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

Fault = Callable[[str, int], str | None]


class CompletionsServer:
    def __init__(
        self,
        target: Path,
        *,
        fault: Fault | None = None,
        models: tuple[str, ...] = ("tiny",),
        llamacpp: bool = False,
        slot_context: int = 4096,
        answer_cap: int | None = None,
        hold_models: bool = False,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(target))
        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.fault = fault or (lambda text, attempt: None)
        self.models = models
        self.llamacpp, self.slot_context = llamacpp, slot_context
        self.answer_cap = answer_cap  # llama-server's -n: no answer longer
        self.hold_models = hold_models
        self.paths: list[str] = []  # every completion request's path
        self.cut = 0  # llama.cpp answers the slot's context cut (truncated)
        self.requests: list[dict[str, Any]] = []  # every completion request's body
        self.attempts: Counter = Counter()
        self.lock = threading.Lock()
        self.reached, self.release = threading.Event(), threading.Event()
        self.stopped = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        """Stop serving: new connections are refused, open ones dropped, hung requests end."""
        if not self.stopped.is_set():
            self.stopped.set()
            self.httpd.shutdown()
            self.httpd.server_close()
        self.release.set()

    def prompts(self) -> list[str]:
        return [self.tokenizer.decode(r["prompt"]) for r in self.requests]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        from transformers import GenerationConfig

        stop = body["stop_token_ids"]
        config = GenerationConfig(
            do_sample=False, max_new_tokens=body["max_tokens"], eos_token_id=stop, pad_token_id=0
        )
        ids = torch.tensor([body["prompt"]])
        with self.lock, torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
        new = out[0, ids.shape[1] :].tolist()
        end = next((i + 1 for i, t in enumerate(new) if t in stop), None)
        new = new if end is None else new[:end]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        finish = "length" if end is None else "stop"
        choice = {"index": 0, "text": text, "token_ids": new, "finish_reason": finish}
        return {"model": body["model"], "choices": [choice]}

    def complete_native(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """llama-server's `/completion`: its end-of-generation token (the tokenizer's eos)
        stops it; the slot's context cuts the answer."""
        prompt, room = body["prompt"], self.slot_context - len(body["prompt"])
        if room <= 0:
            message = (
                f"request ({len(prompt)} tokens) exceeds the available context size "
                f"({self.slot_context} tokens), try increasing it"
            )
            return 400, {"error": {"code": 400, "message": message}}
        n = min(body["n_predict"], room, self.answer_cap or room)
        stop = [self.tokenizer.eos_token_id]
        request = {"prompt": prompt, "max_tokens": n, "stop_token_ids": stop, "model": ""}
        answer = self.complete(request)
        choice = answer["choices"][0]
        new, stopped = choice["token_ids"], choice["finish_reason"] == "stop"
        truncated = not stopped and n == room < body["n_predict"]
        self.cut += truncated
        native = {
            "content": choice["text"],
            "model": self.models[0],
            "stop_type": "eos" if stopped else "limit",
            "tokens_predicted": len(new),
            "truncated": truncated,
        }
        if body.get("return_tokens"):
            native["tokens"] = new
        return 200, native


@contextmanager
def servers(target: Path) -> Iterator[Callable[..., CompletionsServer]]:
    """A function that starts completions servers on `target`; all are stopped on leaving."""
    started: list[CompletionsServer] = []

    def start(**kwargs: Any) -> CompletionsServer:
        started.append(CompletionsServer(target, **kwargs))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def _handler(server: CompletionsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept-alive connections, as real servers keep them

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _drop(self) -> None:
            self.close_connection = True

        def do_GET(self) -> None:
            if server.hold_models:
                server.reached.set()
                server.release.wait()
            if server.stopped.is_set():
                return self._drop()
            if server.llamacpp:
                meta = {"n_ctx": server.slot_context, "n_ctx_train": 8192}
                cards = [{"id": m, "owned_by": "llamacpp", "meta": meta} for m in server.models]
            else:
                cards = [{"id": m, "object": "model", "max_model_len": 4096} for m in server.models]
            self._send(200, {"object": "list", "data": cards})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if server.stopped.is_set():
                return self._drop()
            text = server.tokenizer.decode(body["prompt"])
            if server.llamacpp != (self.path == "/completion"):
                return self._send(404, {"error": {"message": f"File Not Found: {self.path}"}})
            with server.lock:
                server.requests.append(body)
                server.paths.append(self.path)
                server.attempts[text] += 1
                attempt = server.attempts[text]
            fault = server.fault(text, attempt)
            if fault == "stop":
                server.stop()
                return self._drop()
            if fault == "block":
                server.reached.set()
            if fault in ("hang", "block"):
                server.release.wait()
                if fault == "hang" or server.stopped.is_set():
                    return self._drop()
            if fault == "drop":
                return self._drop()
            if fault == "503":
                return self._send(503, {"error": {"message": "overloaded"}})
            if fault == "too_long":
                message = "This model's maximum context length is 64 tokens. However, ..."
                return self._send(400, {"error": {"message": message}})
            if server.llamacpp:
                status, native = server.complete_native(body)
                if fault == "text_only":  # a llama.cpp without return_tokens
                    native.pop("tokens", None)
                return self._send(status, native)
            answer = server.complete(body)
            choice = answer["choices"][0]
            if fault == "text_only":
                del choice["token_ids"]
            if fault == "other_model":
                choice["token_ids"] = [len(server.tokenizer) - 1 - t for t in choice["token_ids"]]
            self._send(200, answer)

    return Handler
