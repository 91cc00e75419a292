"""Pipeline summaries as Markdown that MLflow renders: pipe tables, headings, one paragraph per line.

MLflow shows a ``.md`` artifact rendered, so a fixed-width text table there collapses into one
paragraph; these helpers keep a summary readable both on the console and in the UI.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

_HEADING = re.compile(r"^==+\s*(.*?)\s*==+$")


def _is_row(line: str) -> bool:
    return line.startswith("|") and line.rstrip().endswith("|")


def pipe_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown pipe table (``|`` inside a cell escaped)."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def frame_table(frame, number: Callable[[float], str] = lambda v: f"{v:.4f}") -> str:
    """A pandas DataFrame as a pipe table, floats through ``number`` (NaN as –)."""
    def show(value: Any) -> str:
        if isinstance(value, float):
            return "–" if value != value else number(value)
        return str(value)

    return pipe_table(list(frame.columns), [[show(v) for v in row] for row in frame.itertuples(index=False)])


def as_markdown(text: str) -> str:
    """Console text as Markdown: ``== title ==`` lines as headings, tables kept with a blank line
    around them, every other line its own paragraph (the console's line breaks are meaningful)."""
    blocks: list[list[str]] = []
    for line in text.strip("\n").splitlines():
        heading = _HEADING.match(line.strip())
        if heading:
            blocks.append([f"## {heading.group(1)}"])
        elif _is_row(line.strip()):
            if blocks and blocks[-1] and _is_row(blocks[-1][-1]):
                blocks[-1].append(line.strip())
            else:
                blocks.append([line.strip()])
        elif line.strip():
            blocks.append([line.strip()])
    return "\n\n".join("\n".join(b) for b in blocks)
