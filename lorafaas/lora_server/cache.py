"""The LoRA server's adapter cache: at most M adapters resident, loaded layer by layer, evicted by frequency.

An adapter is admitted when a call needs it; only the layers called so far are read (a layer's factors for every
expert at once), so the first MoE layer of a new adapter is served after reading one layer, not the whole adapter.
When M adapters are resident, admitting one evicts the resident adapter with the lowest access frequency, an
exponentially decayed count (half-life in accesses, so an adapter that was hot long ago does not stay forever); ties
go to the least recently used. Adapters the current batch still needs are evicted last.

Owned by the server's compute thread alone (no locks).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from lorafaas.formats.expert_adapters import ExpertFactors

LayerLoader = Callable[[str, int], dict[str, ExpertFactors]]  # (adapter id, layer) -> projection -> factors


@dataclass
class _Frequency:
    score: float = 0.0
    tick: int = 0  # when `score` was last brought up to date


@dataclass
class _Resident:
    layers: dict[int, dict[str, ExpertFactors]] = field(default_factory=dict)
    last_used: int = 0

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for layer in self.layers.values() for f in layer.values())


class AdapterCache:
    def __init__(self, capacity: int, loader: LayerLoader, half_life_accesses: float = 1024.0) -> None:
        if capacity < 1:
            raise ValueError(f"the adapter cache needs a capacity of at least 1 adapter, got {capacity}")
        if half_life_accesses <= 0:
            raise ValueError(f"half_life_accesses must be positive, got {half_life_accesses}")
        self.capacity = capacity
        self._loader = loader
        self._half_life = half_life_accesses
        self._resident: dict[str, _Resident] = {}
        self._frequency: dict[str, _Frequency] = {}
        self._tick = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_layer_loads = 0
        self.num_evictions = 0

    def touch(self, adapter_id: str, pinned: Collection[str] = ()) -> bool:
        """Count one access (a call) and make the adapter resident; True if it already was (a hit).

        `pinned`: adapters the caller still needs now, evicted only if nothing else can be.
        """
        self._tick += 1
        frequency = self._frequency.setdefault(adapter_id, _Frequency(tick=self._tick))
        frequency.score = self._decayed(frequency) + 1.0
        frequency.tick = self._tick
        resident = self._resident.get(adapter_id)
        if resident is not None:
            resident.last_used = self._tick
            self.num_hits += 1
            return True
        self.num_misses += 1
        while len(self._resident) >= self.capacity:
            self._evict(exclude=adapter_id, pinned=pinned)
        self._resident[adapter_id] = _Resident(last_used=self._tick)
        return False

    def layer(self, adapter_id: str, layer: int) -> dict[str, ExpertFactors]:
        """One layer's factors of a resident adapter (`touch` it first), read on first use."""
        resident = self._resident[adapter_id]
        factors = resident.layers.get(layer)
        if factors is None:
            factors = resident.layers[layer] = self._loader(adapter_id, layer)
            self.num_layer_loads += 1
        return factors

    def forget(self, adapter_id: str) -> None:
        self._resident.pop(adapter_id, None)
        self._frequency.pop(adapter_id, None)

    def frequency(self, adapter_id: str) -> float:
        entry = self._frequency.get(adapter_id)
        return self._decayed(entry) if entry else 0.0

    def resident_layers(self) -> dict[str, tuple[int, ...]]:
        return {adapter_id: tuple(sorted(r.layers)) for adapter_id, r in self._resident.items()}

    @property
    def resident_bytes(self) -> int:
        return sum(r.num_bytes for r in self._resident.values())

    def _decayed(self, entry: _Frequency) -> float:
        return entry.score * 0.5 ** ((self._tick - entry.tick) / self._half_life)

    def _evict(self, exclude: str, pinned: Collection[str]) -> None:
        candidates = [a for a in self._resident if a != exclude]
        victim = min(candidates, key=lambda a: (a in pinned, self.frequency(a), self._resident[a].last_used))
        del self._resident[victim]
        self.num_evictions += 1
