"""Reading the planner's input files so that a bad value is refused with its file, line and column.

CSV: ``file: line N, column 'name': problem`` (line 1 is the header). YAML or JSON: ``file:line:column: field.path:
problem``, the position of the offending value (of its mapping when a required key is missing).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from serving.common.http import field_path

Model = TypeVar("Model", bound=BaseModel)


class PlanInputError(ValueError):
    """A node list, service file or trace the planner cannot use; the message names the file, line and column."""


@dataclass(frozen=True)
class CsvRow:
    """One data row of a CSV file: its values by column and its line in the file (the header is line 1)."""

    path: Path
    line: int
    values: dict[str, str]

    def error(self, column: str, problem: str) -> PlanInputError:
        return PlanInputError(f"{self.path}: line {self.line}, column {column!r}: {problem}")

    def number(self, column: str, *, minimum: float = 0.0, empty: float | None = None) -> float:
        """The column as a finite number >= ``minimum``; an empty cell is ``empty`` (refused when None)."""
        text = self.values.get(column, "").strip()
        if not text:
            if empty is None:
                raise self.error(column, "empty; a number is needed")
            return empty
        try:
            value = float(text)
        except ValueError:
            raise self.error(column, f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum:
            raise self.error(column, f"{text!r} must be a finite number >= {minimum:g}")
        return value

    def text(self, column: str, *, choices: Sequence[str] | None = None, required: bool = True) -> str:
        value = self.values.get(column, "").strip()
        if required and not value:
            raise self.error(column, "empty")
        if choices is not None and value not in choices:
            raise self.error(column, f"{value!r} is not one of {', '.join(choices)}")
        return value


def read_csv(path: str | Path, required: Sequence[str]) -> Iterator[CsvRow]:
    """The data rows of a CSV file whose header holds every ``required`` column; a missing file, a missing
    column or a row with too many or too few cells is a :class:`PlanInputError` naming the line."""
    path = Path(path)
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise PlanInputError(f"{path}: {exc.strerror or exc}") from None
    with handle:
        reader = csv.reader(handle)
        try:
            header = [name.strip() for name in next(reader)]
        except StopIteration:
            raise PlanInputError(f"{path}: line 1: empty file; a header with {', '.join(required)} is needed") from None
        except csv.Error as exc:
            raise PlanInputError(f"{path}: line {reader.line_num}: {exc}") from None
        missing = [name for name in required if name not in header]
        if missing:
            raise PlanInputError(f"{path}: line 1: no column {missing[0]!r}; the header must hold "
                                 f"{', '.join(required)}")
        try:
            for cells in reader:
                if not cells or not any(cell.strip() for cell in cells):
                    continue
                if len(cells) != len(header):
                    raise PlanInputError(f"{path}: line {reader.line_num}: {len(cells)} cells, the header has "
                                         f"{len(header)}")
                yield CsvRow(path, reader.line_num, dict(zip(header, cells, strict=True)))
        except csv.Error as exc:
            raise PlanInputError(f"{path}: line {reader.line_num}: {exc}") from None


@dataclass(frozen=True)
class Document:
    """A parsed YAML or JSON file and the position of every value in it."""

    path: Path
    data: Any
    root: yaml.Node | None

    def position(self, loc: Sequence[str | int]) -> tuple[int, int]:
        """1-based line and column of the value at ``loc`` (keys and list indices), or of the deepest mapping or
        list on the way when the path goes further than the file (a missing key)."""
        node = self.root
        mark = node.start_mark if node is not None else None
        for key in loc:
            child = None
            if isinstance(node, yaml.MappingNode):
                child = next((value for name, value in node.value if name.value == str(key)), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
                child = node.value[key]
            if child is None:
                break
            node, mark = child, child.start_mark
        return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)

    def error(self, loc: Sequence[str | int], problem: str) -> PlanInputError:
        line, column = self.position(loc)
        return PlanInputError(f"{self.path}:{line}:{column}: {problem}")

    def validate(self, model: type[Model], data: Any = None, loc: Sequence[str | int] = ()) -> Model:
        """``model`` validated from ``data`` (the whole document by default, found at ``loc``); the first error is a
        :class:`PlanInputError` at the offending value's line and column."""
        try:
            return model.model_validate(self.data if data is None else data)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = (*loc, *error["loc"])
            raise self.error(where, f"{field_path(where)}: {error['msg'].removeprefix('Value error, ')}") from None


def read_document(path: str | Path) -> Document:
    """A YAML or JSON file (``.json``: JSON, anything else YAML), syntax errors named by line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanInputError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanInputError(f"{path}:{exc.lineno}:{exc.colno}: {exc.msg}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            raise PlanInputError(f"{path}{where}: {getattr(exc, 'problem', None) or exc}") from None
    try:  # JSON text is YAML too: the composed tree gives every value's position
        root = yaml.compose(text)
    except yaml.YAMLError:
        root = None
    return Document(path, data, root)
