"""The one admission policy the node agent and the simulator both carry out (`decide_admission`)."""

from dataclasses import replace

import pytest

from lorafaas.scheduler import (
    AdmissionDecision,
    AdmissionView,
    ComputeTurns,
    InstanceLoad,
    StartOption,
    decide_admission,
)

CPU = StartOption("cpu", busy_instances=0, compute_slots=2, expected_start_s=0.1)


def view(*instances: InstanceLoad, queue: int = 1, slo_batch: int = 4, capacity: int = 8, adaptive: bool = True,
         max_instances: int = 4, options: tuple[StartOption, ...] = (CPU,), slo_s: float = 1.0) -> AdmissionView:
    return AdmissionView("fn", queue, slo_s, slo_batch, capacity, adaptive, max_instances, instances, options)


def ready(name: str, in_flight: int, started_s: float = 0.0) -> InstanceLoad:
    return InstanceLoad(name, True, in_flight, started_s)


def idle(name: str, spare_compute: bool, started_s: float = 0.0) -> InstanceLoad:
    return InstanceLoad(name, True, 0, started_s, spare_compute)


def starting(name: str, started_s: float = 0.0) -> InstanceLoad:
    return InstanceLoad(name, False, 0, started_s)


def test_an_empty_queue_waits() -> None:
    assert decide_admission(view(queue=0)).action == "wait"


def test_the_first_request_starts_the_first_instance() -> None:
    decision = decide_admission(view())
    assert (decision.action, decision.reason, decision.device) == ("start", "first_instance", "cpu")


def test_room_within_b_goes_to_the_least_loaded_then_oldest_instance() -> None:
    decision = decide_admission(view(ready("b", 1, started_s=2.0), ready("a", 1, started_s=1.0), ready("c", 3),
                                     queue=10))
    assert (decision.action, decision.reason, decision.instance_id, decision.size) == ("dispatch", "room", "a", 3)


def test_full_instances_scale_out_where_compute_is_spare() -> None:
    decision = decide_admission(view(ready("a", 4), options=(StartOption("cpu", 1, 2, 0.1),)))
    assert (decision.action, decision.reason) == ("start", "scale_out")


def test_a_saturated_device_makes_requests_join_a_running_batch_up_to_the_worker_capacity() -> None:
    decision = decide_admission(view(ready("a", 4), queue=10, options=(StartOption("cpu", 2, 2, 0.1),)))
    assert (decision.action, decision.reason, decision.instance_id, decision.size) == ("dispatch", "join", "a", 4)


def test_a_start_slower_than_the_slo_gives_way_to_a_running_batch_with_room() -> None:
    slow = StartOption("cpu", 1, 2, expected_start_s=5.0)
    decision = decide_admission(view(ready("a", 4), options=(slow,)))
    assert (decision.action, decision.reason) == ("dispatch", "join")
    assert decide_admission(view(ready("a", 8), options=(slow,))).action == "start", "no batch has room: start"


def test_the_first_start_that_helps_is_taken_in_the_executors_order() -> None:
    options = (StartOption("d0", 1, 1, 0.1), StartOption("d1", 0, 1, 0.1), StartOption("d2", 0, 1, 0.1))
    assert decide_admission(view(ready("a", 4), options=options)).device == "d1"


def test_at_max_instances_with_every_worker_full_the_queue_waits_and_says_why() -> None:
    decision = decide_admission(view(ready("a", 8), max_instances=1))
    assert (decision.action, decision.reason) == ("wait", "max_instances")
    decision = decide_admission(view(ready("a", 8), options=(StartOption("cpu", 2, 2, 0.1),)))
    assert (decision.action, decision.reason) == ("wait", "batch_bound")


def test_a_starting_instance_is_awaited_when_nothing_else_can_take_the_request() -> None:
    decision = decide_admission(view(starting("new", 3.0), starting("old", 1.0), max_instances=2))
    assert (decision.action, decision.reason, decision.instance_id) == ("await_start", "cold_start", "old")


def test_no_start_option_means_no_start() -> None:
    decision = decide_admission(view(options=()))
    assert (decision.action, decision.reason) == ("wait", "no_compute")


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_fixed_batch_size_is_a_hard_limit(adaptive: bool) -> None:
    decision = decide_admission(view(ready("a", 1), slo_batch=1, adaptive=adaptive, max_instances=1, queue=5))
    if adaptive:
        assert (decision.action, decision.reason, decision.size) == ("dispatch", "join", 5)
    else:
        assert (decision.action, decision.reason) == ("wait", "max_instances")


def test_an_idle_instance_does_not_begin_running_on_a_device_whose_compute_is_taken() -> None:
    full = StartOption("cpu", 2, 2, 0.1)
    # the function runs elsewhere in "a" (full within B): "b" idles rather than add a busy instance to full cores
    decision = decide_admission(view(ready("a", 8), idle("b", spare_compute=False), queue=3, max_instances=2,
                                     options=(full,)))
    assert (decision.action, decision.reason) == ("wait", "no_compute")
    # within the worker's capacity the requests join the running batch instead
    decision = decide_admission(view(ready("a", 4), idle("b", spare_compute=False), queue=3, options=(full,)))
    assert (decision.action, decision.reason, decision.instance_id) == ("dispatch", "join", "a")
    # with a core to spare the idle instance takes them
    decision = decide_admission(view(ready("a", 4), idle("b", spare_compute=True), queue=3))
    assert (decision.action, decision.reason, decision.instance_id) == ("dispatch", "room", "b")


def test_every_function_may_run_one_instance_whatever_the_device_load() -> None:
    full = StartOption("cpu", 2, 2, 0.1)
    decision = decide_admission(view(idle("b", spare_compute=False, started_s=2.0),
                                     idle("a", spare_compute=False, started_s=1.0), options=(full,)))
    assert (decision.action, decision.reason, decision.instance_id) == ("dispatch", "room", "a")


# -- strict compute (a CPU): never more busy instances than slots, functions taking turns ---------------------------

FULL = StartOption("cpu", busy_instances=2, compute_slots=2, expected_start_s=0.1)


def strict(v: AdmissionView, others: int = 0, ahead: int | None = None) -> AdmissionView:
    return replace(v, strict_compute=True, compute_waiting_others=others,
                   compute_waiting_ahead=others if ahead is None else ahead)


def test_strictly_a_function_s_one_idle_instance_waits_for_a_core_other_functions_hold() -> None:
    loose = view(idle("a", spare_compute=False), options=())
    assert decide_admission(loose).action == "dispatch"  # the GPU rule: every function may run one instance
    decision = decide_admission(strict(loose))
    assert (decision.action, decision.reason) == ("wait", "no_compute")


def test_strictly_a_first_instance_does_not_start_on_a_full_device() -> None:
    assert decide_admission(view(options=(FULL,))).action == "start"
    decision = decide_admission(strict(view(options=(FULL,))))
    assert (decision.action, decision.reason) == ("wait", "no_compute")


def test_while_another_function_waits_for_a_core_a_running_instance_takes_no_more() -> None:
    running = view(ready("a", 1), queue=2, options=(FULL,))
    assert decide_admission(strict(running)).reason == "room"  # nobody waits: the batch grows
    decision = decide_admission(strict(running, others=1))
    assert (decision.action, decision.reason) == ("wait", "yield")


def test_a_freed_core_goes_to_the_function_that_waited_longest() -> None:
    spare = view(idle("a", spare_compute=True), options=(CPU,))
    first = decide_admission(strict(spare, others=1, ahead=0))
    assert (first.action, first.instance_id) == ("dispatch", "a")
    behind = decide_admission(strict(spare, others=1, ahead=1))
    assert (behind.action, behind.reason) == ("wait", "no_compute")
    nothing = decide_admission(strict(view(options=(CPU,)), others=1, ahead=1))  # nor may it start one
    assert (nothing.action, nothing.reason) == ("wait", "no_compute")


def test_compute_turns_keep_the_order_functions_began_waiting_and_forget_the_stale() -> None:
    turns = ComputeTurns(stale_after_s=1.0)
    waits, runs = AdmissionDecision("wait", "no_compute"), AdmissionDecision("dispatch", "room", "i", size=1)
    turns.note("f", waits, 0.0)
    turns.note("g", waits, 0.1)
    turns.note("f", waits, 0.5)  # asking again keeps its place
    assert turns.counts("f", 0.6) == (1, 0) and turns.counts("g", 0.6) == (1, 1) and turns.counts("h", 0.6) == (2, 2)
    assert turns.waited_s("f", 0.6) == 0.6 and turns.waited_s("h", 0.6) == 0.0
    turns.note("f", runs, 0.7)  # it got its core
    assert turns.counts("g", 0.7) == (0, 0)
    assert turns.waiting(1.2) == []  # g was last told no_compute at 0.1: its queue went away unannounced


def test_a_function_that_waited_its_longest_for_a_core_runs_beside_the_busy_ones() -> None:
    held = strict(view(idle("a", spare_compute=False), options=()), others=1, ahead=1)
    assert decide_admission(replace(held, compute_waited_s=9.9, max_compute_wait_s=10.0)).reason == "no_compute"
    overdue = decide_admission(replace(held, compute_waited_s=10.0, max_compute_wait_s=10.0))
    assert (overdue.action, overdue.reason, overdue.instance_id) == ("dispatch", "overdue", "a")
    first = decide_admission(replace(strict(view(options=(FULL,))), compute_waited_s=12.0))
    assert (first.action, first.reason) == ("start", "overdue")


def test_a_function_taking_its_turn_takes_its_queue_up_to_the_join_limit_not_only_b() -> None:
    spare = view(idle("a", spare_compute=True), queue=10, slo_batch=4, capacity=8, options=(CPU,))
    assert decide_admission(strict(spare)).size == 4  # nobody waits: B now, the rest may scale out or join later
    turn = decide_admission(strict(spare, others=1, ahead=0))
    assert (turn.action, turn.instance_id, turn.size) == ("dispatch", "a", 8)  # the rest would wait a whole round


def test_of_equally_loaded_instances_one_alone_on_its_device_goes_first() -> None:
    shared = InstanceLoad("old", True, 0, 0.0, True, shares_device=True)
    alone = InstanceLoad("young", True, 0, 5.0, True, shares_device=False)
    assert decide_admission(view(shared, alone)).instance_id == "young"
    busy_alone = replace(alone, in_flight=1)
    assert decide_admission(view(shared, busy_alone)).instance_id == "old"  # fewer requests still comes first


def test_a_steady_function_on_a_device_another_keeps_busy_also_starts_an_instance_where_compute_is_spare() -> None:
    gpu0 = StartOption("gpu0", busy_instances=1, compute_slots=1)
    gpu1 = StartOption("gpu1", busy_instances=0, compute_slots=1)
    shared = InstanceLoad("a", True, 0, 0.0, False, shares_device=True)
    steady = replace(view(shared, options=(gpu0, gpu1)), steady=True)
    decision = decide_admission(steady)
    assert (decision.action, decision.reason, decision.instance_id, decision.device) == ("dispatch", "room", "a",
                                                                                         "gpu1")
    spare_here = replace(shared, spare_compute=True)
    assert decide_admission(replace(steady, steady=False, instances=(spare_here,))).device is None  # not steady,
    # and its device's compute is free: no extra instance
    # steady, but its device's compute is free now: a spare would idle to its window and start again (churn)
    assert decide_admission(replace(steady, instances=(spare_here,))).device is None
    alone = replace(shared, shares_device=False)
    assert decide_admission(replace(steady, instances=(alone,))).device is None  # nothing to contend with
    assert decide_admission(replace(steady, start_options=(gpu0,))).device is None  # no compute spare anywhere
    assert decide_admission(replace(steady, max_instances=1)).device is None
    starting_one = replace(steady, instances=(shared, InstanceLoad("b", False, 0, 1.0)))
    assert decide_admission(starting_one).device is None  # one start at a time


def test_a_function_sent_to_a_device_other_functions_keep_busy_also_starts_an_instance_where_compute_is_free() -> None:
    # load-aware sharing: placement bound a busy copy of the backbone (no free device held one); the first request
    # goes there at once, and a spare instance starts where it will not time-slice with the other functions
    busy_gpu = StartOption("gpu0", busy_instances=1, compute_slots=1)
    free_gpu = StartOption("gpu1", busy_instances=0, compute_slots=1)
    contended = InstanceLoad("a", True, 0, 0.0, spare_compute=False, shares_device=True)
    decision = decide_admission(view(contended, options=(busy_gpu, free_gpu)))
    assert (decision.action, decision.reason, decision.instance_id, decision.device) == ("dispatch", "room", "a",
                                                                                         "gpu1")
    from lorafaas.scheduler import needs_start_options

    assert needs_start_options((contended,), 4, 8)  # the executor describes the devices for it
    assert not needs_start_options((replace(contended, spare_compute=True),), 4, 8)
    # once its spare computes alone, requests go there first, even beside fewer on the busy device: that one drains
    alone = InstanceLoad("b", True, 2, 9.0, spare_compute=False, shares_device=False)
    assert decide_admission(view(replace(contended, in_flight=1), alone)).instance_id == "b"


def test_start_options_are_needed_for_a_steady_function_with_every_instance_on_a_shared_device() -> None:
    from lorafaas.scheduler import needs_start_options

    shared = InstanceLoad("a", True, 0, 0.0, True, shares_device=True)
    assert not needs_start_options((shared,), 4, 8)  # it has room: nothing to start
    assert needs_start_options((shared,), 4, 8, steady=True)
    assert not needs_start_options((replace(shared, shares_device=False),), 4, 8, steady=True)


def test_a_burst_outgrowing_its_instances_starts_another_in_the_background_while_they_have_room() -> None:
    # early scale-out: B = 4 and one instance; 5 arrivals within the burst window are more than it takes in its
    # batches, so the dispatch to it also starts one more where compute is spare, before a queue forms
    free = StartOption("gpu1", busy_instances=0, compute_slots=1)
    taking = replace(view(ready("a", 1), options=(free,)), recent_arrivals=5)
    decision = decide_admission(taking)
    assert (decision.action, decision.reason, decision.instance_id, decision.device) == ("dispatch", "room", "a",
                                                                                         "gpu1")
    assert decide_admission(replace(taking, recent_arrivals=4)).device is None  # within what it takes
    two = replace(taking, instances=(ready("a", 1), ready("b", 0, 1.0)))
    assert decide_admission(two).device is None  # two instances take 8
    assert decide_admission(replace(taking, max_instances=1)).device is None
    busy = StartOption("gpu1", busy_instances=1, compute_slots=1)
    assert decide_admission(replace(taking, start_options=(busy,))).device is None  # no compute spare anywhere
    from lorafaas.scheduler import needs_start_options

    assert needs_start_options((ready("a", 1),), 4, 8, recent_arrivals=5)  # the executor describes the devices
    assert not needs_start_options((ready("a", 1),), 4, 8, recent_arrivals=4)


def test_a_start_under_way_is_awaited_rather_than_another_begun() -> None:
    # every ready instance is full; one begun early in the background is starting: it serves sooner than a start
    # from disk begun now (which would hold the queue for a whole load), so the queue awaits it
    full, load = ready("a", 8), StartOption("gpu1", busy_instances=0, compute_slots=1, expected_start_s=20.0)
    decision = decide_admission(view(full, starting("b", 1.0), queue=3, capacity=8, options=(load,)))
    assert (decision.action, decision.reason, decision.instance_id) == ("await_start", "cold_start", "b")
    assert decide_admission(view(full, queue=3, capacity=8, options=(load,))).action == "start"  # none under way
    bind = replace(load, expected_start_s=0.1)  # a bind to a copy on the device: sooner than the one under way
    assert decide_admission(view(full, starting("b", 1.0), queue=3, capacity=8, options=(bind,))).action == "start"
