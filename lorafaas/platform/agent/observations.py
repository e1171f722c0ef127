"""What the scheduler learns from a request's first token."""

from __future__ import annotations

from lorafaas.function_runtime import messages as m
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import FunctionName, Scheduler


def observe_prefill(scheduler: Scheduler, spec: FunctionSpec, batch_size: int, first: m.Token | m.Finished,
                    waited_s: float) -> None:
    """T(b) for the batching model: the worker prefills the requests waiting for it together and reports, on a
    request's first token, the forward time and how many the pass held (queueing excluded). An event without them
    (a request that ended before any token) counts as its dispatch batch taking the time it waited. A prefill run in
    the shared base pass is not observed: its time is the round's, with other functions' rows."""
    prefill_s = getattr(first, "prefill_s", None)
    together = getattr(first, "prefill_batch", None)
    if getattr(first, "prefill_shared", False):  # the round's time (other functions' rows), not T(b) of its own
        return
    name, slo_s = FunctionName(spec.name), spec.slo_ttft_ms / 1e3
    if prefill_s is not None and together:
        scheduler.observe_prefill(name, slo_s, together, prefill_s)
    else:
        scheduler.observe_prefill(name, slo_s, batch_size, waited_s)
