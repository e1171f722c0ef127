"""Dynamic offloading: least value-dense artifacts of non-invoked functions first, until Q bytes are free."""

from __future__ import annotations

from scheduler_builders import fn, res, view

from lorafaas.scheduler import Offload, SchedulerConfig, batch_memory_bytes, plan_offload
from lorafaas.scheduler.offload import device_free_bytes

# a (1 req/s) and b (4 req/s) share backbone x (10) on d0, each with an adapter (2, 0.5 s) and a warm-up (1, 1.5 s);
# c is being invoked, on backbone y (5) with the same adapter and warm-up. Held: 10 + 5 + 3 * (2 + 1) = 24 of 30.
COSTS = {"adapter_device": (0.5, 2), "warmup": (1.5, 1), "backbone_device": (3.0, 10)}
FNS = [fn("a", backbone="x", rate=1.0, **COSTS), fn("b", backbone="x", rate=4.0, **COSTS),
       fn("c", backbone="y", rate=1.0, **{**COSTS, "backbone_device": (3.0, 5)})]
RESIDENT = [res(f, kind, "device", "d0", slot) for f, slot in (("a", "sa"), ("b", "sb"), ("c", "sc"))
            for kind in ("backbone", "adapter", "warmup")] + [res(f, "libraries", "host", slot=s)
                                                               for f, s in (("a", "sa"), ("b", "sb"), ("c", "sc"))]
SLOTS = [("sa", 10, 0, None), ("sb", 1, 0, None), ("sc", 10, 0, None)]


def scene(**kw):
    return view(FNS, devices=[("d0", 30, 0)], slots=SLOTS, resident=RESIDENT, invoked=["c"], **kw)


def test_free_bytes_count_a_shared_backbone_once() -> None:
    assert device_free_bytes(scene(), "d0") == 30 - 24


def test_nothing_to_do_when_it_fits() -> None:
    decision = plan_offload(scene(), "d0", 6)
    assert decision.satisfied and decision.actions == () and decision.free_bytes == 6


def test_least_dense_first_until_enough() -> None:
    # densities: a's adapter+warm-up (0.5+1.5)*1/3 = 0.67 < a's warm-up 1.5 < backbone x with everything bound to
    # it (1+4)*(3.0+0.5+1.5)/16 = 1.56 < b's adapter+warm-up 2.67 < b's warm-up 6.0
    decision = plan_offload(scene(), "d0", 8)  # deficit 2: a's adapter and warm-up free 3
    assert decision.satisfied and decision.freed_bytes == 3
    assert decision.actions == (Offload("a", "warmup", "device", None, "d0", "sa"),
                                Offload("a", "adapter", "device", "host", "d0", "sa"))  # sa has room for it


def test_backbone_goes_with_everything_bound_to_it() -> None:
    decision = plan_offload(scene(), "d0", 10)  # deficit 4: a's 3, then backbone x with b's adapter and warm-up
    assert decision.satisfied and decision.freed_bytes == 3 + 3 + 10
    assert [(o.function, o.kind, o.to_tier) for o in decision.actions] == [
        ("a", "warmup", None), ("a", "adapter", "host"), ("a", "backbone", None),
        ("b", "warmup", None), ("b", "adapter", None), ("b", "backbone", None)]  # sb is too small for b's adapter


def test_invoked_functions_are_never_touched() -> None:
    for needed in (7, 10, 22):
        decision = plan_offload(scene(), "d0", needed)
        assert all(o.function != "c" for o in decision.actions)


def test_cannot_free_enough_is_a_value() -> None:
    decision = plan_offload(scene(), "d0", 6 + 17)  # freeable: 3 + 3 + 10 = 16 < 17
    assert not decision.satisfied and decision.actions == ()
    assert decision.freeable_bytes == 16 and decision.free_bytes == 6


def test_switched_off_evicts_nothing() -> None:
    decision = plan_offload(scene(), "d0", 8, SchedulerConfig(offloading=False))
    assert not decision.satisfied and decision.actions == ()
    assert plan_offload(scene(), "d0", 6, SchedulerConfig(offloading=False)).satisfied  # it fits anyway


def test_adapters_dropped_when_host_offload_is_off() -> None:
    decision = plan_offload(scene(), "d0", 8, SchedulerConfig(offload_to_host=False))
    assert all(o.to_tier is None for o in decision.actions)


def test_batch_memory_from_tokens() -> None:
    assert batch_memory_bytes(fn("f", kv_bytes_per_token=36 * 1024), 100) == 100 * 36 * 1024
    assert batch_memory_bytes(fn("f", kv_bytes_per_token=1024), -5) == 0
