"""The one builder of the `AdmissionView` (`build_admission_view`) the node agent and the simulator both call: the
start options are worked out only when the decision can depend on them, with whether a running batch could join,
and the executor's settings and compute turns are carried into the view."""

from __future__ import annotations

from lorafaas.scheduler import (
    AdmissionSettings,
    ComputeTurns,
    ComputeWait,
    DeviceId,
    FunctionName,
    InstanceId,
    InstanceLoad,
    StartOption,
    build_admission_view,
)
from lorafaas.scheduler.admission import AdmissionDecision

SETTINGS = AdmissionSettings(worker_capacity=8, adaptive=True, requests_per_background_start=3,
                             strict_compute=True, max_compute_wait_s=7.5)
OPTION = StartOption(DeviceId("cpu"), busy_instances=0, compute_slots=2, expected_start_s=None)


class Options:
    """Start options that remember each time they were asked for, and with what."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    def __call__(self, joinable: bool) -> list[StartOption]:
        self.asked.append(joinable)
        return [OPTION]


def _load(in_flight: int, ready: bool = True) -> InstanceLoad:
    return InstanceLoad(InstanceId(f"i{in_flight}"), ready, in_flight, 0.0)


def _view(instances: tuple[InstanceLoad, ...], options: Options, slo_batch: int = 4, steady: bool = False,
          wait: ComputeWait = ComputeWait()):
    return build_admission_view(FunctionName("f"), 3, 1.5, slo_batch, 4, instances, steady, SETTINGS, wait, options)


def test_a_ready_instance_with_room_within_b_asks_for_no_start_options() -> None:
    options = Options()
    view = _view((_load(1),), options)
    assert options.asked == []
    assert view.start_options == ()


def test_a_steady_function_on_a_shared_device_asks_for_them_even_with_room() -> None:
    options = Options()
    shared = InstanceLoad(InstanceId("i"), True, 0, 0.0, shares_device=True)
    assert _view((shared,), options, steady=True).start_options == (OPTION,)
    assert options.asked == [True]


def test_the_options_are_told_whether_a_start_s_expected_time_matters() -> None:
    at_b = Options()  # B reached, the worker has room beyond it: a request could join instead of a start
    assert _view((_load(4),), at_b).start_options == (OPTION,)
    full = Options()  # the worker is full: nothing can join
    _view((_load(8),), full)
    none = Options()  # no instance at all
    _view((), none)
    starting = Options()  # only a starting instance: nothing runs to join, but a slow start would be awaited instead
    _view((_load(0, ready=False),), starting)
    assert (at_b.asked, full.asked, none.asked, starting.asked) == ([True], [False], [False], [True])


def test_the_settings_and_the_compute_turns_are_carried_into_the_view() -> None:
    turns = ComputeTurns()
    turns.note("other", AdmissionDecision("wait", "no_compute"), 10.0)
    turns.note("f", AdmissionDecision("wait", "no_compute"), 11.0)
    wait = turns.wait_of("f", 12.0)
    assert wait == ComputeWait(waiting_others=1, waiting_ahead=1, waited_s=1.0)
    view = _view((_load(1),), Options(), slo_batch=2, wait=wait)
    assert (view.function, view.queue_length, view.slo_ttft_s, view.slo_batch, view.max_instances) == ("f", 3, 1.5, 2,
                                                                                                         4)
    assert (view.worker_capacity, view.adaptive, view.requests_per_background_start, view.strict_compute,
            view.max_compute_wait_s) == (8, True, 3, True, 7.5)
    assert (view.compute_waiting_others, view.compute_waiting_ahead, view.compute_waited_s) == (1, 1, 1.0)
    assert view.instances == (_load(1),) and not view.steady
