"""The devices one node agent drives, and where an instance of a function may start on them.

A node agent drives `cpu`, or one or more GPUs (`cuda:0`, `cuda:1`, ...), never both: every device has its own
memory budget, compute slots and busy count, and its own backbone daemon per backbone it serves. An instance runs on
one device and binds the daemon of its backbone on that device, never one on another.

Where an instance may start is offered to the admission policy (`lorafaas.scheduler.admission`) as `StartOption`s,
best first: the devices in the order the scheduler's placement ranks them for a new instance of the function
(`PlacementPolicy.rank`: where its backbone is resident first, then fewest running requests and most free memory;
a device where the adapter, or the backbone it lacks, does not fit in the budget only when none has room), then the
devices it left out. Each option carries its own device's busy count, so a device whose compute is taken is skipped
and the next one offered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from lorafaas.errors import InvalidInput
from lorafaas.scheduler import ClusterView, DeviceId, FunctionName, PlacementPolicy, StartOption, worth_offering


@dataclass(frozen=True)
class Device:
    name: str  # "cpu" or "cuda:N"
    budget_bytes: int  # the memory the scheduler may fill on it (pre-loads, instances, KV caches)


def check_devices(names: Sequence[str]) -> None:
    """One device at least, none twice, and not the CPU beside GPUs (a CPU's instances share its cores through
    the step gate; a GPU's run on the GPU: one agent schedules one kind)."""
    if not names:
        raise InvalidInput("no device given; use e.g. 'cpu', 'cpu=8G' or 'cuda:0=20G,cuda:1=20G'")
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        raise InvalidInput(f"device {repeated[0]} is named {list(names).count(repeated[0])} times; name each once")
    if "cpu" in names and len(names) > 1:
        gpus = ", ".join(name for name in names if name != "cpu")
        raise InvalidInput(f"cpu cannot be mixed with GPUs ({gpus}) in one node agent; name either cpu or GPUs")


def start_order(names: Sequence[str], function: str, view: Callable[[], ClusterView],
                placement: PlacementPolicy) -> list[str]:
    """The devices, best first for a new instance of `function` (see the module's docstring). One device needs no
    view: it is the only place."""
    if len(names) == 1:
        return list(names)
    ranked = [c.device for c in placement.rank(FunctionName(function), view()) if c.instance_id is None]
    ordered = list(dict.fromkeys(d for d in ranked if d in names))
    return ordered + [d for d in names if d not in ordered]


def start_options(order: Iterable[str], busy: Mapping[str, int], compute_slots: int, num_instances: int,
                  max_instances: int, expected_start_s: float | None) -> tuple[StartOption, ...]:
    """A `StartOption` for each device in `order` where the policy could start one (`worth_offering`, with that
    device's own busy count)."""
    return tuple(StartOption(DeviceId(d), busy[d], compute_slots, expected_start_s) for d in order
                 if worth_offering(num_instances, max_instances, busy[d], compute_slots))


def backbone_device(names: Sequence[str], running_backbones: Callable[[str], list[str]], backbone: str) -> str:
    """Where to pre-load `backbone` ahead of any instance: a device whose daemon serves it already, else the one
    serving the fewest backbones (the first of those)."""
    served = {d: running_backbones(d) for d in names}
    return next((d for d in names if backbone in served[d]), min(names, key=lambda d: len(served[d])))
