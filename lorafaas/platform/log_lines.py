"""Instance log text as `lorafaas logs` shows it: sections per instance (`==> instance <==`, as `tail` prints several
files), each line stamped by the worker's logging format (`2026-11-24 06:52:47,482 INFO ...`, local time).

A line without a stamp (a traceback) belongs to the stamped line before it. Used by the gateway to cut a log to
`tail`/`since`, and by the CLI to follow one (`logs --follow`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
HEADER = re.compile(r"^==> (.+) <==$")


@dataclass(frozen=True)
class LogLine:
    instance: str
    text: str
    logged_at: float | None  # unix time of its stamp (or of the stamped line it continues); None before any stamp


def stamp_of(text: str) -> float | None:
    match = STAMP.match(text)
    if match is None:
        return None
    return time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000


def stamped(instance: str, text: str) -> list[LogLine]:
    """The lines of one instance's log text, each with the time it was logged."""
    lines, logged_at = [], None
    for line in text.splitlines():
        logged_at = stamp_of(line) or logged_at
        lines.append(LogLine(instance, line, logged_at))
    return lines


def cut(lines: list[LogLine], tail: int | None = None, since: float | None = None) -> list[LogLine]:
    """The lines logged at `since` or later (unix time), then the last `tail` of those."""
    if since is not None:
        lines = [line for line in lines if line.logged_at is not None and line.logged_at >= since]
    if tail is not None:
        lines = lines[len(lines) - tail:] if tail else []
    return lines


def render(sections: list[list[LogLine]]) -> str:
    """Sections of instance lines as text: a `==> instance <==` header before each non-empty one."""
    return "\n".join(f"==> {lines[0].instance} <==\n" + "".join(f"{line.text}\n" for line in lines)
                     for lines in sections if lines)


def parse(text: str) -> list[LogLine]:
    """`render`'s text back into lines (what the CLI reads from `GET /v1/functions/{name}/logs`)."""
    lines: list[LogLine] = []
    instance, logged_at = "", None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            if lines and lines[-1].instance == instance and not lines[-1].text:
                lines.pop()  # the blank line `render` puts between sections
            instance, logged_at = header.group(1), None
            continue
        if not line and not instance:
            continue
        logged_at = stamp_of(line) or logged_at
        lines.append(LogLine(instance, line, logged_at))
    return lines
