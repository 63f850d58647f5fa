"""Plain-text tables of fixed-width columns, as ``lmforge evaluate`` and the benchmarks print them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def fmt(value: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    """``value * scale`` formatted with ``spec``; ``-`` for a figure that was not measured."""
    return "-" if value is None else format(value * scale, spec)


def table_lines(
    columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]], *, indent: str = "", rule: bool = True
) -> list[str]:
    """The head, a rule of dashes as long as the head (when ``rule``), then one line per row.

    ``columns`` are ``(title, spec)`` pairs: ``spec`` is an alignment and width such as ``"<28"`` or
    ``">9"``, applied to the title and to the row's cell, so a column's width is written once. Cells
    are formatted strings (see :func:`fmt`), one per column, separated by a space; a cell wider than
    its column pushes the rest of its line right. Every line starts with ``indent``.
    """

    def line(cells: Sequence[str]) -> str:
        return indent + " ".join(format(cell, spec) for cell, (_, spec) in zip(cells, columns, strict=True))

    head = line([title for title, _ in columns])
    return [head, *(["-" * len(head)] if rule else []), *(line(cells) for cells in rows)]
