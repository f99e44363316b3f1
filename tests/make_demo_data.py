"""Generate the shipped demo chat dataset `extract/data/demo.jsonl`, deterministically.

Run `python -m tests.make_demo_data` from the repository root to rewrite the file; a test checks
the shipped file equals this generator's output, so the two never drift apart.

Simple templated English (arithmetic, word facts, short explanations), with single-turn,
multi-turn and system-prompt conversations, so a tiny target and drafter have patterns to learn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

DEMO_PATH = Path(__file__).resolve().parent.parent / "extract" / "data" / "demo.jsonl"
SEED = 20240611
NUM_ROWS = 480

QA = tuple[str, str, str]  # (question, full answer, short answer)


def _table(pairs: str) -> dict[str, str]:
    """`"a:b c:d"` -> `{"a": "b", "c": "d"}`."""
    return dict(pair.split(":") for pair in pairs.split())


WORDS = (
    "apple river garden window orange planet pencil candle forest mirror rocket bridge "
    "island castle dragon tiger banana butter winter summer silver yellow kitten puzzle "
    "ladder button jacket cookie cloud stone music light dream green happy quiet"
).split()
PLURALS = _table(
    "box:boxes child:children mouse:mice leaf:leaves city:cities foot:feet tooth:teeth "
    "baby:babies bus:buses knife:knives person:people story:stories goose:geese "
    "wolf:wolves dish:dishes"
)
OPPOSITES = _table(
    "hot:cold big:small fast:slow happy:sad light:dark open:closed early:late full:empty "
    "hard:soft up:down old:new strong:weak loud:quiet wet:dry high:low"
)
SOUNDS = _table(
    "cat:meow dog:woof cow:moo duck:quack sheep:baa horse:neigh owl:hoot lion:roar "
    "frog:ribbit bee:buzz"
)
COLORS = {
    "the sky on a clear day": "blue",
    "grass": "green",
    "snow": "white",
    "a ripe banana": "yellow",
    "coal": "black",
    "a ripe tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "a carrot": "orange",
    "the night sky": "black",
    "a strawberry": "red",
    "a cloud": "white",
}
CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Egypt": "Cairo",
    "Canada": "Ottawa",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "India": "New Delhi",
    "Germany": "Berlin",
    "Greece": "Athens",
    "Chile": "Santiago",
    "Poland": "Warsaw",
}
EXPLANATIONS = {
    "why is the sky blue": (
        "Sunlight is a mix of many colors. The air scatters blue light much more than red"
        " light, so blue light reaches our eyes from every part of the sky."
    ),
    "why do we have seasons": (
        "The Earth is tilted. As it travels around the Sun, each half of the Earth leans "
        "toward the Sun for part of the year and gets more direct light, which is summer."
    ),
    "what is a prime number": (
        "A prime number is a whole number greater than 1 that can only be divided evenly "
        "by 1 and by itself. For example, 2, 3, 5 and 7 are prime."
    ),
    "how do plants make food": (
        "Plants use sunlight, water and air to make sugar. This is called photosynthesis,"
        " and it happens in the green parts of the leaves."
    ),
    "where does rain come from": (
        "The Sun warms water in seas and lakes, and it rises as vapor. High in the sky "
        "the vapor cools into tiny drops that form clouds, and heavy drops fall as rain."
    ),
    "why does ice float": (
        "Water expands when it freezes, so ice is less dense than liquid water. Anything "
        "less dense than water floats on it."
    ),
    "what is gravity": (
        "Gravity is the pull that every object with mass has on every other object. It "
        "keeps us on the ground and keeps the Moon moving around the Earth."
    ),
    "how does a rainbow form": (
        "Sunlight enters raindrops, bends and reflects inside them, and comes out split "
        "into its colors. Each color leaves at a slightly different angle, making a bow."
    ),
    "what is a noun": (
        "A noun is a word that names a person, a place, a thing or an idea, such as "
        "teacher, city, apple or freedom."
    ),
    "what is a verb": (
        "A verb is a word that describes an action or a state, such as run, think or be."
    ),
    "why does the moon change shape": (
        "The Moon does not change shape. As it goes around the Earth, we see different "
        "amounts of its sunlit half, so it seems to grow and shrink."
    ),
    "why do leaves change color in autumn": (
        "In autumn, trees stop making green chlorophyll. As the green fades, the yellow "
        "and orange colors that were hidden in the leaves show through."
    ),
    "what is an even number": (
        "An even number is a whole number that can be divided by 2 with no remainder, "
        "such as 2, 4, 6 and 8."
    ),
    "why do we need to sleep": (
        "Sleep lets the body rest and repair itself, and it helps the brain store what we"
        " learned during the day."
    ),
}
SYSTEM_PROMPTS = {
    "plain": "You are a helpful assistant.",
    "short": "You are a concise assistant. Answer with as few words as possible.",
    "tutor": "You are a friendly tutor for children. Be warm and encouraging.",
    "caps": "Always answer in capital letters.",
}


def _arithmetic(rng: random.Random) -> QA:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    kind = rng.randrange(7)
    if kind == 0:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", str(a + b)
    if kind == 1:
        return f"Compute {a} + {b}.", f"{a} + {b} = {a + b}.", str(a + b)
    if kind == 2:
        a, b = max(a, b), min(a, b)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}.", str(a - b)
    if kind == 3:
        a, b = a % 13 + 1, b % 13 + 1
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", str(a * b)
    if kind == 4:
        parity = "even" if a % 2 == 0 else "odd"
        why = "it divides by 2 with no remainder" if a % 2 == 0 else "dividing it by 2 leaves 1"
        return f"Is {a} even or odd?", f"{a} is {parity}, because {why}.", parity
    if kind == 5:
        return f"What number comes after {a}?", f"The number after {a} is {a + 1}.", str(a + 1)
    big, small = max(a, b), min(a, b)
    if big == small:
        return f"Which is larger, {a} or {b}?", f"They are equal: both are {a}.", "equal"
    return f"Which is larger, {a} or {b}?", f"{big} is larger than {small}.", str(big)


def _word_fact(rng: random.Random) -> QA:
    w = rng.choice(WORDS)
    kind = rng.randrange(9)
    if kind == 0:
        n = len(w)
        return (
            f"How many letters are in the word '{w}'?",
            f"The word '{w}' has {n} letters.",
            str(n),
        )
    if kind == 1:
        return (
            f"What is the first letter of '{w}'?",
            f"The first letter of '{w}' is '{w[0]}'.",
            w[0],
        )
    if kind == 2:
        r = w[::-1]
        return f"Spell '{w}' backwards.", f"'{w}' spelled backwards is '{r}'.", r
    if kind == 3:
        u = w.upper()
        return f"Write '{w}' in capital letters.", f"'{w}' in capital letters is '{u}'.", u
    if kind == 4:
        s, p = rng.choice(sorted(PLURALS.items()))
        return f"What is the plural of '{s}'?", f"The plural of '{s}' is '{p}'.", p
    if kind == 5:
        a, o = rng.choice(sorted(OPPOSITES.items()))
        return f"What is the opposite of '{a}'?", f"The opposite of '{a}' is '{o}'.", o
    if kind == 6:
        an, s = rng.choice(sorted(SOUNDS.items()))
        return f"What sound does a {an} make?", f"A {an} says '{s}'.", s
    if kind == 7:
        thing, c = rng.choice(sorted(COLORS.items()))
        return f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {c}.", c
    country, city = rng.choice(sorted(CAPITALS.items()))
    return f"What is the capital of {country}?", f"The capital of {country} is {city}.", city


def _explanation(rng: random.Random) -> QA:
    topic, text = rng.choice(sorted(EXPLANATIONS.items()))
    question = topic[0].upper() + topic[1:] + "?"
    short = text.split(". ")[0].rstrip(".") + "."
    framing = rng.choice(
        ("{q}", "Can you explain this: {q}", "Quick question: {q}", "{q} Briefly.")
    )
    full = short if framing.endswith("Briefly.") else text
    return framing.format(q=question), full, short


TOPICS: tuple[Callable[[random.Random], QA], ...] = (_arithmetic, _word_fact, _explanation)


def _styled(qa: QA, style: str) -> str:
    """The assistant's answer under a system-prompt style."""
    _, full, short = qa
    if style == "short":
        return short
    if style == "tutor":
        return f"Good question! {full} You are doing great."
    if style == "caps":
        return full.upper()
    return full


def _follow_up(rng: random.Random, qa: QA, style: str) -> tuple[str, str]:
    """A second user turn that refers to the previous answer, and its reply."""
    short = qa[2]
    if short.isdigit() and rng.random() < 0.6:
        n = int(short)
        return "And if you double that?", _styled(
            ("", f"Doubling {n} gives {2 * n}.", str(2 * n)), style
        )
    if rng.random() < 0.5:
        return "Thanks!", _styled(("", "You're welcome! Happy to help.", "You're welcome."), style)
    return "Can you say that in fewer words?", _styled(("", short, short), style)


def _conversation(rng: random.Random) -> dict:
    """One row: optional system prompt, one to three exchanges, sometimes a follow-up."""
    style = rng.choice(("plain", "short", "tutor", "caps")) if rng.random() < 0.25 else "none"
    messages: list[dict[str, str]] = []
    if style != "none":
        messages.append({"role": "system", "content": SYSTEM_PROMPTS[style]})
    turns = rng.choices((1, 2, 3), weights=(6, 3, 1))[0]
    for _ in range(turns):
        qa = rng.choice(TOPICS)(rng)
        messages.append({"role": "user", "content": qa[0]})
        messages.append({"role": "assistant", "content": _styled(qa, style)})
        if rng.random() < 0.2:
            question, answer = _follow_up(rng, qa, style)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def demo_rows(num_rows: int = NUM_ROWS, seed: int = SEED) -> list[dict]:
    """The demo dataset's rows, identical on every run."""
    rng = random.Random(seed)
    return [_conversation(rng) for _ in range(num_rows)]


def demo_text(num_rows: int = NUM_ROWS, seed: int = SEED) -> str:
    """The demo dataset exactly as shipped: one JSON object per line."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in demo_rows(num_rows, seed))


if __name__ == "__main__":
    DEMO_PATH.parent.mkdir(parents=True, exist_ok=True)
    DEMO_PATH.write_text(demo_text(), encoding="utf-8")
