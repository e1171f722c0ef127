"""Names in /dev/shm: the MoE LoRA server's duplex buffers live there, and backbone segments of earlier versions did
(a starting daemon removes those whose owner died). Backbone segments themselves are sealed memfds now (memfd.py):
a file here is writable by any process of its uid, which is why the backbone left."""

from __future__ import annotations

import os
from pathlib import Path

from lorafaas.errors import SegmentError

SHM_DIR = Path("/dev/shm")


def segment_path(name: str) -> Path:
    if not name or "/" in name or name.startswith(".") or len(name) > 255:
        raise SegmentError(f"{name!r} is not a valid shared-memory segment name")
    return SHM_DIR / name


def list_segments(prefix: str) -> list[str]:
    """Names of the segments in /dev/shm starting with `prefix`."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; processes that map it keep their mapping. True if it existed."""
    try:
        segment_path(name).unlink()
    except FileNotFoundError:
        return False
    return True
