"""What the user sees: bars on a terminal, plain lines in a log file, the end-of-run tables."""

from __future__ import annotations

import io
import json
import logging
import re
import sys

from tqdm import tqdm

from shared import progress
from shared.logs import setup_logging
from shared.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_progress_is_plain_lines(caplog, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress_bar(total=10, desc="train", unit="steps")
    assert isinstance(bar, LineProgress)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO):
        bar = progress_bar(total=10, desc="train", unit="steps", initial=2)
        bar.update(1)
        bar.set_postfix(loss="1.234")
        bar.update(2)
        bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "shared.progress"]
    assert lines[0].startswith("train: 3/10 steps (30%)")
    assert lines[1].startswith("train: 5/10 steps (50%)") and lines[1].endswith("loss=1.234")
    assert "\r" not in "".join(lines)
    quiet = LineProgress(total=10, desc="x", every=3600.0)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            quiet.update(1)
    assert not caplog.records  # not due yet: no line per update


def test_on_a_terminal_log_lines_are_not_written_into_the_bar(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert isinstance(progress_bar(total=3, desc="d", disable=True), tqdm)
    setup_logging(0)
    bar = tqdm(total=3, desc="extract", file=term)
    bar.update(1)
    logging.getLogger("test.display").info("a log line")
    bar.close()
    setup_logging(0)  # back to the real stderr for later tests
    out = term.getvalue()
    line = next(x for x in out.replace("\r", "\n").splitlines() if "a log line" in x)
    assert "extract" not in line  # a line of its own, not glued to the bar


def test_train_summary_table(tmp_path):
    from train.summary import format_summary

    records = [
        {"kind": "train", "step": 10, "loss": 2.5, "tau": 1.5},
        {"kind": "train", "step": 20, "loss": 2.0, "tau": 1.75},
        {"kind": "eval", "step": 20, "loss": 2.25, "tau": 1.625},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "export").mkdir()
    text = format_summary(tmp_path, export=tmp_path / "export", seconds=12.0)
    assert "steps" in text and "20" in text and "12.0 s" in text
    assert "loss 2.0000, tau 1.750" in text and "loss 2.2500, tau 1.625 at step 20" in text
    assert str(tmp_path / "export") in text and str(tmp_path / "metrics.jsonl") in text


def test_train_summary_names_the_prompts_shipped_with_the_data(tmp_path):
    from extract.plan import default_data
    from train.summary import format_summary, shipped_prompts

    demo = default_data()
    assert shipped_prompts([str(p) for p in demo]) == demo[0].with_name("demo_prompts.json")
    data = tmp_path / "chats.jsonl"
    data.write_text("")
    assert shipped_prompts([str(data)]) is None  # none beside it: the user names one
    (tmp_path / "chats_prompts.json").write_text("[]")
    assert shipped_prompts([str(data)]) == tmp_path / "chats_prompts.json"
    assert shipped_prompts([str(data), str(data)]) is None  # several files: whose prompts?
    (tmp_path / "export").mkdir()
    prompts = tmp_path / "chats_prompts.json"
    text = format_summary(tmp_path, export=tmp_path / "export", seconds=1.0, prompts=prompts)
    assert text.count(f"--prompts {prompts}") == 2 and "PROMPTS.json" not in text
    assert "--prompts PROMPTS.json" in format_summary(
        tmp_path, export=tmp_path / "export", seconds=1.0
    )


def test_train_summary_says_why_there_is_no_eval(tmp_path):
    from train.summary import format_summary

    record = {"kind": "train", "step": 3, "loss": 2.5, "tau": 1.5}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")

    def eval_line() -> str:
        text = format_summary(tmp_path, export=tmp_path / "export", seconds=1.0)
        return next(line for line in text.splitlines() if line.startswith("eval"))

    stopped = eval_line()  # no export: the run stopped early, its held-out samples unused yet
    assert "stopped before the first evaluation" in stopped and "--eval" not in stopped
    (tmp_path / "export").mkdir()
    assert "no samples held out (--eval-fraction, --eval-parts)" in eval_line()


def test_extract_summary_lists_the_first_rejected_rows(tmp_path, tiny_qwen3):
    from extract.summary import format_summary
    from tests.test_extract import chat
    from tests.test_extract_safety import extract

    data = tmp_path / "d.jsonl"
    lines = [json.dumps(chat(i)) for i in range(4)]
    lines[1] = "{not json"
    lines[3] = json.dumps({"prompt": "unknown schema"})
    data.write_text("\n".join(lines) + "\n")
    text = format_summary(
        extract(tmp_path / "c", tiny_qwen3, data), out=tmp_path / "c", seconds=1.0
    )
    assert f"{data}:2: " in text and f"{data}:4: " in text, text
    assert re.search(r"unknown_schema +1 \(a row needs `messages` \(OpenAI\), `conv", text)
    assert f"{data}:4: unknown_schema (a row needs" in text and "its keys: ['prompt']" in text
    counts = progress.read_counters(tmp_path / "c" / ".progress")
    assert counts["done_rows"] == 4  # the bar's position: kept rows per batch + rejected rows


def test_extract_summary_names_the_cache_as_this_command_did(tmp_path, tiny_qwen3):
    """A cache copied elsewhere and completed there: its summary and next commands name the
    copy, not the folder its manifest was first written in."""
    import shutil

    from tests.test_extract import chat
    from tests.test_extract_safety import _cli

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(4)))
    args = ["--target", str(tiny_qwen3), "--data", str(data), "--layers", "0,2"]
    assert _cli("--out", str(tmp_path / "first"), *args).exit_code == 0
    shutil.copytree(tmp_path / "first", tmp_path / "copy")
    r = _cli("--out", str(tmp_path / "copy"), *args)
    assert r.exit_code == 0, r.output
    assert f"extract.verify {tmp_path / 'copy'}" in r.output, r.output
    assert str(tmp_path / "first") not in r.output


def test_an_extraction_logged_to_a_file_has_no_carriage_returns(tmp_path):
    """The whole command with stderr not a terminal (a pipe, as a job scheduler's log): the
    target's loading (Hugging Face's own bars) and extraction's progress are plain lines, and
    two ranks end without multiprocessing's leaked-semaphore warning (their exit skips the
    interpreter's finalization, and numcodecs' Blosc lock is a semaphore). The pipe is read
    to its end, which comes when the resource tracker that would print it has exited too."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "extract",
            "--out",
            str(tmp_path / "c"),
            "--max-rows",
            "8",
            "--rows-per-part",
            "4",
            "--gpus",
            "cpu:2",
        ],  # fmt: skip
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    raw = done.stderr  # bytes: a text read turns each carriage return into a newline
    assert done.returncode == 0, raw.decode()
    assert b"\r" not in raw and b"INFO shared.progress: extract: 8/8 rows" in raw
    assert b"leaked semaphore" not in raw, raw.decode()[-2000:]


def _row_counts(folder, **counts) -> None:
    counters = progress.RankCounters(folder, 0)
    counters.add(**counts)
    counters.close()


def test_counter_files_of_an_earlier_run_are_left_out_until_a_rank_writes_its_own(tmp_path):
    _row_counts(tmp_path, rows=10, new_tokens=500)  # an earlier run's rank 0
    earlier = progress.counter_files(tmp_path)
    assert progress.read_counters(tmp_path)["rows"] == 10
    assert progress.read_counters(tmp_path, earlier=earlier) == {}
    _row_counts(tmp_path, rows=3)  # this run's rank 0 replaces the same file
    assert progress.read_counters(tmp_path, earlier=earlier) == {"rows": 3}


def test_regenerate_progress_counts_failed_rows_apart(tmp_path, caplog, monkeypatch):
    from extract.regen.report import RowBar

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    _row_counts(tmp_path, rows=10, failed=2, new_tokens=500)
    caplog.set_level(logging.INFO)
    RowBar(tmp_path, total=15, every=0.0).refresh()
    quiet = RowBar(tmp_path, total=15, every=3600.0)
    quiet.refresh()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1  # the quiet bar is not due yet
    assert lines[0].startswith("regenerate: of 15 rows, 10 done, 2 failed this run, 3 waiting;")
    assert "new tok/s" in lines[0] and " s left" in lines[0] and "\r" not in lines[0]
    quiet.close()  # the last line is always written
    assert len(caplog.records) == 2
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = RowBar(tmp_path, total=15)
    bar.close()
    drawn = term.getvalue().replace("\r", "\n").splitlines()[-1]
    assert "12/15" in drawn and "10 done, 2 failed this run, 3 waiting" in drawn
    assert len(caplog.records) == 2  # a terminal gets the bar, not log lines


def test_train_summary_counts_the_steps_a_stopped_run_reached(tmp_path):
    """A run stopped between log steps (a signal, --stop-after-steps) saves a checkpoint where
    it stops, and its record of that step first: the summary's steps are that checkpoint's;
    where the newest checkpoint is past the last record (a run of a version that did not log
    at checkpoints), it says so."""
    from click.testing import CliRunner

    from tests.cachegen import write_cache
    from tests.test_sweep import TRAIN
    from train.__main__ import main
    from train.summary import format_summary

    cache = write_cache(tmp_path / "cache", num_parts=3, samples_per_part=6)
    at = TRAIN.index("--checkpoint-every")
    options = [*TRAIN[:at], "--checkpoint-every", "3", "--stop-after-steps", "3"]
    args = ["--data", str(cache), "--out", str(tmp_path / "run"), "--gpus", "cpu", *options]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    steps = next(line for line in result.output.splitlines() if line.startswith("steps"))
    assert steps.split(None, 1)[1] == "3"
    assert "none (stopped before the end)" in result.output
    metrics = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["step"] == 3
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))  # as before
    summary = format_summary(tmp_path / "run", export=tmp_path / "run" / "export", seconds=1.0)
    steps = next(line for line in summary.splitlines() if line.startswith("steps"))
    assert steps.split(None, 1)[1].startswith("3 (the newest checkpoint; last logged at ")
