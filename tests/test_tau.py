"""`python -m train.proof.tau`: drafters' tau from speculate's JSON lines, shards joined, paired."""

from __future__ import annotations

import json

from click.testing import CliRunner

from train.proof.tau import main, paired_difference, ratio_se


def summary(name: str, rows: list[tuple[float, int]], lossless: bool = True) -> str:
    per_prompt = [{"tau": tau, "steps": steps} for tau, steps in rows]
    return json.dumps(
        {"drafter": name, "per_prompt": per_prompt, "lossless_up_to_near_ties": lossless}
    )


def test_shards_are_joined_per_drafter_and_compared_with_the_first(tmp_path):
    a1, b1 = [(2.0, 10), (1.5, 20)], [(2.0, 10), (1.6, 18)]
    a2, b2 = [(1.0, 30)], [(1.25, 24)]
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    sampled = json.dumps({"drafter": "S", "tau": 1.5, "steps": 9})  # no per-prompt rows: skipped
    one.write_text(
        "tau 1.6 over ...\n" + summary("A", a1) + "\n" + sampled + "\n" + summary("B", b1) + "\n"
    )
    two.write_text(summary("A", a2) + "\n" + summary("B", b2, lossless=False) + "\n")
    r = CliRunner().invoke(main, [str(one), str(two), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output.splitlines()[-1])
    n_a = [t * s for t, s in a1 + a2]
    s_a = [s for _, s in a1 + a2]
    n_b = [t * s for t, s in b1 + b2]
    s_b = [s for _, s in b1 + b2]
    assert [x["prompts"] for x in rows] == [3, 3]
    assert (rows[0]["tau"], rows[0]["se"]) == ratio_se(n_a, s_a)
    assert rows[1]["vs_first"] == paired_difference((n_a, s_a), (n_b, s_b))
    assert "NOT lossless" in r.output.splitlines()[1]


def test_files_that_do_not_match_are_refused(tmp_path):
    one, two, none = tmp_path / "one", tmp_path / "two", tmp_path / "none"
    one.write_text(summary("A", [(2.0, 3), (1.0, 4)]) + "\n" + summary("B", [(2.0, 3)]) + "\n")
    two.write_text(summary("A", [(2.0, 3)]) + "\n")
    none.write_text("no json here\n")
    r = CliRunner().invoke(main, [str(one), str(two)])
    assert r.exit_code != 0 and "B was decoded on other prompts than A" in r.output
    twice = tmp_path / "twice"
    twice.write_text(summary("A", [(2.0, 3)]) + "\n" + summary("A", [(1.0, 3)]) + "\n")
    r = CliRunner().invoke(main, [str(twice)])
    assert r.exit_code != 0 and "drafter A appears twice" in r.output
    r = CliRunner().invoke(main, [str(none)])
    assert r.exit_code != 0 and "no JSON lines" in r.output


def test_files_of_other_drafters_on_the_same_prompts_add_them(tmp_path):
    """Drafters decoded side by side in two processes: four drafters, each against the first,
    never one file's drafters taken for more prompts of the other's."""
    rows = {"A": [(2.0, 10), (1.5, 20)], "B": [(2.2, 9), (1.5, 20)], "C": [(1.0, 20), (1.2, 25)]}
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text(summary("A", rows["A"]) + "\n" + summary("B", rows["B"]) + "\n")
    two.write_text(summary("C", rows["C"]) + "\n")
    r = CliRunner().invoke(main, [str(one), str(two), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.splitlines()[-1])
    assert [x["drafter"] for x in out] == ["A", "B", "C"]
    assert [x["prompts"] for x in out] == [2, 2, 2]
    n_s = {k: ([t * s for t, s in v], [s for _, s in v]) for k, v in rows.items()}
    assert out[2]["vs_first"] == paired_difference(n_s["A"], n_s["C"])
