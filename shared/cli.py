"""Click options derived from a config dataclass, so defaults and help have one source.

A stage declares `@dataclass(frozen=True, kw_only=True) class XConfig` with fields made by
`option(...)`; `click_options(XConfig)` turns them into click options and `build(XConfig,
kwargs)` makes the config, turning a `ValueError` from `__post_init__` into a clean usage error.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    metavar: str | None = None,
    moot_with: str | None = None,
) -> Any:
    """A config field with its CLI help. A tuple-typed field takes one or more values.
    `moot_with`: another field that, when set, makes this one have no effect; `build` refuses
    the two given together on a command line."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "flag": flag}
    meta["metavar"] = metavar
    meta["moot_with"] = moot_with
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default for sequence fields")
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> tuple[Any, bool, bool]:
    """(element type, is_optional, is_sequence) of a field annotation."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
        origin = typing.get_origin(tp)
    if origin is tuple:
        return typing.get_args(tp)[0], optional, True
    return tp, optional, False


def _click_type(tp: Any, choices: Sequence[str] | None) -> Any:
    if choices:
        return click.Choice(list(choices), case_sensitive=False)
    return {int: int, float: float, str: str, Path: click.Path(path_type=Path)}.get(tp, str)


def click_options(cls: type) -> Callable[[Callable], Callable]:
    """Decorator adding one click option per field of dataclass `cls`."""
    hints = typing.get_type_hints(cls)

    def decorate(fn: Callable) -> Callable:
        for f in reversed(dataclasses.fields(cls)):
            if "help" not in f.metadata:
                continue
            tp, optional, sequence = _base_type(hints[f.name])
            name = _flag(f)
            default = None if f.default is dataclasses.MISSING else f.default
            help_text = f.metadata["help"]
            if tp is bool and not sequence:
                no = "--no-" + name[2:]
                fn = click.option(
                    f"{name}/{no}", f.name, default=bool(default), help=help_text, show_default=True
                )(fn)
                continue
            required = f.default is dataclasses.MISSING
            # No default at all for a required option: click 8.5 takes an explicit None as a
            # value and would let the command run without it.
            fn = click.option(
                name,
                f.name,
                type=_click_type(tp, f.metadata.get("choices")),
                multiple=sequence,
                **({} if required else {"default": default}),
                required=required,
                help=help_text,
                show_default=default is not None and default != (),
                metavar=f.metadata.get("metavar"),
            )(fn)
        return fn

    return decorate


def build(cls: type, kwargs: dict[str, Any]) -> Any:
    """Make `cls(**kwargs)`, turning validation errors into click usage errors."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items() if k in names}
    # click passes () for an unset multiple option: let the dataclass default apply.
    for f in dataclasses.fields(cls):
        if values.get(f.name) == () and f.default is not dataclasses.MISSING:
            values[f.name] = f.default
    refuse_moot(cls, values)
    try:
        return cls(**values)
    except ValueError as e:
        raise click.UsageError(flag_names(cls, str(e))) from None


def refuse_moot(cls: type, values: dict[str, Any]) -> None:
    """A click usage error for an option typed on the command line beside the option that makes
    it have no effect (`option(moot_with=...)`, e.g. `--num-layers` beside `--layers`), or
    without the value of another option it acts under (`cls.ONLY_WITH`, e.g. `--markov-rank`
    only with `--drafter-type dspark`; the outermost condition is named first): which one the
    user meant is theirs to say. Outside a click command, or where the moot one is only its
    default, nothing."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    typed = [f for f in fields.values() if ctx.get_parameter_source(f.name) in given]
    for f in typed:
        other = f.metadata.get("moot_with")
        if other and values.get(other) is not None:
            raise click.UsageError(
                f"{_flag(f)} {values[f.name]} has no effect with {_flag(fields[other])} "
                f"{values[other]}: give one of them"
            )
        for other, wanted in reversed(_conditions(cls, f.name)):
            if str(values.get(other)) not in wanted:
                raise click.UsageError(
                    f"{_flag(f)} has no effect unless {_flag(fields[other])} is "
                    f"{' or '.join(wanted)} (this command's: {values.get(other)}): drop it, or "
                    f"give {_flag(fields[other])} {wanted[0]}"
                )


def _conditions(cls: type, name: str) -> list[tuple[str, tuple[str, ...]]]:
    """The (field, values) conditions under which field `name` acts: its `cls.ONLY_WITH` entry,
    then that field's own, and so on (`--confidence-head` acts under `--dspark-loss full`, which
    acts under `--drafter-type dspark`)."""
    only_with, chain = getattr(cls, "ONLY_WITH", {}), []
    while name in only_with and len(chain) < len(only_with):
        name, wanted = only_with[name]
        chain.append((name, wanted))
    return chain


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_names(cls: type, message: str) -> str:
    """`message` with `cls`'s field names written as their flags (`block_size` ->
    `--block-size`): validation speaks of fields, the user typed flags. A name written as a
    flag already is left alone."""
    for f in sorted(dataclasses.fields(cls), key=lambda f: -len(f.name)):
        if "help" not in f.metadata:
            continue
        flag = _flag(f)
        # Whole words only; a plain word that is also a field (`steps`, `data`) only where the
        # message starts with it, as in "steps: must be >= 1".
        pattern = (
            rf"(?<![\w-]){re.escape(f.name)}(?![\w-])" if "_" in f.name else rf"^{f.name}(?=:)"
        )
        message = re.sub(pattern, flag, message)
    return message


def to_json(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config (paths as strings, tuples as lists)."""

    def conv(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (tuple, list)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return {f.name: conv(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
