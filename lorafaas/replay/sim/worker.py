"""One instance's worker as the simulator models it: prefill passes and continuous decoding at a rate that follows the
device's load.

The lorafaas worker (`lorafaas/function_runtime/engine.py`) loops while it has work: one decode step over its running
sequences (one token each), then one prefill pass over every request that arrived meanwhile, which then decode with
the others. Here a pass is an event that takes the instance's waiting requests together (their first tokens come
when it ends, `CostModel.prefill_pass_s`), and decoding is a step counter that advances at 1 / step_s, paused while
the instance prefills. step_s is the step at the current number of rows times the device's contention now, so it is
recomputed (`retime`) whenever either moves: a request joining or leaving, an instance of the device starting or
ending a batch, the background load changing. A request finishes when the counter reaches the step its last token
needs; its slot is released then, as the node agent releases each request.
"""

from __future__ import annotations

from typing import Protocol

from lorafaas.replay.results import RequestResult
from lorafaas.replay.sim.cluster import ClusterSpec
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.model import DecodeRow, Done, FunctionState, Observe, Prefill, SimEvent, SimInstance
from lorafaas.replay.sim.policies import PolicySpec
from lorafaas.replay.sim.state import DeviceState
from lorafaas.replay.workload import Workload
from lorafaas.scheduler import FunctionName

STEP_EPSILON = 1e-6  # decode steps: rounding of the counter when an event lands on a row's last step


class WorkerHost(Protocol):
    """What the worker model reads and calls of the simulator (`Simulator` is one)."""

    now: float
    fns: dict[FunctionName, FunctionState]
    results: list[RequestResult]
    cluster: ClusterSpec
    policy: PolicySpec
    costs: CostModel
    workload: Workload

    def push(self, at_s: float, event: SimEvent) -> None: ...

    def dispatch(self, name: FunctionName) -> None: ...

    def slowdown(self, device: DeviceState, starting: int = 0) -> float: ...

    def pass_slowdown(self, device: DeviceState) -> float: ...

    def decode_slowdown(self, device: DeviceState) -> float: ...

    def background_threads_now(self) -> float: ...


class WorkerModel:
    def __init__(self, sim: WorkerHost) -> None:
        self.sim = sim

    def schedule_pass(self, inst: SimInstance) -> None:
        """Requests sent before a pass starts join it. The first pass is when the instance is ready; while it
        decodes, a pass waits for the step under way (half a step on average), and the pass after a pass waits for
        the one decode step between them."""
        sim = self.sim
        if inst.pass_at_s is not None or not inst.waiting:
            return
        step = inst.step_s if inst.rows else 0.0
        if inst.ready_at_s > sim.now:
            start = inst.ready_at_s
        elif inst.prefill_free_at_s > sim.now:
            start = inst.prefill_free_at_s + step
        else:
            start = sim.now + step / 2
        inst.pass_at_s = start
        sim.push(start, Prefill(inst))

    def on_prefill(self, inst: SimInstance) -> None:
        """A pass over the instance's waiting requests: first tokens when it ends, then they decode with the rest."""
        sim = self.sim
        fs = sim.fns[inst.function]
        if fs.queue:  # a dispatcher released at this moment (the instance ready) sends before the worker's pass
            sim.dispatch(inst.function)
        inst.pass_at_s = None
        taken, inst.waiting = inst.waiting, []
        backbone = sim.costs.backbone(fs.spec)
        reqs = [sim.workload.requests[i] for i, _ in taken]
        slow = sim.pass_slowdown(inst.device)
        pass_s = sim.costs.prefill_pass_s(backbone, [r.prompt_tokens for r in reqs]) * slow * fs.spec.step_factor
        self._advance(inst)
        end = sim.now + pass_s
        inst.prefill_free_at_s = end
        cold = inst.first_batch and inst.cold_start_s > 0
        inst.first_batch = False
        for (i, batch), r in zip(taken, reqs, strict=True):
            res = sim.results[i]
            res.ttft_s = end + sim.cluster.request_overhead_s - r.arrival_s
            res.completion_tokens = r.output_tokens
            res.usage_prompt_tokens = r.prompt_tokens
            res.cold = cold
            res.cold_start_s = inst.cold_start_s if cold else None
            kv = sim.costs.kv_bytes(backbone, r.prompt_tokens + r.output_tokens)
            inst.rows.append(DecodeRow(i, kv, inst.steps + r.output_tokens - 1, batch))
        inst.device.decoding[inst] = None
        # the agent learns the pass (its forward time and size) when the first tokens arrive
        sim.push(end, Observe(inst.function, fs.spec.slo_ttft_s, len(taken), pass_s))
        self.retime(inst.device)

    def on_done(self, event: Done) -> list[DecodeRow]:
        """The rows of the instance whose last token came now (none if the event is stale); removed from it."""
        inst = event.instance
        if event.token != inst.done_token:
            return []
        self._advance(inst)
        done = [r for r in inst.rows if r.finish_step <= inst.steps + STEP_EPSILON]
        inst.rows = [r for r in inst.rows if r.finish_step > inst.steps + STEP_EPSILON]
        if not inst.rows:
            inst.device.decoding.pop(inst, None)
        overhead = self.sim.cluster.request_overhead_s
        for row in done:
            res = self.sim.results[row.index]
            res.e2e_s = self.sim.now + overhead - res.arrival_s
        return done

    def retime(self, device: DeviceState) -> None:
        """The device's load moved: each decoding instance keeps the steps it made at the old rate and goes on at
        the new one; its next completion event is rescheduled. While they go to the shared base pass
        (`_shared_rounds_s`: a pass per backbone), each makes one step a round (`CostModel.shared_round_s`)."""
        sim = self.sim
        slow = sim.decode_slowdown(device)
        rounds = self._shared_rounds_s(device, slow) if sim.policy.shared_base else {}
        for inst in device.decoding:
            self._advance(inst)
            fn_spec = sim.fns[inst.function].spec
            step_s = sim.costs.decode_step_s(sim.costs.backbone(fn_spec), len(inst.rows)) * slow * fn_spec.step_factor
            inst.step_s = rounds.get(fn_spec.backbone, step_s)
            inst.done_token += 1
            left = max(0.0, min(r.finish_step for r in inst.rows) - inst.steps)
            sim.push(max(sim.now, inst.prefill_free_at_s) + left * inst.step_s, Done(inst, inst.done_token))

    def _shared_rounds_s(self, device: DeviceState, slow: float) -> dict[str, float]:
        """Backbone -> a round's time, for each backbone decoding on the device, while its decoding instances go to
        the shared pass (else {}). Decided for the device as a whole, as the step gate decides it
        (`lorafaas.scheduler.pass_choice`): two or more decoding, and a round shorter than the time for each to make
        one step of its own at the device's contention; or, with a fixed `from_members`, from that many on. Each
        backbone's daemon runs a pass of its own; passes at once share the cores, so each round takes as many times
        longer."""
        sim, spec = self.sim, self.sim.cluster.shared_base
        if spec is None or len(device.decoding) < (spec.from_members or 2):
            return {}
        by_backbone: dict[str, list[SimInstance]] = {}
        for inst in device.decoding:
            by_backbone.setdefault(sim.fns[inst.function].spec.backbone, []).append(inst)
        background = sim.background_threads_now()
        rounds = {name: sim.costs.shared_round_s(len(members), sum(len(inst.rows) for inst in members), background,
                                                 sim.cluster.backbones[name]) * len(by_backbone)
                  for name, members in by_backbone.items()}
        if spec.from_members is not None:
            return rounds
        own_s = max(sim.costs.decode_step_s(sim.costs.backbone(sim.fns[inst.function].spec), len(inst.rows)) * slow
                    for inst in device.decoding)
        return rounds if max(rounds.values()) < own_s else {}

    def _advance(self, inst: SimInstance) -> None:
        """Count the decode steps made since the last update, at the step time of that interval, outside passes."""
        now = self.sim.now
        since = max(inst.updated_s, inst.prefill_free_at_s)
        if inst.rows and now > since and inst.step_s > 0:
            inst.steps += (now - since) / inst.step_s
        inst.updated_s = max(inst.updated_s, now)
