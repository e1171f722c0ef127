"""`lorafaas up`: the whole local platform in one foreground process.

State store (SQLite under $LORAFAAS_HOME, or Redis), model and adapter stores, the node agent (backbone daemons, the
library pool, function workers) and the gateway (uvicorn). On start it restores every stored function and resumes
accepted asynchronous invocations; on SIGTERM/SIGINT it stops every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from lorafaas.errors import InvalidInput, SegmentError
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.platform.adapter_limits import DEFAULT_TENANT_ADAPTER_BYTES, AdapterLimits
from lorafaas.platform.adapter_store import AdapterStore
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.config import DEFAULT_IDLE_BUDGET_FRACTION, DEFAULT_MAX_BATCH
from lorafaas.platform.auth import ADMIN_KEY_FILE, ensure_admin_key, read_admin_key
from lorafaas.platform.backends import open_backend
from lorafaas.platform.backends.lora_servers import LoraServers
from lorafaas.platform.devices import Device, check_devices
from lorafaas.platform.gateway.adapter_route import install_adapter_route
from lorafaas.platform.gateway.app import create_app
from lorafaas.platform.gateway.limits import UPLOAD_MIN_RATE_BYTES_S, UPLOAD_TIMEOUT_S, RequestLimits
from lorafaas.platform.gateway.metrics import GatewayMetrics
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.interface import open_store, sqlite_url
from lorafaas.scheduler import SchedulerConfig, for_device_kind

log = logging.getLogger(__name__)
EXPIRY_INTERVAL_S = 60.0
SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


@dataclass(frozen=True)
class ServerConfig:
    home: Path
    host: str = "127.0.0.1"
    port: int = 8080
    devices: tuple[Device, ...] = ()
    state_url: str | None = None  # default: SQLite in home
    admin_key: str | None = None  # LORAFAAS_ADMIN_KEY
    demo: bool = False
    policy: str = "lorafaas"  # or an ablation: see POLICIES
    backend: str = "local"  # or "kubernetes": function instances as pods (in the chart's controller)
    compute_slots: int | None = None  # AgentConfig.compute_slots (None: cores on a CPU, 1 on a GPU)
    threads_per_instance: int = 1  # AgentConfig.num_threads: torch threads of each worker
    strict_compute: bool = False  # AgentConfig.strict_compute
    step_gate: bool = True  # AgentConfig.step_gate
    lone_threads: int | None = None  # AgentConfig.lone_threads
    shared_base: bool = True  # AgentConfig.shared_base
    shared_base_from: int | None = None  # AgentConfig.shared_base_from
    hang_timeout_s: float = 10.0  # AgentConfig.hang_timeout_s
    start_timeout_s: float = 120.0  # AgentConfig.start_timeout_s
    max_batch_size: int = DEFAULT_MAX_BATCH  # AgentConfig.max_batch_size (the fixed-batch policy's B stays 1)
    tenant_adapter_bytes: int = DEFAULT_TENANT_ADAPTER_BYTES  # AdapterLimits.max_tenant_bytes
    host_tier_bytes: int | None = None  # LocalLauncher's host tier (None: host_tier.default_host_tier_bytes)
    # AgentConfig.idle_budget_bytes (None: DEFAULT_IDLE_BUDGET_FRACTION of the machine's memory)
    idle_budget_bytes: int | None = None
    rank_aware: bool = True  # SchedulerConfig.rank_aware (`up --rank-blind`: a benchmark's comparison)
    standby_workers: int | None = None  # LocalLauncher's pool processes per backbone (None: DEFAULT_STANDBY_WORKERS)
    upload_timeout_s: float = UPLOAD_TIMEOUT_S  # RequestLimits.upload_timeout_s
    upload_min_rate_bytes_s: float = UPLOAD_MIN_RATE_BYTES_S  # RequestLimits.upload_min_rate_bytes_s


# The scheduler's mechanisms, all on ("lorafaas") or one switched off, for evaluations (same names as the simulator).
POLICIES = {
    "lorafaas": SchedulerConfig(max_batch_size=DEFAULT_MAX_BATCH),
    "no-preload": SchedulerConfig(max_batch_size=DEFAULT_MAX_BATCH, preloading=False),
    "no-offload": SchedulerConfig(max_batch_size=DEFAULT_MAX_BATCH, offloading=False),
    "fixed-batch": SchedulerConfig(max_batch_size=1, adaptive_batching=False),
    "fixed-keep-alive": SchedulerConfig(max_batch_size=DEFAULT_MAX_BATCH, keep_alive_policy="fixed"),
}


def scheduler_config(policy: str) -> SchedulerConfig:
    if policy not in POLICIES:
        raise InvalidInput(f"policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    return POLICIES[policy]


def parse_devices(text: str) -> tuple[Device, ...]:
    """`cpu`, `cpu=8G`, `cuda:0`, `cuda:0=20G,cuda:1=20G` ...; a device without a budget gets 80% of its available
    memory (the host's for `cpu`, the GPU's own for `cuda:N`). GPUs may be several, each named once; `cpu` stands
    alone (`check_devices`)."""
    items = [item.partition("=") for item in (part.strip() for part in text.split(",")) if item]
    for name, _, _ in items:
        if name != "cpu" and not re.fullmatch(r"cuda:\d+", name):
            raise InvalidInput(f"device {name!r} is not 'cpu' or 'cuda:N'")
    try:
        check_devices([name for name, _, _ in items])
    except InvalidInput as exc:
        raise InvalidInput(f"--devices {text!r}: {exc.message}") from exc
    return tuple(Device(name, parse_size(budget) if budget else _default_budget(name)) for name, _, budget in items)


def parse_size(text: str, what: str = "memory budget") -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", text.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise InvalidInput(f"{what} {text!r} is not a size like 8G or 512M")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])


def _default_budget(device: str) -> int:
    if device == "cpu":
        return int(psutil.virtual_memory().available * 0.8)
    from lorafaas.cuda_ipc import cuda_driver
    from lorafaas.errors import TransportUnavailable

    try:
        free, _total = cuda_driver.device_memory(int(device.partition(":")[2]))
    except (TransportUnavailable, SegmentError) as exc:
        raise InvalidInput(f"{device} has no memory budget and its memory cannot be read here ({exc.message}); "
                           f"give one, e.g. {device}=20G") from exc
    return int(free * 0.8)


def _kept_admin_key(home: Path) -> str | None:
    return read_admin_key(home) if (home / ADMIN_KEY_FILE).is_file() else None


class Platform:
    """Everything `lorafaas up` runs, built from a ServerConfig (also used by tests to run a platform in-process)."""

    def __init__(self, config: ServerConfig, on_ready=None) -> None:
        self.config = config
        self.on_ready = on_ready  # called with (platform, demo function names) once serving
        home = config.home
        home.mkdir(parents=True, exist_ok=True)
        devices = config.devices or (Device("cpu", _default_budget("cpu")),)
        device = devices[0]  # the kind of every device (cpu, or GPUs: on Kubernetes, the GPUs of each agent node)
        self.store = open_store(config.state_url or sqlite_url(home))
        self.models = ModelStore(home / "models")
        self.adapters = AdapterStore(home / "adapters")
        self.new_admin_key = ensure_admin_key(self.store, home, config.admin_key)
        self.adapter_access = AdapterAccess.from_admin_key(config.admin_key or self.new_admin_key
                                                           or _kept_admin_key(home))
        self.launcher = open_backend(config.backend, home, tuple(d.name for d in devices), self.adapter_access,
                                     host_tier_bytes=config.host_tier_bytes, standby_workers=config.standby_workers)
        scheduler = for_device_kind(scheduler_config(config.policy), "cpu" if device.name == "cpu" else "gpu")
        if scheduler.adaptive_batching:  # the fixed-batch ablation keeps its batch of 1
            scheduler = replace(scheduler, max_batch_size=config.max_batch_size)
        scheduler = replace(scheduler, rank_aware=config.rank_aware)
        idle_budget = config.idle_budget_bytes
        if idle_budget is None:
            idle_budget = int(psutil.virtual_memory().total * DEFAULT_IDLE_BUDGET_FRACTION)
        agent_config = AgentConfig(devices=devices,
                                   max_batch_size=config.max_batch_size,
                                   scheduler=scheduler, compute_slots=config.compute_slots,
                                   num_threads=config.threads_per_instance, strict_compute=config.strict_compute,
                                   step_gate=config.step_gate, lone_threads=config.lone_threads,
                                   shared_base=config.shared_base, shared_base_from=config.shared_base_from,
                                   hang_timeout_s=config.hang_timeout_s, start_timeout_s=config.start_timeout_s,
                                   heartbeat_after_s=min(AgentConfig.heartbeat_after_s, config.hang_timeout_s),
                                   idle_budget_bytes=idle_budget)
        # LoRA servers for MoE backbones run beside local instances; pods have none (remote mode is not wired there)
        lora_servers = None
        if config.backend == "local":
            lora_servers = LoraServers(home / "run", home / "logs", device=device.name,
                                       num_threads=agent_config.num_threads)
        self.agent = NodeAgent(self.launcher, self.adapters.path, agent_config, lora_servers=lora_servers)
        self.service = FunctionService(self.store, self.models, self.adapters, self.agent,
                                       AdapterLimits(max_tenant_bytes=config.tenant_adapter_bytes))
        self.metrics = GatewayMetrics(self.agent, self.service.usage)
        self.ready = False
        limits = RequestLimits(upload_timeout_s=config.upload_timeout_s,
                               upload_min_rate_bytes_s=config.upload_min_rate_bytes_s)
        self.app = create_app(self.service, self.metrics, lifespan=self._lifespan, is_ready=lambda: self.ready,
                              limits=limits)
        install_adapter_route(self.app, self.adapters, self.adapter_access)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app):
        from lorafaas.models.adapter_validation import warm_up

        await asyncio.to_thread(warm_up, self.models)  # before serving: the first upload must not wait for it
        await self.agent.start()
        restored = await self.service.restore()
        log.info("restored %d function(s) from the store", restored)
        await self.agent.adopt()  # before serving: what a previous controller left running serves warm
        demo_names: list[str] = []
        if self.config.demo:
            from lorafaas.platform.demo_functions import deploy_demo_functions

            demo_names = await deploy_demo_functions(self)
        expiry = asyncio.create_task(self._expire_forever())
        self.ready = True
        if self.on_ready is not None:
            self.on_ready(self, demo_names)
        try:
            yield
        finally:
            self.ready = False
            expiry.cancel()
            await self.agent.stop()
            await self.service.usage.flush()  # the usage of the last invocations and keep-alives is stored first
            self.store.close()
            self.service.store_threads.close()

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            removed = await self.service.store_threads.run(self.service.expire_invocations)
            if removed:
                log.info("removed %d expired invocation record(s)", removed)


def run_server(config: ServerConfig, on_ready=None) -> None:
    import uvicorn

    platform = Platform(config, on_ready)
    uvicorn.run(platform.app, host=config.host, port=config.port, log_level="warning", access_log=False)
