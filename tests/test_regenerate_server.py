"""`python -m extract.regen --server URL` against a small completions server in the test
(`tests/completions_server.py`: the tiny target's greedy `generate` behind HTTP, with faults):
the same rows as the local run, failures counted and requested again, a server that stops, a
killed run resumed, and nothing requested twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from extract.data import Rejected
from extract.regen import llamacpp
from extract.regen.client import RequestFailed, ServerClient, completion_request, foreign_ids
from extract.regen.config import RegenConfig, RegenError
from extract.regen.journal import OpenChunk, journal_path
from extract.regen.report import format_summary
from extract.regen.served import connect
from extract.regen.state import parts_dir, read_state
from tests.completions_server import servers
from tests.test_regenerate import (
    MAX_LENGTH,
    MAX_NEW,
    ROWS_PER_CHUNK,
    _read,
    eos_target,
    regen,
    write_chats,
)

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(gpus=None, concurrency=3, retries=1, retry_wait=0.0)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_qwen3, tmp_path_factory) -> Path:
    return eos_target(tiny_qwen3, tmp_path_factory.mktemp("eos-target"))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


@pytest.fixture(scope="module")
def full(target, data_file, tmp_path_factory) -> Path:
    """The local run (Hugging Face `generate` in batches): its output file."""
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    regen(out, target, data_file)
    return out


@pytest.fixture()
def serve(target):
    """Start completions servers on the target; all are stopped after the test."""
    with servers(target) as start:
        yield start


def _turns(local: Path) -> dict[int, int]:
    """Assistant turns of each kept source row."""
    return {
        r["source_row"]: sum(m["role"] == "assistant" for m in r["messages"]) for r in _read(local)
    }


def _finished_rows(out: Path) -> set[int]:
    """Rows a stopped run finished: in committed chunks, or in the journals of open ones."""
    state, parts = read_state(parts_dir(out)), parts_dir(out)
    rows = {r for record in state.chunks.values() for r in range(record.first_row, record.end_row)}
    for journal in parts.glob("chunk-*.journal"):
        chunk = int(journal.stem.removeprefix("chunk-"))
        rows |= set(OpenChunk.load(parts, chunk, range(0, 1 << 30)).entries)
    return rows


def test_rows_equal_the_local_run_and_none_is_asked_twice(serve, target, data_file, full, tmp_path):
    server = serve()
    out = tmp_path / "served.jsonl"
    state = regen(out, target, data_file, server=server.url, **FAST)
    assert out.read_bytes() == full.read_bytes()
    local = read_state(parts_dir(full))
    ours, theirs = state.totals(range(len(state.chunks))), local.totals(range(len(local.chunks)))
    for key in ("rows_kept", "rejected", "turns", "turns_at_limit", "new_tokens"):
        assert ours[key] == theirs[key], key
    assert len(server.requests) == sum(_turns(full).values())  # the too-long row is not sent
    assert {r["temperature"] for r in server.requests} == {0.0}
    assert all(r["repetition_penalty"] == 1.0 and r["return_token_ids"] for r in server.requests)
    assert state.settings["engine"] == "server" and state.settings["server_model"] == "tiny"
    assert "tiny" in format_summary(state, out=out, seconds=1.0)
    again = regen(out, target, data_file, server=server.url, **FAST)
    assert again.merged_rows == 14 and len(server.requests) == sum(_turns(full).values())


def test_llamacpp_is_asked_on_its_own_endpoint_for_the_same_rows(
    serve, target, data_file, full, tmp_path, caplog
):
    server = serve(llamacpp=True)
    out = tmp_path / "llamacpp.jsonl"
    state = regen(out, target, data_file, server=server.url, **FAST)
    assert out.read_bytes() == full.read_bytes()  # its token ids, not our tokenization of text
    assert not [r for r in caplog.records if "without token ids" in r.getMessage()]
    assert set(server.paths) == {"/completion"}
    assert len(server.requests) == sum(_turns(full).values())
    for r in server.requests:
        assert r["return_tokens"] and r["n_predict"] == MAX_NEW and r["temperature"] == 0.0
        assert r["repeat_penalty"] == 1.0 and r["top_k"] == 0 and r["top_p"] == 1.0
        assert r["dry_multiplier"] == 0.0 and r["min_p"] == 0.0 and not r["ignore_eos"]
        assert r["samplers"] == ["temperature", "top_k", "top_p", "min_p"]
        assert r["dynatemp_range"] == 0.0
    local = read_state(parts_dir(full))
    ours, theirs = state.totals(range(len(state.chunks))), local.totals(range(len(local.chunks)))
    for key in ("rows_kept", "turns", "turns_at_limit", "new_tokens"):
        assert ours[key] == theirs[key], key


def test_llamacpp_slot_context_bounds_rows_and_a_cut_answer_is_a_rejected_row(
    serve, target, data_file, full, tmp_path
):
    local = read_state(parts_dir(full))
    kept = {r["source_row"]: r for r in _read(full)}
    before = {
        r["row"]: r["reason"] for r in local.totals(range(len(local.chunks)))["rejected_rows"]
    }
    # Rows whose prompt fits a slot but not with a whole answer after it: the server cuts
    # their answers (truncated) unless eos comes first; longer prompts get its 400.
    slot = 72  # cuts the answer of a row that the full run keeps
    server = serve(llamacpp=True, slot_context=slot)
    out = tmp_path / "slot.jsonl"
    state = regen(out, target, data_file, server=server.url, **FAST)
    rejected = {
        r["row"]: r["reason"] for r in state.totals(range(len(state.chunks)))["rejected_rows"]
    }
    rows = {r["source_row"]: r for r in _read(out)}
    assert state.merged_rows == 14 and rows and all(rows[k] == kept[k] for k in rows)
    assert set(rows) | set(rejected) == set(kept) | set(before)
    newly = {row: reason for row, reason in rejected.items() if row not in before}
    assert newly and set(newly.values()) == {"too_long"}
    assert server.cut and any(len(r["prompt"]) >= slot for r in server.requests)  # and 400s
    # With no --max-length, a slot's context is the limit: no prompt beyond it is sent.
    server = serve(llamacpp=True, slot_context=slot)
    state = regen(
        tmp_path / "bounded.jsonl", target, data_file, server=server.url, max_length=None, **FAST
    )
    assert state.settings["max_length"] == slot
    assert all(len(r["prompt"]) + MAX_NEW <= slot for r in server.requests)


def test_llamacpp_requests_carry_the_sampling_asked_for_and_text_only_is_warned_about(
    serve, target, data_file, full, tmp_path, caplog
):
    request = completion_request(
        model="m", prompt=[1, 2], max_tokens=5, stop_token_ids=[2], seed=7,
        sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 20},
    )  # fmt: skip
    native = llamacpp.native_request(request)
    picked = {k: native[k] for k in ("temperature", "top_p", "top_k", "seed")}
    assert picked == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 7}
    wide = llamacpp.native_request({**request, "seed": (1 << 62) + 5})["seed"]
    assert 0 <= wide < llamacpp.NO_SEED  # 32 bits, never llama.cpp's "draw one" value
    assert native["prompt"] == [1, 2] and native["n_predict"] == 5
    server = serve(llamacpp=True, fault=lambda text, attempt: "text_only")
    out = tmp_path / "text.jsonl"
    state = regen(out, target, data_file, server=server.url, **FAST)
    assert state.merged_rows == 14 and out.read_bytes() == full.read_bytes()
    assert any("without token ids" in r.getMessage() for r in caplog.records)


def test_a_llamacpp_server_capping_answers_is_a_message_and_a_resumable_state(
    serve, target, data_file, full, tmp_path
):
    capped = serve(llamacpp=True, answer_cap=MAX_NEW // 2)
    out = tmp_path / "capped.jsonl"
    proc = _cli(out, target, data_file, capped.url)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr + stdout, stderr
    message = stderr.strip().splitlines()[-1]
    assert message.startswith(f"Error: --server {capped.url}: the run stopped (answers_capped: ")
    assert "start the server without a limit on answers (llama-server -n -1)" in message
    assert message.endswith("run the same command to resume.")
    server = serve(llamacpp=True)
    state = regen(out, target, data_file, server=server.url, **FAST)
    assert state.merged_rows == 14 and out.read_bytes() == full.read_bytes()


def test_llamacpp_answers_read_back_by_how_they_ended():
    request = completion_request(
        model="m", prompt=[1], max_tokens=8, stop_token_ids=[2], sampling=None, seed=None
    )

    def answer(tokens, stop_type, truncated=False):
        body = {"content": "x", "tokens": tokens, "stop_type": stop_type, "truncated": truncated}
        return llamacpp.openai_answer({**body, "tokens_predicted": len(tokens)}, request)

    ended = answer([5, 6, 2], "eos")["choices"][0]
    assert ended["token_ids"] == [5, 6, 2] and ended["finish_reason"] == "stop"
    assert answer([5] * 8, "limit")["choices"][0]["finish_reason"] == "length"
    with pytest.raises(llamacpp.Truncated):  # the slot's context, before any stop id
        answer([5, 6, 7], "limit", truncated=True)
    # a stop id came before the cut: the turn had ended, the cut is past it
    assert answer([5, 2, 7], "limit", truncated=True)["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(llamacpp.Capped):  # the server's own -n
        answer([5, 6, 7], "limit")
    with pytest.raises(ValueError):
        llamacpp.openai_answer({"error": "x"}, request)
    with pytest.raises(ValueError):
        answer([5, None], "eos")
    # a GGUF end-of-generation token the target's config does not list
    assert llamacpp.foreign_stop(answer([5, 9], "eos"), [2]) == 9
    assert llamacpp.foreign_stop(answer([5, 2], "eos"), [2]) is None
    assert llamacpp.slot_context({"meta": {"n_ctx": "many"}}) is None
    assert llamacpp.slot_context({"meta": {"n_ctx": 512}}) == 512


def _progress(caplog) -> str:
    """The last progress line logged (without a terminal, as in a job's log file)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "extract.regen.report"]
    caplog.clear()
    return lines[-1]


def test_failures_are_retried_counted_and_requested_again(
    serve, target, data_file, full, tmp_path, caplog
):
    caplog.set_level(logging.INFO)

    def fault(text: str, attempt: int) -> str | None:
        if "What is 10 plus 0?" in text:
            return "503"  # every attempt
        if "Name 11." in text:
            return "hang"
        if "What is 0 plus 0?" in text and attempt == 1:
            return "503"  # the retry succeeds
        if "What is 1 plus 1?" in text and attempt == 1:
            return "drop"
        return None

    flaky = serve(fault=fault)
    out = tmp_path / "flaky.jsonl"
    state = regen(out, target, data_file, server=flaky.url, request_timeout=1.0, **FAST)
    assert state.failed == {"server_error": 1, "timeout": 1}
    assert state.merged_rows is None and not out.exists()
    assert "of 14 rows, 12 done, 2 failed this run, 0 waiting;" in _progress(caplog)
    summary = format_summary(state, out=out, seconds=1.0).splitlines()
    failed = next(line for line in summary if line.startswith("rows failed"))
    assert failed.split(None, 2)[2] == (
        "2 this run (server_error 1, timeout 1); the same command requests them again"
    )
    assert _finished_rows(out) == set(range(14)) - {10, 11}
    server = serve()
    state = regen(out, target, data_file, server=server.url, **FAST)
    assert out.read_bytes() == full.read_bytes() and state.failed == {}
    # Rows 8 and 9 of their chunk were recorded before: only the failed two wait.
    assert "of 2 rows, 2 done, 0 failed this run, 0 waiting;" in _progress(caplog)
    assert not any(
        line.startswith("rows failed")
        for line in format_summary(state, out=out, seconds=1.0).splitlines()
    )
    turns = _turns(full)
    assert len(server.requests) == turns[10] + turns[11]  # only the failed rows, again


def _cli(out: Path, model: Path, data: Path, url: str) -> subprocess.Popen:
    args = ["--target", str(model), "--data", str(data), "--out", str(out), "--server", url]
    args += ["--max-new-tokens", str(MAX_NEW), "--max-length", str(MAX_LENGTH)]
    args += ["--rows-per-chunk", str(ROWS_PER_CHUNK), "--concurrency", "2"]
    args += ["--retries", "2", "--retry-wait", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "extract.regen", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _resumed_asks_only_the_rest(serve, model: Path, out: Path, data: Path, local: Path) -> None:
    finished = _finished_rows(out)
    assert finished and finished != set(range(14))
    server = serve()
    state = regen(out, model, data, server=server.url, **FAST)
    assert out.read_bytes() == local.read_bytes() and state.merged_rows == 14
    rest = sum(n for row, n in _turns(local).items() if row not in finished)
    assert len(server.requests) == rest


def test_a_server_that_stops_is_a_message_and_a_resumable_state(
    serve, target, data_file, full, tmp_path
):
    dying = serve(fault=lambda text, attempt: "stop" if "What is 4 plus 1?" in text else None)
    out = tmp_path / "stopped.jsonl"
    proc = _cli(out, target, data_file, dying.url)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr + stdout
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("Error: --server") and "the run stopped (refused:" in message
    assert "start the server again" in message and "run the same command to resume" in message
    assert read_state(parts_dir(out)).merged_rows is None and not out.exists()
    _resumed_asks_only_the_rest(serve, target, out, data_file, full)


def test_a_killed_run_resumes_without_asking_twice(serve, target, data_file, full, tmp_path):
    server = serve(fault=lambda text, attempt: "block" if "What is 10 plus 0?" in text else None)
    out = tmp_path / "killed.jsonl"
    proc = _cli(out, target, data_file, server.url)
    try:
        assert server.reached.wait(timeout=300), "the run never reached row 10"
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -9
    server.stop()
    # Row 10 was sent once every earlier row but at most one in flight had been recorded.
    assert len(_finished_rows(out)) >= 9
    _resumed_asks_only_the_rest(serve, target, out, data_file, full)


def test_ctrl_c_first_finishes_the_conversations_in_flight(
    serve, target, data_file, full, tmp_path
):
    server = serve(fault=lambda text, attempt: "block" if "What is 10 plus 0?" in text else None)
    out = tmp_path / "interrupted.jsonl"
    proc = _cli(out, target, data_file, server.url)
    try:
        assert server.reached.wait(timeout=300), "the run never reached row 10"
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:  # the signal is handled: let the request in flight finish
            if "finishing the conversations in flight" in line:
                break
        server.release.set()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in stdout + stderr
    assert "the run stopped (stopped by a signal)" in stderr.strip().splitlines()[-1]
    assert 10 in _finished_rows(out)  # both its turns, the second asked after the signal
    server.stop()
    _resumed_asks_only_the_rest(serve, target, out, data_file, full)


def test_a_turn_the_server_finds_too_long_is_a_rejected_row(
    serve, target, data_file, full, tmp_path
):
    server = serve(fault=lambda text, attempt: "too_long" if "What is 13" in text else None)
    out = tmp_path / "long.jsonl"
    state = regen(out, target, data_file, server=server.url, **FAST)
    rejected = state.totals(range(len(state.chunks)))["rejected_rows"]
    assert {r["row"]: r["reason"] for r in rejected}[13] == "too_long"
    assert _read(out) == [r for r in _read(full) if r["source_row"] != 13]


def test_a_server_of_another_model_is_a_message_and_a_resumable_state(
    serve, target, data_file, full, tmp_path
):
    other = serve(fault=lambda text, attempt: "other_model")
    out = tmp_path / "other.jsonl"
    proc = _cli(out, target, data_file, other.url)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr + stdout, stderr
    message = stderr.strip().splitlines()[-1]
    assert message.startswith(
        f"Error: --server {other.url}: the run stopped (other_model: it reports model 'tiny', "
        "not --target's: its text "
    )
    assert f"serve --target's model there (e.g. vllm serve {target})" in message
    assert message.endswith("run the same command to resume.")
    assert read_state(parts_dir(out)).merged_rows is None and not out.exists()
    kept = {r["source_row"] for r in _read(full)}
    assert not _finished_rows(out) & kept  # no answer of the other model is kept
    server = serve()
    state = regen(out, target, data_file, server=server.url, **FAST)
    assert state.merged_rows == 14 and out.read_bytes() == full.read_bytes()
    assert len(server.requests) == sum(_turns(full).values())


def test_a_server_without_token_ids_is_warned_about_at_its_first_answer(
    serve, target, data_file, full, tmp_path, caplog
):
    server = serve(fault=lambda text, attempt: "text_only")
    requests_then = []

    class AtWarning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "answers text without token ids" in record.getMessage():
                requests_then.append(len(server.requests))

    handler = AtWarning()
    logging.getLogger("extract.regen.remote").addHandler(handler)
    try:
        out = tmp_path / "text.jsonl"
        state = regen(out, target, data_file, server=server.url, **{**FAST, "concurrency": 1})
    finally:
        logging.getLogger("extract.regen.remote").removeHandler(handler)
    assert requests_then == [1]  # once, at the first answer
    warning = next(r.getMessage() for r in caplog.records if "without token ids" in r.getMessage())
    assert warning.startswith(server.url) and "cannot be told apart" in warning
    assert state.merged_rows == 14 and out.read_bytes() == full.read_bytes()


def test_token_ids_of_another_vocabulary_are_told_from_detokenizer_details(tokenizer):
    text = "The capital of France is Paris. What is 3 plus 4?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert foreign_ids(text, ids, tokenizer) is None
    end = tokenizer.all_special_tokens[0]
    assert foreign_ids(f" {text}{end}\n", ids, tokenizer) is None  # spaces, a special token
    torn = tokenizer("é", add_special_tokens=False)["input_ids"][:1]  # its first byte
    assert tokenizer.decode(torn) == "\ufffd"
    assert foreign_ids(text, [*ids, *torn], tokenizer) is None  # a server holds a torn one back
    reversed_ids = [len(tokenizer) - 1 - t for t in ids]
    assert "--target's tokenizer reads" in foreign_ids(text, reversed_ids, tokenizer)
    assert foreign_ids("", [], tokenizer) is None


def test_no_server_or_no_single_model_is_a_message(serve, target, data_file, tmp_path):
    two = serve(models=("a", "b"))
    url = two.url
    with pytest.raises(RegenError, match=r"serves \['a', 'b'\]; name one"):
        regen(tmp_path / "x.jsonl", target, data_file, server=url, **FAST)
    with pytest.raises(RegenError, match="--server-model c:"):
        regen(tmp_path / "x.jsonl", target, data_file, server=url, server_model="c", **FAST)
    two.stop()
    with pytest.raises(RegenError, match="no OpenAI-compatible server answers there"):
        regen(tmp_path / "x.jsonl", target, data_file, server=url, **FAST)
    assert not (tmp_path / "x.jsonl.parts").exists()


def _connections(listening: socket.socket) -> int:
    """Connections made to a socket that never accepts, taken from its queue."""
    listening.setblocking(False)
    made = 0
    while True:
        try:
            listening.accept()[0].close()
        except BlockingIOError:
            return made
        made += 1


def test_a_server_that_does_not_answer_is_a_message_after_the_first_contact_wait(tmp_path):
    with socket.socket() as silent:  # connections are queued, and never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = RegenConfig(out=tmp_path / "x.jsonl", server=url, request_timeout=0.4, retries=1)
        with pytest.raises(RegenError) as stopped:
            connect(cfg, first_contact_s=0.1)
        assert str(stopped.value) == (
            f"--server {url}: the server is not answering (nothing came back to /v1/models in "
            "0.1 s). Start it on the target (e.g. vllm serve TARGET) or check the URL's host and "
            "port."
        )
        assert _connections(silent) == 1  # tried once
        # Later requests wait their own timeout, and are retried.
        client = ServerClient(url, timeout=0.4, retries=1, retry_wait=0.0)
        with pytest.raises(RequestFailed, match=r"^timeout: no answer in 0.1 s"):
            client.models(timeout=0.1)
        with pytest.raises(RequestFailed, match=r"^timeout: no answer in 0.4 s"):
            client.complete({"prompt": [1]})
        assert _connections(silent) == 3


def test_sampled_requests_carry_a_seed_per_row_and_turn(serve, target, data_file, tmp_path):
    server = serve()
    sampled = dict(temperature=0.7, top_p=0.9, top_k=20, seed=3, **FAST)
    regen(tmp_path / "a.jsonl", target, data_file, server=server.url, **sampled)
    first = {(json.dumps(r["prompt"]), r["seed"]) for r in server.requests}
    assert {(r["temperature"], r["top_p"], r["top_k"]) for r in server.requests} == {(0.7, 0.9, 20)}
    assert len({seed for _, seed in first}) == len(server.requests)
    del server.requests[:]
    regen(tmp_path / "b.jsonl", target, data_file, server=server.url, **sampled)
    assert {(json.dumps(r["prompt"]), r["seed"]) for r in server.requests} == first


def test_a_journal_left_by_a_crash_after_its_commit_goes(serve, target, data_file, full, tmp_path):
    server = serve()
    out = tmp_path / "out.jsonl"
    regen(out, target, data_file, server=server.url, max_rows=4, **FAST)  # commits chunk 0
    stale = journal_path(parts_dir(out), 0)
    stale.write_text(json.dumps({"row": 0, "rejected": {"row": 0}}) + "\n")
    regen(out, target, data_file, server=server.url, **FAST)
    assert not stale.exists() and out.read_bytes() == full.read_bytes()


def test_a_torn_journal_line_is_dropped(tmp_path):
    journal = tmp_path / "chunk-000000.journal"
    rejected = Rejected(row=1, source="in.jsonl", line=2, reason="too_long", detail="")
    whole = json.dumps({"row": 1, "rejected": asdict(rejected)}) + "\n"
    journal.write_text(whole + '{"row": 2, "kept"')
    loaded = OpenChunk.load(tmp_path, 0, range(0, 4))
    assert set(loaded.entries) == {1} and journal.read_text() == whole
