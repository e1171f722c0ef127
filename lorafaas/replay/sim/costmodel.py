"""The simulator's cost model: loading delays per artifact and tier, prefill and decode times, memory, and the
`ArtifactCosts` the pre-loading knapsack values artifacts by.

    prefill_pass_s(prompts)    one forward pass over the prompts a worker prefills together: T0 + per-token x the
                               tokens it computes (compute-bound): every prompt padded to the longest
                               (`prefill_padded`, the lorafaas runtime's left padding) or their sum (packed, vLLM)
    decode_step_s(b)           step at batch 1 + per extra sequence (memory-bound: the weights are read once a step)
    shared_round_s(n, rows)    CPU, the shared base pass: one round over n members' rows, each member one step (the
                               device's model, or the backbone's own where its products cost otherwise: bf16)
    contention(n, b)           a phase that starts while n instances run batches on its device takes 1 + c (n - 1)
                               times longer (batches of one instance share its forward passes); on a CPU device
                               with `cores`: max(1, (n + b) / cores) x (1 + i (min(n + b, cores) - 1)), the
                               one-thread instances and b runnable threads of other programs sharing the cores
                               equally (processor sharing), each busy core beyond the first slowing all by i
                               (`core_interference`: shared caches and memory bandwidth)
                               an instance alone on a CPU device (the step gate grants it every core) runs
                               `lone_speedup` times faster, slowed as its threads share the cores with others'
    pass_contention(n, b)      under the step gate (`step_gate`) a pass, once granted, computes on a core of its
                               own: it shares the cores with other programs' threads, not with more instances than
                               cores
    decode_contention(n, p, b) under the step gate the n - p decoding instances share the cores the p passes leave
    backbone load (standard)   lorafaas's loader: NVMe -> device at its `disk` fraction of `hardware.nvme_gbps`;
                               from a copy in host memory (pre-loaded, or kept in the node's host tier) at its
                               `host` fraction of `hardware.host_to_device_gbps`; bound to a copy already on the
                               device (sharing) in `bind_s`
    backbone load (fast)       ServerlessLLM's loader: the same limits at its own fractions, from a checkpoint
                               cached in the node's host memory (host) or from NVMe (disk)
    adapter                    as the backbone, by its own size
    libraries, warm-up         fixed delays (`libraries_s`, `warmup_s`) unless pre-loaded
"""

from __future__ import annotations

from dataclasses import replace

from lorafaas.replay.sim.cluster import BackboneSpec, ClusterSpec, FunctionSpec
from lorafaas.scheduler import AdapterCostModel, ArtifactCost, ArtifactCosts


class CostModel:
    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.load = cluster.loading

    def backbone(self, function: FunctionSpec) -> BackboneSpec:
        return self.cluster.backbones[function.backbone]

    # -- compute -----------------------------------------------------------------------------------------------

    def prefill_pass_s(self, backbone: BackboneSpec, prompt_tokens: list[int]) -> float:
        tokens = len(prompt_tokens) * max(prompt_tokens) if self.cluster.prefill_padded else sum(prompt_tokens)
        return backbone.prefill_base_s + backbone.prefill_s_per_token * tokens

    def decode_step_s(self, backbone: BackboneSpec, batch_size: int) -> float:
        return backbone.decode_step_s + backbone.decode_step_per_seq_s * (batch_size - 1)

    def shared_round_s(self, members: int, rows: int, background_threads: float = 0.0,
                       backbone: BackboneSpec | None = None) -> float:
        """One round of the shared base pass over `backbone` (`ClusterSpec.shared_base`, or the backbone's own
        `BackboneSpec.shared_base`): the executor's products over every member's rows, then each member's own part,
        the cores shared; other programs' threads slow it by their share."""
        spec = self.cluster.shared_base
        assert spec is not None
        model = backbone.shared_base if backbone is not None and backbone.shared_base is not None else spec
        return model.seconds(members, rows) * self._all_cores(background_threads)

    def _all_cores(self, background_threads: float) -> float:
        """How much slower work using every core of a CPU device runs beside other programs' runnable threads."""
        cores = self.cluster.cores
        assert cores is not None
        return max(1.0, (cores + background_threads) / cores)

    def contention(self, num_running: int, background_threads: float = 0.0) -> float:
        cores = self.cluster.cores
        if cores is not None and num_running <= 1 and self.cluster.lone_speedup > 1.0:
            # the step gate grants a lone instance every core (as many threads), sharing them with other programs
            return self._all_cores(background_threads) / self.cluster.lone_speedup
        if cores is not None:
            busy = num_running + background_threads
            interference = 1.0 + self.cluster.core_interference * max(0.0, min(busy, cores) - 1.0)
            return max(1.0, busy / cores) * interference
        return 1.0 + self.cluster.contention * max(0, num_running - 1)

    def pass_contention(self, num_running: int, background_threads: float = 0.0) -> float:
        """A prefill pass starting while `num_running` instances run batches (it among them)."""
        cores = self.cluster.cores
        if cores is None or not self.cluster.step_gate:
            return self.contention(num_running, background_threads)
        return self.contention(min(num_running, max(1, int(cores))), background_threads)

    def decode_contention(self, num_running: int, passing: int, background_threads: float = 0.0) -> float:
        """Decoding while `passing` of the `num_running` instances run a prefill pass: under the step gate each pass
        holds a core, and the others share what is left (when nothing is, the gate still interleaves: as contention)."""
        cores = self.cluster.cores
        if cores is None or not self.cluster.step_gate or passing < 1 or num_running <= 1:
            return self.contention(num_running, background_threads)
        left = cores - min(passing, cores)
        if left < 1:
            return self.contention(num_running, background_threads)
        busy = num_running + background_threads
        interference = 1.0 + self.cluster.core_interference * max(0.0, min(busy, cores) - 1.0)
        return max(1.0, (num_running - passing + background_threads) / left) * interference

    def kv_bytes(self, backbone: BackboneSpec, tokens: int) -> int:
        return backbone.kv_bytes_per_token * tokens

    # -- loading -----------------------------------------------------------------------------------------------

    def backbone_load_s(self, size_bytes: int, on_device: bool, on_host: bool, shared: bool) -> float:
        if on_device:
            return self.load.bind_s if shared else 0.0
        if on_host:
            return size_bytes / self.load.host_to_device_bytes_per_s
        return size_bytes / self.load.disk_bytes_per_s

    def fast_backbone_load_s(self, size_bytes: int, cached_in_host: bool) -> float:
        rate = self.load.fast_dram_bytes_per_s if cached_in_host else self.load.fast_ssd_bytes_per_s
        return size_bytes / rate

    def artifact_costs(self, function: FunctionSpec) -> ArtifactCosts:
        """Value (delay removed from a cold start) and memory of each artifact in each tier, for the knapsack."""
        size = self.backbone(function).size_bytes
        disk, h2d = self.load.disk_bytes_per_s, self.load.host_to_device_bytes_per_s
        return ArtifactCosts(
            libraries=ArtifactCost(self.load.libraries_s, self.load.libraries_bytes),
            backbone_host=ArtifactCost(max(0.0, size / disk - size / h2d), size),
            backbone_device=ArtifactCost(size / disk, size),
            adapter_host=ArtifactCost(
                max(0.0, function.adapter_bytes / disk - function.adapter_bytes / h2d), function.adapter_bytes
            ),
            adapter_device=ArtifactCost(function.adapter_bytes / disk, function.adapter_bytes),
            warmup=ArtifactCost(self.load.warmup_s, self.load.warmup_bytes),
        )

    def priced(self, function: FunctionSpec, pricing: AdapterCostModel) -> FunctionSpec:
        """`function` as the scheduler's decisions see it: a rank-blind scheduler prices every adapter as one shape
        (`SchedulerConfig.rank_aware`); the simulated loads and steps keep the adapter's own."""
        backbone = self.backbone(function).shape
        if function.adapter_shape is None or backbone is None:
            return function
        return replace(function, adapter_bytes=pricing.adapter_bytes(function.adapter_shape, backbone))

    def device_bytes(self, kind: str, function: FunctionSpec) -> int:
        if kind == "backbone":
            return self.backbone(function).size_bytes
        if kind == "adapter":
            return function.adapter_bytes
        if kind == "warmup":
            return self.load.warmup_bytes
        return 0
