"""The printed table and the JSON document of a run.

JSON (``--json PATH``, written by rank 0)::

    {"schema": "fastvideo-bench/1",
     "header": {... harness.header.REQUIRED ..., case-specific keys},
     "rows": [{... case fields ..., "wrong": int | null, "wrong_oracle": str}, ...],
     ... case-specific sections (the tuner's "tuned_rows", the DiT step's "op_level", ...)}

A row that did not run has ``skipped`` (why) and ``wrong: null``. ``validate`` checks a document against this.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.header import REQUIRED, SCHEMA


@dataclass(frozen=True)
class Column:
    """One table column: the row's ``key``, a ``title``, a format for numbers, a scale applied before formatting
    (``scale=100`` prints a fraction as a percentage), or ``get`` to compute the cell from the whole row."""

    key: str
    title: str
    fmt: str = ".3f"
    scale: float = 1.0
    width: int = 0
    get: Callable[[dict], object] | None = None

    def value(self, row: dict) -> object:
        return self.get(row) if self.get is not None else row.get(self.key)

    def cell(self, row: dict) -> str:
        v = self.value(row)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        if isinstance(v, int) and self.scale == 1.0:
            return str(v)
        if isinstance(v, (int, float)):
            return format(v * self.scale, self.fmt)
        return str(v)


WRONG = Column("wrong", "#wrong")


def table_lines(columns: Sequence[Column], rows: Iterable[dict], details: Callable[[dict], list[str]] | None = None,
                key_columns: int = 1) -> list[str]:
    """The table: a title line, then one line per row (``skipped: why`` after the first ``key_columns`` cells of a
    skipped row), each followed by the ``details`` lines of the row; ``#wrong`` is always the last column."""
    columns = [*columns, WRONG]
    rows = list(rows)
    cells = [[c.cell(r) for c in (columns[:key_columns] if "skipped" in r else columns)] for r in rows]
    widths = [max([c.width, len(c.title), *(len(line[i]) for line in cells if i < len(line))])
              for i, c in enumerate(columns)]
    out = [" ".join(c.title.rjust(w) for c, w in zip(columns, widths))]
    for row, line in zip(rows, cells):
        if "skipped" in row:
            head = " ".join(cell.rjust(w) for cell, w in zip(line[:key_columns], widths[:key_columns]))
            out.append(f"{head} skipped: {row['skipped']}")
            continue
        out.append(" ".join(cell.rjust(w) for cell, w in zip(line, widths)))
        for text in (details(row) if details else []):
            out.append(" " * (widths[0] + 1) + text)
    oracles = sorted({r.get("wrong_oracle") for r in rows if r.get("wrong_oracle") and "skipped" not in r})
    out += [f"# #wrong: {text}" for text in oracles]
    return out


def check_row(row: dict) -> None:
    """A row must say how many elements were wrong (or None, with why) and against what. Raises ValueError."""
    if "wrong" not in row or "wrong_oracle" not in row:
        raise ValueError(f"row without 'wrong' and 'wrong_oracle': {sorted(row)}")
    wrong = row["wrong"]
    if wrong is not None and (isinstance(wrong, bool) or not isinstance(wrong, int) or wrong < 0):
        raise ValueError(f"row 'wrong' must be a count >= 0 or None, got {wrong!r}")
    if not isinstance(row["wrong_oracle"], str) or not row["wrong_oracle"]:
        raise ValueError(f"row 'wrong_oracle' must say what the output was compared with, got {row['wrong_oracle']!r}")
    if wrong is None and "skipped" not in row and "wrong_note" not in row:
        raise ValueError("a row with wrong=None must be skipped or carry 'wrong_note' (why nothing was compared)")


def document(header: dict, rows: Sequence[dict], extra: dict | None = None) -> dict:
    return {"schema": SCHEMA, "header": header, "rows": list(rows), **(extra or {})}


def write_json(path: str | None, doc: dict) -> None:
    """Write ``doc`` to ``path`` (parents created), replacing it atomically; nothing without a path."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(target)


def validate(doc: dict) -> list[str]:
    """What is wrong with a run's JSON document against the schema above (empty: valid)."""
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema {doc.get('schema')!r} is not {SCHEMA!r}")
    header = doc.get("header")
    if not isinstance(header, dict):
        return [*problems, "no header"]
    problems += [f"header lacks {k!r}" for k in REQUIRED if k not in header]
    lib = header.get("native_library")
    if lib is not None and not (isinstance(lib, dict) and {"path", "sha256"} <= set(lib)):
        problems.append(f"native_library must be null or have path and sha256: {lib!r}")
    rows = doc.get("rows")
    if not isinstance(rows, list):
        return [*problems, "rows is not a list"]
    for i, row in enumerate(rows):
        try:
            check_row(row)
        except ValueError as exc:
            problems.append(f"row {i}: {exc}")
    return problems
