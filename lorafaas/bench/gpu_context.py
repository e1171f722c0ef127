"""What the GPU check's steps share: the device, the scratch directory, the synthesized store, and a step's result."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from lorafaas.bench.gpu_models import DRY_SHAPES, FULL_SHAPES, Shape
from lorafaas.formats.model_store import ModelStore


class StepResult(msgspec.Struct, kw_only=True):
    name: str
    ok: bool | None  # None: skipped
    seconds: float = 0.0
    summary: str = ""
    figures: dict = {}
    error: str = ""


class CheckContext:
    """What the steps share: the device, where to work, the store of synthesized backbones, and their names."""

    def __init__(self, device: str, work: Path, dry_run: bool) -> None:
        self.device = device
        self.work = work
        self.dry_run = dry_run
        self.shapes: tuple[Shape, ...] = DRY_SHAPES if dry_run else FULL_SHAPES
        self.store = ModelStore(work / "home" / "models")
        self.adapters: dict[str, list[Path]] = {}  # backbone name -> adapter directories

    @property
    def small(self) -> Shape:
        return self.shapes[0]

    @property
    def medium(self) -> Shape:
        return self.shapes[1]

    def log(self, text: str) -> None:
        print(f"[gpu-check {time.strftime('%H:%M:%S')}] {text}", flush=True)
