"""Placement: warm > most pre-loaded > backbone's device > least loaded; seeded random tie-break among the top few."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from scheduler_builders import fn, res, view

from lorafaas.scheduler import InstanceView, PlacementPolicy, SchedulerConfig, may_scale_out, start_beats_joining

READY = frozenset({"libraries", "backbone", "adapter"})
DEVICES = [("d0", 100, 0), ("d1", 100, 0), ("d2", 100, 0)]


def inst(iid: str, function: str, device: str, loaded=READY, running: int = 0, max_running: int = 4) -> InstanceView:
    return InstanceView(iid, function, device, frozenset(loaded), running, max_running)


def place(v, function: str = "f", top_k: int = 1, seed: int = 0):
    return PlacementPolicy(SchedulerConfig(placement_top_k=top_k), random.Random(seed)).place(function, v)


def test_warm_instance_first_least_busy() -> None:
    v = view([fn("f"), fn("g")], DEVICES, instances=[
        inst("busy", "f", "d0", running=3), inst("calm", "f", "d1", running=1), inst("other", "g", "d2"),
        inst("full", "f", "d2", running=4),  # no room left: not warm
        inst("staged", "f", "d2", loaded={"libraries", "backbone", "adapter", "warmup"} - {"adapter"})])
    decision = place(v)
    assert (decision.kind, decision.instance_id, decision.device) == ("warm", "calm", "d1")


def test_most_preloaded_instance_next() -> None:
    v = view([fn("f")], DEVICES, instances=[inst("libs", "f", "d0", loaded={"libraries"}),
                                            inst("more", "f", "d1", loaded={"libraries", "backbone"})])
    decision = place(v)
    assert (decision.kind, decision.instance_id) == ("preloaded", "more")


def test_device_holding_the_backbone_before_an_emptier_one() -> None:
    # another function of backbone b is bound on d2; d0 and d1 are empty and idle
    v = view([fn("f"), fn("g")], DEVICES, resident=[res("g", "backbone", "device", "d2")],
             instances=[inst("g1", "g", "d2", running=2)])
    decision = place(v)
    assert (decision.kind, decision.device, decision.instance_id) == ("backbone", "d2", None)


def test_a_copy_other_functions_keep_busy_ranks_after_a_free_one() -> None:
    # g's pre-loaded adapter sits beside h's busy instance on d0; a copy of the backbone on d1 has free compute
    v = view([fn("f"), fn("g"), fn("h")], DEVICES,
             resident=[res("g", "backbone", "device", "d0"), res("g", "backbone", "device", "d1", slot="s1")],
             instances=[inst("h1", "h", "d0", running=2), inst("pre-f", "f", "d0", max_running=1)])
    decision = place(v)
    assert (decision.kind, decision.device) == ("backbone", "d1")
    ranked = PlacementPolicy(SchedulerConfig(placement_top_k=1)).rank("f", v)
    assert [(c.kind, c.device, c.contended) for c in ranked] == [
        ("backbone", "d1", False), ("warm", "d0", True), ("backbone", "d0", True), ("cold", "d2", False)]
    # with the copy on d1 gone, binding the busy copy still beats a load (admission then starts a spare instance)
    busy_only = view([fn("f"), fn("h")], DEVICES, resident=[res("h", "backbone", "device", "d0")],
                     instances=[inst("h1", "h", "d0", running=2)])
    assert (place(busy_only).kind, place(busy_only).device) == ("backbone", "d0")
    # a device runs as many instances at once as its compute slots: with two, h's one instance leaves room
    two_slots = replace(v, devices=tuple(replace(d, compute_slots=2) for d in v.devices))
    assert (place(two_slots).kind, place(two_slots).device) == ("warm", "d0")


def test_cold_on_the_least_loaded_device_where_it_fits() -> None:
    v = view([fn("f")], [("d0", 100, 0), ("d1", 100, 0), ("d2", 5, 0)],
             instances=[inst("g1", "g", "d0", running=3), inst("g2", "g", "d1", running=1)])
    decision = place(v)  # d2 is idle but too small for backbone (10) + adapter (1)
    assert (decision.kind, decision.device) == ("cold", "d1")
    tiny = view([fn("f")], [("d0", 5, 0), ("d1", 5, 0)], instances=[inst("g1", "g", "d0", running=1)])
    assert place(tiny).device == "d1"  # nowhere fits: least loaded anyway (offloading makes the room)
    assert place(view([fn("f")], [])) is None


def test_random_tie_break_spreads_a_burst() -> None:
    v = view([fn("f"), fn("g")], DEVICES, resident=[res("g", "backbone", "device", d, slot=f"s{d}")
                                                    for d in ("d0", "d1", "d2")])
    policy = PlacementPolicy(SchedulerConfig(placement_top_k=3), random.Random(7))
    counts = Counter(policy.place("f", v).device for _ in range(300))
    assert set(counts) == {"d0", "d1", "d2"} and min(counts.values()) > 60
    first, second = (PlacementPolicy(SchedulerConfig(placement_top_k=3), random.Random(7)) for _ in range(2))
    assert [first.place("f", v) for _ in range(50)] == [second.place("f", v) for _ in range(50)]  # same seed
    assert {place(v, top_k=1).device for _ in range(20)} == {"d0"}  # top_k=1: deterministic


def test_tie_break_never_leaves_the_best_class() -> None:
    # one warm instance and two cold devices: top_k=3 must still pick the warm one
    v = view([fn("f")], DEVICES, instances=[inst("w", "f", "d0")])
    assert {place(v, top_k=3, seed=s).instance_id for s in range(30)} == {"w"}
    # two warm instances of which one much busier: the draw is among the top_k least busy of the tie group only
    v = view([fn("f")], DEVICES, instances=[inst("a", "f", "d0", running=0), inst("b", "f", "d1", running=3)])
    assert {place(v, top_k=1, seed=s).instance_id for s in range(30)} == {"a"}
    assert {place(v, top_k=2, seed=s).instance_id for s in range(30)} == {"a", "b"}


def test_a_first_instance_may_always_start_even_on_a_saturated_device() -> None:
    assert may_scale_out(num_instances=0, busy_on_device=5, compute_slots=2)


def test_scale_out_only_while_the_device_has_compute_to_spare() -> None:
    assert may_scale_out(num_instances=1, busy_on_device=1, compute_slots=2)
    assert not may_scale_out(num_instances=1, busy_on_device=2, compute_slots=2)
    assert not may_scale_out(num_instances=3, busy_on_device=3, compute_slots=2)
    assert may_scale_out(num_instances=3, busy_on_device=3, compute_slots=4)


def test_scale_out_needs_at_least_one_compute_slot() -> None:
    with pytest.raises(ValueError, match="compute_slots"):
        may_scale_out(1, 0, 0)


def test_a_start_slower_than_the_slo_gives_way_to_a_running_batch() -> None:
    assert start_beats_joining(0.05, slo_ttft_s=1.5)  # a bind to the backbone already on the device
    assert start_beats_joining(1.5, slo_ttft_s=1.5)
    assert not start_beats_joining(9.0, slo_ttft_s=1.5)  # a 13.5 GB backbone from disk
    assert start_beats_joining(None, slo_ttft_s=0.001)  # not known yet: tried
    with pytest.raises(ValueError, match="slo_ttft_s"):
        start_beats_joining(0.1, 0.0)
