"""Parsers of the Azure traces: Functions 2019 (invocations, durations, memory), Functions 2021, LLM inference 2023.

Every parser streams its file row by row (the real 2019 day files have tens of thousands of rows of 1,444 columns,
the 2021 file millions of rows) and yields typed records. A malformed header or row raises `TraceMalformed` naming
the file, the line and what was expected. `detect_kind` tells the formats apart by their header.

    iter_2019_invocations(path)  -> FunctionMinuteCounts   HashOwner,HashApp,HashFunction,Trigger,1..1440
    iter_2019_durations(path)    -> FunctionDurations      ...,Average,Count,Minimum,Maximum,percentile_Average_*
    iter_2019_memory(path)       -> AppMemory              HashOwner,HashApp[,HashFunction],SampleCount,...
    iter_2021_invocations(path)  -> Invocation2021         app,func,end_timestamp,duration (seconds)
    iter_llm_requests(path)      -> LLMRequest             TIMESTAMP,ContextTokens,GeneratedTokens
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from lorafaas.errors import TraceMalformed

TraceKind = Literal["azure2019_invocations", "azure2019_durations", "azure2019_memory", "azure2021", "azure_llm"]

MINUTES_PER_DAY = 1440
TRIGGERS = frozenset({"http", "timer", "event", "queue", "storage", "orchestration", "others"})
_ID_COLUMNS = ("HashOwner", "HashApp", "HashFunction")
_DURATION_COLUMNS = (
    "Average",
    "Count",
    "Minimum",
    "Maximum",
    "percentile_Average_0",
    "percentile_Average_1",
    "percentile_Average_25",
    "percentile_Average_50",
    "percentile_Average_75",
    "percentile_Average_99",
    "percentile_Average_100",
)
_MEMORY_COLUMNS = (
    "SampleCount",
    "AverageAllocatedMb",
    "AverageAllocatedMb_pct1",
    "AverageAllocatedMb_pct5",
    "AverageAllocatedMb_pct25",
    "AverageAllocatedMb_pct50",
    "AverageAllocatedMb_pct75",
    "AverageAllocatedMb_pct95",
    "AverageAllocatedMb_pct99",
    "AverageAllocatedMb_pct100",
)
_2021_COLUMNS = ("app", "func", "end_timestamp", "duration")
_LLM_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class FunctionMinuteCounts:
    owner: str
    app: str
    function: str
    trigger: str
    counts: tuple[int, ...]  # invocations in minute 1..1440 of the day

    @property
    def key(self) -> str:
        return f"{self.app}/{self.function}"


@dataclass(frozen=True, slots=True)
class FunctionDurations:
    owner: str
    app: str
    function: str
    average_ms: float
    count: int
    minimum_ms: float
    maximum_ms: float
    percentiles_ms: dict[int, float]  # 0, 1, 25, 50, 75, 99, 100


@dataclass(frozen=True, slots=True)
class AppMemory:
    owner: str
    app: str
    function: str | None  # only in the format sample; the real per-app file has no HashFunction
    sample_count: int
    average_mb: float
    percentiles_mb: dict[int, float]  # 1, 5, 25, 50, 75, 95, 99, 100


@dataclass(frozen=True, slots=True)
class Invocation2021:
    app: str
    function: str
    end_s: float
    duration_s: float

    @property
    def arrival_s(self) -> float:
        return self.end_s - self.duration_s

    @property
    def key(self) -> str:
        return f"{self.app}/{self.function}"


@dataclass(frozen=True, slots=True)
class LLMRequest:
    timestamp: datetime
    context_tokens: int
    generated_tokens: int


class _Rows:
    """csv rows with their line numbers and typed field conversion that names file, line and column on failure."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.line = 0

    def fail(self, what: str) -> TraceMalformed:
        return TraceMalformed(f"{self.path}:{self.line}: {what}")

    def rows(self) -> Iterator[list[str]]:
        try:
            handle = self.path.open(newline="", encoding="utf-8")
        except OSError as exc:
            raise TraceMalformed(f"cannot read trace {self.path}: {exc.strerror or exc}") from exc
        with handle:
            reader = csv.reader(handle)
            try:
                for row in reader:
                    self.line = reader.line_num
                    if row:
                        yield row
            except (csv.Error, UnicodeDecodeError) as exc:
                raise self.fail(f"not CSV text: {exc}") from exc

    def number(self, row: list[str], header: list[str], index: int, integer: bool = False) -> float:
        text = row[index].strip()
        try:
            value = float(text)
        except ValueError:
            raise self.fail(f"column {header[index]!r} is {text!r}; expected a number") from None
        if not math.isfinite(value) or value < 0:
            raise self.fail(f"column {header[index]!r} is {text!r}; expected a finite number >= 0")
        if integer and value != int(value):
            raise self.fail(f"column {header[index]!r} is {text!r}; expected a whole number")
        return value

    def check_width(self, row: list[str], width: int) -> None:
        if len(row) != width:
            raise self.fail(f"{len(row)} fields; the header has {width}")


def _header(rows: _Rows, it: Iterator[list[str]], expected_prefix: tuple[str, ...], what: str) -> list[str]:
    header = next(it, None)
    if header is None:
        raise TraceMalformed(f"{rows.path}: empty file; expected a {what} header")
    header = [h.strip().lstrip("\ufeff") for h in header]
    if tuple(header[: len(expected_prefix)]) != expected_prefix:
        raise rows.fail(
            f"header starts {header[: len(expected_prefix)]}; a {what} header starts {list(expected_prefix)}"
        )
    return header


def iter_2019_invocations(path: Path | str) -> Iterator[FunctionMinuteCounts]:
    rows = _Rows(Path(path))
    it = rows.rows()
    header = _header(rows, it, (*_ID_COLUMNS, "Trigger"), "2019 invocations")
    minutes = header[4:]
    if not minutes or minutes != [str(i) for i in range(1, len(minutes) + 1)] or len(minutes) > MINUTES_PER_DAY:
        raise rows.fail(
            f"minute columns are {minutes[:3]}...{minutes[-2:]} ({len(minutes)}); expected 1..N with "
            f"N <= {MINUTES_PER_DAY}"
        )
    for row in it:
        rows.check_width(row, len(header))
        trigger = row[3].strip()
        if trigger not in TRIGGERS:
            raise rows.fail(f"Trigger is {trigger!r}; expected one of {sorted(TRIGGERS)}")
        counts = tuple(int(rows.number(row, header, i, integer=True)) for i in range(4, len(header)))
        yield FunctionMinuteCounts(row[0], row[1], row[2], trigger, counts)


def iter_2019_durations(path: Path | str) -> Iterator[FunctionDurations]:
    rows = _Rows(Path(path))
    it = rows.rows()
    header = _header(rows, it, (*_ID_COLUMNS, *_DURATION_COLUMNS), "2019 durations")
    for row in it:
        rows.check_width(row, len(header))
        v = [rows.number(row, header, i) for i in range(3, 3 + len(_DURATION_COLUMNS))]
        percentiles = {
            int(name.rsplit("_", 1)[1]): value for name, value in zip(_DURATION_COLUMNS[4:], v[4:], strict=True)
        }
        yield FunctionDurations(row[0], row[1], row[2], v[0], int(v[1]), v[2], v[3], percentiles)


def iter_2019_memory(path: Path | str) -> Iterator[AppMemory]:
    rows = _Rows(Path(path))
    it = rows.rows()
    header = _header(rows, it, _ID_COLUMNS[:2], "2019 memory")
    has_function = len(header) > 2 and header[2] == "HashFunction"
    first = 3 if has_function else 2
    if tuple(header[first:]) != _MEMORY_COLUMNS:
        raise rows.fail(f"columns after the ids are {header[first:]}; expected {list(_MEMORY_COLUMNS)}")
    for row in it:
        rows.check_width(row, len(header))
        v = [rows.number(row, header, i) for i in range(first, len(header))]
        percentiles = {
            int(name.rsplit("pct", 1)[1]): value for name, value in zip(_MEMORY_COLUMNS[2:], v[2:], strict=True)
        }
        yield AppMemory(row[0], row[1], row[2] if has_function else None, int(v[0]), v[1], percentiles)


def iter_2021_invocations(path: Path | str) -> Iterator[Invocation2021]:
    rows = _Rows(Path(path))
    it = rows.rows()
    header = _header(rows, it, _2021_COLUMNS, "2021 invocations")
    rows.check_width(header, len(_2021_COLUMNS))
    for row in it:
        rows.check_width(row, len(header))
        end_s, duration_s = rows.number(row, header, 2), rows.number(row, header, 3)
        if duration_s > end_s + 1e-6:
            raise rows.fail(f"duration {duration_s} s exceeds end_timestamp {end_s} s (arrival before the trace)")
        yield Invocation2021(row[0], row[1], end_s, duration_s)


def iter_llm_requests(path: Path | str) -> Iterator[LLMRequest]:
    rows = _Rows(Path(path))
    it = rows.rows()
    header = _header(rows, it, _LLM_COLUMNS, "Azure LLM inference")
    rows.check_width(header, len(_LLM_COLUMNS))
    for row in it:
        rows.check_width(row, len(header))
        text = row[0].strip()
        try:
            # fromisoformat before 3.11 takes at most 6 fractional digits; the trace has 7
            head, _, frac = text.partition(".")
            stamp = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}" if frac else head)
        except ValueError:
            raise rows.fail(f"TIMESTAMP is {text!r}; expected 'YYYY-MM-DD HH:MM:SS[.fraction]'") from None
        yield LLMRequest(
            stamp, int(rows.number(row, header, 1, integer=True)), int(rows.number(row, header, 2, integer=True))
        )


def detect_kind(path: Path | str) -> TraceKind:
    """Which trace format a file holds, from its header."""
    rows = _Rows(Path(path))
    header = next(rows.rows(), None)
    if header is None:
        raise TraceMalformed(f"{path}: empty file; expected a trace header")
    header = [h.strip().lstrip("\ufeff") for h in header]
    if tuple(header[:3]) == _LLM_COLUMNS:
        return "azure_llm"
    if tuple(header[:4]) == _2021_COLUMNS:
        return "azure2021"
    if tuple(header[:2]) == _ID_COLUMNS[:2]:
        if len(header) > 3 and header[3] == "Trigger":
            return "azure2019_invocations"
        if "Average" in header:
            return "azure2019_durations"
        if "AverageAllocatedMb" in header:
            return "azure2019_memory"
    raise TraceMalformed(
        f"{path}:1: header {header[:5]} is not a known Azure trace format (2019 invocations, "
        "durations, memory; 2021 invocations; LLM inference)"
    )
