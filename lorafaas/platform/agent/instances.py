"""Function instances from spawn to exit: start (with a time budget, and stopped at once when its deployment goes),
stop, kill, watch for an exit nobody asked for, and liveness (heartbeats, hung instances killed).

`Instances` owns the processes; the node agent decides when to start and stop them. It reports back through two
callbacks: `on_ready(instance)` when a start finished, `on_gone(instance, failed)` when one stopped, or crashed or
hung and was killed (`failed`), so that the agent wakes the function's queue and replaces a failed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from lorafaas.errors import InstanceUnavailable, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.client import tcp_address
from lorafaas.function_runtime.standby import STANDBY_FUNCTION
from lorafaas.function_runtime.zygote import prepare_backbone, zygote_status
from lorafaas.platform.agent.config import GATE_LEASE_S, AgentConfig
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.agent.start_stages import StartStages
from lorafaas.platform.backends.base import AsyncKillable, AsyncLauncher, Backend, StandbyLauncher
from lorafaas.platform.backends.lora_servers import LoraServers, with_lora_mode
from lorafaas.platform.compute_gate import ComputeGate
from lorafaas.platform.devices import backbone_device
from lorafaas.platform.instance_table import Identity, Instance, InstanceTable
from lorafaas.platform.metering import idle_bytes, idle_s
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.protocols.daemon_config import base_pass_socket
from lorafaas.scheduler import CoreGrants, PassChoice

log = logging.getLogger(__name__)


def device_slots(config: AgentConfig) -> int:
    """Per device: instances it runs at full speed at once."""
    if config.compute_slots is not None:
        return config.compute_slots
    if config.cpu:
        return max(1, (os.cpu_count() or 1) // max(1, config.num_threads))
    return 1  # a GPU runs one instance's kernels at a time; batching, not more instances, fills it


class Instances:
    def __init__(
        self,
        launcher: Backend,
        config: AgentConfig,
        table: InstanceTable,
        adapter_path: Callable[[str], Path],
        clock: Callable[[], float],
        lora_servers: LoraServers | None,
        state_of: Callable[[Instance], FunctionState | None],
        on_ready: Callable[[Instance], None],
        on_gone: Callable[[Instance, bool], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.launcher = launcher
        self.config = config
        self.table = table
        self.adapter_path = adapter_path
        self.clock = clock
        self.lora_servers = lora_servers
        self._state_of = state_of
        self._on_ready = on_ready
        self._on_gone = on_gone
        self._spawn = spawn
        self.gate: ComputeGate | None = None  # the device's step gate (local CPU workers); started by start_pool()
        self.library_import_s: float | None = None
        self.daemon_start_s: dict[str, float] = {}  # backbone -> seconds its daemon took to start here
        # Called with (instance, idle seconds, bytes) when an idle instance stops: its last keep-alive is charged.
        self.on_keep_alive: Callable[[Instance, float, float], None] | None = None
        self._probes: dict[Instance, asyncio.Task] = {}
        self.start_stages = StartStages()  # every start's stages, summed per stage (metrics)

    @property
    def slots(self) -> int:
        return device_slots(self.config)

    # -- the library pool and the backbones ------------------------------------------------------------------------

    async def start_pool(self) -> None:
        """The library pool (zygote) and, for local CPU workers, the device's step gate."""
        await asyncio.to_thread(self.launcher.start_zygote)
        if self.launcher.zygote_pid is None:  # a backend without a library pool (pods) has nothing to ask
            return
        status = await asyncio.to_thread(zygote_status, self.launcher.zygote_socket)
        self.library_import_s = status.import_s
        if self.config.step_gate and self.config.cpu:  # local workers, on this machine's cores
            threads = max(1, self.config.num_threads)
            # members' steps go to the shared pass where it measures faster, or from a fixed count stepping at once
            shared_from = self.config.shared_base_from if self.config.shared_base else None
            choice = PassChoice(self.slots, threads) if self.config.shared_base else None
            self.gate = ComputeGate(self.launcher.zygote_socket.parent / "step-gate-cpu.sock",
                                    CoreGrants(self.slots * threads, threads, self.config.lone_threads,
                                               lease_s=GATE_LEASE_S, shared_from=shared_from,
                                               choice=choice),
                                    self._is_worker, self._is_base_pass_member)
            await self.gate.start()

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        for instance in self.table.all():
            if self.launcher.keeps_instances and instance.state in ("ready", "draining"):
                await self._leave_running(instance)
            else:
                await self.stop(instance, "the node agent is stopping")
        await asyncio.to_thread(self.launcher.close)
        if self.gate is not None:
            await self.gate.stop()
        if self.lora_servers is not None:
            await asyncio.to_thread(self.lora_servers.close)

    async def prepare_backbone(self, backbone: str, device: str | None = None) -> None:
        """Make the backbone resident on `device` (None: where it runs already, else the device serving fewest
        backbones): its daemon running and its tokenizer in the library pool, so that cold starts find it loaded."""
        device = device or backbone_device(self.config.device_names, self.launcher.running_backbones, backbone)
        if backbone not in self.launcher.running_backbones(device):
            started = time.perf_counter()
            await asyncio.to_thread(self.launcher.daemon_socket, backbone, device)
            self.daemon_start_s[backbone] = time.perf_counter() - started
        if self.launcher.zygote_pid is not None:
            await asyncio.to_thread(prepare_backbone, self.launcher.zygote_socket, self.launcher.store.path(backbone))
        if isinstance(self.launcher, StandbyLauncher):  # its pool processes attach and warm up now, not at a start
            spec = await asyncio.to_thread(self.launcher.spec, STANDBY_FUNCTION, backbone, None, device=device,
                                           num_threads=self.config.num_threads)
            await asyncio.to_thread(self.launcher.fill_standbys, spec)

    def _is_worker(self, pid: int) -> bool:
        return any(i.pid == pid for i in self.table.all())

    def _is_base_pass_member(self, pid: int) -> bool:
        return any(i.pid == pid and i.in_shared_base for i in self.table.all())

    # -- starting ----------------------------------------------------------------------------------------------------

    async def start(self, spec: FunctionSpec, stages: tuple[m.StageName, ...], kind: str, device: str) -> Instance:
        """Start an instance of `spec` on `device`, bound to the daemon of its backbone there. A start that runs past
        `start_timeout_s`, or whose deployment goes meanwhile (`abort_start`), is killed: InstanceUnavailable."""
        now = self.clock()
        instance = self.table.add(Instance("(starting)", Identity.of(spec), device, started_s=now, last_used_s=now))
        instance.backbone = spec.backbone
        scale_out = any(i.state == "ready" for i in self.table.current(spec))
        started = time.perf_counter()
        staging = asyncio.ensure_future(self._launch_and_stage(instance, spec, stages, device, started))
        staging.add_done_callback(lambda t: t.cancelled() or t.exception())  # one left behind fails unread
        aborted = asyncio.ensure_future(instance.aborted.wait())
        launching = asyncio.ensure_future(instance.launching.wait())
        try:
            # The budget counts from the spawn: a backbone daemon started on the way is the node's work, not the
            # function's (its own start has its own time limit)
            done, _ = await asyncio.wait({staging, aborted, launching}, return_when=asyncio.FIRST_COMPLETED)
            if done == {launching}:
                done, _ = await asyncio.wait({staging, aborted}, timeout=self.config.start_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            if staging in done:
                staging.result()  # its error, if it failed
            elif not done:
                reason = f"it took over {self.config.start_timeout_s:g} s (the agent's start budget) and was killed"
                self._record_failure(instance, f"start failed: {reason}")
                self.abort_start(instance, reason)
                raise InstanceUnavailable(reason)
            else:
                raise InstanceUnavailable(f"its start was stopped: {instance.abort}")
        except (LorafaasError, OSError) as exc:
            if not instance.abort:  # a start stopped on purpose has been recorded (or is no failure of its own)
                self._record_failure(instance, f"start failed: {exc}")
            self.table.transition(instance, "crashed", "start failed")
            await self.kill(instance)
            raise InstanceUnavailable(f"function {spec.name}: starting an instance failed: {exc}") from exc
        except BaseException:  # cancelled (the agent is stopping): leave no process behind
            instance.abort = instance.abort or "the agent is stopping"
            staging.cancel()
            self.table.transition(instance, "crashed", "start cancelled")
            await asyncio.shield(self.kill(instance))
            raise
        finally:
            aborted.cancel()
            launching.cancel()
        instance.cold_start["total"] = time.perf_counter() - started
        instance.staged = True
        adopted = instance.handle is not None and instance.handle.adopted  # running already: no cold start
        instance.start_kind = "adopted" if adopted else kind
        instance.last_used_s = instance.last_progress_s = instance.ready_s = self.clock()
        self._spawn(self._watch(instance))
        state = self._state_of(instance)
        if state is not None and not adopted:
            state.record_cold_start(kind, instance.cold_start, scale_out)
        if not adopted:
            self.start_stages.observe(instance.cold_start)
        log.info("%s: instance %s (pid %s) %s in %.0f ms (%s)", spec.name, instance.instance_id, instance.pid,
                 "adopted" if adopted else "started", instance.cold_start["total"] * 1e3, instance.start_kind)
        self._on_ready(instance)
        return instance

    def record_first_token(self, instance: Instance, first: m.Token | m.Finished, seconds: float) -> None:
        """The last stages of an instance's start: its first request's first token (from dispatch) and forward
        pass, added to its breakdown, its function's last one and the node's per-stage sums. Once per instance."""
        if "first_token" in instance.cold_start or not instance.cold_start:
            return
        stages = {"first_token": seconds}
        prefill_s = getattr(first, "prefill_s", None)
        if prefill_s is not None:
            stages["first_prefill"] = prefill_s
        instance.cold_start.update(stages)
        state = self._state_of(instance)
        if state is not None and state.last_cold_start is not None:
            state.last_cold_start.update(stages)
        self.start_stages.observe(stages)

    def abort_start(self, instance: Instance, reason: str) -> None:
        """Stop a start in progress now: its process is killed and its start fails at once (a launch still under
        way is killed as soon as it returns)."""
        if instance.staged or instance.abort:
            return
        instance.abort = reason
        instance.aborted.set()
        log.info("%s: start of instance %s stopped: %s", instance.function, instance.instance_id, reason)
        if instance.handle is not None:
            self._spawn(self.kill(instance))

    async def _launch_and_stage(self, instance: Instance, spec: FunctionSpec, stages: tuple[m.StageName, ...],
                                device: str, started: float) -> None:
        try:
            await self._launch_and_stage_steps(instance, spec, stages, device, started)
        except BaseException:
            if instance.abort:  # nobody waits for it any more: what it launched is its own to stop
                await asyncio.shield(self.kill(instance))
            raise

    async def _launch_and_stage_steps(self, instance: Instance, spec: FunctionSpec,
                                      stages: tuple[m.StageName, ...], device: str, started: float) -> None:
        def check() -> None:
            if instance.abort:
                raise InstanceUnavailable(f"start stopped: {instance.abort}")

        worker_spec = await asyncio.to_thread(  # may start the backbone daemon: off the event loop
            self.launcher.spec, spec.name, spec.backbone, self.adapter_path(spec.adapter_digest),
            max_batch_size=self.config.max_batch_size, num_threads=self.config.num_threads, deployment=spec.uid,
            device=device,
        )
        worker_spec = await asyncio.to_thread(  # an expert adapter's mode; may start the LoRA server
            with_lora_mode, worker_spec, spec.backbone, spec.lora_mode, self.lora_servers)
        if self.gate is not None:
            worker_spec = msgspec.structs.replace(worker_spec, step_gate=str(self.gate.path))
        if self.config.shared_base and spec.shared_base and self.config.cpu and worker_spec.daemon_socket:
            worker_spec = msgspec.structs.replace(
                worker_spec, base_pass=str(base_pass_socket(Path(worker_spec.daemon_socket))))
        instance.backbone_bytes = await asyncio.to_thread(self._backbone_bytes, spec.backbone)
        instance.instance_id = worker_spec.instance_id
        check()
        launched = time.perf_counter()
        instance.cold_start["prepare"] = launched - started  # its worker spec: daemon socket, LoRA mode, sizes
        instance.launching.set()
        if isinstance(self.launcher, AsyncLauncher):  # a pod: its readiness is awaited, no thread held meanwhile
            instance.handle = await self.launcher.launch_async(worker_spec)
        else:
            instance.handle = await asyncio.to_thread(self.launcher.launch, worker_spec)
        instance.instance_id = instance.handle.spec.instance_id  # a pod adopted after a restart keeps its id
        check()
        instance.cold_start["spawn"] = time.perf_counter() - launched
        standby_s = getattr(instance.handle, "standby_s", None)  # a local pool process: its attach and warm-up
        preloaded: tuple[m.StageName, ...] = ()
        if standby_s is not None:  # it loaded these before it listened (standby.py): no round trip to ask again
            instance.cold_start["standby_warm"] = standby_s
            preloaded = ("libraries", "backbone")
            instance.loaded.update(preloaded)
        instance.client = await instance.handle.connect()
        for stage in stages:
            if stage in preloaded:
                continue
            check()
            done = await instance.client.stage(stage)
            instance.cold_start[stage] = done.seconds
            instance.loaded.add(stage)
            if stage == "adapter" and done.adapter is not None:
                instance.adapter = done.adapter
        check()

    def _backbone_bytes(self, backbone: str) -> int:
        """The backbone's size as its store manifest records it; 0 when the store cannot say (never fatal)."""
        try:
            return self.launcher.store.get(backbone).bytes
        except (LorafaasError, OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: backbone size unknown, not charged to its functions: %s", backbone, exc)
            return 0

    # -- stopping ----------------------------------------------------------------------------------------------------

    async def kill(self, instance: Instance, sig: int = 9) -> None:
        if instance.client is not None:
            await instance.client.close()
        if instance.handle is not None:
            if isinstance(instance.handle, AsyncKillable):
                await instance.handle.kill_async(sig, self.config.stop_timeout_s)
            else:
                await asyncio.to_thread(instance.handle.kill, sig, self.config.stop_timeout_s)
            with contextlib.suppress(ValueError):
                self.launcher.instances.remove(instance.handle)
            address = instance.handle.spec.socket_path
            if tcp_address(address) is None:  # a killed worker could not remove its own socket
                Path(address).unlink(missing_ok=True)

    async def stop(self, instance: Instance, reason: str = "") -> None:
        if instance.state in ("stopping", "stopped", "crashed"):
            return
        self._charge_keep_alive(instance)
        self.table.transition(instance, "stopping", reason)
        if instance.client is not None:
            with contextlib.suppress(LorafaasError, OSError):
                await instance.client.shutdown()
        await self.kill(instance, 15)
        self.table.transition(instance, "stopped")
        self._on_gone(instance, False)

    async def _leave_running(self, instance: Instance) -> None:
        """The agent stops but the instance outlives it (a pod): only our connection closes; the next controller
        adopts it."""
        self._charge_keep_alive(instance)
        self.table.transition(instance, "stopping", "left running for the next controller")
        if instance.client is not None:
            await instance.client.close()
        self.table.transition(instance, "stopped")

    def _charge_keep_alive(self, instance: Instance) -> None:
        if instance.staged and not instance.in_flight and self.on_keep_alive is not None:
            self.on_keep_alive(instance, idle_s(instance, self.clock()), idle_bytes(self.table, instance))

    async def _watch(self, instance: Instance) -> None:
        assert instance.client is not None
        await instance.client.wait_closed()
        if instance.state in ("ready", "draining"):
            self._record_failure(instance, "exited unexpectedly", restart=True)
            self.table.transition(instance, "crashed", "exited unexpectedly")
            await self.kill(instance)
            self._on_gone(instance, True)

    def _record_failure(self, instance: Instance, reason: str, restart: bool = False) -> None:
        log.warning("%s: instance %s (pid %s) %s", instance.function, instance.instance_id, instance.pid, reason)
        state = self._state_of(instance)
        if state is not None:  # else a deleted deployment's instance: nobody reads its record any more
            state.record_failure(instance.instance_id, instance.pid, reason, instance.version)
            state.restarts += restart

    # -- liveness --------------------------------------------------------------------------------------------------

    def check_liveness(self) -> None:
        """Ask every instance that holds requests and has sent nothing for a while for a heartbeat."""
        now = self.clock()
        for instance in self.table.all():
            if (instance.state in ("ready", "draining") and instance.in_flight and instance.client is not None
                    and now - instance.last_progress_s >= self.config.heartbeat_after_s
                    and instance not in self._probes):
                task = asyncio.create_task(self._probe(instance))
                self._probes[instance] = task
                task.add_done_callback(functools.partial(self._probe_done, instance))

    def _probe_done(self, instance: Instance, _task: asyncio.Task) -> None:
        self._probes.pop(instance, None)

    async def _probe(self, instance: Instance) -> None:
        assert instance.client is not None
        try:
            stats = await asyncio.wait_for(instance.client.stats(), self.config.hang_timeout_s)
        except TimeoutError:
            await self._hung(instance, f"answered no heartbeat within {self.config.hang_timeout_s:g} s while "
                                       f"holding {instance.in_flight} request(s)")
            return
        except (LorafaasError, OSError):
            return  # it went away: its watcher reports the crash
        now = self.clock()
        if stats.num_steps != instance.num_steps:
            instance.num_steps = stats.num_steps
            instance.last_progress_s = now
        elif instance.in_flight and now - instance.last_progress_s >= self.config.hang_after_steps_s:
            await self._hung(instance, f"made no progress for {now - instance.last_progress_s:.0f} s while holding "
                                       f"{instance.in_flight} request(s)")

    async def _hung(self, instance: Instance, reason: str) -> None:
        """Fail or retry its requests (closing the connection ends their streams), kill it, replace it."""
        if not self.table.transition(instance, "hung", reason):
            return
        instance.hung = reason
        self._record_failure(instance, f"hung: {reason}", restart=True)
        self.table.transition(instance, "stopping", "hung")
        await self.kill(instance)
        self.table.transition(instance, "stopped")
        self._on_gone(instance, True)
