"""The LoRA server's compute: a batch of calls from many instances, grouped by (adapter, expert), low-rank products.

A batch holds every call that arrived while the previous batch ran (of any instance, adapter and layer). Calls are
grouped by (adapter, layer, projection); within a group, the rows of every call routed to expert e are gathered into
one matrix and multiplied once, `B_e(A_e(X)) * scaling` (the same `lora_delta` a local-mode instance runs), and the
deltas are scattered back to each call's result. Groups of one adapter run back to back, so the adapter cache loads
and pins each adapter once per batch.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from lorafaas.lora_server.cache import AdapterCache
from lorafaas.models.moe_lora import lora_delta

log = logging.getLogger(__name__)


@dataclass
class LoraWork:
    """One call: rows sorted by expert in, deltas out (both tensors the server may read/write in place)."""

    adapter_id: str
    layer: int
    projection: str
    expert_counts: tuple[int, ...]
    rows: torch.Tensor  # [num_rows, in_features]
    result: torch.Tensor  # [num_rows, out_features]
    error: BaseException | None = field(default=None)

    @property
    def starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.expert_counts)]


@dataclass
class BatchStats:
    num_calls: int = 0
    num_batches: int = 0
    max_calls_per_batch: int = 0
    num_groups: int = 0
    compute_s: float = 0.0  # time spent computing batches


class LoraCompute:
    def __init__(self, cache: AdapterCache) -> None:
        self.cache = cache
        self.stats = BatchStats()

    @torch.inference_mode()
    def run(self, works: list[LoraWork]) -> None:
        """Fill every work's `result`, or set its `error` (one adapter failing to load fails only its calls)."""
        started = time.perf_counter()
        try:
            self._run(works)
        finally:
            self.stats.compute_s += time.perf_counter() - started

    def _run(self, works: list[LoraWork]) -> None:
        self.stats.num_batches += 1
        self.stats.num_calls += len(works)
        self.stats.max_calls_per_batch = max(self.stats.max_calls_per_batch, len(works))
        groups: dict[tuple[str, int, str], list[LoraWork]] = {}
        for work in works:
            groups.setdefault((work.adapter_id, work.layer, work.projection), []).append(work)
        pinned = {work.adapter_id for work in works}
        for adapter_id, grouped in itertools.groupby(sorted(groups.items()), key=lambda item: item[0][0]):
            adapter_groups = list(grouped)
            adapter_works = [w for _, group in adapter_groups for w in group]
            try:
                for _ in adapter_works:
                    self.cache.touch(adapter_id, pinned)
                for (_, layer, projection), group in adapter_groups:
                    self._run_group(self.cache.layer(adapter_id, layer)[projection], group)
            except Exception as exc:  # an unreadable adapter fails its own calls, not the batch
                log.exception("LoRA server: calls of adapter %s failed", adapter_id)
                for work in adapter_works:
                    work.error = exc
            pinned.discard(adapter_id)

    def _run_group(self, factors, works: list[LoraWork]) -> None:
        starts = [w.starts for w in works]
        for expert in range(len(works[0].expert_counts)):
            parts = [
                (w, s[expert], s[expert + 1]) for w, s in zip(works, starts, strict=True) if s[expert + 1] > s[expert]
            ]
            if not parts:
                continue
            self.stats.num_groups += 1
            rows = (
                parts[0][0].rows[parts[0][1] : parts[0][2]]
                if len(parts) == 1
                else torch.cat([w.rows[begin:end] for w, begin, end in parts])
            )
            delta = lora_delta(rows, factors.a[expert], factors.b[expert], factors.scaling)
            offset = 0
            for work, begin, end in parts:
                work.result[begin:end] = delta[offset : offset + end - begin]
                offset += end - begin
