"""The pre-load knapsack: hand-computed plans, each constraint, the difference step, greedy against exact."""

from __future__ import annotations

import dataclasses
import random

import pytest
from preload_reference import check_target, exact_target, random_instance, target_value
from scheduler_builders import fn, kinds_of, res, view

from lorafaas.scheduler import Offload, Preload, PreloadPlanner, SchedulerConfig, plan_difference


def plan(v, **config):
    return PreloadPlanner(SchedulerConfig(**config)).plan(v)


def test_everything_fits_value_is_rate_times_delay() -> None:
    # libraries 2.0 s, backbone on device 3.0 s, adapter on device 0.5 s, warm-up 1.5 s; 2 requests/s
    p = plan(view([fn("f", rate=2.0)]))
    assert kinds_of(p.target, "f") == {"libraries": ("host", None), "backbone": ("device", "d0"),
                                       "adapter": ("device", "d0"), "warmup": ("device", "d0")}
    assert p.value == pytest.approx(2.0 * (2.0 + 3.0 + 0.5 + 1.5))
    # loading order: libraries, then backbone and adapter, then warm-up
    assert [a.kind for a in p.preloads] == ["libraries", "backbone", "adapter", "warmup"]
    assert all(isinstance(a, Preload) and a.slot == "s0" for a in p.preloads) and p.offloads == ()


def test_no_device_room_falls_back_to_host_copies() -> None:
    p = plan(view([fn("f", rate=1.5)], devices=[("d0", 5, 0)]))  # backbone 10 does not fit the device
    assert kinds_of(p.target, "f") == {"libraries": ("host", None), "backbone": ("host", None),
                                       "adapter": ("host", None)}
    assert p.value == pytest.approx(1.5 * (2.0 + 1.0 + 0.2))


def test_device_capacity_counts_backbones_adapters_and_warmups() -> None:
    # two backbones of 10 on a device of 15: only one can be there; the busier function gets it
    fns = [fn("a", backbone="x", rate=1.0), fn("b", backbone="y", rate=3.0)]
    p = plan(view(fns, devices=[("d0", 15, 0)]))
    check_target(view(fns, devices=[("d0", 15, 0)]), p.target)
    assert kinds_of(p.target, "b")["backbone"] == ("device", "d0")
    assert kinds_of(p.target, "a").get("backbone") == ("host", None)


def test_only_idle_capacity_is_used() -> None:
    # 100 of capacity but 95 in use by running instances: nothing of 10 fits on the device
    p = plan(view([fn("f")], devices=[("d0", 100, 95)]))
    assert all(r.tier == "host" for r in p.target)
    p = plan(view([fn("f")], slots=[("s0", 100, 99, None)]))  # one byte left in the slot: libraries (1) only
    assert kinds_of(p.target, "f") == {"libraries": ("host", None), "backbone": ("device", "d0"),
                                       "adapter": ("device", "d0"), "warmup": ("device", "d0")}
    p = plan(view([fn("f")], slots=[("s0", 100, 100, None)]))  # a full slot: nothing at all
    assert p.target == ()


def test_slot_capacity_and_one_function_per_slot() -> None:
    # slot of 5: libraries (1) and the host adapter (1) fit, the host backbone (10) does not
    p = plan(view([fn("f")], devices=[], slots=[("s0", 5, 0, None)]))
    assert kinds_of(p.target, "f") == {"libraries": ("host", None), "adapter": ("host", None)}
    # two functions, one slot: a slot holds one function's host side, the busier one
    p = plan(view([fn("a", rate=1.0), fn("b", rate=2.0)], slots=[("s0", 100, 0, None)]))
    assert {r.function for r in p.target} == {"b"}


def test_a_slot_bound_to_a_function_serves_only_it() -> None:
    fns = [fn("a", rate=5.0), fn("b", rate=1.0)]
    p = plan(view(fns, slots=[("s0", 100, 0, "b")]))
    assert {r.function for r in p.target} == {"b"}


def test_precedence_libraries_before_anything() -> None:
    p = plan(view([fn("f", libraries=None)]))  # libraries cannot be pre-loaded: nothing can
    assert p.target == ()


def test_warmup_needs_the_adapter_on_the_device() -> None:
    p = plan(view([fn("f", adapter_device=None, warmup=(50.0, 1))]))
    assert "warmup" not in kinds_of(p.target, "f")
    assert kinds_of(p.target, "f")["adapter"] == ("host", None)


def test_adapter_goes_where_the_backbone_is() -> None:
    # d0 has room for the backbone only; the adapter (and warm-up) must not go to d1 without it
    fns = [fn("f", backbone_device=(3.0, 10), adapter_device=(0.5, 4))]
    p = plan(view(fns, devices=[("d0", 10, 0), ("d1", 5, 0)]))
    got = kinds_of(p.target, "f")
    assert got["backbone"] == ("device", "d0")
    assert got["adapter"] == ("host", None) and "warmup" not in got


def test_shared_backbone_counted_once_per_device() -> None:
    # three functions of one backbone (10) and adapters of 1 on a device of 13: one copy, three bindings
    fns = [fn(name, warmup=None) for name in ("a", "b", "c")]
    v = view(fns, devices=[("d0", 13, 0)])
    p = plan(v)
    check_target(v, p.target)
    assert all(kinds_of(p.target, name)["adapter"] == ("device", "d0") for name in "abc")
    assert p.value == pytest.approx(3 * (2.0 + 3.0 + 0.5))


def test_invoked_functions_are_pinned_and_their_backbone_is_shared() -> None:
    fns = [fn("busy", backbone="x"), fn("idle", backbone="x", warmup=None)]
    pinned = (res("busy", "libraries", "host", slot="s0"), res("busy", "backbone", "device", "d0", "s0"))
    # the device has room for one copy only: the idle function binds to the busy one's copy
    v = view(fns, devices=[("d0", 12, 0)], resident=pinned, invoked=["busy"])
    p = plan(v)
    check_target(v, p.target)
    assert set(pinned) <= set(p.target)
    assert all(a.function == "idle" for a in (*p.preloads, *p.offloads))
    assert kinds_of(p.target, "idle") == {"libraries": ("host", None), "backbone": ("device", "d0"),
                                          "adapter": ("device", "d0")}
    assert p.value == pytest.approx(2.0 + 3.0 + 0.5)  # pinned artifacts add no value


def test_a_slot_holding_an_invoked_function_is_not_reused() -> None:
    v = view([fn("busy", backbone="x"), fn("idle", backbone="y")], slots=[("s0", 100, 0, None)],
             resident=[res("busy", "adapter", "device", "d0", "s0")], invoked=["busy"])
    assert plan(v).target == v.resident


def test_zero_rate_gets_nothing_and_switch_off_gives_empty_plan() -> None:
    assert plan(view([fn("f", rate=0.0)])).target == ()
    loaded = view([fn("f")], resident=[res("f", "libraries", "host")])
    off = plan(loaded, preloading=False)
    assert (off.target, off.preloads, off.offloads, off.value) == ((), (), (), 0.0)


def test_replanning_the_same_view_is_stable() -> None:
    v = view([fn(f"f{k}", backbone=f"b{k % 2}", rate=1.0 + k) for k in range(6)],
             devices=[("d0", 25, 0), ("d1", 14, 0)], slots=[(f"s{k}", 12 if k % 2 else 4, 0, None) for k in range(5)])
    first = plan(v)
    again = plan(dataclasses.replace(v, resident=first.target))
    assert (again.preloads, again.offloads) == ((), ())
    assert again.value == pytest.approx(first.value)


def test_plan_difference_unloads_first_top_down_then_loads_in_order() -> None:
    current = [res("f", "libraries", "host"), res("f", "backbone", "device", "d0"), res("f", "adapter", "device", "d0"),
               res("f", "warmup", "device", "d0"), res("g", "libraries", "host", slot="s1"),
               res("g", "adapter", "host", slot="s1")]
    target = [res("f", "libraries", "host"), res("f", "backbone", "device", "d0"), res("f", "adapter", "host"),
              res("g", "libraries", "host", slot="s1"), res("g", "backbone", "device", "d1", "s1"),
              res("g", "adapter", "device", "d1", "s1"), res("h", "libraries", "host", slot="s2")]
    offloads, preloads = plan_difference(current, target)
    assert offloads == (Offload("f", "warmup", "device", None, "d0", "s0"),
                        Offload("f", "adapter", "device", "host", "d0", "s0"))
    # g's host adapter moves up with its device preload (no separate offload); target order is kept
    assert preloads == (Preload("g", "backbone", "device", "d1", "s1"), Preload("g", "adapter", "device", "d1", "s1"),
                        Preload("h", "libraries", "host", None, "s2"))
    assert plan_difference(target, target) == ((), ())


def test_plan_difference_drops_functions_that_left() -> None:
    offloads, preloads = plan_difference([res("gone", "libraries", "host"), res("gone", "adapter", "host")], [])
    assert [(o.kind, o.to_tier) for o in offloads] == [("adapter", None), ("libraries", None)] and preloads == ()


def test_greedy_against_exact_on_random_small_instances() -> None:
    """200 random instances (2-4 functions, 1-2 devices, 1-3 slots, shared backbones, bound slots, invoked
    functions): every greedy plan is feasible, never better than the optimum, and within the bound seen."""
    rng = random.Random(20240601)
    ratios = []
    for _ in range(200):
        v = random_instance(rng)
        p = PreloadPlanner().plan(v)
        check_target(v, p.target)
        greedy = target_value(v, p.target)
        assert greedy == pytest.approx(p.value)
        best, best_target = exact_target(v)
        check_target(v, best_target)  # the reference's own optimum is feasible and worth what it says
        assert target_value(v, best_target) == pytest.approx(best)
        assert greedy <= best * (1 + 1e-9)
        ratios.append(greedy / best if best > 0 else 1.0)
    worst = min(ratios)
    print(f"greedy/exact over {len(ratios)} instances: worst {worst:.3f}, mean {sum(ratios) / len(ratios):.4f}, "
          f"optimal in {sum(r > 1 - 1e-9 for r in ratios)}")
    assert worst >= 0.80
    assert sum(ratios) / len(ratios) >= 0.99


def test_the_device_tier_takes_memory_only_for_functions_expected_within_the_horizon() -> None:
    # a: once a minute, expected within the 600 s horizon; b: once an hour (the rate floor), not; both fit anywhere
    fns = [fn("a", backbone="x", rate=1 / 60), fn("b", backbone="y", rate=1 / 3600)]
    p = plan(view(fns, devices=[("d0", 100, 0)]), device_preload_horizon_s=600.0)
    assert kinds_of(p.target, "a") == {"libraries": ("host", None), "backbone": ("device", "d0"),
                                       "adapter": ("device", "d0"), "warmup": ("device", "d0")}
    assert kinds_of(p.target, "b") == {"libraries": ("host", None), "backbone": ("host", None),
                                       "adapter": ("host", None)}  # staged where memory is not billed
    # the horizon off: device memory for both, as before it existed
    p = plan(view(fns, devices=[("d0", 100, 0)]), device_preload_horizon_s=0.0)
    assert kinds_of(p.target, "b")["backbone"] == ("device", "d0")


def test_beyond_the_horizon_a_function_still_binds_to_a_backbone_copy_already_there() -> None:
    # a runs on d0 (its copy of x is pinned there); b, once an hour, is not expected within the horizon: binding to
    # a's copy takes no device memory, b's own adapter would, so it stays in host memory
    fns = [fn("a", backbone="x", rate=1 / 60), fn("b", backbone="x", rate=1 / 3600)]
    resident = [res("a", "backbone", "device", "d0", slot="s0")]
    p = plan(view(fns, devices=[("d0", 100, 10)], resident=resident, invoked=["a"]), device_preload_horizon_s=600.0)
    assert kinds_of(p.target, "b")["backbone"] == ("device", "d0")
    assert kinds_of(p.target, "b")["adapter"] == ("host", None)
    assert "warmup" not in kinds_of(p.target, "b")


def test_the_horizon_counts_the_arrivals_of_every_function_a_backbone_copy_would_serve() -> None:
    # x's four functions, each every 20 minutes (0.5 expected within 600 s), are together expected twice: its copy
    # and their adapters and warm-ups go to the device. y's one function at the same rate stays in host memory.
    fns = [fn(f"x{k}", backbone="x", rate=1 / 1200) for k in range(4)] + [fn("y0", backbone="y", rate=1 / 1200)]
    p = plan(view(fns, devices=[("d0", 100, 0)]), device_preload_horizon_s=600.0)
    for k in range(4):
        assert kinds_of(p.target, f"x{k}") == {"libraries": ("host", None), "backbone": ("device", "d0"),
                                               "adapter": ("device", "d0"), "warmup": ("device", "d0")}
    assert kinds_of(p.target, "y0") == {"libraries": ("host", None), "backbone": ("host", None),
                                        "adapter": ("host", None)}
