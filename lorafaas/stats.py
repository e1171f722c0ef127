"""The project's one percentile: linear interpolation between closest ranks (numpy's default, and vLLM's benches')."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar, overload

T = TypeVar("T")


@overload
def percentile(values: Sequence[float], q: float) -> float | None: ...


@overload
def percentile(values: Sequence[float], q: float, empty: T) -> float | T: ...


def percentile(values: Sequence[float], q: float, empty: object = None) -> object:
    """The q-th percentile (q in [0, 100]) of `values`; `empty` when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return empty
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
