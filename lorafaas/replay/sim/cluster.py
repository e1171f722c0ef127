"""Cluster descriptions for the simulator: devices, nodes, backbones, functions, loading figures and a price sheet.

A cluster YAML (see `lorafaas/replay/clusters/paper.yaml`) is read into frozen specs, every field checked with a
`ClusterInvalid` that names the file, the field, the value and the bound. Sizes are GB (10^9 bytes) and bandwidths
GB/s in the YAML, bytes and bytes/s here. `load_cluster("paper")` or `load_cluster("local")` reads the shipped files.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from lorafaas.errors import ClusterInvalid
from lorafaas.scheduler import AdapterShape, BackboneShape

GB = 1e9


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    size_bytes: int
    prefill_base_s: float  # one prefill's fixed cost
    prefill_s_per_token: float  # per prompt token in the batch
    decode_step_s: float  # one decode step at batch 1
    decode_step_per_seq_s: float  # added per extra sequence in the batch
    kv_bytes_per_token: int
    shape: BackboneShape | None = None  # its layers' widths: what a LoRA adapter's rank costs on it (None: unknown)
    # CPU: its own round of the shared base pass, where its products cost other than the device's model says (a bf16
    # copy reads half the bytes); None: the device's (`ClusterSpec.shared_base`)
    shared_base: PassRound | None = None


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    backbone: str
    adapter_bytes: int
    slo_ttft_s: float
    adapter_shape: AdapterShape | None = None  # rank and target modules (the fleet's functions; None: unknown)
    step_factor: float = 1.0  # prefill and decode run this much slower with its adapter (rank-aware, the truth)


@dataclass(frozen=True)
class LoadingSpec:
    libraries_s: float  # container/process start + imports
    libraries_bytes: int  # host memory they hold
    warmup_s: float  # kernels, allocator, thread pools
    warmup_bytes: int  # device memory it holds
    bind_s: float  # attach to a shared backbone copy already on the device
    instance_overhead_bytes: int  # device memory of one instance process (context, workspace)
    # each loader's rates: its fraction (`loading.loaders`) of the node's limits (`loading.hardware`)
    disk_bytes_per_s: float  # lorafaas's loader (`standard`) from local NVMe to the device
    host_to_device_bytes_per_s: float  # lorafaas's loader from a copy in host memory (pre-loaded, host tier)
    fast_dram_bytes_per_s: float  # ServerlessLLM's loader from a checkpoint cached in host memory to the device
    fast_ssd_bytes_per_s: float  # ServerlessLLM's loader from local NVMe to the device
    host_cache_bytes: int  # per node: host memory for cached checkpoints (ServerlessLLM) and worker slots
    spawn_s: float = 0.0  # every instance start, whatever is resident: process, connection, mapping, adapter placing


@dataclass(frozen=True)
class PriceSheet:
    name: str
    source: str
    gpu_active_per_gb_s: float
    gpu_idle_per_gb_s: float
    per_request: float
    currency: str = "USD"


@dataclass(frozen=True)
class PassRound:
    """A round of the shared base pass over n members and R rows: round_s + per_member_s x n + per_row_s x R."""

    round_s: float
    per_member_s: float  # each member's own part (attention, norms, LoRA, sampling, its calls) on the shared cores
    per_row_s: float

    def seconds(self, members: int, rows: int) -> float:
        return self.round_s + self.per_member_s * members + self.per_row_s * rows


@dataclass(frozen=True)
class SharedBaseSpec(PassRound):
    """The shared base pass on a CPU device (a CPU node's default): while a round is shorter than the decoding
    instances' own steps (the step gate's measured choice), or with a fixed `from_members` once that many decode at
    once, the backbone daemon computes their base products in one pass a round, and each of them one step a round.
    Its round is the device's model (calibrated by `bench serve`; a backbone may have its own:
    `BackboneSpec.shared_base`)."""

    from_members: int | None  # a fixed threshold (`up --shared-base-from`); None: the faster of the two modes


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device_kind: str
    num_nodes: int
    devices_per_node: int
    device_memory_bytes: int
    backbones: dict[str, BackboneSpec]
    functions: dict[str, FunctionSpec]
    default_adapter_bytes: int
    default_slo_ttft_s: float
    loading: LoadingSpec
    price: PriceSheet
    contention: float  # a phase on a device running n batches takes (1 + contention * (n - 1)) times longer
    max_batch_size: int  # per instance batch
    max_concurrent_batches: int  # batches one instance (serverless) runs at once
    serverful_max_concurrent_batches: int  # batches one always-on server runs at once (continuous batching)
    keep_alive_s: float  # fixed keep-alive of the baselines and of the fixed policy
    plan_interval_s: float
    slots_per_node: int
    slot_bytes: int
    max_instances_per_function: int = 64
    min_replan_s: float = 5.0  # a moved arrival rate re-plans at most this often (the node agent: every 5 s)
    prefill_padded: bool = False  # a prefill pass pads every prompt to the longest (True) or packs them (False)
    request_overhead_s: float = 0.0  # gateway -> agent -> worker and back: added to a request's TTFT
    cores: float | None = None  # CPU device: its cores, shared by busy one-thread instances and background threads
    compute_slots: int | None = None  # instances a device runs at full speed at once (the agent's AgentConfig field;
    # None: the cores on a CPU, 1 on a GPU)
    core_interference: float = 0.0  # CPU: each busy core beyond the first slows every one by this much (shared
    # caches and memory bandwidth)
    # the functions are deployed this long before the first arrival: a policy that pre-loads has planned (and
    # billed) its staging by then, as the node agent's plan runs within plan_interval_s of a deploy
    deploy_lead_s: float = 0.0
    strict_compute: bool = False  # the agent's --strict-compute (admission's strict compute)
    # CPU: the step gate gives an instance computing alone every core; it then runs this much faster (1.0: not modelled)
    lone_speedup: float = 1.0
    shared_base: SharedBaseSpec | None = None  # CPU: the shared base pass's model (None: the cluster has none)
    # CPU: the agent's step gate (`up`'s default) grants a step a core of its own for its whole length, never more
    # steps at once than cores: a pass is not time-sliced with other instances, which share the cores it leaves
    step_gate: bool = False
    # per node: bytes of idle instances the scheduler's policies keep (value per byte, `keep_within_budget`); None:
    # no budget, each idle instance stays its keep-alive window
    idle_budget_bytes: int | None = None

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def function(self, name: str, index: int) -> FunctionSpec:
        """A listed function, or one made for an unlisted workload function: backbones round-robin by first use."""
        spec = self.functions.get(name)
        if spec is not None:
            return spec
        backbones = sorted(self.backbones)
        return FunctionSpec(
            name, backbones[index % len(backbones)], self.default_adapter_bytes, self.default_slo_ttft_s
        )


class _Fields:
    """One mapping of the YAML; remembers the keys it was asked for, so `check_known` can refuse the others (a
    misspelt key would otherwise leave its default in force without a word)."""

    def __init__(self, where: str, data: object) -> None:
        if not isinstance(data, dict):
            raise ClusterInvalid(f"{where}: expected a mapping, got {type(data).__name__}")
        self.where, self.data = where, data
        self.seen: set[str] = set()

    def get(self, key: str, default: object = None) -> object:
        self.seen.add(key)
        return self.data.get(key, default)

    def has(self, key: str) -> bool:
        self.seen.add(key)
        return key in self.data

    def check_known(self) -> None:
        unknown = sorted(str(k) for k in self.data if k not in self.seen)
        if unknown:
            hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, self.seen, 1)) else k
                     for k in unknown]
            raise ClusterInvalid(f"{self.where}: unknown key(s) {', '.join(hints)}; "
                                 f"known: {', '.join(sorted(self.seen))}")

    def mapping(self, key: str) -> dict:
        value = self.get(key) or {}
        if not isinstance(value, dict):
            raise ClusterInvalid(f"{self.where}.{key} is {value!r}; expected a mapping")
        return value

    def sequence(self, key: str) -> list:
        value = self.get(key) or []
        if not isinstance(value, list):
            raise ClusterInvalid(f"{self.where}.{key} is {value!r}; expected a list")
        return value

    def sub(self, key: str) -> _Fields:
        return _Fields(f"{self.where}.{key}", self.get(key, {}))

    def number(self, key: str, default: float | None = None, low: float = 0.0, high: float = math.inf) -> float:
        value = self.get(key, default)
        if value is None:
            raise ClusterInvalid(f"{self.where}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ClusterInvalid(f"{self.where}.{key} is {value!r}; expected a number")
        if not low <= value <= high:
            raise ClusterInvalid(f"{self.where}.{key} is {value}; it must be in [{low}, {high}]")
        return float(value)

    def integer(self, key: str, default: int | None = None, low: int = 1, high: int = 1_000_000) -> int:
        value = self.number(key, default, low, high)
        if value != int(value):
            raise ClusterInvalid(f"{self.where}.{key} is {value}; expected a whole number")
        return int(value)

    def text(self, key: str, default: str | None = None) -> str:
        value = self.get(key, default)
        if not isinstance(value, str) or not value:
            raise ClusterInvalid(f"{self.where}.{key} is {value!r}; expected a non-empty string")
        return value


def parse_cluster(data: object, where: str) -> ClusterSpec:
    top = _Fields(where, data)
    dev, load, price = top.sub("device"), top.sub("loading"), top.sub("price")
    backbones = {}
    checked = [top]
    for name, raw in top.mapping("backbones").items():
        b = _Fields(f"{where}.backbones.{name}", raw)
        checked.append(b)
        backbones[name] = BackboneSpec(
            name,
            int(b.number("size_gb", low=1e-6) * GB),
            b.number("prefill_base_ms") / 1e3,
            b.number("prefill_ms_per_token") / 1e3,
            b.number("decode_ms_per_step", low=1e-6) / 1e3,
            b.number("decode_ms_per_extra_seq") / 1e3,
            int(b.number("kv_kb_per_token") * 1e3),
            _backbone_shape(b) if b.has("hidden") else None,
            _pass_round(b.sub("shared_base")) if b.has("shared_base") else None,
        )
    if not backbones:
        raise ClusterInvalid(f"{where}.backbones is empty; a cluster needs at least one backbone")
    default_slo = top.number("default_slo_ttft_ms", 1000, 1e-3) / 1e3
    functions = {}
    for i, raw in enumerate(top.sequence("functions")):
        f = _Fields(f"{where}.functions[{i}]", raw)
        checked.append(f)
        backbone = f.text("backbone")
        if backbone not in backbones:
            raise ClusterInvalid(f"{f.where}.backbone is {backbone!r}; the cluster's backbones are {sorted(backbones)}")
        name = f.text("name")
        functions[name] = FunctionSpec(
            name,
            backbone,
            int(f.number("adapter_mb", low=1e-6) * 1e6),
            f.number("slo_ttft_ms", default_slo * 1e3, 1e-3) / 1e3,
        )
    loading = LoadingSpec(
        load.number("libraries_s"),
        int(load.number("libraries_gb") * GB),
        load.number("warmup_s"),
        int(load.number("warmup_gb") * GB),
        load.number("bind_s"),
        int(load.number("instance_overhead_gb") * GB),
        *_loader_rates(load.sub("hardware"), load.sub("loaders")),
        int(load.number("host_cache_gb") * GB),
        load.number("spawn_s", 0.0),
    )
    sheet = PriceSheet(
        price.text("name"),
        price.text("source"),
        price.number("gpu_active_per_gb_s"),
        price.number("gpu_idle_per_gb_s"),
        price.number("per_request", 0.0),
        price.text("currency", "USD"),
    )
    shared_base = _shared_base(dev.sub("shared_base")) if dev.has("shared_base") else None
    own_rounds = sorted(name for name, b in backbones.items() if b.shared_base is not None)
    if own_rounds and shared_base is None:
        raise ClusterInvalid(f"{where}.backbones.{own_rounds[0]}.shared_base needs device.shared_base (the pass "
                             "itself, and when it runs)")
    if shared_base is not None and (dev.get("kind", "gpu") != "cpu" or not dev.has("cores")):
        raise ClusterInvalid(f"{where}.device.shared_base is for a CPU device with `cores` (the backbone daemon's "
                             f"executor shares them); this device is kind {dev.get('kind', 'gpu')!r}"
                             f"{'' if dev.has('cores') else ', without cores'}")
    memory = int(dev.number("memory_gb", low=1e-3) * GB)
    largest = max(b.size_bytes for b in backbones.values())
    if largest + loading.instance_overhead_bytes > memory:
        raise ClusterInvalid(
            f"{where}: the largest backbone ({largest / GB:.1f} GB) and one instance's overhead "
            f"({loading.instance_overhead_bytes / GB:.1f} GB) exceed a device's {memory / GB:.1f} GB"
        )
    spec = ClusterSpec(
        top.text("name"),
        dev.text("kind", "gpu"),
        top.integer("nodes"),
        top.integer("devices_per_node"),
        memory,
        backbones,
        functions,
        int(top.number("default_adapter_mb", 100, 1e-6) * 1e6),
        default_slo,
        loading,
        sheet,
        top.number("contention", 1.0, 0.0, 10.0),
        top.integer("max_batch_size", 16, 1, 4096),
        top.integer("max_concurrent_batches", 1, 1, 1024),
        top.integer("serverful_max_concurrent_batches", 8, 1, 1024),
        top.number("keep_alive_s", 600, 0.0),
        top.number("plan_interval_s", 60, 0.1),
        top.integer("slots_per_node", 8, 0, 100_000),
        int(top.number("slot_gb", 32, 1e-3) * GB),
        top.integer("max_instances_per_function", 64, 1, 100_000),
        top.number("min_replan_s", 5.0, 0.0),
        _flag(top, "prefill_padded", False),
        top.number("request_overhead_ms", 0.0, 0.0, 60_000.0) / 1e3,
        dev.number("cores", low=1.0, high=4096.0) if dev.has("cores") else None,
        dev.integer("compute_slots", low=1, high=100_000) if dev.has("compute_slots") else None,
        dev.number("core_interference", 0.0, 0.0, 10.0),
        top.number("deploy_lead_s", 0.0, 0.0, 86_400.0),
        _flag(dev, "strict_compute", False),
        dev.number("lone_speedup", 1.0, 1.0, 64.0),
        shared_base,
        _flag(dev, "step_gate", False),
        int(top.number("idle_budget_gb", low=0.0) * GB) if top.has("idle_budget_gb") else None,
    )
    if spec.step_gate and spec.cores is None:
        raise ClusterInvalid(f"{where}.device.step_gate is for a CPU device with `cores` (the gate grants cores)")
    for fields in (*checked, dev, load, price):
        fields.check_known()
    return spec


def _backbone_shape(b: _Fields) -> BackboneShape:
    """The widths a LoRA adapter's cost follows (`lorafaas.scheduler.adapter_cost`)."""
    hidden = b.integer("hidden", high=1 << 20)
    return BackboneShape(hidden, b.integer("intermediate", high=1 << 20), b.integer("layers", high=4096),
                         b.integer("kv_dim", hidden, high=1 << 20), int(b.number("params_b", low=1e-6) * 1e9))


def _shared_base(fields: _Fields) -> SharedBaseSpec:
    from_members = fields.integer("from_members", low=2, high=100_000) if fields.has("from_members") else None
    return SharedBaseSpec(**dataclasses.asdict(_pass_round(fields)), from_members=from_members)


def _pass_round(fields: _Fields) -> PassRound:
    """A backbone's `shared_base` takes these three only (the threshold is the device's)."""
    spec = PassRound(fields.number("round_ms", low=1e-3) / 1e3, fields.number("per_member_ms") / 1e3,
                     fields.number("per_row_ms") / 1e3)
    fields.check_known()
    return spec


def _loader_rates(hardware: _Fields, loaders: _Fields) -> tuple[float, float, float, float]:
    """(standard disk, standard host, fast host, fast disk) bytes/s: each loader's fraction of the node's limits, the
    same limits for every loader (no policy gets a faster disk than another)."""
    nvme = hardware.number("nvme_gbps", low=1e-6) * GB
    host_to_device = hardware.number("host_to_device_gbps", low=1e-6) * GB
    hardware.check_known()
    rates = {}
    for loader in ("standard", "fast"):
        fractions = loaders.sub(loader)
        rates[loader] = (fractions.number("disk", low=1e-6, high=1.0) * nvme,
                         fractions.number("host", low=1e-6, high=1.0) * host_to_device)
        fractions.check_known()
    loaders.check_known()
    return rates["standard"][0], rates["standard"][1], rates["fast"][1], rates["fast"][0]


def _flag(fields: _Fields, key: str, default: bool) -> bool:
    value = fields.get(key, default)
    if not isinstance(value, bool):
        raise ClusterInvalid(f"{fields.where}.{key} is {value!r}; expected true or false")
    return value


SHIPPED_CLUSTERS = ("paper", "local", "local-bf16")


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """A shipped cluster (`SHIPPED_CLUSTERS`) or a path to a cluster YAML. A YAML may start from a shipped cluster
    (`base: local`): each of its top-level keys replaces the base's."""
    where, data = _read_cluster(str(name_or_path))
    if isinstance(data, dict) and "base" in data:
        base = data["base"]
        if base not in SHIPPED_CLUSTERS:
            raise ClusterInvalid(f"{where}: base is {base!r}; expected a shipped cluster: "
                                 f"{', '.join(SHIPPED_CLUSTERS)}")
        _, base_data = _read_cluster(base)
        if not isinstance(base_data, dict) or "base" in base_data:
            raise ClusterInvalid(f"{where}: its base {base!r} is not a cluster of its own (one level of base only)")
        data = {**base_data, **{key: value for key, value in data.items() if key != "base"}}
    return parse_cluster(data, where)


def _read_cluster(text_name: str) -> tuple[str, object]:
    if text_name in SHIPPED_CLUSTERS:
        where = f"lorafaas/replay/clusters/{text_name}.yaml"
        text = resources.files("lorafaas.replay").joinpath("clusters", f"{text_name}.yaml").read_text()
    else:
        path = Path(text_name)
        if not path.is_file():
            raise ClusterInvalid(f"cluster {text_name!r} is neither a shipped one ({', '.join(SHIPPED_CLUSTERS)}) "
                                 "nor a YAML file")
        where, text = str(path), path.read_text()
    try:
        return where, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ClusterInvalid(f"{where}: not YAML: {exc}") from exc
