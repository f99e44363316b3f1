"""`python -m extract.regen` on CPU with a tiny target: greedy turns, resume, bad rows."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from extract.regen.config import REGEN_REJECT_REASONS, RegenConfig, RegenError
from extract.regen.regenerate import run
from extract.regen.report import format_summary
from extract.regen.state import parts_dir, read_state

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 10
MAX_LENGTH = 160  # row 8's long user turn exceeds it
ROWS_PER_CHUNK = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _chat(i: int, turns: int, system: bool = False) -> dict:
    msgs = [{"role": "system", "content": f"You are bot {i}."}] if system else []
    for t in range(turns):
        msgs += [_user(f"What is {i} plus {t}?"), _assistant(f"old answer {i}.{t}")]
    return {"messages": msgs}


def _sharegpt(i: int, turns: int) -> dict:
    conv = [{"from": "system", "value": f"Be brief, {i}."}]
    for t in range(turns):
        conv += [{"from": "human", "value": f"Name {i + t}."}, {"from": "gpt", "value": "old"}]
    return {"conversations": conv}


# (row, JSONL line) of each bad row and its reason; line 6 is blank (not a row).
BAD = {3: "malformed_json", 5: "pretokenized", 6: "no_assistant_turn", 7: "unknown_schema"}
BAD[8] = "too_long"


def _rows() -> list[str]:
    rows = [
        _chat(0, 1, system=True),
        _chat(1, 2),
        _sharegpt(2, 2),
        "{not json",
        _chat(4, 3, system=True),
        {"input_ids": [1, 5, 2], "loss_mask": [0, 1, 1]},
        {"messages": [_user("no answer here")]},
        {"prompt": "unknown schema"},
        {"messages": [_user("word " * 200), _assistant("old")]},
        {"messages": [_user("Hi"), _assistant("old"), _user("trailing question")]},
        _chat(10, 2),
        _sharegpt(11, 1),
        {"messages": [{"role": "system", "content": "Speak first."}, _assistant("old")]},
        _chat(13, 1),
    ]
    return [r if isinstance(r, str) else json.dumps(r) for r in rows]


def _line(row: int) -> int:
    return row + 1 if row < 5 else row + 2


def write_chats(path: Path) -> Path:
    rows = _rows()
    path.write_text("\n".join(rows[:5] + [""] + rows[5:]) + "\n")
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


def _load(target: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    return tok, model


def _greedy(tok, model, messages: list[dict]) -> tuple[str, bool]:
    """Plain one-prompt `model.generate`: (text before eos, whether it hit MAX_NEW)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
        )
    new = out[0, ids.shape[1] :].tolist()
    at_limit = tok.eos_token_id not in new
    new = new if at_limit else new[: new.index(tok.eos_token_id)]
    return tok.decode(new, skip_special_tokens=False, clean_up_tokenization_spaces=False), at_limit


@pytest.fixture(scope="module")
def target(tiny_qwen3, tmp_path_factory) -> Path:
    return eos_target(tiny_qwen3, tmp_path_factory.mktemp("eos-target"))


def eos_target(tiny_qwen3: Path, folder: Path) -> Path:
    """The tiny target with its eos logit tied to a token it often predicts (x 1.05), so that
    greedy turns end with eos as well as at MAX_NEW (random weights alone never emit eos)."""
    tok, model = _load(tiny_qwen3)
    prompts = [[_user(f"What is {i} plus 0?")] for i in range(6)]
    firsts, seen = set(), Counter()
    for p in prompts:
        ids = tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False))
        out = model.generate(torch.tensor([ids["input_ids"]]), max_new_tokens=MAX_NEW)
        new = out[0, len(ids["input_ids"]) :].tolist()
        firsts.add(new[0])
        seen.update(new)
    head = model.lm_head.weight.detach().clone()
    for token, _ in seen.most_common():
        if token in firsts:
            continue  # every turn would be empty
        with torch.no_grad():
            model.lm_head.weight.copy_(head)
            model.lm_head.weight[tok.eos_token_id] = head[token] * 1.05
        ends = [_greedy(tok, model, p)[1] for p in prompts]
        if any(ends) and not all(ends):
            break
    else:
        pytest.fail("no token gives a mix of eos-ended and cut turns")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def regen(out: Path, target: Path, data: Path | tuple[Path, ...], **over) -> object:
    cfg = dict(
        target=str(target),
        data=data if isinstance(data, tuple) else (data,),
        out=out,
        gpus="cpu",
        max_new_tokens=MAX_NEW,
        max_length=MAX_LENGTH,
        batch_size=3,
        rows_per_chunk=ROWS_PER_CHUNK,
    )
    cfg.update(over)
    return run(RegenConfig(**cfg))


@pytest.fixture(scope="module")
def full(target, data_file, tmp_path_factory) -> Path:
    """An uninterrupted run: its output file."""
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    regen(out, target, data_file)
    return out


def _read(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_turns_are_the_targets_greedy_continuations(target, data_file, full):
    from extract.data import SHAREGPT_ROLES

    tok, model = _load(target)
    rows = [json.loads(r) if r != "{not json" else None for r in _rows()]
    out = _read(full)
    assert [r["source_row"] for r in out] == [i for i in range(len(rows)) if i not in BAD]
    ended = Counter()
    for got in out:
        src = rows[got["source_row"]]
        if "conversations" in src:
            src = {
                "messages": [
                    {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                    for t in src["conversations"]
                ]
            }
        expected, at_limit = [], []
        for m in src["messages"]:
            if m["role"] == "assistant":
                text, cut = _greedy(tok, model, expected)
                at_limit += [len(expected)] if cut else []
                ended[cut] += 1
                expected.append({"role": "assistant", "content": text})
            else:
                expected.append(m)
        assert got["messages"] == expected
        assert got["turns_at_limit"] == at_limit
    assert ended[True] and ended[False]  # both ways of ending a turn were exercised


def test_batched_equals_unbatched(target, data_file, full, tmp_path):
    regen(tmp_path / "one.jsonl", target, data_file, batch_size=1)
    assert (tmp_path / "one.jsonl").read_bytes() == full.read_bytes()


def test_bad_rows_are_counted_with_line_numbers(target, data_file, full):
    state = read_state(parts_dir(full))
    t = state.totals(range(len(state.chunks)))
    assert t["rejected"] == dict(sorted(Counter(BAD.values()).items()))
    assert set(t["rejected"]) <= set(REGEN_REJECT_REASONS)
    listed = {r["row"]: (r["line"], r["reason"]) for r in t["rejected_rows"]}
    assert listed == {row: (_line(row), reason) for row, reason in BAD.items()}
    assert t["rows_read"] == 14 and t["rows_kept"] == 14 - len(BAD)
    rows = _read(full)
    assert t["turns"] == sum(1 for r in rows for m in r["messages"] if m["role"] == "assistant")
    assert t["turns_at_limit"] == sum(len(r["turns_at_limit"]) for r in rows)
    summary = format_summary(state, out=full, seconds=1.0)
    assert re.search(rf"pretokenized +1 \(lines chats.jsonl:{_line(5)}\)", summary)


def test_tool_use_rows_are_rejected_as_such(tmp_path):
    from extract.regen.config import iter_chats

    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "tool_calls": [call]}]},
        {"tools": [{"type": "function"}], "messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": "a"}]},
    ]  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, call_row, tools_row = iter_chats([path], range(3))
    assert plain.messages == rows[0]["messages"]
    assert call_row.reason == tools_row.reason == "tool_calls" and "tool" in call_row.detail
    assert "tool_calls" in REGEN_REJECT_REASONS


def test_resume_after_max_rows_equals_uninterrupted(target, data_file, full, tmp_path):
    out = tmp_path / "out.jsonl"
    regen(out, target, data_file, max_rows=6)  # chunk 1 holds rows 4-5 only
    assert [r["source_row"] for r in _read(out)] == [0, 1, 2, 4]
    first = (parts_dir(out) / "chunk-000000.jsonl").stat().st_ino
    state = regen(out, target, data_file)
    assert out.read_bytes() == full.read_bytes()
    assert (parts_dir(out) / "chunk-000000.jsonl").stat().st_ino == first  # not redone
    assert state.merged_rows == 14 and state.chunks[1].end_row == 8


def _start(out: Path, target: Path, data_file: Path) -> subprocess.Popen:
    """`python -m extract.regen` on the test's data in a process of its own, stderr piped."""
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out)]
    args += ["--gpus", "cpu", "--max-new-tokens", str(MAX_NEW), "--max-length", str(MAX_LENGTH)]
    args += ["--batch-size", "3", "--rows-per-chunk", str(ROWS_PER_CHUNK)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "extract.regen", *args],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_resume_after_kill_equals_uninterrupted(target, data_file, full, tmp_path):
    out = tmp_path / "killed.jsonl"
    proc = _start(out, target, data_file)
    for line in proc.stderr:  # kill -9 as soon as the first chunk is committed
        if "committed chunk-" in line:
            proc.kill()
            break
    proc.wait()
    assert proc.returncode == -9
    partial = read_state(parts_dir(out))
    assert 1 <= len(partial.chunks) < 4 and partial.merged_rows is None and not out.exists()
    state = regen(out, target, data_file)
    assert out.read_bytes() == full.read_bytes()
    assert state.merged_rows == 14


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_chunk_in_progress_and_says_how_to_resume(
    target, data_file, full, tmp_path, sig
):
    out = tmp_path / "stopped.jsonl"
    proc = _start(out, target, data_file)
    for line in proc.stderr:  # the signal as soon as the first chunk is committed
        if "committed chunk-" in line:
            proc.send_signal(sig)
            break
    err = proc.stderr.read()
    assert proc.wait() == 1
    name = signal.Signals(sig).name
    assert f"stopped by {name}" in err and "run the same command to resume" in err
    partial = read_state(parts_dir(out))
    assert 1 <= len(partial.chunks) < 4 and not out.exists()
    assert f"{4 - len(partial.chunks)} chunks" in err  # what is still to do
    state = regen(out, target, data_file)
    assert out.read_bytes() == full.read_bytes() and state.merged_rows == 14


@pytest.mark.slow
def test_two_processes_equal_one(target, data_file, full, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned processes
    state = regen(tmp_path / "two.jsonl", target, data_file, gpus="cpu:2")
    assert (tmp_path / "two.jsonl").read_bytes() == full.read_bytes()
    assert state.merged_rows == 14 and sorted(state.chunks) == [0, 1, 2, 3]


def test_settings_mismatch_refused_then_overwritten(target, data_file, tmp_path):
    out = tmp_path / "out.jsonl"
    regen(out, target, data_file, max_rows=2)
    with pytest.raises(RegenError, match="max_new_tokens"):
        regen(out, target, data_file, max_rows=2, max_new_tokens=3)
    state = regen(out, target, data_file, max_rows=2, max_new_tokens=3, overwrite=True)
    assert state.settings["max_new_tokens"] == 3 and state.merged_rows == 2
    assert [r["source_row"] for r in _read(out)] == [0, 1]
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("{}\n")
    for overwrite in (False, True):  # --overwrite replaces this command's output only
        with pytest.raises(RegenError, match="this command did not write it"):
            regen(foreign, target, data_file, max_rows=2, overwrite=overwrite)
        assert foreign.read_text() == "{}\n"
    with pytest.raises(RegenError, match="one of the --data"):
        regen(data_file, target, data_file, overwrite=True)


def test_cli_takes_several_files_after_data(target, data_file, full, tmp_path):
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    lines = data_file.read_text().splitlines(keepends=True)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(lines[:7]))  # rows 0-5 (line 6 is blank)
    second.write_text("".join(lines[7:]))
    out = tmp_path / "cli.jsonl"
    args = ["--target", str(target), "--data", str(first), str(second), "--out", str(out)]
    args += ["--gpus", "cpu", "--max-new-tokens", str(MAX_NEW), "--max-length", str(MAX_LENGTH)]
    result = CliRunner().invoke(main, [*args, "--rows-per-chunk", str(ROWS_PER_CHUNK)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == full.read_bytes()
    assert f"wrote {out}: rows 0.." in result.output  # the log says it, as kept rows went there
    assert re.search(r"no_assistant_turn +1 \(lines b.jsonl:1\)", result.output)


def test_an_output_in_use_is_refused(target, data_file, tmp_path):
    from click.testing import CliRunner

    from extract.regen.__main__ import main
    from shared.lock import output_lock

    out = tmp_path / "busy.jsonl"
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out), "--gpus", "cpu"]
    with output_lock(parts_dir(out), "another regeneration"):
        result = CliRunner().invoke(main, [*args, "--overwrite", "--max-rows", "2"])
    assert result.exit_code == 1 and "another regeneration" in result.output, result.output
    assert not out.exists()


@pytest.mark.parametrize("under", ["a_file", "proc"])
def test_an_out_that_cannot_be_written_is_named(target, data_file, tmp_path, under):
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "x.jsonl" if under == "a_file" else Path("/proc/nope-regen.jsonl")
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out), "--gpus", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"Error: --out {out}: " in result.output and "Traceback" not in result.output
    assert (tmp_path / "afile").read_text() == "x"


def test_nothing_kept_is_a_failure_that_says_why_and_what_to_change(target, tmp_path):
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    data = tmp_path / "none_kept.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "hi"}]},
        {"messages": [_user("word " * 200), _assistant("old")]},
        {"input_ids": [1, 5, 2], "loss_mask": [0, 1, 1]},
        {"messages": [_user("word " * 300), _assistant("old")]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "none.jsonl"
    args = ["--target", str(target), "--data", str(data), "--out", str(out), "--gpus", "cpu"]
    args += ["--max-length", str(MAX_LENGTH), "--max-new-tokens", str(MAX_NEW)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    said = result.output.split("Error: ", 1)[-1]  # the logs before it, then this alone
    assert said.startswith(
        "no row of --data was kept (4 read; rejected: 1 no_assistant_turn, 1 pretokenized, "
        f"2 too_long), so nothing was written to {out}. The first rejected rows:\n"
        f"  {data}:1: no_assistant_turn ("
    ), result.output
    assert f"  {data}:2: too_long (prompt of " in said and f"  {data}:3: pretokenized (" in said
    assert "a smaller --max-new-tokens, or a larger --max-length" in said  # too_long's hint
    assert "give such rows to `python -m extract` as they are" in said  # pretokenized's
    assert "rows read" not in result.output and "(0 rows)" not in result.output  # no table
    assert "committed chunk-000000.jsonl: 0 rows kept, 4 rejected" in result.output  # the log
    assert f"wrote {out}" not in result.output  # claims no output that then goes
    assert sorted(p.name for p in tmp_path.iterdir() if "none." in p.name) == []  # no output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "nothing.jsonl"
    args = ["--target", str(target), "--data", str(empty), "--out", str(out), "--gpus", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and f"--data: {empty} holds no rows" in result.output
    assert sorted(p.name for p in tmp_path.iterdir() if "nothing" in p.name) == []  # no output


def test_hybrid_target_batched_equals_plain_generate(tiny_qwen35, data_file, tmp_path):
    out = tmp_path / "hybrid.jsonl"
    regen(out, tiny_qwen35, data_file, max_rows=3, max_new_tokens=MAX_NEW)
    tok, model = _load(tiny_qwen35)
    for row in _read(out):
        messages = row["messages"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                assert _greedy(tok, model, messages[:i])[0] == m["content"]


def test_sampling_draws_the_same_again_with_top_k_off_unless_asked(
    target, data_file, full, tmp_path
):
    from extract.regen.generation import BatchGenerator
    from extract.regen.turns import Prompter

    drawn = dict(temperature=1.0, seed=5, max_rows=8)
    a = regen(tmp_path / "a.jsonl", target, data_file, **drawn)
    regen(tmp_path / "b.jsonl", target, data_file, **drawn)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert _read(tmp_path / "a.jsonl") != _read(full)[: len(_read(tmp_path / "a.jsonl"))]
    assert a.settings["decoding"] == {"temperature": 1.0, "top_p": 1.0, "seed": 5}
    tok, model = _load(target)
    prompter = Prompter(tok, max_new_tokens=MAX_NEW, max_length=None)
    sampled = BatchGenerator(model, prompter, sampling={"temperature": 1.0, "top_p": 1.0}).config
    assert sampled.do_sample and sampled.top_k == 0
    with_k = BatchGenerator(model, prompter, sampling={"temperature": 1.0, "top_k": 7}).config
    assert with_k.top_k == 7 and not BatchGenerator(model, prompter).config.do_sample


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_in_bf16(target, data_file, tmp_path):
    out = tmp_path / "gpu.jsonl"
    state = regen(out, target, data_file, gpus="0")
    assert state.settings["dtype"] == "bfloat16" and state.merged_rows == 14
    assert [r["source_row"] for r in _read(out)] == [i for i in range(14) if i not in BAD]


def test_a_log_file_gets_plain_progress_lines(target, data_file, tmp_path):
    """Without a terminal (a job's log file) the bar is a plain line, never carriage returns."""
    out = tmp_path / "logged.jsonl"
    args = ["--target", str(target), "--data", str(data_file), "--out", str(out), "--gpus", "cpu"]
    args += ["--max-new-tokens", str(MAX_NEW), "--max-length", str(MAX_LENGTH), "--max-rows", "4"]
    log_file = tmp_path / "job.log"
    with open(log_file, "w") as f:
        done = subprocess.run(
            [sys.executable, "-m", "extract.regen", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            stderr=f,
        )
    raw = log_file.read_bytes()  # bytes: a text read turns each carriage return into a newline
    assert done.returncode == 0, raw.decode()
    line = rb"INFO extract.regen.report: regenerate: of 4 rows, 4 done, 0 failed this run, 0 wait"
    assert b"\r" not in raw and re.search(line, raw)


def test_a_parquet_file_regenerates_as_its_jsonl(target, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chats = [json.loads(r) for r in _rows() if r.startswith("{") and "messages" in r][:5]
    jsonl, table = tmp_path / "chats.jsonl", tmp_path / "chats.parquet"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in chats))
    pq.write_table(pa.Table.from_pylist(chats), table, row_group_size=2)
    a = regen(tmp_path / "a.jsonl", target, jsonl)
    b = regen(tmp_path / "b.jsonl", target, table)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert a.totals(range(2))["rows_kept"] == b.totals(range(2))["rows_kept"] >= 3
