"""Plain-text tables and section rules shared by the benchmark scripts (no torch here)."""

from __future__ import annotations

import json


def rule(title: str = "") -> None:
    print(f"\n== {title} " + "=" * max(0, 86 - len(title)) if title else "=" * 90, flush=True)


def table(rows: list[tuple], header: tuple) -> None:
    cols = [header] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    for j, r in enumerate(cols):
        cells = zip(r, widths, strict=True)
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(cells)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def print_result(result: dict) -> None:
    """The last line a benchmark prints: its headline numbers as one JSON object."""
    print(json.dumps(result), flush=True)
