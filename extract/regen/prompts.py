"""`python -m extract.regen.prompts`: a prompt set written by the target itself, for regeneration.

Two steps around `python -m extract.regen` (which does all generation):

    python -m extract.regen.prompts seeds --out seeds.jsonl --count 30000
    python -m extract.regen --target T --data seeds.jsonl --out seeds.regen.jsonl \\
        --max-new-tokens 48
    python -m extract.regen.prompts chats --regen seeds.regen.jsonl --out chats.jsonl \\
        --held-out prompts.json --held-out-count 64
    python -m extract.regen --target T --data chats.jsonl --out data.jsonl

`seeds` writes one chat per (topic, kind of question, asker) asking the model to write one question
(a deterministic enumeration, so any count up to `max_seeds()` gives the same first rows); `chats`
takes the model's answers as prompts, keeps those that look like one question, drops duplicates
(case, spacing and punctuation folded), puts the shipped demo prompts first, holds the last
`--held-out-count` out (never trained on: for `train.proof.speculate`), and writes the rest as chats
whose assistant turns the second regeneration fills in.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import click

from shared.fsio import atomic_write_text

DEMO_PROMPTS = Path(__file__).parents[1] / "data" / "demo_prompts.json"
# What `BENCH_MODE=cpu bash bench/real_target.sh` wrote with smollm2-135m-instruct (800 seeds):
# its questions, answered by it (at most 128 tokens), and the 32 prompts it held out.
REAL_CHATS = Path(__file__).parents[1] / "data" / "smollm2_chats.jsonl"
REAL_HELD_OUT = Path(__file__).parents[1] / "data" / "smollm2_held_out.json"
SEEDS = Path(__file__).parents[1] / "data" / "prompt_seeds.json"  # topics, kinds, askers
_QUESTION = re.compile(r"^[^\n]{8,300}\?$")
_QUOTED = re.compile(r'"([^"\n]{8,300}\?)"')


def _seeds() -> dict[str, list[str]]:
    return json.loads(SEEDS.read_text())


def max_seeds() -> int:
    s = _seeds()
    return len(s["topics"]) * len(s["kinds"]) * len(s["askers"])


def seed_rows(count: int) -> Iterator[dict]:
    """The first `count` prompt-writing chats. The topic varies fastest, then the kind of
    question, then the asker, so a count much smaller than `max_seeds()` covers every topic."""
    s = _seeds()
    combos = itertools.product(s["askers"], s["kinds"], s["topics"])
    for asker, kind, topic in itertools.islice(combos, count):
        ask = (
            f"Write {kind} about {topic} that {asker} might ask an assistant. "
            "Reply with the question only."
        )
        yield {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": ""}]}


def normalized(text: str) -> str:
    """Duplicate key: lower case, letters and digits only, single spaces."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def clean_question(text: str) -> str | None:
    """The model's answer as one question, or None (several lines, no question mark, too long).

    A small model often wraps the question (`A child might ask, "What's a river?"`): the last
    quoted question is taken then.

    >>> clean_question('What a question! A child might ask, "What is a river?"')
    'What is a river?'
    """
    quoted = _QUOTED.findall(text)
    text = (quoted[-1] if quoted else text).strip().strip('"').strip()
    if text.lower().startswith("question:"):
        text = text[len("question:") :].strip()
    return text if _QUESTION.match(text) else None


def unique_prompts(first: Iterable[str], answers: Iterable[str]) -> list[str]:
    """`first` (kept as is), then the answers that are one question, without duplicates."""
    seen: set[str] = set()
    out = []
    for text in itertools.chain(first, (q for q in map(clean_question, answers) if q)):
        key = normalized(text)
        if key and key not in seen:
            seen.add(key)
            out.append(text)
    return out


def regenerated_answers(path: Path) -> Iterator[str]:
    """The last assistant turn of each row of `path`, an output of `python -m extract.regen`."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                messages = json.loads(line)["messages"]
                answers = [m["content"] for m in messages if m["role"] == "assistant"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                answers, why = [], f"{type(e).__name__}: {e}"
            else:
                why = "no assistant turn"
            if not answers or not isinstance(answers[-1], str):
                raise click.ClickException(
                    f"--regen {path}, line {number}: not a row of `python -m extract.regen`'s "
                    f"output ({why}); give the file that command wrote"
                )
            yield answers[-1]


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A prompt set written by the target itself (see the module help)."""


def _file(**kwargs: bool) -> click.Path:
    return click.Path(dir_okay=False, path_type=Path, **kwargs)


@main.command()
@click.option("--out", type=_file(), required=True)
@click.option("--count", type=int, default=2000, show_default=True, help="Seed chats to write.")
def seeds(out: Path, count: int) -> None:
    """Write prompt-writing chats for `python -m extract.regen`."""
    if not 1 <= count <= max_seeds():
        raise click.BadParameter(
            f"{count} is not in 1 .. {max_seeds()}, the topics x kinds x askers of {SEEDS.name}",
            param_hint="--count",
        )
    atomic_write_text(out, _jsonl(seed_rows(count)))
    click.echo(f"{count} seed chats -> {out}")


@main.command()
@click.option("--regen", type=_file(exists=True), required=True)
@click.option("--out", type=_file(), required=True)
@click.option("--held-out", type=_file(), required=True)
@click.option("--held-out-count", type=click.IntRange(min=0), default=64, show_default=True)
def chats(regen: Path, out: Path, held_out: Path, held_out_count: int) -> None:
    """Prompts from regenerated seed chats -> chats to answer, and held-out prompts."""
    named = {"--regen": regen, "--out": out, "--held-out": held_out}
    for (a, x), (b, y) in itertools.combinations(named.items(), 2):
        if x.resolve() == y.resolve():
            raise click.ClickException(f"{a} and {b} are the same file, {x}; give two files")
    demo = json.loads(DEMO_PROMPTS.read_text())
    prompts = unique_prompts(demo, regenerated_answers(regen))
    if len(prompts) <= held_out_count:
        raise click.ClickException(f"only {len(prompts)} distinct prompts")
    cut = len(prompts) - held_out_count
    train, test = prompts[:cut], prompts[cut:]
    rows = (
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]}
        for p in train
    )
    atomic_write_text(out, _jsonl(rows))
    atomic_write_text(held_out, json.dumps(test, indent=1, ensure_ascii=False) + "\n")
    click.echo(f"{len(prompts)} distinct prompts: {len(train)} -> {out}, {len(test)} -> {held_out}")


if __name__ == "__main__":
    main()
