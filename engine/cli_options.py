"""Command-line options whose default is a field of a config dataclass (every ``lmforge`` subcommand's)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

from engine.errors import UsageError

#: The engine dtypes a command offers (``auto``: bfloat16 where the CPU has native bf16 units, else float32).
ENGINE_DTYPES = ("auto", "float32", "bfloat16")


def add_engine_dtype_option(parser: Any, flag: str, help: str) -> None:
    """Add ``flag``, the engine's dtype: one of ``ENGINE_DTYPES``, default ``auto``."""
    parser.add_argument(flag, default="auto", choices=list(ENGINE_DTYPES), help=help)


def default_text(value: Any) -> str:
    """How a help text names a default: ``600.0`` as ``600``, anything else as ``str`` writes it."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def add_option(parser: Any, flag: str, default: Any, help: str, **kwargs: Any) -> None:
    """Add ``flag`` with ``default``, which ``help`` gets at its end as ``(default X)`` (see
    :func:`default_text`), so the value is written once.

    ``parser`` is an ``argparse.ArgumentParser`` or one of its groups. Without ``type``, ``choices`` or
    ``action``, an int or float default gives the option its type.
    """
    parser.add_argument(
        flag, default=default, help=f"{help} (default {default_text(default)})", **_typed(default, kwargs)
    )


def _typed(default: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of ``add_argument`` with ``type`` taken from an int or float ``default`` where none of
    ``type``, ``choices`` or ``action`` is given."""
    if not {"type", "choices", "action"} & kwargs.keys() and type(default) in (int, float):
        return {**kwargs, "type": type(default)}
    return kwargs


def add_config_option(parser: Any, config: Any, field: str, help: str | None = None, **kwargs: Any) -> None:
    """Add ``--field-name`` (the field's underscores as dashes) whose default is ``config.field``.

    ``parser`` is an ``argparse.ArgumentParser`` or one of its groups. Without ``type``, ``choices`` or
    ``action``, an int or float default gives the option its type. ``help`` names the default as
    ``%(default)s`` (argparse fills it in), so one value is written once.
    """
    default = getattr(config, field)
    parser.add_argument("--" + field.replace("_", "-"), default=default, help=help, **_typed(default, kwargs))


def config_fields(config_cls: Any, args: Any, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for dataclass ``config_cls``: each field ``args`` (an ``argparse.Namespace``) has an
    option of the same name for, then ``overrides`` (the fields whose flag is named or typed otherwise)."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def errors_name_flags(fields: Iterable[str], renames: dict[str, str] | None = None) -> Iterator[None]:
    """Inside: a ``UsageError`` of a config's own check, ``"field=value: why"``, is raised again as
    ``"--flag value: why"`` for a ``field`` in ``fields``, so a command's error names the flag the user
    typed, not the dataclass field behind it. The flag is ``--field-name`` unless ``renames`` gives it."""
    flags = {field: "--" + field.replace("_", "-") for field in fields} | (renames or {})
    try:
        yield
    except UsageError as exc:
        match = re.match(r"(\w+)=(.*?): (.*)", exc.message, re.S)
        if match is None or match[1] not in flags:
            raise
        raise UsageError(f"{flags[match[1]]} {match[2]}: {match[3]}", fix=exc.fix) from exc
