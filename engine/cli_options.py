"""Command-line options whose default is a field of a config dataclass (every ``lmforge`` subcommand's)."""

from __future__ import annotations

from typing import Any


def add_config_option(parser: Any, config: Any, field: str, help: str | None = None, **kwargs: Any) -> None:
    """Add ``--field-name`` (the field's underscores as dashes) whose default is ``config.field``.

    ``parser`` is an ``argparse.ArgumentParser`` or one of its groups. Without ``type``, ``choices`` or
    ``action``, an int or float default gives the option its type. ``help`` names the default as
    ``%(default)s`` (argparse fills it in), so one value is written once.
    """
    default = getattr(config, field)
    if not {"type", "choices", "action"} & kwargs.keys() and type(default) in (int, float):
        kwargs["type"] = type(default)
    parser.add_argument("--" + field.replace("_", "-"), default=default, help=help, **kwargs)
