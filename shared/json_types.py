"""Types of the fields of a dataclass as a JSON object holds them: the check of a file edited
by hand (a manifest), before its values are used."""

from __future__ import annotations

import dataclasses
from typing import Any

SCALARS = {"int": int, "bool": bool, "str": str}


def wrong_types(obj: Any, cls: type) -> list[str]:
    """The fields of `cls` that the JSON object `obj` holds with another type (a hand-edited
    manifest): `name is 'x', not int`. Only scalars and lists of ints are checked.

    >>> from shared.manifest import Manifest, PartRecord
    >>> wrong_types({"unit": "3", "first_row": 0, "name": "part-000003"}, PartRecord)
    ["unit is '3', not int"]
    >>> wrong_types({"layer_ids": [1, "x"], "complete": 1}, Manifest)
    ['complete is 1, not bool', "layer_ids holds 'x', not int"]
    """
    if not isinstance(obj, dict):
        return [f"{obj!r} is not an object"]
    fields = [f for f in dataclasses.fields(cls) if f.name in obj]  # missing ones: KeyError
    found = (_wrong_type(f.name, str(f.type), obj[f.name]) for f in fields)
    return [w for w in found if w]


def _wrong_type(name: str, kind: str, value: Any) -> str | None:
    if kind == "tuple[int, ...]":
        if not isinstance(value, list):
            return f"{name} is {value!r}, not a list"
        bad = [v for v in value if type(v) is not int]  # bool and float are no layer ids
        return f"{name} holds {bad[0]!r}, not int" if bad else None
    want = SCALARS.get(kind)
    if want is None or type(value) is want:
        return None
    return f"{name} is {value!r}, not {want.__name__}"
