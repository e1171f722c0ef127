"""Rank-aware costs (CaraServe): what an adapter of rank r on target modules M adds to a step and to a cold start.

A LoRA pair on a linear d_in -> d_out holds r (d_in + d_out) parameters and costs 2 r (d_in + d_out) FLOPs per token,
per layer. Summed over the target modules and layers:

    adapter_bytes        = params x bytes per parameter                        read and attached at a cold start
    extra_flops_per_token = 2 x params                                         beside the backbone's 2 x its params
    step_factor          = 1 + extra / backbone FLOPs x `lora_step_inefficiency`  (its small products run far below
                           the backbone's utilisation: unmerged LoRA kernels)

`rank_aware=False` (`SchedulerConfig`) prices every adapter as the reference shape (`rank_blind_rank` on
`RANK_BLIND_MODULES`): the comparison of issue 41, where a rank-64 all-linear adapter costs what a rank-4 q/v one does.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafaas.scheduler.config import SchedulerConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION_MODULES + MLP_MODULES
RANK_BLIND_MODULES = ("q_proj", "v_proj")


@dataclass(frozen=True, slots=True)
class BackboneShape:
    hidden: int
    intermediate: int
    num_layers: int
    kv_dim: int  # k_proj / v_proj output width (grouped-query attention: fewer heads than q)
    num_params: int
    bytes_per_param: int = 2

    def module_dims(self, module: str) -> tuple[int, int]:
        dims = {"q_proj": (self.hidden, self.hidden), "k_proj": (self.hidden, self.kv_dim),
                "v_proj": (self.hidden, self.kv_dim), "o_proj": (self.hidden, self.hidden),
                "gate_proj": (self.hidden, self.intermediate), "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}
        if module not in dims:
            raise ValueError(f"unknown LoRA target module {module!r}; known: {', '.join(dims)}")
        return dims[module]


@dataclass(frozen=True, slots=True)
class AdapterShape:
    rank: int
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= 4096:
            raise ValueError(f"adapter rank is {self.rank}; must be in [1, 4096]")
        if not self.target_modules:
            raise ValueError("an adapter needs at least one target module")


class AdapterCostModel:
    """The scheduler's price of an adapter: its bytes, its extra step time and its share of a cold start."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()

    def priced_shape(self, shape: AdapterShape) -> AdapterShape:
        """The shape decisions see: the adapter's own, or the reference shape when rank-blind."""
        if self.config.rank_aware:
            return shape
        return AdapterShape(self.config.rank_blind_rank, RANK_BLIND_MODULES)

    def params(self, shape: AdapterShape, backbone: BackboneShape) -> int:
        priced = self.priced_shape(shape)
        per_layer = sum(sum(backbone.module_dims(m)) for m in priced.target_modules)
        return priced.rank * per_layer * backbone.num_layers

    def adapter_bytes(self, shape: AdapterShape, backbone: BackboneShape) -> int:
        return self.params(shape, backbone) * backbone.bytes_per_param

    def extra_flops_per_token(self, shape: AdapterShape, backbone: BackboneShape) -> int:
        return 2 * self.params(shape, backbone)

    def step_factor(self, shape: AdapterShape, backbone: BackboneShape) -> float:
        """How much longer a step (prefill per token, decode step) runs with the adapter than the bare backbone."""
        extra = self.extra_flops_per_token(shape, backbone) / (2 * backbone.num_params)
        return 1.0 + extra * self.config.lora_step_inefficiency

    def cold_start_s(self, shape: AdapterShape, backbone: BackboneShape, load_bytes_per_s: float,
                     attach_s_per_module: float = 0.0) -> float:
        """The adapter's share of a cold start: its bytes read at `load_bytes_per_s`, plus a fixed attach per
        wrapped module and layer."""
        if not load_bytes_per_s > 0:
            raise ValueError(f"load_bytes_per_s is {load_bytes_per_s}; must be > 0")
        priced = self.priced_shape(shape)
        modules = len(priced.target_modules) * backbone.num_layers
        return self.adapter_bytes(shape, backbone) / load_bytes_per_s + attach_s_per_module * modules
