"""Load-aware sharing and early scale-out, simulated on the paper cluster (docs/scheduler.md, "Load-aware sharing"
and "Early scale-out")."""

import statistics

from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import Request, Workload

PAPER = load_cluster("paper")


def _mean_e2e_after(out, since_s: float) -> float:
    return statistics.mean(r.e2e_s for r in out.results if r.arrival_s >= since_s)


def test_hot_functions_of_one_backbone_do_not_time_slice_one_copy_while_devices_are_free() -> None:
    # four functions of one backbone turn hot one after another, each keeping a GPU busy (a request every 2 s, 400
    # tokens each); sharing first binds each to the copy the others keep busy (its first token comes at once), then
    # starts it a spare instance where compute is free, and its requests go there: once every function has one,
    # they run as fast as with a copy each (no-sharing), not time-sliced on one GPU
    names = ["llama2-7b-a", "llama2-7b-b", "llama2-7b-c", "llama2-7b-d"]
    requests = sorted((Request(20.0 * k + 2.0 * t + 0.1 * k, "t", f, 200, 400) for k, f in enumerate(names)
                       for t in range(150)), key=lambda r: r.arrival_s)
    work = Workload(tuple(requests), 400.0)
    shared, _ = simulate(work, PAPER, POLICIES["lorafaas"], seed=1)
    alone, _ = simulate(work, PAPER, POLICIES["no-sharing"], seed=1)
    assert _mean_e2e_after(shared, 100.0) <= 1.05 * _mean_e2e_after(alone, 100.0)
