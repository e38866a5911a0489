"""How ``cutlass-tune`` prints: JSON with ``--json``, else a plain table and a line of text."""

from __future__ import annotations

import json
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def emit(args, data: Any, table: tuple[list[str], list[list]] | None = None,
         text: str | None = None) -> None:
    if getattr(args, "json", False):
        print(json.dumps(data, indent=1, default=str))
        return
    if table is not None:
        print_table(*table)
    if text:
        print(text)


def print_table(headers: list[str], rows: list[list]) -> None:
    if not rows:
        print("(nothing)")
        return
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4f}"


def ratio(value: float | None) -> float | None:
    return round(value, 3) if value else None
