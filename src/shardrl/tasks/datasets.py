"""User datasets: JSONL or Parquet rows with `prompt` and `answer` become `TaskItem`s.

Columns: `prompt` (required, non-empty text), `answer` (required; text, or a number which
is kept as written), `category` (optional, default "default"), `prompt_id` (optional;
otherwise a stable hash of the prompt, the same hash the built-in task uses). Every bad row
is reported (up to `max_errors`) with the file and its 1-based row number, so a user fixes
a file in one pass instead of one error per run.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardrl.tasks.builtin import TaskItem

DEFAULT_CATEGORY = "default"
_LINE_END = re.compile(rb"\r\n|\r|\n")
COLUMNS = ("prompt", "answer", "category", "prompt_id")
"""The columns a dataset row may give; others are ignored."""
MAX_REPORTED_ERRORS = 20


class DatasetError(ValueError):
    """A dataset file is unreadable or has bad rows; the message lists them."""


def prompt_id_of(prompt: str) -> str:
    """Stable id of a prompt: 12 hex digits of blake2b over its UTF-8 text."""
    return hashlib.blake2b(prompt.encode(), digest_size=6).hexdigest()


def _text(value: Any, column: str, required: bool) -> tuple[str | None, str | None]:
    """(text, problem) for one cell; numbers become their written form."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, f"missing column '{column}'" if required else None
    if isinstance(value, bool):
        return None, f"column '{column}' is a boolean, expected text"
    if isinstance(value, int | float):
        return str(value), None
    if not isinstance(value, str):
        return None, f"column '{column}' is {type(value).__name__}, expected text"
    if required and not value.strip():
        return None, f"column '{column}' is empty"
    return value, None


def row_to_item(row: Any) -> tuple[TaskItem | None, list[str]]:
    """The item a row describes, or the list of what is wrong with it."""
    if not isinstance(row, dict):
        return None, [f"row is {type(row).__name__}, expected an object"]
    cells = {
        "prompt": _text(row.get("prompt"), "prompt", True),
        "answer": _text(row.get("answer"), "answer", True),
        "category": _text(row.get("category"), "category", False),
        "prompt_id": _text(row.get("prompt_id"), "prompt_id", False),
    }
    problems = [problem for _, problem in cells.values() if problem]
    if problems:
        return None, problems
    prompt = cells["prompt"][0]
    return TaskItem(
        prompt_id=cells["prompt_id"][0] or prompt_id_of(prompt),
        prompt=prompt,
        answer=cells["answer"][0],
        category=cells["category"][0] or DEFAULT_CATEGORY,
    ), []


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed row or None, parse problem) per non-blank line."""
    # lines end in \n, \r\n or \r; not at U+2028 and the like, which JSON strings may hold
    for number, raw in enumerate(_LINE_END.split(path.read_bytes()), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield number, None, (f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                 f"{exc.start + 1})")
            continue
        if not line.strip():
            continue
        try:
            yield number, json.loads(line), None
        except json.JSONDecodeError as exc:
            yield number, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        for column in ("prompt", "answer"):
            if column not in names:
                raise DatasetError(
                    f"{path}: no column '{column}' (columns: {', '.join(names)}); "
                    "a dataset needs 'prompt' and 'answer'"
                )
        # the columns a task uses, not the others a file may carry (a large one would be
        # read by every process that builds the task)
        table = pq.read_table(path, columns=[c for c in COLUMNS if c in names])
    except DatasetError:
        raise
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read Parquet: {exc}") from exc
    for number, row in enumerate(table.to_pylist(), start=1):
        yield number, row, None


def load_items(path: str | Path, *, max_errors: int = MAX_REPORTED_ERRORS) -> list[TaskItem]:
    """Read a `.jsonl` or `.parquet` dataset; raise `DatasetError` listing its bad rows.

    Duplicate `prompt_id`s are bad rows too (prompt state and groups are keyed by id).
    """
    source = Path(path)
    if not source.is_file():
        raise DatasetError(f"{source}: no such file")
    if source.suffix == ".jsonl":
        rows = _jsonl_rows(source)
    elif source.suffix == ".parquet":
        rows = _parquet_rows(source)
    else:
        raise DatasetError(f"{source}: unknown format '{source.suffix}', use .jsonl or .parquet")

    items: list[TaskItem] = []
    first_row: dict[str, int] = {}
    answered: dict[str, tuple[str, int]] = {}
    errors: list[str] = []
    for number, row, problem in rows:
        item, problems = (None, [problem]) if problem else row_to_item(row)
        if item is not None and item.prompt_id in first_row:
            problems = [
                f"duplicate prompt_id {item.prompt_id!r} (first at row {first_row[item.prompt_id]})"
            ]
        elif item is not None and (seen := answered.get(item.prompt)) and \
                seen[0].strip() != item.answer.strip():  # as a dataset's checker compares them
            problems = [f"the prompt of row {seen[1]} again, with another answer "
                        f"({item.answer!r}, not {seen[0]!r})"]
        elif item is not None:
            answered.setdefault(item.prompt, (item.answer, number))
        if problems:
            errors.extend(f"{source}: row {number}: {p}" for p in problems)
            continue
        first_row[item.prompt_id] = number
        items.append(item)
    if errors:
        shown = errors[:max_errors]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise DatasetError(f"{len(errors)} problem(s) in {source}:\n  " + "\n  ".join(shown) + more)
    if not items:
        raise DatasetError(f"{source}: no rows")
    return items
