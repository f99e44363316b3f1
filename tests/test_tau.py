"""`python -m train.proof.tau`: drafters' tau from speculate's JSON lines, shards joined, paired."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from train.proof.decode import pooled_tau_se
from train.proof.tau import main, paired_difference, ratio_se


def summary(name: str, rows: list[tuple[float, int]], lossless: bool = True, **settings) -> str:
    per_prompt = [{"tau": tau, "steps": steps} for tau, steps in rows]
    return json.dumps(
        {"drafter": name, "per_prompt": per_prompt, "lossless_up_to_near_ties": lossless}
        | {"max_new_tokens": 64, "dtype": "bfloat16"}
        | settings
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
    share = tmp_path / "share"  # a second share of A's prompts, decoded otherwise
    share.write_text(summary("A", [(2.0, 3)], dtype="float32") + "\n")
    r = CliRunner().invoke(main, [str(two), str(share)])
    assert r.exit_code != 0 and "decode every share alike" in r.output, r.output
    short = tmp_path / "short"  # the same prompts, decoded to fewer new tokens
    short.write_text(summary("C", [(2.0, 3)], max_new_tokens=16) + "\n")
    r = CliRunner().invoke(main, [str(two), str(short)])
    assert r.exit_code != 0 and "C was decoded with max_new_tokens 16, A with 64" in r.output
    cut = tmp_path / "cut"  # a decoding killed while it wrote its line
    cut.write_text("tau 1.6 over ...\n" + summary("A", [(2.0, 3)])[:40] + "\n")
    r = CliRunner().invoke(main, [str(cut)])
    assert r.exit_code == 1 and f"{cut}:2: a JSON line cut short" in r.output, r.output


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


def test_two_groups_are_compared_pair_by_pair_by_their_mean_and_pooled(tmp_path):
    # seeds 0 and 1 of a recipe on two caches, decoded side by side on the same 3 prompts
    rows = {
        "bf16/seed-0": [(1.2, 10), (1.1, 20), (1.3, 10)],
        "int4/seed-0": [(1.2, 10), (1.0, 22), (1.3, 10)],
        "bf16/seed-1": [(1.4, 10), (1.1, 20), (1.2, 10)],
        "int4/seed-1": [(1.5, 10), (1.1, 20), (1.2, 10)],
    }
    spec = tmp_path / "spec.txt"
    spec.write_text("\n".join(summary(name, r) for name, r in rows.items()) + "\n")
    r = CliRunner().invoke(main, [str(spec), "--compare", "bf16/", "int4/", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.splitlines()[-1])["compare"]

    def ns(name):
        return [t * s for t, s in rows[name]], [s for _, s in rows[name]]

    pairs = [paired_difference(ns(f"bf16/seed-{i}"), ns(f"int4/seed-{i}")) for i in (0, 1)]
    assert [p[2] for p in out["pairs"]] == pairs
    rel = [p["relative"] for p in pairs]
    assert out["mean"] == sum(rel) / 2
    assert out["mean_se"] == abs(rel[0] - rel[1]) / 2  # sd of two over sqrt(2)
    summed = [
        [sum(x) for x in zip(ns(f"{g}/seed-0")[k], ns(f"{g}/seed-1")[k], strict=True)]
        for g in ("bf16", "int4")
        for k in (0, 1)
    ]
    assert out["pooled"] == paired_difference(summed[:2], summed[2:])
    assert "pooled" in r.output and "(over pairs)" in r.output


def test_groups_of_other_sizes_or_overlapping_names_are_refused(tmp_path):
    spec = tmp_path / "spec.txt"
    rows = [(1.2, 10), (1.1, 20)]
    spec.write_text("\n".join(summary(n, rows) for n in ("a/0", "a/1", "b/0")) + "\n")
    r = CliRunner().invoke(main, [str(spec), "--compare", "a/", "b/"])
    assert r.exit_code != 0 and "2 drafters named with 'a/' against 1" in r.output
    r = CliRunner().invoke(main, [str(spec), "--compare", "/", "a/"])
    assert r.exit_code != 0 and "named with both" in r.output


def test_shares_missing_or_out_of_order_are_refused(tmp_path):
    """speculate's rows carry their index in the whole prompt list: shares joined must give
    0, 1, 2, ... (a share that failed and printed nothing, or files in another order, would
    otherwise give a tau over other prompts without a word)."""

    def share(path, indices):
        rows = [{"tau": 1.5, "steps": 4, "index": i} for i in indices]
        line = {"drafter": "A", "per_prompt": rows, "lossless_up_to_near_ties": True}
        path.write_text(json.dumps(line) + "\n")
        return str(path)

    first, second, third = (
        share(tmp_path / f"s{k}", idx) for k, idx in enumerate([[0, 1], [2], [3]])
    )
    empty = tmp_path / "empty"
    empty.write_text("Traceback (most recent call last): ...\n")
    assert CliRunner().invoke(main, [first, second, third]).exit_code == 0
    for files in ([first, third], [first, third, second], [second, first, third]):
        r = CliRunner().invoke(main, files)
        assert r.exit_code != 0 and "not the whole prompt list in order" in r.output, files
    r = CliRunner().invoke(main, [first, str(empty), third])
    assert r.exit_code != 0 and "not the whole prompt list in order" in r.output


def test_a_last_share_missing_is_refused(tmp_path):
    """The shares' `shard` (K/N) tells a missing last share, which the indices alone cannot."""
    paths = []
    for k, indices in enumerate([[0, 1], [2], [3]], start=1):
        rows = [{"tau": 1.5, "steps": 4, "index": i} for i in indices]
        line = {"drafter": "A", "per_prompt": rows, "lossless_up_to_near_ties": True}
        paths.append(tmp_path / f"s{k}")
        paths[-1].write_text(json.dumps({**line, "shard": f"{k}/3"}) + "\n")
    assert CliRunner().invoke(main, [str(p) for p in paths]).exit_code == 0
    r = CliRunner().invoke(main, [str(p) for p in paths[:2]])
    assert r.exit_code != 0 and "not the whole prompt list in order" in r.output


def test_a_decoding_with_no_standard_error_is_refused_by_name(tmp_path):
    """Under two prompts with a verify step there is no spread to measure: one prompt, none
    with a step, or one of three with a step (its se would read 0)."""
    one, steps, once = tmp_path / "one", tmp_path / "steps", tmp_path / "once"
    one.write_text(summary("A", [(1.5, 2)]) + "\n")  # one prompt
    steps.write_text(summary("B", [(float("nan"), 0), (float("nan"), 0)]) + "\n")  # no step
    once.write_text(summary("C", [(1.5, 2), (float("nan"), 0), (float("nan"), 0)]) + "\n")
    for path, needle in [
        (one, "A: decoded on 1 prompt, 1 of them with a verify step"),
        (steps, "B: decoded on 2 prompts, 0 of them"),
        (once, "C: decoded on 3 prompts, 1 of them"),
    ]:
        r = CliRunner().invoke(main, [str(path)])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
        assert needle in r.output and "needs 2 or more prompts with a verify step" in r.output


def test_a_prompt_without_a_verify_step_adds_nothing(tmp_path):
    """A prompt whose first new token was eos has no step and tau NaN (null in strict JSON)."""
    rows = [(1.5, 2), (2.0, 3), (4.0, 1)]
    for empty in (float("nan"), None):
        spec = tmp_path / "spec"
        spec.write_text(summary("A", [(empty, 0), *rows]) + "\n")
        r = CliRunner().invoke(main, [str(spec), "--json"])
        assert r.exit_code == 0, r.output
        (row,) = json.loads(r.output.splitlines()[-1])
        n = [0.0] + [t * s for t, s in rows]
        assert (row["tau"], row["se"]) == ratio_se(n, [0, 2, 3, 1])
        assert row["tau"] == (3 + 6 + 4) / 6 and row["prompts"] == 4


def test_speculate_and_tau_give_one_standard_error_where_a_prompt_has_no_step():
    """train.proof.speculate's pooled error and train.proof.tau's count a prompt with no verify
    step alike (one of the prompts, adding nothing to tau)."""
    lengths = [[2, 1], [], [3, 3, 1], [1]]
    se = ratio_se([sum(ls) for ls in lengths], [len(ls) for ls in lengths])[1]
    assert pooled_tau_se(lengths) == pytest.approx(se, rel=1e-12)
    assert pooled_tau_se(lengths) != pytest.approx(pooled_tau_se([ls for ls in lengths if ls]))
