"""Between the simulator's state and the scheduler: views out, decisions applied, artifacts loaded and evicted.

view()                      a `ClusterView` of now (profiles, devices, worker slots, residencies, invoked
                            functions, instances; a function with device artifacts but no instance shows as a
                            pre-loaded worker)
apply_plan(plan)            offloads, then pre-loads (each resident after its loading delay)
candidate_devices(f)        where a new instance may go, best first (the scheduler's placement, ServerlessLLM's
                            locality, or the freest device)
make_room(f, device, need)  the scheduler's offloading, LRU eviction (baselines) or nothing (no-offload)
load_artifacts(f, device)   a cold start: the delay of every artifact not resident, by stage
"""

from __future__ import annotations

from typing import Protocol

from lorafaas.replay.sim.cluster import ClusterSpec
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.model import FunctionState, SimInstance
from lorafaas.replay.sim.policies import PolicySpec
from lorafaas.replay.sim.state import DeviceState, MemoryState, slot_of
from lorafaas.replay.workload import Workload
from lorafaas.scheduler import (
    AdapterCostModel,
    BackboneName,
    ClusterView,
    DeviceView,
    FunctionName,
    FunctionProfile,
    InstanceId,
    InstanceView,
    Offload,
    Plan,
    Residency,
    Scheduler,
    SlotId,
    WorkerSlot,
)

READY = frozenset({"libraries", "backbone", "adapter", "warmup"})


class ViewHost(Protocol):
    """What the views read and call of the simulator (`Simulator` is one)."""

    now: float
    fns: dict[FunctionName, FunctionState]
    mem: MemoryState
    policy: PolicySpec
    scheduler: Scheduler
    workload: Workload
    concurrency: int
    compute_slots: int  # per device: instances it runs at full speed at once
    host_cache: dict[int, dict[str, None]]  # per node: backbones in host memory, oldest first

    def stop_instance(self, inst: SimInstance, keep_artifacts: bool) -> None: ...


class ViewBuilder:
    def __init__(self, sim: ViewHost, cluster: ClusterSpec, costs: CostModel) -> None:
        self.sim, self.cluster, self.costs = sim, cluster, costs
        self.mem = sim.mem
        pricing = AdapterCostModel(sim.scheduler.config)
        self.profiles = {
            f: FunctionProfile(
                f,
                BackboneName(self.mem.backbone_of[f]),
                0.0,
                costs.artifact_costs(costs.priced(s.spec, pricing)),
                s.spec.slo_ttft_s,
                costs.backbone(s.spec).kv_bytes_per_token,
            )
            for f, s in sim.fns.items()
        }
        self.pool_slots = [SlotId(f"p{n}-{k}") for n in range(cluster.num_nodes) for k in range(cluster.slots_per_node)]
        self.pool_set = set(self.pool_slots)
        self._base_version = -1
        self._base_resident: list[Residency] = []
        self._base_owners: dict[SlotId, FunctionName] = {}
        self._base_slots: tuple[WorkerSlot, ...] = ()

    # -- views --------------------------------------------------------------------------------------------------

    def slot_of_function(self, f: FunctionName) -> SlotId:
        for r in self.mem.of_function.get(f, ()):
            if r.slot is not None:
                return r.slot
        return slot_of(f)

    def light_view(self, f: FunctionName, device: DeviceState | None = None) -> ClusterView:
        """What placement (of `f`) and offloading (on `device`) read, built in O(device residencies + running
        instances) instead of O(everything): every device-tier residency, the host residencies of the functions
        resident on `device` (where offloaded adapters may go), `f`'s instances and every running one."""
        mem, sim = self.mem, self.sim
        if self._base_version != mem.version:  # the device residencies and their slots, rebuilt only when they change
            self._base_version = mem.version
            self._base_resident = [r for d in mem.devices for r in d.resident]
            self._base_owners = {r.slot: r.function for r in self._base_resident if r.slot is not None}
            self._base_slots = self._slots(self._base_owners)
        resident, owners, slots = self._base_resident, self._base_owners, self._base_slots
        if device is not None:
            on_device = dict.fromkeys(r.function for r in device.resident)  # ordered: no hash-dependent order
            extra = [r for g in on_device for r in mem.of_function.get(g, ()) if r.tier == "host"]
            if extra:
                resident = resident + extra
                owners = {**owners, **{r.slot: r.function for r in extra if r.slot is not None}}
                slots = self._slots(owners)
        instances, invoked = [], {}
        for d in mem.devices:
            invoked.update(dict.fromkeys(mem.running_functions[d.device_id]))
        for g in dict.fromkeys([f, *invoked]):
            fs = sim.fns[g]
            for inst in fs.instances:
                loaded = READY if inst.ready_at_s <= sim.now else frozenset({"libraries"})
                instances.append(
                    InstanceView(
                        InstanceId(inst.instance_id), g, inst.device.device_id, loaded, inst.running, sim.concurrency
                    )
                )
        pre = [r for r in mem.of_function.get(f, ()) if r.tier == "device"]
        if not sim.fns[f].instances and pre:
            instances.append(
                InstanceView(
                    InstanceId(f"pre-{f}"),
                    f,
                    pre[0].device,  # type: ignore[arg-type]
                    frozenset(r.kind for r in pre) | {"libraries"},
                    0,
                    1,
                )
            )
        devices = tuple(DeviceView(d.device_id, d.capacity_bytes, d.used_bytes, sim.compute_slots)
                        for d in mem.devices)
        return ClusterView(self.profiles, devices, slots, tuple(resident), frozenset(invoked), tuple(instances))

    def _slots(self, owners: dict[SlotId, FunctionName]) -> tuple[WorkerSlot, ...]:
        slots = [WorkerSlot(s, self.cluster.slot_bytes, 0, owners.get(s)) for s in self.pool_slots]
        slots += [WorkerSlot(s, self.cluster.slot_bytes, 0, g) for s, g in owners.items() if s not in self.pool_set]
        return tuple(slots)

    def view(self) -> ClusterView:
        mem, sim = self.mem, self.sim
        owners: dict[SlotId, FunctionName] = {}
        for f, rs in mem.of_function.items():
            for r in rs:
                if r.slot is not None:
                    owners[r.slot] = f
        slots = [WorkerSlot(s, self.cluster.slot_bytes, 0, owners.get(s)) for s in self.pool_slots]
        instances, invoked = [], set()
        for f, fs in sim.fns.items():
            if fs.instances:
                slot = self.slot_of_function(f)
                if slot not in self.pool_slots:
                    slots.append(WorkerSlot(slot, self.cluster.slot_bytes, 0, f))
            for inst in fs.instances:
                if inst.running:
                    invoked.add(f)
                loaded = READY if inst.ready_at_s <= sim.now else frozenset({"libraries"})
                instances.append(
                    InstanceView(
                        InstanceId(inst.instance_id), f, inst.device.device_id, loaded, inst.running, sim.concurrency
                    )
                )
            if not fs.instances:
                on_device = [r for r in mem.of_function.get(f, ()) if r.tier == "device"]
                if on_device:
                    instances.append(
                        InstanceView(
                            InstanceId(f"pre-{f}"),
                            f,
                            on_device[0].device,  # type: ignore[arg-type]
                            frozenset(r.kind for r in on_device) | {"libraries"},
                            0,
                            1,
                        )
                    )
        devices = tuple(DeviceView(d.device_id, d.capacity_bytes, d.used_bytes, sim.compute_slots)
                        for d in mem.devices)
        return ClusterView(
            self.profiles, devices, tuple(slots), mem.all_resident(), frozenset(invoked), tuple(instances)
        )

    # -- plans --------------------------------------------------------------------------------------------------

    def apply_plan(self, plan: Plan) -> None:
        self._apply_offloads(plan.offloads)
        now = self.sim.now
        for p in plan.preloads:
            f = p.function
            if f not in self.sim.fns:
                continue
            spec = self.sim.fns[f].spec
            if p.tier == "host":
                delay = (
                    self.cluster.loading.libraries_s
                    if p.kind == "libraries"
                    else self.costs.device_bytes(p.kind, spec) / self.cluster.loading.disk_bytes_per_s
                )
                self.mem.add(Residency(f, p.kind, "host", None, p.slot), now + delay)
                continue
            device = self.mem.by_id[p.device]  # type: ignore[index]
            self.mem.bill(device, now)
            delay = self._device_load_s(f, p.kind, device)
            host = self.mem.find(f, p.kind, "host")
            if host is not None:
                self.mem.remove(host)
            self.mem.add(Residency(f, p.kind, "device", p.device, p.slot), now + delay)
            self.mem.bill(device, now)

    def _apply_offloads(self, offloads: tuple[Offload, ...]) -> None:
        """The plan's offloads of artifacts no instance of the function holds on that device. An instance kept
        alive keeps what makes it warm until its keep-alive ends (as the agent's do): dropping it when a burst ends
        and the rates fall made every next burst a cold start from disk (docs/scheduler.md)."""
        now = self.sim.now
        for o in offloads:
            r = self.mem.find(o.function, o.kind, o.from_tier, o.device)
            if r is None:
                continue
            if o.device is not None and any(i.device.device_id == o.device for i in self.sim.fns[o.function].instances):
                continue
            device = self.mem.by_id[o.device] if o.device is not None else None
            if device is not None:
                self.mem.bill(device, now)
            self.mem.remove(r)
            if o.to_tier == "host":
                self.mem.add(Residency(o.function, o.kind, "host", None, o.slot or r.slot), now)
            if device is not None and o.kind in ("backbone", "adapter"):
                for inst in list(self.sim.fns[o.function].instances):
                    if inst.device is device and not inst.running:
                        self.sim.stop_instance(inst, keep_artifacts=True)  # it lost what made it warm
            if device is not None:
                self.mem.bill(device, now)

    # -- placement and room -------------------------------------------------------------------------------------

    def candidate_devices(self, f: FunctionName) -> list[DeviceState]:
        mem, policy = self.mem, self.sim.policy
        freest = sorted(mem.devices, key=lambda d: (d.num_running, -mem.free_bytes(d), d.device_id))
        if policy.locality:
            backbone = self.sim.fns[f].spec.backbone
            return sorted(freest, key=lambda d: backbone not in self.sim.host_cache[d.node])
        if policy.uses_scheduler_placement:
            decision = self.sim.scheduler.place(f, self.light_view(f))
            if decision is not None:
                first = mem.by_id[decision.device]
                return [first, *(d for d in freest if d is not first)]
        return freest

    def bytes_to_start(self, f: FunctionName, device: DeviceState, batch_size: int) -> int:
        fs = self.sim.fns[f]
        spec = fs.spec
        need = self.cluster.loading.instance_overhead_bytes
        if self.mem.backbone_on(device, self.mem.backbone_of[f]) is None:
            need += self.costs.backbone(spec).size_bytes
        for kind in ("adapter", "warmup"):
            if self.mem.find(f, kind, "device", device.device_id) is None:
                need += self.costs.device_bytes(kind, spec)
        tokens = sum(
            self.sim.workload.requests[i].prompt_tokens + self.sim.workload.requests[i].output_tokens
            for i in list(fs.queue)[:batch_size]
        )
        return need + self.costs.kv_bytes(self.costs.backbone(spec), tokens)

    def make_room(self, f: FunctionName, device: DeviceState, need: int) -> bool:
        policy = self.sim.policy
        if policy.eviction == "none":
            return False
        if policy.eviction == "scheduler":
            decision = self.sim.scheduler.make_room(self.light_view(f, device), device.device_id, need)
            if not decision.satisfied:
                return False
            self._apply_offloads(decision.actions)
            return self.mem.free_bytes(device) >= need
        return self._evict_lru(f, device, need)

    def _evict_lru(self, f: FunctionName, device: DeviceState, need: int) -> bool:
        """Baselines: stop idle instances and drop pre-loaded artifacts of functions not running, oldest first."""
        mem, sim = self.mem, self.sim
        running = mem.running_functions[device.device_id]
        idle = sorted(
            (
                inst
                for fs in sim.fns.values()
                for inst in fs.instances
                if inst.device is device and not inst.running and not inst.permanent
            ),
            key=lambda i: (i.last_used_s, i.instance_id),
        )
        for inst in idle:
            if mem.free_bytes(device) >= need:
                return True
            sim.stop_instance(inst, keep_artifacts=False)
        stale = sorted(
            (
                r
                for r in device.resident
                if r.function not in running and r.function != f and not sim.fns[r.function].instances
            ),
            key=lambda r: (r.function, r.kind),
        )
        for r in stale:
            if mem.free_bytes(device) >= need:
                return True
            mem.bill(device, sim.now)
            mem.remove(r)
            mem.bill(device, sim.now)
        return mem.free_bytes(device) >= need

    # -- loading ------------------------------------------------------------------------------------------------

    def _device_load_s(self, f: FunctionName, kind: str, device: DeviceState) -> float:
        spec = self.sim.fns[f].spec
        load = self.cluster.loading
        if kind == "warmup":
            return load.warmup_s
        size = self.costs.device_bytes(kind, spec)
        on_host = self.mem.find(f, kind, "host") is not None
        if kind == "backbone":
            on_host = on_host or spec.backbone in self.sim.host_cache[device.node]  # the node's host tier
            shared = self.mem.backbone_on(device, self.mem.backbone_of[f]) is not None
            return self.costs.backbone_load_s(size, shared, on_host, shared)
        return size / (load.host_to_device_bytes_per_s if on_host else load.disk_bytes_per_s)

    def _remaining(self, r: Residency | None) -> float | None:
        """None: not resident; else the seconds until it is (0 when loaded)."""
        if r is None:
            return None
        return max(0.0, self.mem.available_at.get(r, 0.0) - self.sim.now)

    def start_delays(self, f: FunctionName, device: DeviceState) -> dict[str, float]:
        """Per stage, what a start of `f` on `device` would wait for now: `spawn_s`, and the loading of what is not
        resident (or the rest of what is still loading). Changes nothing."""
        mem, sim, load = self.mem, self.sim, self.cluster.loading
        spec = sim.fns[f].spec
        out: dict[str, float] = {"spawn": load.spawn_s}
        libs = self._remaining(mem.find(f, "libraries", "host"))
        out["libraries"] = load.libraries_s if libs is None else libs
        cached = spec.backbone in sim.host_cache[device.node]
        for kind in ("backbone", "adapter"):
            mine = self._remaining(mem.find(f, kind, "device", device.device_id))
            if mine is not None:
                out[kind] = mine
            elif sim.policy.loader == "fast":
                out[kind] = self.costs.fast_backbone_load_s(self.costs.device_bytes(kind, spec), cached)
                cached = True  # the backbone's load goes through the node's host cache
            else:
                out[kind] = self._device_load_s(f, kind, device)
        warm = self._remaining(mem.find(f, "warmup", "device", device.device_id))
        out["warmup"] = load.warmup_s if warm is None else warm
        return out

    def load_artifacts(self, f: FunctionName, device: DeviceState) -> dict[str, float]:
        """A cold start of `f` on `device`: per stage, the delay of loading what is not resident (`start_delays`);
        the artifacts become resident (libraries in the function's slot, the rest on the device)."""
        mem, sim = self.mem, self.sim
        spec = sim.fns[f].spec
        slot = self.slot_of_function(f)
        now = sim.now
        mem.bill(device, now)
        out = self.start_delays(f, device)
        if mem.find(f, "libraries", "host") is None:
            mem.add(Residency(f, "libraries", "host", None, slot), now)
        for kind in ("backbone", "adapter"):
            if mem.find(f, kind, "device", device.device_id) is not None:
                continue
            if sim.policy.loader == "fast":
                if kind == "backbone":
                    self._cache_on_host(device.node, spec.backbone)
            else:
                host = mem.find(f, kind, "host")
                if host is not None:
                    mem.remove(host)
                if kind == "backbone":  # lorafaas's host tier keeps the node's recently loaded backbones
                    self._cache_on_host(device.node, spec.backbone)
            mem.add(Residency(f, kind, "device", device.device_id, slot), now)
        if mem.find(f, "warmup", "device", device.device_id) is None:
            mem.add(Residency(f, "warmup", "device", device.device_id, slot), now)
        mem.bill(device, now)
        return out

    def _cache_on_host(self, node: int, backbone: str) -> None:
        """The node's host memory keeps `backbone` (most recent last), within the cluster's host_cache_gb."""
        cache = self.sim.host_cache[node]
        cache.pop(backbone, None)
        cache[backbone] = None
        self._trim_cache(node)

    def _trim_cache(self, node: int) -> None:
        cache = self.sim.host_cache[node]
        while sum(self.cluster.backbones[b].size_bytes for b in cache) > self.cluster.loading.host_cache_bytes:
            cache.pop(next(iter(cache)))

    def drop_instance_artifacts(self, f: FunctionName, device: DeviceState, last: bool) -> None:
        for r in list(self.mem.of_function.get(f, ())):
            if (r.tier == "device" and r.device == device.device_id) or (last and r.tier == "host"):
                self.mem.remove(r)

    # -- serverful ----------------------------------------------------------------------------------------------

    def start_servers(self) -> None:
        sim, mem = self.sim, self.mem
        by_backbone: dict[str, list[FunctionName]] = {}
        for f, fs in sim.fns.items():
            by_backbone.setdefault(fs.spec.backbone, []).append(f)
        names = sorted(by_backbone)
        total = sum(len(v) for v in by_backbone.values())
        shares = {b: max(1, round(len(mem.devices) * len(by_backbone[b]) / total)) for b in names}
        order = [b for b in names for _ in range(shares[b])]
        for k, device in enumerate(mem.devices):
            backbone = order[k % len(order)]
            for j, f in enumerate(by_backbone[backbone]):
                for kind in ("backbone", "adapter"):
                    mem.add(Residency(f, kind, "device", device.device_id, slot_of(f)), 0.0)
                overhead = self.cluster.loading.instance_overhead_bytes if j == 0 else 0
                device.used_bytes += overhead
                inst: SimInstance = SimInstance(
                    f"srv-{device.device_id}-{f}", f, device, 0.0, 0.0, overhead, permanent=True
                )
                sim.fns[f].instances.append(inst)
                device.instances.add(inst)
