"""Pure policy (no I/O, no torch, no clock): pre-loading, adaptive batching, offloading, placement, keep-alive.

Plain frozen data in (`messages.ClusterView`), decisions out (`messages.Plan` and the policies' decision types);
times arrive as `now_s` arguments. `Scheduler` bundles the policies for a node agent or the simulator.
"""

from lorafaas.scheduler.adapter_cost import AdapterCostModel, AdapterShape, BackboneShape
from lorafaas.scheduler.admission import (
    AdmissionDecision,
    AdmissionView,
    InstanceLoad,
    StartOption,
    can_join,
    decide_admission,
    needs_start_options,
    worth_offering,
)
from lorafaas.scheduler.admission_view import AdmissionSettings, ComputeWait, StartOptions, build_admission_view
from lorafaas.scheduler.batching import (
    BatchDecision,
    BatchPolicy,
    PrefillModel,
    in_flight_limit,
)
from lorafaas.scheduler.compute_turns import ComputeTurns
from lorafaas.scheduler.config import SchedulerConfig, for_device_kind
from lorafaas.scheduler.core_grants import SHARED_PASS, CoreGrants
from lorafaas.scheduler.idle_budget import IdleBudgetDecision, IdleInstance, keep_within_budget
from lorafaas.scheduler.keepalive import KeepAliveDecision, KeepAlivePolicy
from lorafaas.scheduler.messages import (
    ArtifactCost,
    ArtifactCosts,
    BackboneName,
    ClusterView,
    DeviceId,
    DeviceView,
    FunctionName,
    FunctionProfile,
    InstanceId,
    InstanceView,
    Offload,
    Plan,
    Preload,
    Residency,
    SlotId,
    WorkerSlot,
)
from lorafaas.scheduler.offload import OffloadDecision, batch_memory_bytes, plan_offload
from lorafaas.scheduler.pass_choice import PassChoice
from lorafaas.scheduler.placement import PlacementDecision, PlacementPolicy, may_scale_out, start_beats_joining
from lorafaas.scheduler.preload import PreloadPlan, PreloadPlanner, plan_difference
from lorafaas.scheduler.rates import RateTracker
from lorafaas.scheduler.scheduler import Scheduler

__all__ = [
    "SHARED_PASS",
    "AdapterCostModel",
    "AdapterShape",
    "AdmissionDecision",
    "AdmissionSettings",
    "AdmissionView",
    "ArtifactCost",
    "ArtifactCosts",
    "BackboneName",
    "BackboneShape",
    "BatchDecision",
    "BatchPolicy",
    "ClusterView",
    "ComputeTurns",
    "ComputeWait",
    "CoreGrants",
    "DeviceId",
    "DeviceView",
    "FunctionName",
    "FunctionProfile",
    "IdleBudgetDecision",
    "IdleInstance",
    "InstanceId",
    "InstanceLoad",
    "InstanceView",
    "KeepAliveDecision",
    "KeepAlivePolicy",
    "Offload",
    "OffloadDecision",
    "PassChoice",
    "PlacementDecision",
    "PlacementPolicy",
    "Plan",
    "PrefillModel",
    "Preload",
    "PreloadPlan",
    "PreloadPlanner",
    "RateTracker",
    "Residency",
    "Scheduler",
    "SchedulerConfig",
    "SlotId",
    "StartOption",
    "StartOptions",
    "WorkerSlot",
    "batch_memory_bytes",
    "build_admission_view",
    "can_join",
    "decide_admission",
    "for_device_kind",
    "in_flight_limit",
    "keep_within_budget",
    "may_scale_out",
    "needs_start_options",
    "plan_difference",
    "plan_offload",
    "start_beats_joining",
    "worth_offering",
]
