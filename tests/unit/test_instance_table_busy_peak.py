"""The busy-instances high-water mark behind `lorafaas_busy_instances_peak`: starting and running instances count,
idle ready ones do not, other devices do not, and the peak never falls."""

from lorafaas.platform.instance_table import Identity, Instance, InstanceTable


def instance(name: str, device: str = "cpu") -> Instance:
    return Instance(f"{name}-1", Identity("t", name, f"uid-{name}", 1, "digest"), device)


def test_peak_counts_starting_and_running_instances_per_device() -> None:
    table = InstanceTable()
    a, b = table.add(instance("a")), table.add(instance("b"))
    assert table.busy_peak == {"cpu": 2}  # both starting
    table.transition(a, "ready")
    table.transition(b, "ready")
    table.add(instance("c", device="gpu0"))
    table.record_busy("cpu")
    assert table.busy_peak == {"cpu": 2, "gpu0": 1}  # idle ready instances are not busy; the peak stays
    a.in_flight = 1
    table.record_busy("cpu")
    assert table.busy_peak["cpu"] == 2
    table.add(instance("d"))
    b.in_flight = 2
    table.record_busy("cpu")
    assert table.busy_peak["cpu"] == 3  # a and b running, d starting
