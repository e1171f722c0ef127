"""Progress reporting for long steps, kept out of the code that does the work.

Workers call a `ProgressSink`; the CLI passes a rich one, tests and libraries the silent default.
"""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    def stage(self, description: str, total: float | None = None) -> None:
        """Begin a new step; `total` units of work if known."""

    def advance(self, amount: float = 1) -> None:
        """Report `amount` units of the current step done."""


class SilentProgress:
    def stage(self, description: str, total: float | None = None) -> None:
        pass

    def advance(self, amount: float = 1) -> None:
        pass
