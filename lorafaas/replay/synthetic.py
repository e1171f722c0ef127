"""Seeded synthetic traces in the Azure Functions 2019 invocation format, per CoV class.

The real 2019 day files are a download users bring; the simulator's class experiments (and its speed check at 1,000
functions) need traces of known class. A candidate function's per-minute counts are drawn from a generator of its
class and kept only if the CoV the workload code computes (`stats_2019`) puts it in that class, so the file feeds the
same parser, classifier and selection as a real one:

    predictable  Poisson counts at a steady rate per minute                   (CoV of gaps around 0.2-0.8)
    normal       on/off: Poisson minutes in active stretches, idle stretches   (CoV 1-4)
    bursty       mostly idle; rare minutes with a burst of many invocations    (CoV > 4)
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.replay.traces import FunctionMinuteCounts
from lorafaas.replay.workload import CLASSES, TraceClass, classify, expand_minute_counts, inter_arrival_cov

MAX_TRIES = 200


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    if lam > 30:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _candidate(cls: TraceClass, minutes: int, rng: random.Random, rate_scale: float) -> list[int]:
    if cls == "predictable":
        lam = rng.uniform(1.0, 4.0) * rate_scale
        return [_poisson(rng, lam) for _ in range(minutes)]
    if cls == "normal":
        counts: list[int] = []
        active = rng.random() < 0.5
        lam = rng.uniform(1.0, 6.0) * rate_scale
        while len(counts) < minutes:
            span = rng.randint(5, 40) if active else rng.randint(3, 30)
            counts.extend(_poisson(rng, lam) if active else 0 for _ in range(span))
            active = not active
        return counts[:minutes]
    counts = [0] * minutes
    for _ in range(max(2, rng.randint(2, max(2, minutes // 40)))):
        counts[rng.randrange(minutes)] += max(5, round(rng.uniform(10, 60) * rate_scale))
    return counts


def generate(
    per_class: dict[TraceClass, int], minutes: int, seed: int, rate_scale: float = 1.0, prefix: str = "syn"
) -> Iterator[FunctionMinuteCounts]:
    """`per_class[c]` functions of class c with `minutes` minutes of counts, checked against the classifier."""
    if not 1 <= minutes <= 1440:
        raise InvalidInput(f"minutes is {minutes}; a 2019 day file has 1 to 1440 minute columns")
    rng = random.Random(seed)
    for cls in CLASSES:
        for i in range(per_class.get(cls, 0)):
            for _ in range(MAX_TRIES):
                counts = _candidate(cls, minutes, rng, rate_scale)
                if classify(inter_arrival_cov(expand_minute_counts(counts))) == cls:
                    break
            else:
                raise InvalidInput(f"no {cls} candidate in {MAX_TRIES} tries at rate scale {rate_scale}")
            name = f"{prefix}-{cls}-{i:04d}"
            yield FunctionMinuteCounts("owner", f"app-{name}", name, "http", tuple(counts))


def write_2019_invocations(path: Path, rows: Iterator[FunctionMinuteCounts], minutes: int) -> Path:
    with Path(path).open("w") as f:
        f.write("HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(m) for m in range(1, minutes + 1)) + "\n")
        for row in rows:
            f.write(f"{row.owner},{row.app},{row.function},{row.trigger}," + ",".join(map(str, row.counts)) + "\n")
    return Path(path)
