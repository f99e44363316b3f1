"""`python -m train.proof.tau SPEC [SPEC...]`: the acceptance length of drafters decoded on the
same prompts, with standard errors, and each one's paired difference from the first.

SPEC: the output of `python -m train.proof.speculate ... --json` (its JSON lines, one per
drafter; other lines are skipped). Drafters are told apart by name: files holding the same
drafters on more prompts (one prompt set cut into shards) are joined in order, files holding
other drafters on the same prompts (decoded side by side) add them.

tau = (tokens accepted + 1 per verify step, summed) / verify steps, over all prompts (what
`train.proof.speculate` reports). Prompts are the unit of sampling: tau's standard error is the
ratio estimator's, from each prompt's tokens n and steps s (`ratio_se`). Two drafters decoded
on the same prompts differ far less than two independent samples of prompts would: a prompt
easy for one is easy for the other. `paired_difference` gives tau_b / tau_a - 1 with the
standard error of the paired per-prompt terms, and the one the two independent errors would
give, so a report shows how much the pairing resolves.

`--compare A B` pairs two groups of drafters, those whose names contain A with those whose names
contain B, one to one in order (e.g. the seeds of a recipe trained on two caches): each pair's
paired difference, their mean with the standard error over pairs (what the seeds' spread
says), and the groups pooled (each prompt's tokens and steps summed over the group, then paired
by prompt: what the prompts' spread says).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click


def ratio_se(n_P: Sequence[float], s_P: Sequence[float]) -> tuple[float, float]:
    """(tau, its standard error): tau = sum(n) / sum(s) over prompts P, the error from the
    prompts' residuals n - tau * s (the ratio estimator's linearisation; the estimator of
    `train.proof.decode.pooled_tau_se`, here from each prompt's sums).

    >>> tau, se = ratio_se([20, 30, 10, 40], [10, 20, 10, 20])
    >>> round(tau, 4), round(se, 4)
    (1.6667, 0.2029)
    """
    P, N, S = len(n_P), float(sum(n_P)), float(sum(s_P))
    if sum(1 for s in s_P if s) < 2:
        raise ValueError(f"tau's standard error needs 2 or more prompts with steps, got {P}")
    tau = N / S
    residual = sum((n - tau * s) ** 2 for n, s in zip(n_P, s_P, strict=True))
    return tau, math.sqrt(residual * P / (P - 1)) / S


def _log_terms(n_P: Sequence[float], s_P: Sequence[float]) -> list[float]:
    """Each prompt's term of log tau's linearisation: n / N - s / S (they sum to 0)."""
    N, S = float(sum(n_P)), float(sum(s_P))
    return [n / N - s / S for n, s in zip(n_P, s_P, strict=True)]


def paired_difference(
    a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]]
) -> dict[str, float]:
    """tau_b / tau_a - 1 for two drafters' (n, s) on the same prompts, with its standard error
    from the paired per-prompt terms (`paired_se`) and from the two taus' own errors as if
    their prompts were independent (`independent_se`).

    >>> a = ([20, 30, 10, 40], [10, 20, 10, 20])
    >>> b = ([20, 30, 10, 40], [10, 19, 10, 19])  # one step fewer on two prompts
    >>> d = paired_difference(a, b)
    >>> round(d["relative"], 4), round(d["paired_se"], 4), round(d["independent_se"], 4)
    (0.0345, 0.0137, 0.1816)
    """
    (na, sa), (nb, sb) = a, b
    P = len(na)
    if len(nb) != P or P < 2:
        raise ValueError(f"a paired difference needs the same 2+ prompts, got {P} and {len(nb)}")
    ta, tb = sum(na) / sum(sa), sum(nb) / sum(sb)
    la, lb = _log_terms(na, sa), _log_terms(nb, sb)
    scale = P / (P - 1)
    paired = math.sqrt(scale * sum((y - x) ** 2 for x, y in zip(la, lb, strict=True)))
    independent = math.sqrt(scale * (sum(x * x for x in la) + sum(y * y for y in lb)))
    ratio = tb / ta
    return {
        "relative": ratio - 1,
        "paired_se": ratio * paired,
        "independent_se": ratio * independent,
        "prompts": P,
    }


SAME_SETTINGS = ("max_new_tokens", "dtype")  # decodings compared must share these


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a decoding's output (its lines that start with '{'); a
    ClickException naming the line when one is cut short (a decoding killed mid-write)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"{path}: cannot read it ({e})") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("{"):
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            raise click.ClickException(
                f"{path}:{number}: a JSON line cut short (its decoding killed while writing?): "
                "run that decoding again"
            ) from None
    return out


def read_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Per drafter, in the order first seen: its name and per-prompt tokens n and steps s. A
    drafter in several files gets their prompts joined in file order (one prompt set cut into
    shards); drafters in different files (decoded side by side in several processes) must have
    been decoded on the same prompts, which each prompt's length checks."""
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        # greedy decodings only: a sampled one (DSpark's --temperature) has no per-prompt rows
        found = [x for x in _json_lines(Path(path)) if "per_prompt" in x]
        names = [x["drafter"] for x in found]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise click.ClickException(f"{path}: drafter {twice[0]} appears twice")
        for summary in found:
            run = runs.setdefault(
                summary["drafter"],
                {"drafter": summary["drafter"], "lossless": True}
                | {key: [] for key in ("n", "s", "prompts", "indices", "shards")},
            )
            settings = {k: summary.get(k) for k in SAME_SETTINGS}
            if run.setdefault("settings", settings) != settings:
                raise click.ClickException(
                    f"{path}: {summary['drafter']}'s share was decoded with {settings}, its "
                    f"others with {run['settings']}: decode every share alike"
                )
            rows = summary["per_prompt"]
            # a prompt with no verify step (eos first) has tau NaN, or null: it adds nothing
            run["n"] += [r["tau"] * r["steps"] if r["steps"] else 0.0 for r in rows]
            run["s"] += [r["steps"] for r in rows]
            run["prompts"] += [r.get("prompt_tokens") for r in rows]
            run["indices"] += [r.get("index") for r in rows]
            run["shards"].append(summary.get("shard"))
            run["lossless"] &= summary["lossless_up_to_near_ties"]
    if not runs:
        raise click.ClickException("no JSON lines: run train.proof.speculate with --json")
    for run in runs.values():  # shares of one prompt list: all of them, in order
        shards, n = run["shards"], len(run["shards"])
        whole = [f"{k}/{n}" for k in range(1, n + 1)] if None not in shards else shards
        if shards != whole or (
            None not in run["indices"] and run["indices"] != list(range(len(run["indices"])))
        ):
            raise click.ClickException(
                f"{run['drafter']}: its prompts, joined in the order the files were given, are "
                "not the whole prompt list in order (a share missing, given twice or out of "
                "order? give every --shard K/N output once, in K's order)"
            )
    first, *rest = runs.values()
    for run in rest:
        if differ := [k for k in SAME_SETTINGS if run["settings"][k] != first["settings"][k]]:
            k = differ[0]
            raise click.ClickException(
                f"{run['drafter']} was decoded with {k} {run['settings'][k]}, "
                f"{first['drafter']} with {first['settings'][k]}: their taus are not comparable "
                "(decode every drafter with the same --max-new-tokens and --dtype)"
            )
        if run["prompts"] != first["prompts"]:
            raise click.ClickException(
                f"{run['drafter']} was decoded on other prompts than {first['drafter']} "
                f"({len(run['n'])} against {len(first['n'])}, or other lengths): give every "
                "drafter's files for the same prompt set"
            )
    return list(runs.values())


def compare_groups(runs: Sequence[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    """Drafters named with `a` against those named with `b`, paired one to one in order (see
    the module docstring): {"pairs": [(name a, name b, paired_difference)], "mean", "mean_se"
    (None for one pair), "pooled": paired_difference of the summed groups}.

    >>> r = lambda name, n: {"drafter": name, "n": n, "s": [10.0, 10.0]}
    >>> out = compare_groups([r("x/s0", [11, 12]), r("y/s0", [12, 12]), r("x/s1", [11, 13]),
    ...                       r("y/s1", [11, 14])], "x/", "y/")
    >>> [round(p[2]["relative"], 4) for p in out["pairs"]], round(out["mean"], 4)
    ([0.0435, 0.0417], 0.0426)
    >>> round(out["pooled"]["relative"], 4)  # (24 + 26) / (22 + 25) - 1
    0.0426
    """
    group_a = [r for r in runs if a in r["drafter"]]
    group_b = [r for r in runs if b in r["drafter"]]
    if both := [r["drafter"] for r in group_a if b in r["drafter"]]:
        raise click.ClickException(f"--compare: {both[0]} is named with both {a!r} and {b!r}")
    if not group_a or len(group_a) != len(group_b):
        raise click.ClickException(
            f"--compare: {len(group_a)} drafters named with {a!r} against {len(group_b)} with "
            f"{b!r}: give as many of each, in the same order"
        )
    pairs = [
        (x["drafter"], y["drafter"], paired_difference((x["n"], x["s"]), (y["n"], y["s"])))
        for x, y in zip(group_a, group_b, strict=True)
    ]
    rel = [d["relative"] for _, _, d in pairs]
    mean = sum(rel) / len(rel)
    mean_se = None
    if len(rel) > 1:
        mean_se = math.sqrt(sum((x - mean) ** 2 for x in rel) / (len(rel) - 1) / len(rel))

    def pooled(group: list[dict[str, Any]], key: str) -> list[float]:
        return [sum(vals) for vals in zip(*(r[key] for r in group), strict=True)]

    summed = [(pooled(g, "n"), pooled(g, "s")) for g in (group_a, group_b)]
    return {"pairs": pairs, "mean": mean, "mean_se": mean_se, "pooled": paired_difference(*summed)}


def _compare_lines(out: dict[str, Any], a: str, b: str) -> list[str]:
    lines = [f"{a!r} against {b!r}, paired one to one:"]
    for x, y, d in out["pairs"]:
        lines.append(
            f"  {y} against {x}: {100 * d['relative']:+.2f}% +- {100 * d['paired_se']:.2f}%"
        )
    se = "" if out["mean_se"] is None else f" +- {100 * out['mean_se']:.2f}% (over pairs)"
    p = out["pooled"]
    lines.append(f"  mean {100 * out['mean']:+.2f}%{se}")
    lines.append(
        f"  pooled {100 * p['relative']:+.2f}% +- {100 * p['paired_se']:.2f}% (over prompts)"
    )
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("spec", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print one JSON line last")
@click.option(
    "--compare",
    nargs=2,
    default=None,
    metavar="A B",
    help="also pair the drafters named with A one to one with those named with B",
)
def main(spec: tuple[Path, ...], as_json: bool, compare: tuple[str, str] | None) -> None:
    """tau of each drafter with its standard error, and each one against the first, paired."""
    runs = read_runs(spec)
    for run in runs:
        stepped = sum(1 for s in run["s"] if s)
        if stepped < 2:
            prompts = f"{len(run['s'])} prompt" + ("s" if len(run["s"]) != 1 else "")
            raise click.ClickException(
                f"{run['drafter']}: decoded on {prompts}, {stepped} of them with a verify step: "
                "tau's standard error needs 2 or more prompts with a verify step; "
                "decode more prompts, or more tokens each (train.proof.speculate "
                "--max-new-tokens)"
            )
    compared = None if compare is None else compare_groups(runs, *compare)
    out = []
    for run in runs:
        tau, se = ratio_se(run["n"], run["s"])
        row = {"drafter": run["drafter"], "tau": tau, "se": se, "prompts": len(run["n"])}
        line = f"{run['drafter']}: tau {tau:.4f} +- {se:.4f} ({len(run['n'])} prompts)"
        if run is not runs[0]:
            d = paired_difference((runs[0]["n"], runs[0]["s"]), (run["n"], run["s"]))
            row["vs_first"] = d
            line += (
                f"; against the first {100 * d['relative']:+.2f}% +- "
                f"{100 * d['paired_se']:.2f}% paired ({100 * d['independent_se']:.2f}% unpaired)"
            )
        if not run["lossless"]:
            line += "; NOT lossless against greedy"
        click.echo(line)
        out.append(row)
    if compared is not None:
        click.echo("\n".join(_compare_lines(compared, *compare)))
    if as_json:
        click.echo(json.dumps(out if compared is None else {"drafters": out, "compare": compared}))


if __name__ == "__main__":
    main()
