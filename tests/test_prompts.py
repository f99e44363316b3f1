"""extract.regen.prompts: seed chats, the question filter and deduplication (no model needed)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from extract.regen.prompts import (
    SEEDS,
    clean_question,
    main,
    max_seeds,
    normalized,
    seed_rows,
    unique_prompts,
)


def test_seed_rows_are_distinct_and_cover_every_topic_early():
    topics = json.loads(SEEDS.read_text())["topics"]
    rows = list(seed_rows(len(topics)))
    asks = [r["messages"][0]["content"] for r in rows]
    assert len(set(asks)) == len(asks) and all(
        f"about {t} " in a for t, a in zip(topics, asks, strict=True)
    )
    assert all(r["messages"][1] == {"role": "assistant", "content": ""} for r in rows)
    assert len(list(seed_rows(max_seeds() + 5))) == max_seeds()


def test_question_filter_and_dedup():
    assert clean_question(' "Why is the sky blue?" ') == "Why is the sky blue?"
    assert clean_question("Question: How do bees fly?") == "How do bees fly?"
    assert clean_question("Here are three questions:\n1. Why?") is None
    assert clean_question("Bees fly with wings.") is None
    assert clean_question('Great! A child might ask, "Why do cats purr?"') == "Why do cats purr?"
    got = unique_prompts(["What is 2 plus 2?"], ["what is 2 plus 2 ?", "How do bees fly?", "x"])
    assert got == ["What is 2 plus 2?", "How do bees fly?"]


def test_chats_holds_the_last_prompts_out(tmp_path):
    regen = tmp_path / "seeds.regen.jsonl"
    answers = [f"How does thing number {i} work?" for i in range(30)] + [
        "How does thing number 3 work?"
    ]
    regen.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": a},
                    ]
                }
            )
            + "\n"
            for a in answers
        )
    )
    out, held = tmp_path / "chats.jsonl", tmp_path / "held.json"
    args = ["chats", "--regen", regen, "--out", out, "--held-out", held, "--held-out-count", 5]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    train = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    test = json.loads(held.read_text())
    assert len(train) + len(test) == 8 + 30 and len(test) == 5  # 8 demo prompts first
    assert not set(train) & set(test) and test[-1] == "How does thing number 29 work?"


def test_shipped_real_chats_are_answered_distinct_and_disjoint_from_the_held_out():
    """The real model's data set in the package: every row one question and its non-empty
    answer, no prompt twice, none of the held-out prompts among them (a leak would inflate tau)."""
    from extract.regen.prompts import REAL_CHATS, REAL_HELD_OUT

    rows = [json.loads(line) for line in REAL_CHATS.read_text().splitlines()]
    held_out = json.loads(REAL_HELD_OUT.read_text())
    assert len(rows) >= 300 and len(held_out) >= 30
    roles = {tuple(m["role"] for m in r["messages"]) for r in rows}
    assert roles == {("user", "assistant")}
    assert all(r["messages"][1]["content"].strip() for r in rows)
    keys = [normalized(r["messages"][0]["content"]) for r in rows]  # the dedup's own key
    assert len(set(keys)) == len(keys)
    assert not set(keys) & {normalized(p) for p in held_out}


def _regen_rows(path, answers: list[str]) -> list[str]:
    """`path` written as `python -m extract.regen` writes seed chats answered by `answers`."""
    path.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": "q"}, _answer(a)]}) + "\n"
            for a in answers
        )
    )
    return [str(path)]


def _answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_held_out_count_zero_keeps_every_prompt_for_training(tmp_path):
    regen = _regen_rows(tmp_path / "r.jsonl", [f"How does thing {i} work?" for i in range(3)])
    out, held = tmp_path / "chats.jsonl", tmp_path / "held.json"
    args = ["chats", "--regen", *regen, "--out", str(out), "--held-out", str(held)]
    result = CliRunner().invoke(main, [*args, "--held-out-count", "0"])
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 8 + 3 and json.loads(held.read_text()) == []


def test_bad_files_are_named_without_a_traceback(tmp_path):
    regen = _regen_rows(tmp_path / "r.jsonl", ["How does a thing work?"])
    kept = (tmp_path / "r.jsonl").read_bytes()
    out, held = str(tmp_path / "chats.jsonl"), str(tmp_path / "held.json")

    def refused(*args: str) -> str:
        result = CliRunner().invoke(main, list(args))
        assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
        return result.output

    assert "same file" in refused("chats", "--regen", *regen, "--out", *regen, "--held-out", held)
    assert "same file" in refused("chats", "--regen", *regen, "--out", out, "--held-out", out)
    assert (tmp_path / "r.jsonl").read_bytes() == kept
    assert "is a directory" in refused("seeds", "--out", str(tmp_path), "--count", "2")
    (tmp_path / "r.jsonl").write_text("garbage\n")
    message = refused("chats", "--regen", *regen, "--out", out, "--held-out", held)
    assert f"--regen {regen[0]}, line 1: not a row of" in message
