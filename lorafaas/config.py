"""Process-wide settings, read from the environment once at start-up (never at import, never in policy code)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = Path("~/.lorafaas")


@dataclass(frozen=True)
class LorafaasConfig:
    home: Path

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> LorafaasConfig:
        """`home` (a --home flag) wins over $LORAFAAS_HOME, which wins over ~/.lorafaas."""
        chosen = home if home is not None else os.environ.get("LORAFAAS_HOME") or DEFAULT_HOME
        return cls(home=Path(chosen).expanduser().resolve())
