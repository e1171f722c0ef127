"""Terminal output shared by the CLI commands: rich tables and progress on stderr, JSON documents on stdout.

Model text and log lines go to stdout verbatim (`print_text`), never through rich: rich hard-wraps at the terminal's
width (80 columns when piped), which would put newlines into generated text and split log lines. Tables go through
`print_table`: fitted to a terminal, whole when piped to a file (rich would cut their columns to 80).
"""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn

console = Console()
# Messages are never hard-wrapped: a wrapped hint, path or key cannot be copied and run (a terminal wraps them).
err_console = Console(stderr=True, soft_wrap=True)


def print_table(table) -> None:
    """A rich table on stdout: fitted to a terminal's width; piped or redirected, at its natural width, so no cell is
    cut short or wrapped in a file someone will read or parse later."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update(width=100_000), table).maximum
    # `print(width=...)` is capped at the console's own width: a console of the table's width prints it whole
    Console(file=console.file, width=max(console.width, natural)).print(table)


def print_columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Rows as plain aligned columns (as `kubectl get` prints them): one line per row, never cut or wrapped, and
    printed in milliseconds for thousands of rows, where a rich table takes seconds."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    sys.stdout.write("\n".join(lines) + "\n")


def print_json(document: object) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str, ensure_ascii=False) + "\n")


def print_json_line(document: object) -> None:
    """One JSON document on one line (JSON lines), flushed: a stream read line by line sees each event at once."""
    sys.stdout.write(json.dumps(document, default=str, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def print_text(text: str, end: str = "\n", flush: bool = False) -> None:
    """`text` exactly as given (no wrapping, markup or highlighting)."""
    sys.stdout.write(text + end)
    if flush:
        sys.stdout.flush()


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(num_bytes) < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


class RichProgress:
    """A ProgressSink drawing one bar per stage on stderr (so `--json` output on stdout stays clean). Where stderr is
    not a terminal (a log file, CI), where rich draws nothing until the end, it writes a plain line per stage and
    per tenth of a stage's total instead, so a long step shows it is moving."""

    def __init__(self) -> None:
        self._live = err_console.is_terminal
        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
            TimeElapsedColumn(), console=err_console,
        )
        self._task: TaskID | None = None
        self._lines = _ProgressLines()

    def __enter__(self) -> RichProgress:
        if self._live:
            self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._finish_stage()
        if self._live:
            self._progress.stop()

    def stage(self, description: str, total: float | None = None) -> None:
        self._finish_stage()
        if self._live:
            self._task = self._progress.add_task(description, total=total)
        else:
            self._lines.stage(description, total)

    def advance(self, amount: float = 1) -> None:
        if self._task is not None:
            self._progress.advance(self._task, amount)
        elif not self._live:
            self._lines.advance(amount)

    def _finish_stage(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[self._task]
            self._progress.update(self._task, total=task.total or 1, completed=task.total or 1)
        elif not self._live:
            self._lines.finish()


class _ProgressLines:
    """Plain progress lines on stderr: a stage's start, each tenth of its total, its end."""

    def __init__(self) -> None:
        self.description: str | None = None
        self.total: float | None = None
        self.done = 0.0
        self.tenths = 0

    def stage(self, description: str, total: float | None) -> None:
        self.description, self.total, self.done, self.tenths = description, total, 0.0, 0
        print(f"{description} ...", file=sys.stderr, flush=True)

    def advance(self, amount: float) -> None:
        self.done += amount
        if self.description is None or not self.total:
            return
        tenths = min(10, int(10 * self.done / self.total))
        if tenths > self.tenths and tenths < 10:
            self.tenths = tenths
            print(f"{self.description}: {self.done:g} of {self.total:g}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.description is not None:
            print(f"{self.description}: done", file=sys.stderr, flush=True)
            self.description = None
